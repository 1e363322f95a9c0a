"""The decoder: the round loop over a target adapter and a drafter.

Words (docs/DESIGN.md): a round drafts up to k tokens per row, scores them with
one target forward over k + 1 positions, verifies, commits the emitted
tokens, and rolls both caches back to the committed length.

Cache invariant after every round, per row: the target holds all committed
tokens but the last (the recovered or bonus token, which it never saw); the
draft holds a prefix of the committed tokens, at most all but the last.

The round's parts live beside it: committed tokens (specdec.batch), the target's
side of a round (specdec.scoring), draft trees (specdec.trees), the target alone
one round ahead (specdec.run_ahead), copy drafts (specdec.lookup).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec import run_ahead
from specdec.adapters import TargetModel, finite_flag
from specdec.batch import Batch, StopCheck, commit_row
from specdec.drafters import DraftModel, DraftSettings, Proposal, as_drafter, check_proposal
from specdec.lookup import Extension, PromptLookup
from specdec.metrics import Clock, SpeculativeMetrics, Stopwatch
from specdec.policy import DraftLengthPolicy
from specdec.race import Race
from specdec.sampling import RowWarpings, SamplingConfig, Warping
from specdec.scoring import VERIFICATIONS, host_result, score, start_read, to_host, verify
from specdec.trees import (
    MAX_DRAFT_WIDTH,
    MAX_TREE_LOGITS_BYTES,
    chain_agreement,
    check_draft_width,
    check_tree_size,
    path_nodes,
    sibling_counts,
    tree_width,
    verify_tree,
)
from specdec.verify import VerifyResult

__all__ = [  # the round loop's own names, and those of its parts that were imported from here before
    "MAX_DRAFT_WIDTH",
    "MAX_TREE_LOGITS_BYTES",
    "VERIFICATIONS",
    "Batch",
    "Decoder",
    "StopCheck",
    "check_draft_width",
    "check_tree_size",
    "commit_row",
    "decode",
    "host_result",
    "score",
    "start_read",
    "to_host",
    "tree_width",
    "verify",
    "verify_tree",
]


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
        if self.read_ahead and run_ahead.can_read_ahead(self):
            run_ahead.run_ahead(self, batch)
            return
        step, current, sub, rows = 0, self, batch, list(range(len(batch.sequences)))
        while not batch.done:
            if any(sub.finished) and self.can_drop_rows():
                index = torch.tensor([i for i, done in enumerate(sub.finished) if not done])
                self.target.select_rows(index)
                self.drafter.select_rows(index)
                rows = [rows[i] for i in index.tolist()]
                current, sub = self.over_rows(batch, rows), batch.select(rows)
            step = current.round(sub, step)
            for i, row in enumerate(rows):
                batch.finished[row] = sub.finished[i]

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
        """One round over the batch: draft -> verify -> commit -> rollback -> observe. Returns the step count."""
        step += 1
        remaining = batch.remaining()
        active = remaining > 0
        with self.watch.time("draft_time_s"):
            proposal, copies = self.draft(batch, remaining)
        with self.watch.time("target_time_s"):
            logits = score(self.target, batch, active, proposal)
        result = verify(logits, proposal, self.warping, batch.sequences, self.generator, self.verification, self.race)
        check = (f"target model {self.target.name}", step, finite_flag(logits, active))
        result = to_host(result, [*proposal.checks, check])
        starts = batch.lengths()
        self.commit(batch, active, proposal, result)
        if proposal.siblings is not None:  # the target keeps each row's path through the tree
            self.target.keep_path(path_nodes(proposal, result))
        self.rollback(batch, chain_agreement(batch, starts, proposal))
        if copies is not None:  # the drafter and the policy learn from their own chain
            self.observe_copies(proposal, copies, result, active)
            proposal, result = copies.base, PromptLookup.base_result(proposal, copies, result)
        self.observe(proposal, result)
        if self.on_round is not None:
            self.on_round(batch)
        return step

    def draft(self, batch: Batch, remaining: torch.Tensor) -> tuple[Proposal, Extension | None]:
        """The round's proposal: up to k drafts per row (the policy's k; never past a row's budget but
        one), then the copy drafts that pay appended (`Extension`: what they added; None without)."""
        k = chosen = self.policy.next_k()
        rate = None if self.lookup is None else self.policy.expected_speedup(chosen)  # what a copy must beat
        if self.drafter.can_extend:  # auto k: past k, the drafter's learned stop decides
            past_k = self.policy.extension(k)
            self.drafter.set_extension(past_k)
            k = k if past_k is None else self.policy.max_k
        lengths = torch.clamp(torch.minimum(torch.full_like(remaining, k), remaining - 1), min=0)
        proposal = self.drafter.propose(batch.sequences, lengths, self.warping, self.generator, race=self.race)
        check_proposal(proposal, self.drafter, lengths, self.target.vocab_size)
        if self.lookup is None:
            return proposal, None
        room = torch.where(remaining > 0, remaining - 1, 0).clamp(min=0)
        survival = self.chain_survival(proposal)
        return self.lookup.extend(
            proposal, batch.sequences, room, survival, rate, self.policy.verify_cost, self.policy.max_width
        )

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
            siblings, on_sibling = sibling_counts(proposal, result, row, accepted)
            for metrics in (self.watch.metrics, self.row_metrics[row]):
                metrics.record_round(drafted[row], accepted, emitted, bonus[row])
                metrics.tree_nodes += siblings
                metrics.sibling_tokens += int(on_sibling)
            if self.on_commit is not None:
                self.on_commit(row, batch.new_tokens(row)[-emitted:])

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
    (specdec.run_ahead; None: on CUDA, where the device runs while the host commits).
    prompt_lookup: append copy drafts (prompt lookup over the text and the round's drafts) after each
    proposal where their learned acceptance pays for the wider verify (specdec.lookup); True builds a
    PromptLookup with its defaults. It reads the drafts on the host once per round."""
    warping, drafter = _warping(warping, sampling, verification), as_drafter(drafter)
    width = tree_width(draft_width, target, drafter, verification, warping.greedy)
    check_tree_size(width, policy.k if policy.k is not None else policy.max_k, target.vocab_size)
    if generator is not None and generator.device.type != target.device.type:
        raise ValueError(f"the generator is on {generator.device} but the target on {target.device}; create it there")
    race = _race(verification, warping, race_seed, prompts, target.vocab_size, row_seeds)
    batch = Batch.from_prompts(prompts, max_new_tokens)
    metrics = metrics if metrics is not None else SpeculativeMetrics()
    row_metrics = row_metrics if row_metrics is not None else [SpeculativeMetrics() for _ in prompts]
    target.reset(len(prompts))
    drafter.reset(len(prompts))
    drafter.configure(draft_settings(policy, width))
    lookup = PromptLookup() if prompt_lookup is True else (prompt_lookup or None)
    if lookup is not None:
        lookup.reset()
    decoder = Decoder(
        target=target,
        drafter=drafter,
        warping=warping.for_prompts(batch.prompt_lengths),
        policy=policy,
        watch=Stopwatch(metrics, clock),
        row_metrics=row_metrics,
        eos_ids=set(eos_ids),
        stop=stop,
        on_commit=on_commit,
        on_round=on_round,
        generator=generator,
        verification=verification,
        race=race,
        read_ahead=target.device.type == "cuda" if read_ahead is None else read_ahead,
        lookup=lookup,
    )
    start = clock()
    try:
        decoder.run(batch)
    finally:
        _share_clocks(metrics, row_metrics, clock() - start)
    return batch, metrics


def draft_settings(policy: DraftLengthPolicy, width: int | str) -> DraftSettings:
    """The drafter's settings from the policy's costs: the marginal cost of each draft (its learned stop)
    and the verify cost per width."""
    stop_costs = tuple(policy.round_cost(i + 1) - policy.round_cost(i) for i in range(policy.max_k + 1))
    return DraftSettings(width, stop_costs, policy.verify_cost, policy.max_width)


def _warping(warping: Warping | RowWarpings | None, sampling: SamplingConfig | None, verification: str):
    """decode()'s warping, from exactly one of its two forms; the verification rule checked."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    if (warping is None) == (sampling is None):
        raise ValueError("give exactly one of warping= and sampling=")
    return warping if warping is not None else Warping.from_sampling(sampling)


def _race(verification: str, warping, seed: int | None, prompts, vocab: int, row_seeds) -> Race | None:
    """The keyed noise of race verification (None for the other rules, and for greedy runs)."""
    if verification != "race" or warping.greedy:
        return None
    if seed is None:
        raise ValueError("race verification needs a seed")
    return Race.for_prompts(seed, prompts, vocab, row_seeds)


def _share_clocks(metrics: SpeculativeMetrics, row_metrics: list[SpeculativeMetrics], wall: float) -> None:
    """The run's wall time; forwards are shared by the batch, so each row reports the batch's clocks."""
    metrics.wall_time_s = wall
    for row in row_metrics:
        row.wall_time_s, row.draft_time_s, row.target_time_s = wall, metrics.draft_time_s, metrics.target_time_s
