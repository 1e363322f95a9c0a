"""A round's target side: one forward over the drafts, exact verification, one host read.

Words (docs/DESIGN.md): each row's pending tokens (committed, not yet in the target's cache) and
its drafts are scored in one target forward (`score`: logits [batch, k + 1, vocab]); `verify`
keeps a prefix of the drafts and draws the recovered or bonus token by the run's rule (greedy,
token, block or race; a draft tree's rules are in specdec.engine.trees); `to_host` copies the result and
the round's pending finiteness checks to the host in one read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters.proposal import Proposal
from specdec.engine.trees import score_tree, verify_tree
from specdec.models.adapters import TargetModel
from specdec.verify import VerifyResult, block_verify, greedy_verify, speculative_verify
from specdec.verify.race import Race, race_verify
from specdec.verify.reads import PendingRead, read_checked, to_device
from specdec.verify.sampling import Warping


def score(
    target: TargetModel, sequences: Sequence[Sequence[int]], active: torch.Tensor, proposal: Proposal
) -> torch.Tensor:
    """One target forward over each active row's pending tokens of `sequences` and its drafts -> logits
    [batch, k + 1, vocab] (a draft tree: [batch, nodes + 1, vocab], column 1 + j scoring after node j)."""
    if proposal.siblings is not None:
        return score_tree(target, sequences, active, proposal)
    k = proposal.tokens.shape[1]
    valid = torch.arange(k) < proposal.lengths[:, None]
    return target.feed(sequences, active, proposal.tokens, valid, keep_logits=k + 1)


def verify(
    logits: torch.Tensor,  # [batch, k + 1, vocab]
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
        return greedy_verify(scores, drafts, draft_lengths=lengths, check_inputs=False)
    target_probs = warping.probs(scores)  # [batch, k + 1, vocab]
    draft_probs = None if proposal.probs is None else proposal.probs.to(target_probs.device)
    if verification == "race":
        assert race is not None and draft_probs is None, "race drafts are the draft's own race winners"
        starts = to_device(torch.tensor([len(s) for s in sequences]), logits.device)
        positions = starts[:, None] + torch.arange(logits.shape[1], device=logits.device)  # [batch, k + 1]
        noise = race.noise(positions)
        return race_verify(target_probs, drafts, noise=noise, draft_lengths=lengths, check_inputs=False)
    rule = block_verify if verification == "block" else speculative_verify
    return rule(target_probs, drafts, draft_probs, draft_lengths=lengths, generator=generator, check_inputs=False)


def to_host(result: VerifyResult, checks: list) -> VerifyResult:
    """The round's one host read: a chain's verify result and the finiteness checks still pending (the
    drafter's, then the target's), in one copy; raises NonFiniteLogitsError for the first that failed."""
    if result.path is not None:  # a tree's result is built on the host
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
