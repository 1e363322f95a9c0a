"""The decoder: the round loop over a target adapter and a drafter.

Words (docs/DESIGN.md): a round drafts up to k tokens per row, scores them with
one target forward over k + 1 positions, verifies, commits the emitted
tokens, and rolls both caches back to the committed length.

Cache invariant after every round, per row: the target holds all committed
tokens but the last (the recovered or bonus token, which it never saw); the
draft holds a prefix of the committed tokens, at most all but the last.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.adapters import PendingRead, TargetModel, finite_flag, read_checked, to_device, tree_ancestors
from specdec.drafters import DraftModel, DraftSettings, NoDrafter, Proposal, as_drafter, check_proposal
from specdec.lookup import Extension, PromptLookup
from specdec.metrics import Clock, SpeculativeMetrics, Stopwatch
from specdec.policy import DraftLengthPolicy
from specdec.race import Race, race_sample, race_verify
from specdec.sampling import RowWarpings, SamplingConfig, Warping
from specdec.verify import VerifyResult, block_verify, greedy_verify, speculative_verify, tree_verify

VERIFICATIONS = ("token", "block", "race")

# (row, committed sequence, prompt length, tokens just added) -> new tokens to keep, or None
StopCheck = Callable[[int, list[int], int, int], int | None]


@dataclass
class Batch:
    """Committed tokens per row and which rows still generate."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    max_new_tokens: list[int]  # per row
    finished: list[bool]

    @classmethod
    def from_prompts(cls, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> Batch:
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        assert len(budgets) == len(prompts), "one max_new_tokens per prompt"
        return cls([list(p) for p in prompts], [len(p) for p in prompts], budgets, [False] * len(prompts))

    def new_tokens(self, row: int) -> list[int]:
        return self.sequences[row][self.prompt_lengths[row] :]

    def remaining(self) -> torch.Tensor:  # [batch] tokens still allowed, 0 for finished rows
        return torch.tensor(
            [0 if done else self.max_new_tokens[b] - len(self.new_tokens(b)) for b, done in enumerate(self.finished)]
        )

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(s) for s in self.sequences])

    @property
    def done(self) -> bool:
        return all(self.finished)


def commit_row(batch: Batch, row: int, tokens: list[int], eos_ids: set[int], stop: StopCheck | None) -> int:
    """Append a round's tokens to a row, cut at EOS (kept, as transformers does), at a stop
    string, or at max_new_tokens. Returns how many were committed."""
    room = batch.max_new_tokens[row] - len(batch.new_tokens(row))
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            tokens, batch.finished[row] = tokens[: i + 1], True
            break
    batch.sequences[row].extend(tokens)
    if stop is not None and tokens:
        keep = stop(row, batch.sequences[row], batch.prompt_lengths[row], len(tokens))
        if keep is not None:
            cut = len(batch.new_tokens(row)) - keep
            del batch.sequences[row][len(batch.sequences[row]) - cut :]
            # The cut can reach into earlier rounds (decoding is not prefix-monotone): emit none then.
            tokens, batch.finished[row] = tokens[: max(0, len(tokens) - cut)], True
    if len(batch.new_tokens(row)) >= batch.max_new_tokens[row]:
        batch.finished[row] = True
    return len(tokens)


def score(target: TargetModel, batch: Batch, active: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """One target forward over each row's pending tokens and its drafts -> logits [batch, k + 1, vocab]
    (a draft tree: [batch, nodes + 1, vocab], column 1 + j scoring after node j)."""
    if proposal.siblings is not None:
        nodes, parents, valid = proposal.tree
        return target.feed(batch.sequences, active, nodes, valid, keep_logits=nodes.shape[1] + 1, extra_parents=parents)
    k = proposal.tokens.shape[1]
    valid = torch.arange(k) < proposal.lengths[:, None]
    return target.feed(batch.sequences, active, proposal.tokens, valid, keep_logits=k + 1)


def to_host(result: VerifyResult, checks: list) -> VerifyResult:
    """The round's one host read: a chain's verify result and the finiteness checks still pending (the
    drafter's, then the target's), in one copy; raises NonFiniteLogitsError for the first that failed."""
    if type(result) is not VerifyResult:  # a tree's result (TreeVerifyResult) is built on the host
        read_checked([], checks)
        return result
    return host_result(start_read(result, checks))


def start_read(result: VerifyResult, checks: list) -> PendingRead:
    """A chain's verify result and the pending checks, copied to the host in one queued read."""
    return PendingRead([result.tokens, result.num_accepted[:, None], result.bonus[:, None]], checks)


def host_result(read: PendingRead) -> VerifyResult:
    """Wait for `start_read`'s copy (raising NonFiniteLogitsError for a failed check): the result on the CPU."""
    tokens, num_accepted, bonus = read.result()
    return VerifyResult(tokens, num_accepted[:, 0], bonus[:, 0])


def verify(
    logits: torch.Tensor,
    proposal: Proposal,
    warping: Warping,
    sequences: Sequence[Sequence[int]],
    generator: torch.Generator | None,
    verification: str = "token",
    race: Race | None = None,
) -> VerifyResult:
    """Exact verification of a proposal against the target logits (results on the logits' device).
    Each position is warped with its own prefix: the committed tokens, then the drafts before it.
    Greedy is one rule for every method; sampling uses token-level (Leviathan), block (Sun et al.)
    or race verification (keyed Gumbel winners at the absolute positions)."""
    if proposal.siblings is not None:
        return verify_tree(logits, proposal, warping, sequences, generator, race)
    drafts, lengths = to_device(proposal.tokens, logits.device), to_device(proposal.lengths, logits.device)
    scores = warping.scores(logits, None if warping.prefix_free else sequences, proposal.tokens)
    if warping.greedy:
        result = greedy_verify(scores, drafts, draft_lengths=lengths, check_inputs=False)
    else:
        target_probs = warping.probs(scores)  # [batch, k + 1, vocab]
        draft_probs = None if proposal.probs is None else proposal.probs.to(target_probs.device)
        if verification == "race":
            assert race is not None and draft_probs is None, "race drafts are the draft's own race winners"
            starts = to_device(torch.tensor([len(s) for s in sequences]), logits.device)
            positions = starts[:, None] + torch.arange(logits.shape[1], device=logits.device)  # [batch, k + 1]
            noise = race.noise(positions)
            result = race_verify(target_probs, drafts, noise=noise, draft_lengths=lengths, check_inputs=False)
        elif verification == "block":
            result = block_verify(
                target_probs, drafts, draft_probs, draft_lengths=lengths, generator=generator, check_inputs=False
            )
        else:
            result = speculative_verify(
                target_probs, drafts, draft_probs, draft_lengths=lengths, generator=generator, check_inputs=False
            )
    return result


def verify_tree(
    logits: torch.Tensor,
    proposal: Proposal,
    warping: Warping,
    sequences: Sequence[Sequence[int]],
    generator: torch.Generator | None,
    race: Race | None,
):
    """Exact verification of a draft tree (specdec.verify.tree_verify): each node is warped with
    its own path as prefix; greedy and race fix the target's token at every node, token-level
    sampling judges the chain draft there by p/q and its siblings against the residual."""
    nodes, parents, valid = proposal.tree
    paths = None
    if not warping.prefix_free or (race is not None and not warping.greedy):
        ancestors = tree_ancestors(parents)  # [batch, nodes, nodes]: each node's path, itself included
    if not warping.prefix_free:
        paths = [
            [[]]
            + [[t for t, on in zip(nodes[b].tolist(), ancestors[b, j].tolist()) if on] for j in range(len(nodes[b]))]
            for b in range(len(nodes))
        ]
    scores = warping.scores(logits, None if warping.prefix_free else sequences, paths=paths)
    if warping.greedy:
        result = tree_verify(None, nodes, parents, node_valid=valid, winners=scores.argmax(-1))
    elif race is not None:
        depth = torch.cat([torch.zeros(len(nodes), 1, dtype=torch.long), ancestors.sum(-1)], 1)
        starts = torch.tensor([len(s) for s in sequences])
        noise = race.noise((starts[:, None] + depth).to(logits.device))
        winners = race_sample(warping.probs(scores), noise)  # the target's race winner at every node
        result = tree_verify(None, nodes, parents, node_valid=valid, winners=winners)
    else:
        draft_probs = None if proposal.probs is None else proposal.probs.to(scores.device)
        result = tree_verify(
            warping.probs(scores), nodes, parents, node_valid=valid, draft_probs=draft_probs, generator=generator
        )
    return result


@dataclass
class Decoder:
    """One generation's models, settings and hooks; `run` is the round loop."""

    target: TargetModel
    drafter: DraftModel
    warping: Warping
    policy: DraftLengthPolicy
    watch: Stopwatch
    row_metrics: list[SpeculativeMetrics]
    eos_ids: set[int]
    stop: StopCheck | None = None
    on_commit: Callable[[int, list[int]], None] | None = None
    on_round: Callable[[Batch], None] | None = None
    generator: torch.Generator | None = None
    verification: str = "token"
    race: Race | None = None
    read_ahead: bool = False  # the target alone: queue each forward before reading the last token (run_ahead)
    lookup: PromptLookup | None = None  # copy drafts appended to each proposal where they pay (specdec.lookup)

    def run(self, batch: Batch) -> None:
        """draft -> verify -> commit -> rollback -> observe, until every row is finished.
        Finished rows leave the forwards where both models can drop rows: the rounds then run
        over a sub-batch of the rows still generating (`rows`: their numbers in `batch`)."""
        if self.read_ahead and self.can_read_ahead():
            self.run_ahead(batch)
            return
        step, current, sub, rows = 0, self, batch, list(range(len(batch.sequences)))
        while not batch.done:
            if any(sub.finished) and self.can_drop_rows():
                index = torch.tensor([i for i, done in enumerate(sub.finished) if not done])
                self.target.select_rows(index)
                self.drafter.select_rows(index)
                rows = [rows[i] for i in index.tolist()]
                current = self.over_rows(batch, rows)
                sub = Batch(
                    [batch.sequences[r] for r in rows],
                    [batch.prompt_lengths[r] for r in rows],
                    [batch.max_new_tokens[r] for r in rows],
                    [False] * len(rows),
                )
            step = current.round(sub, step)
            for i, row in enumerate(rows):
                batch.finished[row] = sub.finished[i]

    def can_read_ahead(self) -> bool:
        """The target alone (one token per round, so the host knows each next forward's shape), with
        warpers that need no committed prefix (the next forward is queued before the last token is read),
        and a target that can embed every id it emits (the sampled ids are fed back as they are)."""
        alone = isinstance(self.drafter, NoDrafter) and self.lookup is None
        embeds_all = self.target.vocab_size <= getattr(self.target, "embed_size", self.target.vocab_size)
        return alone and self.warping.prefix_free and self.race is None and embeds_all

    def run_ahead(self, batch: Batch) -> None:
        """The target alone with the host one round behind the device: round s's forward is queued,
        its input the token round s - 1 sampled, still on the device; then round s - 1's token is read
        and committed while the device runs round s. On a GPU the host's work between rounds (the
        commit, the next forward's inputs, the launch) then no longer idles the device. Tokens and
        random draws are those of `run` (the same forwards and verify calls, in the same order) while
        no row has finished. Rows are not dropped here (`run` drops finished rows where the models can,
        which changes a sampled batch's later draws, not its law). A row that finishes while its next
        round is queued wastes that round (its token is never committed), and the final rollback drops
        what it fed."""
        nothing = torch.zeros(len(batch.sequences), dtype=torch.long)
        proposal = self.drafter.propose(batch.sequences, nothing, None, None)  # NoDrafter: nothing
        step, ids, queued = 0, None, None
        remaining = batch.remaining()
        while True:
            active = remaining > 0  # rows whose next token the host will commit, as far as it knows
            launched = None
            if bool(active.any()):
                step += 1
                with self.watch.time("target_time_s"):
                    if ids is None:  # the first round feeds each row's pending tokens from the host
                        logits = self.target.feed(batch.sequences, active)
                    else:
                        logits = self.target.forward(ids, active[:, None])
                result = verify(logits, proposal, self.warping, batch.sequences, self.generator, self.verification)
                ids = result.tokens[:, :1]  # the next round's input, left on the device
                check = (f"target model {self.target.name}", step, finite_flag(logits, active))
                launched = start_read(result, [check]), active
            if queued is not None:
                read, was_active = queued
                result = host_result(read)
                self.commit(batch, was_active & ~torch.tensor(batch.finished), proposal, result)
                self.observe(proposal, result)
                if self.on_round is not None:
                    self.on_round(batch)
            if launched is None:
                break
            queued = launched
            remaining = (batch.remaining() - launched[1].long()).clamp_min(0)  # the queued round's token counts
        self.rollback(batch)

    def can_drop_rows(self) -> bool:
        return getattr(self.target, "select_rows", None) is not None and self.drafter.can_select_rows

    def over_rows(self, batch: Batch, rows: list[int]) -> Decoder:
        """This decoder for a sub-batch of `batch`'s rows: per-row state picked, and stop and commit
        hooks that see `batch`'s row numbers (the sub-batch shares the rows' token lists, so commits
        land there). on_round sees the sub-batch: the rows the models hold."""
        stop, on_commit, race = self.stop, self.on_commit, self.race
        return dataclasses.replace(
            self,
            warping=self.warping.select(rows),
            row_metrics=[self.row_metrics[r] for r in rows],
            stop=None if stop is None else (lambda row, *rest: stop(rows[row], *rest)),
            on_commit=None if on_commit is None else (lambda row, tokens: on_commit(rows[row], tokens)),
            race=None if race is None else race.rows(rows),
        )

    def round(self, batch: Batch, step: int) -> int:
        """One round over the batch; returns the step count."""
        step += 1
        remaining = batch.remaining()
        active = remaining > 0
        k = chosen = self.policy.next_k()
        rate = None if self.lookup is None else self.policy.expected_speedup(chosen)  # what a copy must beat
        if self.drafter.can_extend:  # auto k: past k, the drafter's learned stop decides
            past_k = self.policy.extension(k)
            self.drafter.set_extension(past_k)
            k = k if past_k is None else self.policy.max_k
        lengths = torch.clamp(torch.minimum(torch.full_like(remaining, k), remaining - 1), min=0)
        with self.watch.time("draft_time_s"):
            proposal = self.drafter.propose(batch.sequences, lengths, self.warping, self.generator, race=self.race)
            check_proposal(proposal, self.drafter, lengths, self.target.vocab_size)
            extension = None
            if self.lookup is not None:
                room = torch.where(active, remaining - 1, 0).clamp(min=0)
                survival = self.chain_survival(proposal)
                proposal, extension = self.lookup.extend(
                    proposal, batch.sequences, room, survival, rate, self.policy.verify_cost, self.policy.max_width
                )
        with self.watch.time("target_time_s"):
            logits = score(self.target, batch, active, proposal)
        result = verify(logits, proposal, self.warping, batch.sequences, self.generator, self.verification, self.race)
        check = (f"target model {self.target.name}", step, finite_flag(logits, active))
        result = to_host(result, [*proposal.checks, check])
        starts = batch.lengths()
        self.commit(batch, active, proposal, result)
        if proposal.siblings is not None:  # the target keeps each row's path through the tree
            nodes = proposal.siblings.tokens.shape[1] + proposal.tokens.shape[1]
            keep = torch.zeros(len(starts), nodes, dtype=torch.bool)
            on_path = result.path >= 0
            keep[on_path.nonzero()[:, 0], result.path[on_path]] = True
            self.target.keep_path(keep)
        self.rollback(batch, self.chain_agreement(batch, starts, proposal))
        if extension is not None:
            self.observe_copies(proposal, extension, result, active)
            proposal, result = extension.base, PromptLookup.base_result(proposal, extension, result)
        self.observe(proposal, result)
        if self.on_round is not None:
            self.on_round(batch)
        return step

    def chain_survival(self, proposal: Proposal) -> torch.Tensor:
        """[batch] the chance that each row's whole chain is accepted (1 for no drafts): the drafter's
        acceptance learned by confidence where it reports confidences, else the policy's rates."""
        lengths = proposal.lengths.cpu()
        confidences = proposal.confidences
        survive = self.drafter.survival(confidences) if confidences is not None and confidences.numel() else None
        if survive is not None:
            drafted = torch.arange(confidences.shape[1]) < lengths[:, None]
            return torch.where(drafted, survive, torch.ones_like(survive)).prod(1)
        width = int(lengths.max()) if len(lengths) else 0
        survive = torch.tensor(self.policy.rates(width), dtype=torch.float64).cumprod(0)  # [width]
        return torch.cat([torch.ones(1, dtype=torch.float64), survive])[lengths]

    def observe_copies(self, proposal: Proposal, extension: Extension, result: VerifyResult, active) -> None:
        """Copy acceptance for the lookup, and the copies proposed and accepted for the metrics."""
        kept = self.lookup.observe(proposal, extension, result)
        for row in active.nonzero().flatten().tolist():
            for metrics in (self.watch.metrics, self.row_metrics[row]):
                metrics.lookup_tokens += int(extension.copied[row])
                metrics.lookup_accepted += int(kept[row])

    def commit(self, batch: Batch, active: torch.Tensor, proposal: Proposal, result: VerifyResult) -> None:
        """Append each active row's emitted tokens (EOS, stop strings, budget), count and stream them."""
        drafted, num_accepted, bonus = proposal.lengths.tolist(), result.num_accepted.tolist(), result.bonus.tolist()
        for row in active.nonzero().flatten().tolist():
            tokens = result.tokens[row, : num_accepted[row] + 1].tolist()  # accepted, then recovered or bonus
            emitted = commit_row(batch, row, tokens, self.eos_ids, self.stop)
            if not emitted:
                continue
            accepted = min(num_accepted[row], emitted)
            siblings, on_sibling = 0, False
            if proposal.siblings is not None:
                k = proposal.tokens.shape[1]
                siblings = int(proposal.tree[2][row, k:].sum())  # valid nodes past the chain
                on_sibling = accepted > 0 and int(result.path[row, accepted - 1]) >= k
            for metrics in (self.watch.metrics, self.row_metrics[row]):
                metrics.record_round(drafted[row], accepted, emitted, bonus[row])
                metrics.tree_nodes += siblings
                metrics.sibling_tokens += int(on_sibling)
            if self.on_commit is not None:
                self.on_commit(row, batch.new_tokens(row)[-emitted:])

    @staticmethod
    def chain_agreement(batch: Batch, starts: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """Per row: the committed length up to the first chain draft that was not committed, + 1.
        The draft cache holds the chain; a path that ends on a sibling leaves the chain draft at
        that depth in it, which the draft's rollback must drop."""
        k = proposal.tokens.shape[1]
        if proposal.siblings is None or k == 0:
            return batch.lengths()
        agree = []
        for row, start in enumerate(starts.tolist()):
            committed = batch.sequences[row][start : start + k]
            chain = proposal.tokens[row, : len(committed)].tolist()
            same = next((i for i, (a, b) in enumerate(zip(committed, chain)) if a != b), len(committed))
            agree.append(start + same + 1)
        return torch.minimum(batch.lengths(), torch.tensor(agree))

    def rollback(self, batch: Batch, draft_committed: torch.Tensor | None = None) -> None:
        """Both caches back to the invariant: at most the committed tokens but the last."""
        committed = batch.lengths()
        self.target.rollback(torch.minimum(self.target.lengths, committed - 1))
        self.drafter.rollback(committed if draft_committed is None else draft_committed)

    def observe(self, proposal: Proposal, result: VerifyResult) -> None:
        """Forward counts for the metrics; acceptance counts (never clocks) for the draft-length policy."""
        metrics = self.watch.metrics
        metrics.draft_forwards += proposal.steps
        metrics.target_forwards += 1
        self.policy.observe(result, proposal.lengths)
        if self.drafter.learns:
            self.drafter.observe(proposal, result)


MAX_DRAFT_WIDTH = 1024  # checked before any model is known: a tree scores width x drafts nodes in one forward
MAX_TREE_LOGITS_BYTES = 4 * 2**30  # one row's verify logits (width x drafts x vocab x float32) past this: refused


def check_draft_width(draft_width) -> None:
    if draft_width != "auto" and (
        isinstance(draft_width, bool) or not isinstance(draft_width, int) or not 1 <= draft_width <= MAX_DRAFT_WIDTH
    ):
        raise ValueError(f"draft_width must be an integer in [1, {MAX_DRAFT_WIDTH}] or 'auto', got {draft_width!r}")


def check_tree_size(width: int | str, drafts: int, vocab: int) -> None:
    """A draft tree the target can score: at most one candidate per token of its vocabulary at each
    position, and one row's verify logits (width x drafts x vocab float32) within MAX_TREE_LOGITS_BYTES."""
    if width == "auto" or width == 1:
        return
    if width > vocab:
        raise ValueError(
            f"draft_width={width} exceeds the target's vocabulary ({vocab} tokens): a draft position has at most "
            f"{vocab} candidates"
        )
    need = width * drafts * vocab * 4
    if need > MAX_TREE_LOGITS_BYTES:
        raise ValueError(
            f"draft_width={width} with num_draft_tokens={drafts} needs {need:,} bytes of logits per row (width x "
            f"drafts x vocabulary {vocab} x 4), over the {MAX_TREE_LOGITS_BYTES:,} allowed; lower either"
        )


def tree_width(draft_width, target: TargetModel, drafter: DraftModel, verification: str, greedy: bool) -> int | str:
    """The draft width a run can use: trees need a drafter that grows them, a target adapter that
    scores them, and a verification rule for several candidates (token, race; block judges chains)."""
    check_draft_width(draft_width)
    if draft_width == 1:
        return 1
    reasons = []
    if not drafter.supports_trees:
        reasons.append(f"the drafter ({type(drafter).__name__}) proposes chains only")
    if not getattr(target, "supports_trees", False):
        hint = "; use cache='dynamic'" if getattr(target, "compile_mode", False) is not False else ""
        reasons.append(f"the target adapter ({type(target).__name__}, {target.name}) scores chains only{hint}")
    if verification == "block" and not greedy:
        reasons.append("block verification judges a chain; use verification='token' or 'race'")
    if not reasons:
        return draft_width
    if draft_width == "auto":
        return 1
    raise ValueError(f"draft_width={draft_width} needs a draft tree, but " + "; ".join(reasons))


def decode(
    target: TargetModel,
    drafter: DraftModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],  # per prompt, or one for all
    warping: Warping | RowWarpings | None = None,
    policy: DraftLengthPolicy,
    sampling: SamplingConfig | None = None,
    eos_ids: set[int] = frozenset(),
    stop: StopCheck | None = None,
    on_commit: Callable[[int, list[int]], None] | None = None,
    generator: torch.Generator | None = None,
    clock: Clock = time.perf_counter,
    on_round: Callable[[Batch], None] | None = None,
    metrics: SpeculativeMetrics | None = None,
    row_metrics: list[SpeculativeMetrics] | None = None,
    verification: str = "token",
    race_seed: int | None = None,
    row_seeds: Sequence[int | None] | None = None,
    draft_width: int | str = 1,
    read_ahead: bool | None = None,
    prompt_lookup: PromptLookup | bool = False,
) -> tuple[Batch, SpeculativeMetrics]:
    """Generate up to max_new_tokens per prompt. Returns the batch and its metrics
    (`metrics`, when given, is filled in place, so it is readable after an interrupt;
    `row_metrics`, when given, gets each row's own counts, with the batch's clocks).
    Give `warping` (processors from a generation config) or a plain `sampling` config.
    verification: "token", "block" or "race" (race needs `race_seed`; its tokens depend only on it).
    row_seeds: per row, its own race seed (None: `race_seed`); such a row's tokens are the same alone
    or in any batch.
    draft_width: candidates per draft position (1: a chain; w: a draft tree with w - 1 point-mass
    siblings beside each chain draft; "auto": siblings where the calibrated verify costs say they pay).
    read_ahead: for the target alone, queue each round's forward before reading the last token
    (Decoder.run_ahead; None: on CUDA, where the device runs while the host commits).
    prompt_lookup: append copy drafts (prompt lookup over the text and the round's drafts) after each
    proposal where their learned acceptance pays for the wider verify (specdec.lookup); True builds a
    PromptLookup with its defaults. It reads the drafts on the host once per round."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    if (warping is None) == (sampling is None):
        raise ValueError("give exactly one of warping= and sampling=")
    drafter = as_drafter(drafter)
    warping = warping if warping is not None else Warping.from_sampling(sampling)
    width = tree_width(draft_width, target, drafter, verification, warping.greedy)
    check_tree_size(width, policy.k if policy.k is not None else policy.max_k, target.vocab_size)
    if generator is not None and generator.device.type != target.device.type:
        raise ValueError(f"the generator is on {generator.device} but the target on {target.device}; create it there")
    batch = Batch.from_prompts(prompts, max_new_tokens)
    metrics = metrics if metrics is not None else SpeculativeMetrics()
    row_metrics = row_metrics if row_metrics is not None else [SpeculativeMetrics() for _ in prompts]
    watch = Stopwatch(metrics, clock)
    target.reset(len(prompts))
    drafter.reset(len(prompts))
    warping = warping.for_prompts(batch.prompt_lengths)
    stop_costs = tuple(policy.round_cost(i + 1) - policy.round_cost(i) for i in range(policy.max_k + 1))
    drafter.configure(DraftSettings(width, stop_costs, policy.verify_cost, policy.max_width))
    lookup = PromptLookup() if prompt_lookup is True else (prompt_lookup or None)
    if lookup is not None:
        lookup.reset()
    race = None
    if verification == "race" and not warping.greedy:
        if race_seed is None:
            raise ValueError("race verification needs a seed")
        race = Race.for_prompts(race_seed, prompts, target.vocab_size, row_seeds)
    decoder = Decoder(
        target,
        drafter,
        warping,
        policy,
        watch,
        row_metrics,
        set(eos_ids),
        stop,
        on_commit,
        on_round,
        generator,
        verification,
        race,
        target.device.type == "cuda" if read_ahead is None else read_ahead,
        lookup,
    )
    start = clock()
    try:
        decoder.run(batch)
    finally:
        metrics.wall_time_s = clock() - start
        for row in row_metrics:  # forwards are shared by the batch: each row reports the batch's clocks
            row.wall_time_s, row.draft_time_s, row.target_time_s = (
                metrics.wall_time_s,
                metrics.draft_time_s,
                metrics.target_time_s,
            )
    return batch, metrics
