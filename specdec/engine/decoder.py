"""The engine: the rows the models hold, and the round over them.

Words (docs/DESIGN.md): a round drafts up to k tokens per row, scores them with one target forward
over k + 1 positions, verifies, commits the emitted tokens, and rolls both caches back to the committed
length. A row is one prompt: its committed tokens and its own settings (`Row`). Rows join (`add_rows`)
and leave (`drop_rows`) between rounds; `generate()` admits every prompt at once and runs to the end,
the server's session admits and drops them as requests come and go. The same rounds serve both.

Cache invariant after every round, per row: the target holds all committed tokens but the last (the
recovered or bonus token, which it never saw); the draft holds a prefix of the committed tokens, at
most all but the last.

The round's parts live beside it: the target's side of a round (specdec.engine.scoring), draft trees
(specdec.engine.trees). Copy drafts are a drafter that wraps
another (specdec.drafters.lookup.PromptLookup).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.drafters import DraftModel, as_drafter, check_proposal
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.proposal import Proposal, copies_accepted
from specdec.engine.scoring import host_result, score, start_read, to_host, verify
from specdec.engine.trees import chain_agreement, check_tree_size, path_nodes, sibling_counts, tree_width
from specdec.metrics import SpeculativeMetrics, Stopwatch
from specdec.models.adapters import TargetModel
from specdec.tuning.costs import DraftSettings, RoundPrice
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify import VERIFICATIONS, VerifyResult
from specdec.verify.race import Race
from specdec.verify.reads import finite_flag
from specdec.verify.sampling import RowWarpings, SamplingConfig, Warping, row_warping

# A row's stop strings: (committed sequence, prompt length, tokens just added) -> new tokens to keep, or None
StopCheck = Callable[[list[int], int, int], int | None]


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target's raw law at its position (log_softmax of the
    logits the verify forward computed there, float32, before temperature and the other processors), and
    the `logprobs` most likely ids at that position with theirs."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # a row is itself: rows of equal prompts are still two rows
class Row:
    """One prompt the engine decodes: its committed tokens and what it runs with, resolved before it joins."""

    prompt: list[int]
    max_new_tokens: int
    warping: Warping  # its own processors (rows of equal settings share one object)
    race_key: int | None = None  # its race (verification="race"): the key of its prompt (Race.for_prompts) and
    race_seed: int | None = None  # its seed (None: no race; sampled rows then cannot be race-verified)
    stop: StopCheck | None = None  # its stop strings
    on_commit: Callable[[int, list[int]], None] | None = None  # (its number in the run, tokens just committed)
    number: int = 0  # its place in the run that admitted it (what on_commit is told)
    metrics: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)  # its own counts
    logprobs: int | None = None  # each committed token's TokenLogprob with this many alternatives (None: none)
    drafts: bool = True  # False: no drafts for this row (the target alone in a shared batch)
    sequence: list[int] = field(init=False)  # the prompt, then every committed token
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per committed token (when logprobs)
    token_kinds: list[tuple[str, int, int]] = field(default_factory=list)  # per token: (KINDS, round, round's drafts)
    finished: bool = False

    def __post_init__(self):
        self.sequence = list(self.prompt)

    @property
    def new_tokens(self) -> list[int]:
        return self.sequence[len(self.prompt) :]

    @property
    def remaining(self) -> int:
        """Tokens it may still commit: 0 once finished."""
        return 0 if self.finished else self.max_new_tokens - (len(self.sequence) - len(self.prompt))

    def commit(self, tokens: list[int], eos_ids: frozenset[int]) -> int:
        """Append a round's tokens, cut at EOS (kept, as transformers does), at a stop string or at
        max_new_tokens; a cut finishes the row. Returns how many were committed."""
        tokens = tokens[: self.remaining]
        for i, token in enumerate(tokens):
            if token in eos_ids:
                tokens, self.finished = tokens[: i + 1], True
                break
        self.sequence.extend(tokens)
        if self.stop is not None and tokens:
            keep = self.stop(self.sequence, len(self.prompt), len(tokens))
            if keep is not None:
                cut = len(self.sequence) - len(self.prompt) - keep
                del self.sequence[len(self.sequence) - cut :]
                # The cut can reach into earlier rounds (decoding is not prefix-monotone): emit none then.
                tokens, self.finished = tokens[: max(0, len(tokens) - cut)], True
        if len(self.sequence) - len(self.prompt) >= self.max_new_tokens:
            self.finished = True
        return len(tokens)


@dataclass(frozen=True)
class Plan:
    """How a run decodes, resolved once before its first round."""

    policy: DraftLengthPolicy  # k each round (auto k learns from the rounds' counts)
    eos_ids: frozenset[int] = frozenset()
    verification: str = "token"
    width: int | str = 1  # draft width (tree_width resolved it: 1, w > 1 or "auto")
    generator: torch.Generator | None = None  # token and block verification's random draws
    read_ahead: bool = False  # the target alone: queue each forward before reading the last token
    prefill_chunk: int | None = None  # a joining prompt is fed this many tokens a round (None: at once)
    copies: bool = False  # copy drafts after the drafter's chain (the drafter wrapped in PromptLookup)


class Decoder:
    """The engine: a target, a drafter, the rows they hold and the round loop over them."""

    def __init__(self, target: TargetModel, drafter: DraftModel, plan: Plan, watch: Stopwatch):
        self.target, self.plan, self.watch = target, plan, watch
        self.drafter = PromptLookup(drafter) if plan.copies else drafter
        self.scored_width = 1  # the last round's verify width: the columns the target scored
        self.prefilled = False  # the last round fed a chunk of a joining prompt (not a decoding round's cost)
        self.rows: list[Row] = []
        self.steps = 0
        self.memo: OrderedDict = OrderedDict()  # race noise, kept across rounds and row changes
        self._bind()

    # ------------------------------------------------------------ rows

    def start(self, rows: Sequence[Row]) -> None:
        """Empty models holding these rows: the start of a run (or of a session)."""
        self.target.reset(len(rows))
        self.drafter.reset(len(rows))
        self.drafter.configure(draft_settings(self.plan.policy, self.plan.width))
        self.rows = list(rows)
        self._bind()

    @property
    def can_change_rows(self) -> bool:
        """Rows can join and leave between rounds (both models' caches can add and drop rows)."""
        return self.target.can_select_rows and self.drafter.can_select_rows

    def add_rows(self, rows: Sequence[Row]) -> None:
        """Rows join before the next round; their prompts are fed with its forward."""
        self.target.add_rows(len(rows))
        self.drafter.add_rows(len(rows))
        self.rows += rows
        self._bind()

    def drop_rows(self, keep: Sequence[int]) -> None:
        """Only the rows `keep` (their numbers now) stay, in this order; the others leave both models."""
        index = torch.tensor(list(keep), dtype=torch.long)
        self.target.select_rows(index)
        self.drafter.select_rows(index)
        self.rows = [self.rows[i] for i in keep]
        self._bind()

    def _bind(self) -> None:
        """The rows as one round sees them: their token lists (shared, not copied), their warpings and
        their races."""
        rows = self.rows
        self.sequences = [r.sequence for r in rows]
        warping = row_warping([r.warping for r in rows]) if rows else Warping.from_sampling(SamplingConfig(0))
        self.warping = warping.for_prompts([len(r.prompt) for r in rows])
        self.drafting = torch.tensor([r.drafts for r in rows], dtype=torch.long)  # [batch] 0: a row drafts nothing
        self.race = None
        if self.plan.verification == "race" and not self.warping.greedy:
            if any(r.race_key is None for r in rows):
                raise ValueError("race verification needs a seed")
            keys, seeds = ([r.race_key for r in rows], [r.race_seed for r in rows])
            self.race = Race(0, torch.tensor(keys, dtype=torch.int64), self.target.vocab_size,
                             torch.tensor(seeds, dtype=torch.int64), self.memo)  # fmt: skip

    def remaining(self) -> torch.Tensor:  # [batch] tokens each row may still commit, 0 for finished rows
        return torch.tensor([r.remaining for r in self.rows], dtype=torch.long)

    def lengths(self) -> torch.Tensor:  # [batch] committed tokens per row, the prompt's included
        return torch.tensor([len(s) for s in self.sequences], dtype=torch.long)

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """Rounds until every row has finished; finished rows leave the forwards where the models can drop
        rows (a sampled batch's later draws then differ, not its law)."""
        if self.plan.read_ahead and self.can_read_ahead():
            self.run_ahead()
            return
        while not all(row.finished for row in self.rows):
            if any(row.finished for row in self.rows) and self.can_change_rows:
                self.drop_rows([i for i, row in enumerate(self.rows) if not row.finished])
            self.round()

    def round(self) -> None:
        """One round over the rows: propose -> score -> verify -> commit (rollback, observe)."""
        self.steps += 1
        target = self.target
        sequences, filling = self.chunks()
        remaining = self.remaining() * ~filling
        active = remaining > 0
        with self.watch.time("draft_time_s"):
            proposal = self.propose(remaining)
            self.drafter.feed_prompts(sequences, filling)
        with self.watch.time("target_time_s"):
            logits = score(target, sequences, active | filling, proposal)
        self.scored_width = logits.shape[1]
        result = verify(logits, proposal, self.warping, self.sequences, self.plan.generator, self.plan.verification,
                        self.race)  # fmt: skip
        check = (f"target model {target.name}", self.steps, finite_flag(logits, active))
        result = to_host(result, [*proposal.checks, check])
        starts = self.lengths()
        self.commit(active, proposal, result, logits)
        path = None if proposal.siblings is None else path_nodes(proposal, result)  # each row's path in the tree
        self.rollback(chain_agreement(self.sequences, starts, proposal), path)
        self.observe(proposal, result)

    def chunks(self) -> tuple[list[list[int]], torch.Tensor]:
        """The sequences this round feeds, and which rows are still being fed their prompt ([batch] bool):
        a row whose pending tokens exceed the plan's prefill chunk feeds its next chunk alone and takes no
        part in drafting, verifying or committing, so the running rows keep decoding while a long prompt
        joins (chunked prefill). Its cache then holds a prefix of its prompt, as the invariant allows."""
        chunk, sequences = self.plan.prefill_chunk, self.sequences
        held = self.target.lengths.tolist()
        filling = [chunk is not None and len(s) - n > chunk for s, n in zip(sequences, held)]
        self.prefilled = any(len(s) - n > 1 for s, n in zip(sequences, held))  # the last chunk's round too
        fed = [s[: n + chunk] if cut else s for s, n, cut in zip(sequences, held, filling)]
        return fed, torch.tensor(filling, dtype=torch.bool)

    def propose(self, remaining: torch.Tensor) -> Proposal:
        """The round's proposal: up to k drafts per row (the policy's k; never past a row's budget but
        one), priced for the drafter first (`RoundPrice`)."""
        policy = self.plan.policy  # a serving session prices it each round (its costs; a round alone)
        k = chosen = policy.next_k()
        # What a column must beat: it widens every row's verify, so where the costs are this batch's
        # measured ones, one row's column must pay for all rows (the batch's tokens per cost: rows x a row's).
        # So must a draft past k (auto k's extension, where the drafter's learned stop decides).
        rows = max(1, int((remaining > 0).sum())) if policy.costs is not None else 1
        extension = policy.extension(k) if self.drafter.can_extend else None
        extension = None if extension is None else (extension[0], extension[1] * rows)
        k = k if extension is None else policy.max_k
        room = (remaining - 1).clamp(min=0) * self.drafting * (not policy.alone)  # alone: no copies either
        rate = policy.expected_speedup(chosen) * rows
        self.drafter.plan_round(RoundPrice(extension, rate, policy.rates(k), room))
        lengths = torch.clamp(torch.minimum(torch.full_like(remaining, k), room), min=0)
        proposal = self.drafter.propose(self.sequences, lengths, self.warping, self.plan.generator,
                                        race=self.race)  # fmt: skip
        check_proposal(proposal, self.drafter, lengths, self.target.vocab_size)
        return proposal

    def commit(
        self,
        active: torch.Tensor,
        proposal: Proposal,
        result: VerifyResult,
        logits: torch.Tensor | None = None,  # [batch, columns, vocab]: the round's, for rows that want logprobs
    ) -> None:
        """Append each active row's emitted tokens (EOS, stop strings, budget), count them in the row's
        metrics and stream them."""
        eos_ids = self.plan.eos_ids
        drafted, num_accepted, bonus = proposal.lengths.tolist(), result.num_accepted.tolist(), result.bonus.tolist()
        copied = [0] * len(drafted) if proposal.copied is None else proposal.copied.tolist()
        forced = [0] * len(drafted) if proposal.forced is None else proposal.forced.tolist()
        copies_kept = copies_accepted(proposal, result).tolist()
        chains, k = proposal.chain_lengths.tolist(), proposal.tokens.shape[1]
        paths = None if result.path is None else result.path.tolist()
        for i in active.nonzero().flatten().tolist():
            row = self.rows[i]
            row.metrics.lookup_tokens += copied[i]
            row.metrics.lookup_accepted += copies_kept[i]
            row.metrics.forced_tokens += forced[i]
            tokens = result.tokens[i, : num_accepted[i] + 1].tolist()  # accepted, then recovered or bonus
            emitted = row.commit(tokens, eos_ids)
            kept = len(row.new_tokens) - emitted  # a stop string's cut may reach into earlier rounds: theirs go too
            path = None if paths is None else paths[i]
            kinds = token_kinds(path, k, chains[i], drafted[i], num_accepted[i], bonus[i], emitted,
                                self.drafter.uses_model)  # fmt: skip
            row.token_kinds[kept:] = [(kind, row.metrics.rounds + 1, drafted[i]) for kind in kinds]
            if row.logprobs is not None:
                row.token_logprobs[kept:] = token_logprobs(logits[i], columns(path, emitted), tokens, row.logprobs)
            if not emitted:
                continue
            accepted = min(num_accepted[i], emitted)
            siblings, on_sibling = sibling_counts(proposal, result, i, accepted)
            row.metrics.record_round(drafted[i], accepted, emitted, bonus[i])
            row.metrics.tree_nodes += siblings
            row.metrics.sibling_tokens += int(on_sibling)
            if row.on_commit is not None:
                row.on_commit(row.number, row.sequence[-emitted:])

    def rollback(self, draft_committed: torch.Tensor | None = None, path: torch.Tensor | None = None) -> None:
        """Both caches back to the invariant: at most the committed tokens but the last (the target keeps a
        tree's `path` first)."""
        committed = self.lengths()
        self.target.commit(committed - 1, path)
        self.drafter.rollback(committed if draft_committed is None else draft_committed)

    def observe(self, proposal: Proposal, result: VerifyResult) -> None:
        """Forward counts for the metrics; acceptance counts (never clocks) for the draft-length policy."""
        metrics = self.watch.metrics
        metrics.draft_forwards += proposal.steps
        metrics.target_forwards += 1
        self.plan.policy.observe(result, proposal.chain_lengths)  # the policy learns from the drafter's own chains
        if self.drafter.learns:
            self.drafter.observe(proposal, result)

    # ------------------------------------------------------------ run-ahead: the target alone

    def can_read_ahead(self) -> bool:
        """Run-ahead: round s's forward is queued, its input the token round s - 1 sampled, still on the
        device; then round s - 1's token is read and committed while the device runs round s (on a GPU the
        host's work between rounds then no longer idles the device). For the target alone (one token per
        round, so the host knows each next forward's shape), with warpers that need no committed prefix
        (the next forward is queued before the last token is read), and a target that can embed every id
        it emits (the sampled ids are fed back as they are)."""
        alone = not self.drafter.drafts
        embeds_all = self.target.vocab_size <= self.target.embed_size
        return alone and self.warping.prefix_free and self.race is None and embeds_all

    def run_ahead(self) -> None:
        """Every round of the target alone, each forward queued before the last round's token is read.
        Tokens and random draws are those of the plain loop while no row has finished; rows are not dropped
        here. A row that finishes while its next round is queued wastes that round (its token is never
        committed), and the final rollback drops what it fed."""
        target, sequences = self.target, self.sequences
        nothing = torch.zeros(len(sequences), dtype=torch.long)
        proposal = self.drafter.propose(sequences, nothing, None, None)  # the target alone: nothing
        ids, queued = None, None
        remaining = self.remaining()
        while True:
            active = remaining > 0  # rows whose next token the host will commit, as far as it knows
            launched = None
            if bool(active.any()):
                self.steps += 1
                with self.watch.time("target_time_s"):
                    if ids is None:  # the first round feeds each row's pending tokens from the host
                        logits = target.feed(sequences, active)
                    else:
                        logits = target.forward(ids, active[:, None])
                result = verify(logits, proposal, self.warping, sequences, self.plan.generator,
                                self.plan.verification)  # fmt: skip
                ids = result.tokens[:, :1]  # the next round's input, left on the device
                check = (f"target model {target.name}", self.steps, finite_flag(logits, active))
                launched = start_read(result, [check]), active, logits
            if queued is not None:
                read, was_active, was_logits = queued
                result = host_result(read)
                self.commit(was_active, proposal, result, was_logits)  # a row finished meanwhile takes none
                self.observe(proposal, result)
            if launched is None:
                break
            queued = launched
            remaining = (self.remaining() - launched[1].long()).clamp_min(0)  # the queued round's token counts
        self.rollback()


# What emitted a token: a draft model's accepted draft, an accepted copy draft (prompt lookup, n-gram), an
# accepted tree sibling, the target's recovered or bonus token, or the target's own token in a round that
# drafted nothing (the target alone).
KINDS = ("draft", "copy", "sibling", "recovered", "bonus", "target")


def token_kinds(
    path: list[int] | None, k: int, chain: int, drafted: int, accepted: int, bonus: bool, emitted: int, model: bool
) -> list[str]:
    """The KINDS of a row's first `emitted` tokens of a round: its accepted drafts, then the target's token.
    path: a tree's accepted nodes (None: a chain; chain nodes keep their chain position, siblings come
    after the k chain columns); chain: the drafter's own drafts, copies after them; model: those come from
    a draft model ("draft"), else from the context ("copy")."""
    kinds = []
    for j in range(min(accepted, emitted)):
        node = j if path is None else path[j]
        kinds.append("sibling" if node >= k else ("copy" if node >= chain or not model else "draft"))
    if emitted > accepted:
        kinds.append("target" if drafted == 0 else ("bonus" if bonus else "recovered"))
    return kinds


def columns(path: list[int] | None, emitted: int) -> list[int]:
    """The logits columns that scored a row's first `emitted` tokens of a round: token j is scored after
    token j - 1 (a chain, path None: column j; a tree: column 1 + the node of token j - 1, 0 for the first)."""
    if path is None or emitted == 0:
        return list(range(emitted))
    return [0] + [1 + node for node in path[: emitted - 1]]


def token_logprobs(logits: torch.Tensor, at: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [columns, vocab] of one row -> each token's TokenLogprob at its column (raw law, float32)."""
    if not at:
        return []
    laws = torch.log_softmax(logits[at].float(), -1).cpu()  # [tokens, vocab]
    chosen = laws[torch.arange(len(at)), torch.tensor(tokens[: len(at)])].tolist()
    best = laws.topk(top, -1) if top else None
    return [
        TokenLogprob(value, () if best is None else tuple(zip(best.indices[j].tolist(), best.values[j].tolist())))
        for j, value in enumerate(chosen)
    ]


# ------------------------------------------------------------------ one run of a batch


def rows_for(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],  # per prompt, or one for all
    warping: Warping | RowWarpings,  # one for all, or one per row
    vocab_size: int,
    *,
    race_seed: int | None = None,
    row_seeds: Sequence[int | None] | None = None,
    stops: Sequence[StopCheck | None] | None = None,
    on_commit: Callable[[int, list[int]], None] | None = None,
    metrics: Sequence[SpeculativeMetrics] | None = None,
    logprobs: int | None = None,
) -> list[Row]:
    """A run's rows, one per prompt. race_seed: the run's race (its keys hash every prompt token; without
    one, race verification of sampled rows is refused); row_seeds: per row, its own race seed (None:
    `race_seed`), so that its tokens are the same alone or in any batch. metrics: each row's own counts.
    logprobs: each committed token's TokenLogprob, with this many alternatives (None: none)."""
    keys, seeds = [None] * len(prompts), [None] * len(prompts)
    if race_seed is not None:
        race = Race.for_prompts(race_seed, prompts, vocab_size, row_seeds)
        keys = race.row_keys.tolist()
        seeds = race.row_seeds.tolist() if race.row_seeds is not None else [race.seed] * len(prompts)
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    warpings = warping.warpings if isinstance(warping, RowWarpings) else [warping] * len(prompts)
    metrics = metrics if metrics is not None else [SpeculativeMetrics() for _ in prompts]
    stops = stops or [None] * len(prompts)
    return [
        Row(list(p), n, w, key, seed, stop, on_commit, i, m, logprobs)
        for i, (p, n, w, key, seed, stop, m) in enumerate(zip(prompts, budgets, warpings, keys, seeds, stops, metrics))
    ]


def plan_for(
    target: TargetModel,
    drafter: DraftModel,
    policy: DraftLengthPolicy,
    greedy: bool,
    *,
    eos_ids: set[int] = frozenset(),
    verification: str = "token",
    draft_width: int | str = 1,
    generator: torch.Generator | None = None,
    read_ahead: bool | None = None,
    prompt_lookup: bool | str = False,
    priced: bool | None = None,
    prefill_chunk: int | None = None,
) -> Plan:
    """How a run decodes, checked against its models: the one place generate() and a serving session
    resolve theirs. greedy: every row's warping is greedy.
    verification: "token", "block" or "race" (race tokens depend only on the rows' race seeds).
    draft_width: candidates per draft position (1: a chain; w: a draft tree with w - 1 point-mass
    siblings beside each chain draft; "auto": siblings where the calibrated verify costs say they pay).
    read_ahead: for the target alone, queue each round's forward before reading the last token
    (None: on CUDA, where the device runs while the host commits).
    prompt_lookup: copy drafts after the drafter's chain; "auto": after a draft model's chain, on the CPU,
    where the rounds are priced by this host's measured costs (`priced`; None: the policy has costs),
    which weigh each copy against its verify column. prefill_chunk: a joining prompt's tokens a round."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    width = tree_width(draft_width, target, drafter, verification, greedy)
    check_tree_size(width, policy.k if policy.k is not None else policy.max_k, target.vocab_size)
    if generator is not None and generator.device.type != target.device.type:
        raise ValueError(f"the generator is on {generator.device} but the target on {target.device}; create it there")
    read_ahead = target.device.type == "cuda" if read_ahead is None else read_ahead
    priced = policy.costs is not None if priced is None else priced
    auto = drafter.uses_model and target.device.type == "cpu" and priced
    copies = auto if prompt_lookup == "auto" else bool(prompt_lookup)
    return Plan(policy, frozenset(eos_ids), verification, width, generator, read_ahead, prefill_chunk, copies)


def decode(
    target: TargetModel,
    drafter: DraftModel,
    rows: Sequence[Row],
    plan: Plan,
    watch: Stopwatch | None = None,
) -> tuple[list[Row], SpeculativeMetrics]:
    """Every row from its prompt to its end: one engine run (`rows_for`, `plan_for`). Returns the rows
    (their new tokens: `row.new_tokens`) and the run's metrics (`watch.metrics`: its forwards and clocks as
    the rounds run, and the sum of its rows' counts at its end, an interrupt's too); each row gets its own
    counts, with the batch's clocks."""
    watch = watch if watch is not None else Stopwatch(SpeculativeMetrics())
    engine = Decoder(target, as_drafter(drafter), plan, watch)
    engine.start(rows)
    start = watch.clock()
    try:
        engine.run()
    finally:
        _share_clocks(watch.metrics, [row.metrics for row in rows], watch.clock() - start)
        watch.metrics.add_counts(row.metrics for row in rows)
    return list(rows), watch.metrics


def draft_settings(policy: DraftLengthPolicy, width: int | str) -> DraftSettings:
    """The drafter's settings from the policy's costs: the marginal cost of each draft (its learned stop)
    and the verify cost per width."""
    stop_costs = tuple(policy.round_cost(i + 1) - policy.round_cost(i) for i in range(policy.max_k + 1))
    return DraftSettings(width, stop_costs, policy.verify_cost, policy.max_width)


def _share_clocks(metrics: SpeculativeMetrics, row_metrics: list[SpeculativeMetrics], wall: float) -> None:
    """The run's wall time; forwards are shared by the batch, so each row reports the batch's clocks."""
    metrics.wall_time_s = wall
    for row in row_metrics:
        row.wall_time_s, row.draft_time_s, row.target_time_s = wall, metrics.draft_time_s, metrics.target_time_s
