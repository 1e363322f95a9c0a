"""Prompt lookup after the draft: copy drafts appended to a round's proposal, where they pay.

Words (docs/DESIGN.md, "Prompt lookup after the draft"):
- copy: the continuation of an earlier occurrence of the text's last n tokens
  (specdec.drafters.NgramDrafter's lookup over the committed tokens and the
  round's drafts), proposed as point-mass drafts after the drafter's chain.
- chain survival: the chance that every draft of the drafter's chain is
  accepted (the drafter's learned acceptance by confidence, or the policy's
  rates); a copy token is judged only then.

`PromptLookup` is a drafter that wraps another: its inner drafter proposes its
chain (k may be 0: a copy round, no draft forward at all). Then, per row, copy
tokens are appended one at a time while
each pays: its value, chain survival x the learned chance that the copy holds
up to it, must pay for one more verify column at the round's expected tokens
per cost (`RoundPrice.rate`; specdec.tuning.costs's one rule, with the
calibration's verify widths). The proposal says how many of each row's drafts
are copies (`Proposal.copied`); the inner drafter and the draft-length policy
learn from the chain alone (`chain_round`: copies dropped).
Where a wider verify is nearly free (AVX-512 bf16, GPUs) copies ride along on
most rounds; where it is dear (AVX2) only confident ones do. Copy acceptance is
learned from counts per match length (1, 2, 3, 4+ tokens: specdec.tuning.costs's rate
counters), reset each run, so a seed still fixes the tokens.

Exact: a copy is a deterministic function of the prefix it extends (a point
mass), which token-level, block and race verification all judge exactly; in a
sampled round whose chain carries draft laws, the copies get one-hot laws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdec.drafters import (
    COPY_CONTINUATION_PRIOR,
    COPY_FIRST_PRIOR,
    Drafter,
    DraftModel,
    NgramDrafter,
)
from specdec.drafters.proposal import Proposal, chain_accepted
from specdec.tuning.costs import PERFECT, DraftSettings, RateCounter, RoundPrice, columns_that_pay
from specdec.verify import VerifyResult

MATCH_BINS = 4  # match lengths 1, 2, 3, and 4 or more


def copy_laws(probs: torch.Tensor, lengths: torch.Tensor, added: list[list[int]], width: int) -> torch.Tensor:
    """[batch, width, vocab]: each row's chain laws (its first lengths[b] columns of `probs`), then a
    one-hot law per copy token: the point mass it is, so p / q judges it as one."""
    laws = probs.new_zeros(len(added), width, probs.shape[-1])
    kept = min(probs.shape[1], width)
    laws[:, :kept] = probs[:, :kept]
    for row, copy in enumerate(added):
        start = int(lengths[row])
        laws[row, start : start + len(copy)] = 0
        laws[row, torch.arange(start, start + len(copy)), torch.tensor(copy, dtype=torch.long)] = 1
    return laws


class PromptLookup(Drafter):
    """A drafter's chains, then copy drafts where they pay (see the module notes). Everything else is
    the inner drafter's: its caches, rows, learned stop and declarations."""

    learns = True  # copy acceptance per match length

    def __init__(
        self,
        inner: DraftModel,
        lookup: NgramDrafter | None = None,
        max_tokens: int = 8,
        first_prior: Sequence[float] = COPY_FIRST_PRIOR,
        continuation_prior: Sequence[float] = COPY_CONTINUATION_PRIOR,
        weight: float = 2.0,
    ):
        self.inner = inner
        self.lookup = lookup or NgramDrafter(max_ngram=MATCH_BINS, min_ngram=1)
        self.max_tokens = max_tokens
        # per match-length bin: P(the first copy token is accepted), P(a later one is | the one before was)
        self.first = RateCounter(first_prior, weight, MATCH_BINS, cap=PERFECT)
        self.continuation = RateCounter(continuation_prior, weight, MATCH_BINS, cap=PERFECT)
        self.settings, self.price = DraftSettings(), RoundPrice()
        self.chain: Proposal | None = None  # this round's: the inner drafter's proposal (copies were added)
        self.match = torch.zeros(0, dtype=torch.long)  # ... and each row's match-length bin

    # what the inner drafter is and does
    name = property(lambda self: self.inner.name)
    adapter = property(lambda self: self.inner.adapter)
    max_positions = property(lambda self: self.inner.max_positions)
    uses_model = property(lambda self: self.inner.uses_model)
    supports_trees = property(lambda self: self.inner.supports_trees)
    can_extend = property(lambda self: self.inner.can_extend)
    can_select_rows = property(lambda self: self.inner.can_select_rows)
    trusted = property(lambda self: self.inner.trusted)

    def reset(self, batch: int) -> None:
        self.inner.reset(batch)
        self.first.reset()
        self.continuation.reset()

    def configure(self, settings: DraftSettings) -> None:
        self.inner.configure(settings)
        self.settings = settings

    def plan_round(self, price: RoundPrice) -> None:
        self.inner.plan_round(price)
        self.price = price

    def survival(self, confidences: torch.Tensor) -> torch.Tensor | None:
        return self.inner.survival(confidences)

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        self.inner.rollback(committed_lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)

    def add_rows(self, count: int) -> None:
        self.inner.add_rows(count)

    def feed_prompts(self, sequences, rows: torch.Tensor) -> None:
        self.inner.feed_prompts(sequences, rows)

    # ------------------------------------------------------------ copies

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        chain = self.inner.propose(sequences, max_lengths, warping, generator, race=race)
        self.chain = None
        price = self.price
        if price.rate is None or price.room is None or not isinstance(chain, Proposal):
            return chain  # no copies this round (a proposal that is none: the decoder's check names it)
        survival = self.chain_survival(chain, price.rates)
        proposal, self.match = self.extend(chain, sequences, price.room, survival, price.rate, warping)
        self.chain = chain if proposal is not chain else None
        return proposal

    def chain_survival(self, proposal: Proposal, rates: Sequence[float]) -> torch.Tensor:
        """[batch] the chance that each row's whole chain is accepted (1 for no drafts): the inner
        drafter's acceptance learned by confidence where it reports confidences, else the policy's rates."""
        lengths = proposal.lengths.cpu()
        confidences = proposal.confidences
        survive = self.inner.survival(confidences) if confidences is not None and confidences.numel() else None
        if survive is not None:
            drafted = torch.arange(confidences.shape[1]) < lengths[:, None]
            return torch.where(drafted, survive, torch.ones_like(survive)).prod(1)
        width = int(lengths.max()) if len(lengths) else 0
        rates = list(rates[:width]) + [rates[-1] if rates else 0.0] * max(0, width - len(rates))
        survive = torch.tensor(rates, dtype=torch.float64).cumprod(0)  # [width]
        return torch.cat([torch.ones(1, dtype=torch.float64), survive])[lengths]

    def rates(self, match: int) -> tuple[float, float]:
        """(first copy token, later ones given the one before) acceptance for a match-length bin."""
        return self.first.rate(match), self.continuation.rate(match)

    def copies(self, survival: float, match: int, width: int, rate: float, room: int) -> int:
        """How many copy tokens to append after a chain verified over `width` columns: each while its
        value (survival x the chance the copy holds up to it) pays for one more verify column at `rate`,
        the round's own tokens per cost (specdec.tuning.costs.columns_that_pay)."""
        first, later = self.rates(match)
        values, reach = [], survival * first
        for _ in range(min(room, self.max_tokens)):
            values.append(reach)
            reach *= later
        return columns_that_pay(values, width, rate, 1.0, self.settings.verify_cost, raise_bar=False)

    def extend(
        self, proposal: Proposal, sequences: Sequence[Sequence[int]], room: torch.Tensor, survival: torch.Tensor,
        rate: float, warping=None,
    ) -> tuple[Proposal, torch.Tensor]:  # fmt: skip
        """`proposal` with copies appended per row (room[b]: drafts the row may still add; survival[b]:
        the chance its whole chain is accepted), and each row's match-length bin. A row's verify never
        grows past the settings' `max_width` columns, the widest the calibration measured (past it the
        cost is a guess: on AMX a 17th row is a second tile). Nothing copied: the proposal as it was."""
        lengths = proposal.lengths.cpu()
        chains = proposal.tokens.cpu().tolist() if proposal.tokens.numel() else [[] for _ in sequences]
        siblings = torch.zeros_like(lengths) if proposal.siblings is None else proposal.siblings.valid.sum(1)
        added, match = [], []
        for row, seq in enumerate(sequences):
            length = int(lengths[row])
            width = length + 1 + int(siblings[row])
            free = min(int(room[row]) - length, self.settings.max_width - width)
            found, n = [], 0
            if free > 0:
                n, found = self.lookup.find(list(seq) + chains[row][:length], min(free, self.max_tokens))
            if found and getattr(warping, "constrained", False):  # no copy the grammar refuses
                found = warping.grammatical(list(seq) + chains[row][:length], row, found, len(found))[0]
            bin_ = max(min(n, MATCH_BINS) - 1, 0)
            count = self.copies(float(survival[row]), bin_, width, rate, len(found)) if found else 0
            added.append(found[:count])
            match.append(bin_)
        copied = torch.tensor([len(a) for a in added], dtype=torch.long)
        if not bool(copied.any()):
            return proposal, torch.tensor(match)
        new_lengths = lengths + copied
        k = int(new_lengths.max())
        tokens = torch.zeros(len(sequences), k, dtype=torch.long)
        kept = min(proposal.tokens.shape[1], k)
        tokens[:, :kept] = proposal.tokens.cpu()[:, :kept]
        for row, copy in enumerate(added):
            if copy:
                tokens[row, int(lengths[row]) : int(new_lengths[row])] = torch.tensor(copy)
        probs = None if proposal.probs is None else copy_laws(proposal.probs, lengths, added, k)
        sibs = proposal.siblings
        if sibs is not None:  # siblings stand beside the drafter's chain only
            sibs = dataclasses.replace(sibs, valid=sibs.valid & (sibs.depth < lengths[:, None]))
        extended = dataclasses.replace(
            proposal, tokens=tokens.to(proposal.tokens.device), lengths=new_lengths.to(proposal.lengths.device),
            probs=probs, siblings=sibs, copied=copied,
        )  # fmt: skip
        return extended, torch.tensor(match)

    def observe(self, proposal: Proposal, result: VerifyResult) -> None:
        """Learn copy acceptance from a verified round (a row's copies were judged only if its whole
        chain was accepted); the inner drafter learns from its own chain."""
        if self.chain is None:  # nothing was copied: the round was the inner drafter's own
            self.inner.observe(proposal, result)
            return
        base, copied = self.chain.lengths.cpu(), proposal.copied
        accepted = chain_accepted(proposal, result).cpu()  # chain and copies
        judged = (copied > 0) & (accepted >= base)
        got, copied, bins = (accepted - base)[judged], copied[judged], self.match[judged]
        self.first.observe((got >= 1).double(), 1.0, bins)
        later = (got - 1).clamp(min=0).double()
        stopped = ((got >= 1) & (got < copied)).double()
        self.continuation.observe(later, later + stopped, bins)
        self.inner.observe(self.chain, chain_round(proposal, self.chain, result))


def chain_round(proposal: Proposal, chain: Proposal, result: VerifyResult) -> VerifyResult:
    """The verify result as the drafter's own proposal (`chain`, before the copies) saw it: copies on
    its path dropped, sibling indices moved back past them."""
    base_k, k = chain.tokens.shape[1], proposal.tokens.shape[1]
    path = result.path
    if path is None:
        chain_lengths = chain.lengths.to(result.num_accepted.device)
        return VerifyResult(result.tokens, torch.minimum(result.num_accepted, chain_lengths), result.bonus)
    start = chain.lengths.to(path.device)[:, None]  # a row's copies follow its own chain
    copy = (path >= start) & (path < k)
    moved = torch.where(path >= k, path - (k - base_k), path)
    moved = torch.where(copy, torch.full_like(path, -1), moved)
    return dataclasses.replace(result, num_accepted=(moved >= 0).sum(1), path=moved)
