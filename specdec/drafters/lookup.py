"""Prompt lookup after the draft: copy drafts appended to a round's proposal, where they pay.

Words (docs/DESIGN.md, "Prompt lookup after the draft"):
- copy: the continuation of an earlier occurrence of the text's last n tokens
  (specdec.drafters.NgramDrafter's lookup over the committed tokens and the
  round's drafts), proposed as point-mass drafts after the drafter's chain.
- chain survival: the chance that every draft of the drafter's chain is
  accepted (the drafter's learned acceptance by confidence, or the policy's
  rates); a copy token is judged only then.

A round's drafter proposes its chain (k may be 0: a copy round, no draft
forward at all). Then, per row, copy tokens are appended one at a time while
each pays: its value, chain survival x the learned chance that the copy holds
up to it, must pay for one more verify column at the round's expected tokens
per cost (specdec.tuning.costs's one rule, with the calibration's verify widths).
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
from collections.abc import Callable, Sequence

import torch

from specdec.drafters import COPY_CONTINUATION_PRIOR, COPY_FIRST_PRIOR, NgramDrafter, Proposal, chain_accepted
from specdec.tuning.costs import PERFECT, RateCounter, columns_that_pay
from specdec.verify import VerifyResult

MATCH_BINS = 4  # match lengths 1, 2, 3, and 4 or more


@dataclasses.dataclass
class Extension:
    """What a round's copies added: per row, the drafter's own chain length, the copies appended
    after it, and the match length (bin) they came from."""

    base: Proposal  # the drafter's proposal, as it proposed it
    copied: torch.Tensor  # [batch] copy tokens appended
    match: torch.Tensor  # [batch] match-length bin (0-based) of each row's copy


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


class PromptLookup:
    """Appends copy drafts to proposals (see the module notes). `extend` before the verify, `observe`
    after it; `base_result` gives the drafter and the policy the round as their own chain saw it."""

    def __init__(
        self,
        lookup: NgramDrafter | None = None,
        max_tokens: int = 8,
        first_prior: Sequence[float] = COPY_FIRST_PRIOR,
        continuation_prior: Sequence[float] = COPY_CONTINUATION_PRIOR,
        weight: float = 2.0,
    ):
        self.lookup = lookup or NgramDrafter(max_ngram=MATCH_BINS, min_ngram=1)
        self.max_tokens = max_tokens
        # per match-length bin: P(the first copy token is accepted), P(a later one is | the one before was)
        self.first = RateCounter(first_prior, weight, MATCH_BINS, cap=PERFECT)
        self.continuation = RateCounter(continuation_prior, weight, MATCH_BINS, cap=PERFECT)

    def reset(self) -> None:
        self.first.reset()
        self.continuation.reset()

    def rates(self, match: int) -> tuple[float, float]:
        """(first copy token, later ones given the one before) acceptance for a match-length bin."""
        return self.first.rate(match), self.continuation.rate(match)

    def copies(self, survival: float, match: int, width: int, rate: float, verify_cost: Callable, room: int) -> int:
        """How many copy tokens to append after a chain verified over `width` columns: each while its
        value (survival x the chance the copy holds up to it) pays for one more verify column at `rate`,
        the round's own tokens per cost (specdec.tuning.costs.columns_that_pay)."""
        first, later = self.rates(match)
        values, reach = [], survival * first
        for _ in range(min(room, self.max_tokens)):
            values.append(reach)
            reach *= later
        return columns_that_pay(values, width, rate, 1.0, verify_cost, raise_bar=False)

    def extend(
        self,
        proposal: Proposal,
        sequences: Sequence[Sequence[int]],
        room: torch.Tensor,
        survival: torch.Tensor,
        rate: float,
        verify_cost: Callable[[int], float],
        max_width: int = 11,
    ) -> tuple[Proposal, Extension | None]:
        """`proposal` with copies appended per row (room[b]: drafts the row may still add; survival[b]:
        the chance its whole chain is accepted). A row's verify never grows past `max_width` columns,
        the widest the calibration measured (past it the cost is a guess: on AMX a 17th row is a second
        tile). Returns the proposal to verify and what was added (None: nothing; the proposal as it was)."""
        lengths = proposal.lengths.cpu()
        chains = proposal.tokens.cpu().tolist() if proposal.tokens.numel() else [[] for _ in sequences]
        siblings = torch.zeros_like(lengths) if proposal.siblings is None else proposal.siblings.valid.sum(1)
        added, match = [], []
        for row, seq in enumerate(sequences):
            length = int(lengths[row])
            width = length + 1 + int(siblings[row])
            free = min(int(room[row]) - length, max_width - width)
            found, n = [], 0
            if free > 0:
                n, found = self.lookup.find(list(seq) + chains[row][:length], min(free, self.max_tokens))
            bin_ = max(min(n, MATCH_BINS) - 1, 0)
            count = self.copies(float(survival[row]), bin_, width, rate, verify_cost, len(found)) if found else 0
            added.append(found[:count])
            match.append(bin_)
        copied = torch.tensor([len(a) for a in added], dtype=torch.long)
        if not bool(copied.any()):
            return proposal, None
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
        extended = Proposal(
            tokens.to(proposal.tokens.device),
            new_lengths.to(proposal.lengths.device),
            probs,
            proposal.steps,
            proposal.confidences,
            sibs,
            proposal.checks,
        )
        return extended, Extension(proposal, copied, torch.tensor(match))

    def observe(self, proposal: Proposal, extension: Extension, result: VerifyResult) -> torch.Tensor:
        """Learn copy acceptance from a verified round: a row's copies were judged only if its whole
        chain was accepted. Returns [batch] copy tokens accepted per row."""
        base = extension.base.lengths.cpu()
        accepted = chain_accepted(proposal, result).cpu()  # chain and copies
        judged = (extension.copied > 0) & (accepted >= base)
        kept = (accepted - base).clamp(min=0)
        got, copied, bins = kept[judged], extension.copied[judged], extension.match[judged]
        self.first.observe((got >= 1).double(), 1.0, bins)
        later = (got - 1).clamp(min=0).double()
        stopped = ((got >= 1) & (got < copied)).double()
        self.continuation.observe(later, later + stopped, bins)
        return torch.where(judged, kept, 0)

    @staticmethod
    def base_result(proposal: Proposal, extension: Extension | None, result: VerifyResult) -> VerifyResult:
        """The verify result as the drafter's own proposal saw it: copies on its path dropped, sibling
        indices moved back past them; the drafter and the draft-length policy learn from this."""
        if extension is None:
            return result
        base_k = extension.base.tokens.shape[1]
        k = proposal.tokens.shape[1]
        path = result.path
        if path is None:
            base_lengths = extension.base.lengths.to(result.num_accepted.device)
            return VerifyResult(result.tokens, torch.minimum(result.num_accepted, base_lengths), result.bonus)
        start = extension.base.lengths.to(path.device)[:, None]  # a row's copies follow its own chain
        copy = (path >= start) & (path < k)
        moved = torch.where(path >= k, path - (k - base_k), path)
        moved = torch.where(copy, torch.full_like(path, -1), moved)
        num = (moved >= 0).sum(1)
        return dataclasses.replace(result, num_accepted=num, path=moved)
