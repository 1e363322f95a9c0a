"""Drafters: what proposes the k tokens the target then checks.

Words (a proposal, its siblings: specdec.drafters.proposal):
- ModelDrafter: a small Hugging Face LM sampled with the target's warping.
- NgramDrafter: prompt lookup; finds an earlier occurrence (the earliest, by
  default) of the last n tokens in the prompt and the output so far, and
  proposes what followed it (under auto k, as much of it as pays by the
  acceptance learned per match length). Model-free, so its cost ratio is ~0.

A new drafter is a new class: a `Drafter` that overrides what it does (`DraftModel` lists every
member the decoder calls and what a drafter declares); an object with nothing but `propose` is
wrapped in `CustomDrafter` with the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from specdec.drafters.proposal import Proposal, Siblings, check_proposal_shape, tree_outcome
from specdec.models.adapters import PAD_ID, TargetModel
from specdec.tuning.costs import PERFECT, DraftSettings, RateCounter, RoundPrice, columns_that_pay, surplus
from specdec.verify.race import Race
from specdec.verify.reads import finite_flag, read_checked, to_device
from specdec.verify.sampling import Warping, sample


class AcceptanceByConfidence:
    """P(a draft is accepted | the draft's own probability of it), learned from counts in bins.

    Peaked real drafts are rejected when unsure; a flat draft that agrees with its target (a
    layer-skip draft, a random pair) is accepted at any confidence. Counts tell the two apart,
    per pair and per generation (reset each run, so a seed still fixes the tokens)."""

    EDGES = torch.tensor([0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9])  # 10 bins of the draft's probability

    def __init__(self, prior: float = 0.7, weight: float = 2.0):
        self.counts = RateCounter(prior, weight, len(self.EDGES) + 1)

    def reset(self) -> None:
        self.counts.reset()

    def predict(self, confidence: torch.Tensor) -> torch.Tensor:  # [batch] -> [batch] float64
        return self.counts.predict(torch.bucketize(confidence.double(), self.EDGES.double()))

    def observe(self, confidences: torch.Tensor, lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Drafts up to and including each row's first rejection were judged; later ones were not."""
        position = torch.arange(confidences.shape[1])[None, :]
        judged = position < torch.minimum(num_accepted + 1, lengths)[:, None]
        accepted = position < num_accepted[:, None]
        bins = torch.bucketize(confidences.double(), self.EDGES.double())
        self.counts.observe(accepted[judged].double(), 1.0, bins[judged])


class AcceptanceByRank:
    """P(the target's token at a rejected chain draft is the sibling of rank r), from counts;
    the prior falls with the rank. Reset each run, as AcceptanceByConfidence."""

    def __init__(self, ranks: int = 4, prior: tuple[float, ...] = (0.3, 0.15, 0.1, 0.07), weight: float = 2.0):
        self.counts = RateCounter(prior[:ranks], weight)

    def reset(self) -> None:
        self.counts.reset()

    def _bins(self, rank: torch.Tensor) -> torch.Tensor:  # ranks (1-based) -> bins; past the last: the last
        return (rank - 1).clamp(0, len(self.counts.prior) - 1)

    def predict(self, rank: torch.Tensor) -> torch.Tensor:  # ranks (1-based) -> probabilities
        return self.counts.predict(self._bins(rank))

    def observe(
        self, siblings: Siblings, chain_accepted: torch.Tensor, lengths: torch.Tensor, won: torch.Tensor
    ) -> None:
        """Siblings beside a rejected chain draft were judged (`won`: the one the target took)."""
        judged = siblings.valid & (siblings.depth == chain_accepted[:, None]) & (siblings.depth < lengths[:, None])
        self.counts.observe(won[judged].double(), 1.0, self._bins(siblings.rank[judged]))


class DraftModel(Protocol):
    """Everything the decoder may call on a drafter, and what a drafter declares about itself.

    Declared, never probed (class attributes, or properties where they follow the drafter's settings):
    - uses_model: runs a draft LM (its step is calibrated; copy drafts may follow its chain).
    - supports_trees: proposes siblings beside its chain once configured with a width other than 1.
    - learns: `observe` updates what it knows from verified rounds (reset with each run).
    - can_extend: can stop on its own past the round's k (`RoundPrice.extension`, auto k).
    - can_select_rows: rows can leave (`select_rows`) and join (`add_rows`) between rounds.
    - drafts: proposes draft tokens at all (False: the target alone, `NoDrafter`).
    - trusted: its proposals are target ids within the asked lengths by construction, so the decoder
      does not check them (a check reads device tensors: a host sync each round).
    specdec's drafters inherit `Drafter`, whose defaults say no to each; a user's object with only
    `propose` is wrapped in `CustomDrafter` (`as_drafter`).
    """

    name: str
    adapter: TargetModel | None  # the draft LM's adapter (None: model-free)
    max_positions: int | None  # the context the drafter can hold (None: unbounded)
    uses_model: bool
    supports_trees: bool
    learns: bool
    can_extend: bool
    can_select_rows: bool
    drafts: bool
    trusted: bool

    def reset(self, batch: int) -> None:
        """A new run over `batch` rows: empty caches, forget what was learned."""

    def configure(self, settings: DraftSettings) -> None:
        """The run's width and costs (after `reset`, before the first round)."""

    def plan_round(self, price: RoundPrice) -> None:
        """This round's price, before its proposal (specdec.tuning.costs.RoundPrice): the learned stop's
        extension past k (can_extend drafters), the round's tokens per cost and each row's room."""

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        max_lengths: torch.Tensor,  # [batch] drafts wanted per row (0: none)
        warping: Warping,
        generator: torch.Generator | None,
        race: Race | None = None,  # under race verification: the keyed noise drafts are race winners of
    ) -> Proposal: ...

    def survival(self, confidences: torch.Tensor) -> torch.Tensor | None:
        """[batch, k] the draft's confidences -> the learned chance each draft is accepted (float64),
        or None where the drafter learns none."""

    def observe(self, proposal: Proposal, result) -> None:
        """A verified round (its VerifyResult, with a tree's path where it drafted one), for drafters that learn."""

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        """[batch] committed tokens per row: keep at most all but the last in the draft's cache."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch), in this order."""

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows."""

    def feed_prompts(self, sequences: Sequence[Sequence[int]], rows: torch.Tensor) -> None:
        """[batch] bool rows: feed their pending tokens of `sequences` (a long prompt's next chunk, cut by
        the caller) into the draft's cache, so the prompt is not fed at once when the row first drafts."""


class Drafter:
    """The protocol's defaults: a model-free drafter of chains that learns nothing and holds no per-row
    state (so rows may leave and join). Subclasses override what they do."""

    adapter: TargetModel | None = None
    max_positions: int | None = None
    uses_model = False
    supports_trees = False
    learns = False
    can_extend = False
    can_select_rows = True
    drafts = True
    trusted = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def reset(self, batch: int) -> None:
        pass

    def configure(self, settings: DraftSettings) -> None:
        pass

    def plan_round(self, price: RoundPrice) -> None:
        pass

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        raise NotImplementedError

    def survival(self, confidences: torch.Tensor) -> torch.Tensor | None:
        return None

    def observe(self, proposal: Proposal, result) -> None:
        pass

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def add_rows(self, count: int) -> None:
        pass

    def feed_prompts(self, sequences, rows: torch.Tensor) -> None:
        pass


class CustomDrafter(Drafter):
    """A user's drafter that is nothing but `propose`, with the protocol's defaults around it: chains, no
    learning, no per-row state (so no rows join or leave). A drafter that keeps state or learns is a
    `Drafter` subclass: its methods are then called, never looked for."""

    can_select_rows = False

    def __init__(self, inner: Proposes):
        self.inner = inner

    @property
    def name(self) -> str:
        return type(self.inner).__name__

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        keys = {} if race is None else {"race": race}  # a drafter written before race verification takes none
        return self.inner.propose(sequences, max_lengths, warping, generator, **keys)


@runtime_checkable
class Proposes(Protocol):
    """What `CustomDrafter` needs of a user's object."""

    def propose(self, sequences, max_lengths, warping, generator) -> Proposal: ...


def as_drafter(drafter) -> Drafter:
    """A drafter the decoder can drive: specdec's own (and any `Drafter`) as it is, any other object
    with `propose` wrapped in `CustomDrafter`, which calls that alone (subclass `Drafter` to have the
    protocol's other methods called: the declaration is the class, never its methods looked for)."""
    if isinstance(drafter, Drafter):
        return drafter
    if not isinstance(drafter, Proposes):
        raise ValueError(f"a drafter needs a propose() method; {type(drafter).__name__} has none")
    return CustomDrafter(drafter)


class ModelDrafter(Drafter):
    """A draft LM that samples (or takes the argmax) under the target's warping."""

    uses_model = True
    supports_trees = True
    learns = True
    trusted = True

    AUTO_RANKS = 3  # siblings per chain draft that draft_width="auto" considers
    MAX_SIBLINGS = 16  # ... and at most this many per round

    def __init__(
        self,
        adapter: TargetModel,
        vocab_size: int | None = None,
        stop_below: float | str | None = "auto",
        width: int | str = 1,
    ):
        self.adapter = adapter
        self.max_positions = adapter.max_positions
        self.vocab_size = vocab_size or adapter.vocab_size  # the target's: drafts live in its vocabulary
        # When to stop a row's drafting early (exact either way: it only shortens proposals):
        # a number: after a token the draft itself gave probability < stop_below;
        # "auto": once the learned chance that every draft so far survives falls below what one more
        # draft costs (`stop_costs`, in target forwards, set from the calibration); None: never.
        # On CUDA "auto" is off: the stop reads each draft's confidence on the host, which drains the
        # device's queue; on the H100 layer-skip pair it cost 22-34% of the speed of drafting without it,
        # for the same accepted length (docs/BENCHMARKS.md, "GPU: one host read per round"). A number still stops.
        if not (stop_below is None or stop_below == "auto" or isinstance(stop_below, (int, float))):
            raise ValueError(f"stop_below must be a probability, 'auto' or None, got {stop_below!r}")
        on_cuda = adapter.device.type == "cuda"
        self.stop_below = None if stop_below == "auto" and on_cuda else stop_below
        self.acceptance = AcceptanceByConfidence()
        # Draft trees: `width` candidates per chain draft (1: a chain), or "auto": siblings chosen by
        # their learned value (AcceptanceByRank, the chance of reaching them) against what one more
        # verify column costs, `verify_cost(width)` in target forwards (`configure` sets the run's).
        self.configure(DraftSettings(width=width))
        self.rank_acceptance = AcceptanceByRank()
        self.extension: tuple[int, float] | None = None  # this round's (RoundPrice.extension)
        self.step = 0

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def can_extend(self) -> bool:
        """Whether drafts past the round's k can stop on their own (the learned stop)."""
        return self.stop_below == "auto"

    def configure(self, settings: DraftSettings) -> None:
        self.width, self.max_width, self.verify_cost = settings.width, settings.max_width, settings.verify_cost
        self.stop_costs = list(settings.stop_costs)  # the marginal cost of the (i+1)-th draft
        self.stops = settings.stops and self.stop_below is not None

    def plan_round(self, price: RoundPrice) -> None:
        self.extension = price.extension

    def survival(self, confidences: torch.Tensor) -> torch.Tensor:
        return self.acceptance.predict(confidences.reshape(-1)).reshape(confidences.shape)

    def reset(self, batch: int) -> None:
        self.adapter.reset(batch)
        self.acceptance.reset()
        self.rank_acceptance.reset()

    def observe(self, proposal: Proposal, result) -> None:
        """Learn acceptance by confidence (and, for trees, by sibling rank) from a verified round."""
        accepted = result.num_accepted
        if proposal.siblings is not None:
            accepted, won = tree_outcome(proposal, result)
            self.rank_acceptance.observe(proposal.siblings, accepted, proposal.lengths, won)
        if proposal.confidences is not None and proposal.confidences.numel():
            self.acceptance.observe(proposal.confidences, proposal.lengths, accepted)

    def _siblings(
        self, chain: list[torch.Tensor], rankings: list[torch.Tensor], confidences: list[torch.Tensor], lengths
    ) -> Siblings | None:
        """Point-mass alternatives beside each chain draft: the top of its ranking (the draft's law,
        greedy scores, or the race's noised log-law) other than the chain's token."""
        if self.width == 1 or not chain:
            return None
        per_depth = self.AUTO_RANKS if self.width == "auto" else self.width - 1
        ranked = torch.stack(rankings, 1).float()  # [batch, depth, vocab]
        ranked.scatter_(2, torch.stack(chain, 1).to(ranked.device)[..., None], float("-inf"))
        top = ranked.topk(min(per_depth, ranked.shape[-1] - 1), dim=-1)
        batch, depth, ranks = top.indices.shape
        depths = torch.arange(depth)[None, :, None].expand(batch, depth, ranks)
        rank = torch.arange(1, ranks + 1)[None, None, :].expand(batch, depth, ranks)
        valid = (top.values > float("-inf")).cpu() & (depths < lengths[:, None, None])
        if self.width == "auto":
            valid &= self._worth_verifying(torch.stack(confidences, 1), rank, valid, lengths)
        flat = lambda t: t.reshape(batch, depth * ranks)  # noqa: E731
        order = torch.sort((~flat(valid)).long(), dim=1, stable=True).indices  # chosen ones first
        count = int(flat(valid).sum(1).max())
        if count == 0:
            return None
        pick = lambda t: flat(t).gather(1, order)[:, :count]  # noqa: E731
        return Siblings(pick(top.indices.cpu()), pick(depths), pick(rank), pick(valid))

    def _worth_verifying(self, confidences, rank, valid, lengths) -> torch.Tensor:
        """draft_width="auto": add siblings, best first, while each raises the round's expected
        tokens per unit of cost: its value v (the chance of reaching its depth and the chain draft
        there failing, times the learned acceptance of its rank) must exceed (tokens / cost) of the
        round so far times what one more verify column costs (specdec.tuning.costs.columns_that_pay). The
        verify never grows past `max_width` columns, the widest the calibration measured."""
        batch, depth, ranks = rank.shape
        survive = self.acceptance.predict(confidences.reshape(-1)).reshape(batch, depth)  # per chain draft
        reach = torch.cat([torch.ones(batch, 1, dtype=torch.float64), survive.cumprod(1)[:, :-1]], 1)
        value = (reach * (1 - survive))[..., None] * self.rank_acceptance.predict(rank)
        value = torch.where(valid, value, torch.zeros_like(value)).reshape(batch, -1)
        best = value.sort(1, descending=True)
        keep = torch.zeros_like(value, dtype=torch.bool)
        for row in range(batch):
            k = int(lengths[row])
            tokens = 1 + float((reach[row, :k] * survive[row, :k]).sum())  # expected from the chain
            cost = 1 + sum(self.stop_costs[:k])  # the chain round, in target forwards
            limit = min(self.max_width, k + 1 + self.MAX_SIBLINGS)
            count = columns_that_pay(best.values[row].tolist(), k + 1, tokens, cost, self.verify_cost, limit)
            keep[row, best.indices[row, :count]] = True
        return keep.reshape(batch, depth, ranks)

    def _stop(self, confidence: torch.Tensor, survive: torch.Tensor, i: int) -> torch.Tensor:
        """Rows whose drafting should end after draft i (0-based). `survive` is updated in place.
        "auto": a row stops once one more draft does not pay (specdec.tuning.costs.surplus): the chance that
        every draft so far survives, against the next draft's marginal cost times the bar (past k
        with auto k, `extension`'s; else 1, the target alone's token per forward)."""
        if not self.stops:
            return torch.zeros_like(confidence, dtype=torch.bool)
        if self.stop_below == "auto":
            survive.mul_(self.acceptance.predict(confidence))
            cost = self.stop_costs[min(i + 1, len(self.stop_costs) - 1)]
            if self.extension is not None and i + 1 >= self.extension[0]:
                return surplus(survive, self.extension[1], 1.0, cost) < 0  # the next draft does not pay
            return surplus(survive, 1.0, 1.0, cost) < 0
        return confidence < self.stop_below

    def _next_logits(
        self, raw: torch.Tensor, active: torch.Tensor, generator: torch.Generator | None, flags: list
    ) -> torch.Tensor:
        """Draft logits over the target's vocabulary: extra ids cut, missing ids at -inf (probability 0).
        The draft law is then exactly what is sampled, so verification stays exact. The logits'
        finiteness check joins `flags`, read with the drafts or the round's verify result (no sync of its own)."""
        self.step += 1
        flags.append((f"draft model {self.adapter.name}", self.step, finite_flag(raw, active)))
        logits = raw if generator is None else raw.to(generator.device)
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def propose(self, sequences, max_lengths, warping: Warping, generator, race: Race | None = None) -> Proposal:
        """Up to max_lengths[b] drafts per row. Under race verification each draft is the draft's own
        race winner with the target's keyed noise at its absolute position (a point mass)."""
        batch, k = len(sequences), int(max_lengths.max()) if len(max_lengths) else 0
        if k == 0:
            return Proposal(torch.zeros(batch, 0, dtype=torch.long), max_lengths, None)
        active = max_lengths > 0
        lengths = max_lengths.clone()  # shrinks where the draft loses confidence
        flags = []  # the finiteness checks of the draft forwards not yet read
        logits = self._next_logits(self.adapter.feed(sequences, active)[:, -1], active, generator, flags)
        tokens, probs, confidences, rankings = [], [], [], []
        survive = torch.ones(batch, dtype=torch.float64)  # the learned chance that all drafts so far survive
        host = []  # per read: [batch, drafts read] tokens and confidences on the CPU
        forced, steps = torch.zeros(batch, dtype=torch.long), 1  # drafts the grammar forced per row; forwards
        while len(tokens) < k:
            i = len(tokens)
            token, confidence, law, ranking = self._draft(logits, warping, sequences, tokens, generator, race)
            if law is not None:  # sampled: the law each draft was drawn from goes to verification
                probs.append(law)
            if self.width != 1:
                rankings.append(ranking)
            tokens.append(token)
            confidences.append(confidence)
            if self.stops:  # the stop reads this draft's confidence: the step's one host read
                host.append(self._read(tokens[-1:], confidences[-1:], flags))
                lengths[self._stop(host[-1][1][:, 0], survive, i) & (lengths > i + 1)] = i + 1
            going = active & (lengths > i + 1)
            fed, valid = [token], [going]
            while getattr(warping, "constrained", False) and len(tokens) < k:
                # Forced tokens are free drafts: where the grammar allows one token, the law there is its point
                # mass whatever the logits, so it is drafted without a forward (exact: the masked target gives it
                # probability 1). A drafting row's forced draft rides along the next forward; a row whose chain
                # ended (its stop, not its room) still takes the forced drafts that follow it, never fed.
                j = len(tokens)
                rows = (active & (max_lengths > j) & (lengths >= j)).nonzero().flatten().tolist()
                drafted = torch.stack(tokens, 1).tolist()
                ids = warping.forced([list(seq) + drafted[row] for row, seq in enumerate(sequences)], rows)
                if not rows or any(t is None and bool(going[r]) for r, t in zip(rows, ids)):
                    break  # a drafting row needs the draft's logits
                extended = [r for r, t in zip(rows, ids) if t is not None]
                if not extended:
                    break
                token = torch.zeros(batch, dtype=torch.long)
                token[extended] = torch.tensor([t for t in ids if t is not None])
                forced[extended] += 1
                lengths[extended] = torch.clamp(lengths[extended], min=j + 1)
                self._append_forced(token.to(tokens[-1].device), tokens, probs, confidences, rankings, law, host)
                going = going & (lengths > j + 1)
                embed = self.adapter.embed_size  # a forced id the draft cannot embed is fed as PAD_ID
                fed.append(torch.where(tokens[-1] < embed, tokens[-1], torch.full_like(tokens[-1], PAD_ID)))
                valid.append(going)
            if not bool(going.any()):
                break
            # The last draft of a row is never fed: the target scores it.
            raw = self.adapter.forward(torch.stack(fed, 1).to(self.adapter.device), torch.stack(valid, 1))
            logits = self._next_logits(raw[:, -1], going, generator, flags)
            steps += 1
        forced = forced if bool(forced.any()) else None
        if not self.stops and self.width == 1:  # nothing read yet: the round's verify read takes all
            law = torch.stack(probs, 1) if probs else None
            return Proposal(torch.stack(tokens, 1), lengths, law, steps, checks=flags, forced=forced)
        if not self.stops:  # a tree's siblings are chosen on the host: read the drafts once, here
            host.append(self._read(tokens, confidences, flags))
        drafts, read_confidences = torch.cat([h[0] for h in host], 1), torch.cat([h[1] for h in host], 1)
        return Proposal(
            drafts,
            lengths,
            torch.stack(probs, 1) if probs else None,
            steps=steps,
            confidences=read_confidences,
            siblings=self._siblings(tokens, rankings, list(read_confidences.unbind(1)), lengths),
            forced=forced,
        )

    def _append_forced(self, token, tokens: list, probs: list, confidences: list, rankings: list, law, host) -> None:
        """A forced draft [batch] after the others: its law, confidence and ranking are its point mass."""
        one_hot = torch.zeros(len(token), self.vocab_size, device=token.device).scatter_(1, token[:, None], 1.0)
        if law is not None:
            probs.append(one_hot.to(law.device))
        if self.width != 1:
            rankings.append(torch.log(one_hot))  # no siblings beside a forced draft
        tokens.append(token)
        confidences.append(torch.ones(len(token), device=token.device))
        if self.stops:  # read with the rest (a forced draft never stops the chain)
            host.append((token.cpu()[:, None], torch.ones(len(token), 1)))

    def _draft(self, logits, warping: Warping, sequences, tokens: list, generator, race: Race | None):
        """One draft per row from the draft's logits [batch, vocab], warped exactly as the target is, at its
        own prefix (committed + drafted so far) -> (token [batch], the draft's confidence in it [batch] or
        None, the law it was drawn from [batch, vocab] (None: a point mass), its ranking for siblings)."""
        prefixes = None
        if not warping.prefix_free:
            drafted = torch.stack(tokens, 1).tolist() if tokens else [[] for _ in sequences]
            prefixes = [list(seq) + drafted[row] for row, seq in enumerate(sequences)]
        scores = warping.scores(logits[:, None], prefixes)[:, 0]  # [batch, vocab]
        if warping.greedy:
            token, confidence = scores.argmax(-1), None
            # Read by the stop and the tree's siblings only: a chain without a stop (CUDA's default) skips
            # the softmax, a few kernels per draft step.
            if self.stops or self.width != 1:
                confidence = torch.softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
            return token, confidence, None, scores
        law = warping.probs(scores)  # exactly what the token is drawn from
        if race is not None:
            positions = to_device(torch.tensor([[len(seq) + len(tokens)] for seq in sequences]), law.device)
            ranking = torch.log(law.float()).add_(race.noise(positions)[:, 0])
            token = ranking.argmax(-1)  # race_sample
            return token, law.gather(-1, token[:, None]).squeeze(-1), None, ranking
        token = sample(law, generator)
        return token, law.gather(-1, token[:, None]).squeeze(-1), law, torch.log(law)  # log: -inf where it never goes

    @staticmethod
    def _read(tokens: list, confidences: list, flags: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One host read of drafts and their confidences ([batch] tensors on the device) with the finiteness
        checks not yet read (then cleared); raises for non-finite draft logits. -> [batch, n] long, float."""
        drafts, read = read_checked([torch.stack(tokens, 1), torch.stack(confidences, 1).float()], flags)
        flags.clear()
        return drafts, read

    def select_rows(self, rows: torch.Tensor) -> None:
        self.adapter.select_rows(rows)

    def add_rows(self, count: int) -> None:
        self.adapter.add_rows(count)

    @property
    def can_select_rows(self) -> bool:
        return self.adapter.can_select_rows  # a static cache keeps its rows

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        # Keep what the draft cache holds of the committed tokens; the last one is always pending.
        self.adapter.rollback(torch.minimum(self.adapter.lengths, committed_lengths.cpu() - 1))

    def feed_prompts(self, sequences, rows: torch.Tensor) -> None:
        if bool(rows.any()):
            self.adapter.feed(sequences, rows)


# Copy acceptance priors per match length (1, 2, 3, 4+ tokens), from the bench texts' copies (chat copies
# rarely hold): P(the first copied token is accepted), P(a later one is | the one before was).
COPY_FIRST_PRIOR = (0.15, 0.35, 0.5, 0.65)
COPY_CONTINUATION_PRIOR = (0.4, 0.5, 0.6, 0.7)


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; transformers' prompt_lookup_num_tokens): point-mass drafts.

    The longest suffix n-gram (max_ngram down to min_ngram) is looked up in the prompt and
    the output so far; the earliest match wins, as in transformers (the prompt is where
    editing tasks copy from); `match="latest"` prefers the most recent one instead.

    With auto k it stops on its own: a row drafts the part of its match with the most expected
    tokens per verify cost (the calibration's widths), by the acceptance learned per match length.
    A one-token match rarely holds (on the editing prompts 6 of 38 first copies), and where a verify
    of 2 tokens costs much more than 1 (float32 on CPU: 1.4x) transformers' prompt lookup pays it on
    every match. A match not drafted still teaches its first token: a point mass is accepted exactly
    when the target's own token equals it, so the round's emitted token says whether it would have been.
    """

    learns = True
    can_extend = True  # auto k: past the policy's k, the learned rates per match length decide
    trusted = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, match: str = "earliest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if match not in ("earliest", "latest"):
            raise ValueError(f"match must be 'earliest' or 'latest', got {match!r}")
        self.max_ngram, self.min_ngram, self.match = max_ngram, min_ngram, match
        bins = len(COPY_FIRST_PRIOR)
        self.first = RateCounter(COPY_FIRST_PRIOR, 2.0, bins, cap=PERFECT)  # per match-length bin
        self.continuation = RateCounter(COPY_CONTINUATION_PRIOR, 2.0, bins, cap=PERFECT)
        self.settings = DraftSettings()
        self.stops = False  # auto k (RoundPrice.extension): each row drafts what pays; else up to k
        self.found: list[tuple[int, list[int]]] = []  # per row, the last round's (match bin, continuation)

    def reset(self, batch: int) -> None:
        self.first.reset()
        self.continuation.reset()
        self.found = []

    def configure(self, settings: DraftSettings) -> None:
        self.settings = settings

    def plan_round(self, price: RoundPrice) -> None:
        self.stops = price.extension is not None

    def find(self, sequence: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, continuation): the longest suffix n-gram found earlier and up to k tokens that followed
        it; (0, []) when none matches."""
        seq = np.asarray(sequence, dtype=np.int64)  # one vectorised pass per n, not a Python loop per start
        length = len(seq)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            starts = length - n  # candidate starts 0 .. length - n - 1 (the suffix itself excluded)
            hit = seq[:starts] == seq[starts]
            for j in range(1, n):
                hit &= seq[j : starts + j] == seq[starts + j]
            found = np.flatnonzero(hit)
            if len(found):
                start = int(found[0] if self.match == "earliest" else found[-1])
                return n, seq[start + n : start + n + k].tolist()
        return 0, []

    def worth_drafting(self, match_bin: int, found: int) -> int:
        """How many of a match's `found` tokens to draft: the count with the most expected tokens per
        verify cost (1 + the expected accepted copies, over verify_cost(count + 1)); 0 where not
        drafting pays best. Never past the widest calibrated verify."""
        first, later = self.first.rate(match_bin), self.continuation.rate(match_bin)
        verify_cost = self.settings.verify_cost
        best, best_rate, tokens, reach = 0, 1.0 / verify_cost(1), 1.0, first
        for count in range(1, min(found, self.settings.max_width - 1) + 1):
            tokens, reach = tokens + reach, reach * later
            if tokens / verify_cost(count + 1) > best_rate:
                best, best_rate = count, tokens / verify_cost(count + 1)
        return best

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        self.found = []
        for seq, k in zip(sequences, max_lengths.tolist()):
            n, continuation = self.find(seq, k) if k > 0 else (0, [])
            self.found.append((min(n, len(COPY_FIRST_PRIOR)) - 1, continuation))
        drafts = [f[: self.worth_drafting(b, len(f))] if self.stops else f for b, f in self.found]
        forced = None
        if getattr(warping, "constrained", False):  # no copy the grammar refuses; the tokens it forces after, free
            room = [min(k, self.settings.max_width - 1) for k in max_lengths.tolist()]
            cut = [warping.grammatical(seq, row, d, n) for row, (seq, d, n) in enumerate(zip(sequences, drafts, room))]
            drafts, forced = [c for c, _ in cut], torch.tensor([n for _, n in cut], dtype=torch.long)
        width = max([len(d) for d in drafts] + [0])
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for row, draft in enumerate(drafts):
            tokens[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        return Proposal(tokens, torch.tensor([len(d) for d in drafts], dtype=torch.long), None, forced=forced)

    def observe(self, proposal: Proposal, result) -> None:
        """Copy acceptance per match length from a verified round; a match not drafted (or cut short)
        still tells its first token, by the token the round emitted in its place."""
        drafted = proposal.chain_lengths if proposal.forced is None else proposal.lengths - proposal.forced
        drafted, accepted = drafted.tolist(), result.num_accepted.tolist()  # copies only: forced tokens aside
        emitted = result.tokens[:, 0].tolist()
        for row, (match_bin, found) in enumerate(self.found[: len(drafted)]):
            if not found:
                continue
            if drafted[row] == 0:
                self.first.observe(float(emitted[row] == found[0]), 1.0, match_bin)
                continue
            got = min(accepted[row], drafted[row])
            later, stopped = max(got - 1, 0), float(1 <= got < drafted[row])
            self.first.observe(float(got >= 1), 1.0, match_bin)
            self.continuation.observe(float(later), later + stopped, match_bin)


class NoDrafter(Drafter):
    """The target alone through the same loop: the baseline for timing."""

    drafts = False
    trusted = True

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        return Proposal(torch.zeros(len(sequences), 0, dtype=torch.long), torch.zeros_like(max_lengths), None)


def check_proposal(proposal, drafter, max_lengths: torch.Tensor, vocab_size: int) -> None:
    """A drafter's proposal, checked at the boundary (check_proposal_shape), unless the drafter is
    trusted (specdec's own: reading their device tensors here would cost a host sync each round)."""
    if not drafter.trusted:
        check_proposal_shape(proposal, f"drafter {drafter.name}", max_lengths, vocab_size)
