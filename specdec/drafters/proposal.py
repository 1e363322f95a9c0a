"""What a drafter hands the decoder: a proposal of draft tokens per row, a chain or a draft tree.

Words (docs/DESIGN.md):
- proposal: per row up to `max_lengths[b]` draft tokens (`lengths[b]` of them valid), and `probs`,
  the exact law each was drawn from, or None for point masses (argmax, n-gram, copies), whose
  proposals are deterministic.
- siblings: point-mass alternatives beside the chain's drafts; chain and siblings form a draft tree.
- chain accepted: on a tree's path, the chain drafts kept before it left the chain (if it did).
- copied: the last `copied[b]` of a row's drafts are copy drafts (prompt lookup, specdec.drafters.lookup)
  after its chain; the chain alone is the drafter's own (`chain_lengths`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from specdec.verify.reads import Check


@dataclass
class Siblings:
    """A draft tree as a chain plus point-mass alternatives: sibling s stands beside chain draft
    depth[b, s] (same parent: the chain draft before it, or the last committed token) and is the
    draft's rank[b, s]-th best token there other than the chain's own (1: the best)."""

    tokens: torch.Tensor  # [batch, s]
    depth: torch.Tensor  # [batch, s]
    rank: torch.Tensor  # [batch, s]
    valid: torch.Tensor  # [batch, s] bool

    def tree(self, chain: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chain [batch, k] then siblings as one tree: (tokens, parents, valid), each [batch, k + s]."""
        batch, k = chain.shape
        chain_parents = torch.arange(-1, k - 1).expand(batch, k)
        chain_valid = torch.arange(k) < lengths[:, None]
        valid = self.valid & (self.depth < lengths[:, None])
        return (
            torch.cat([chain, self.tokens], 1),
            torch.cat([chain_parents, self.depth - 1], 1),
            torch.cat([chain_valid, valid], 1),
        )


@dataclass
class Proposal:
    tokens: torch.Tensor  # [batch, k] (entries past lengths[b] are padding; on the CPU or the drafter's device)
    lengths: torch.Tensor  # [batch] valid drafts per row
    probs: torch.Tensor | None  # [batch, k, vocab] law each token was drawn from; None: point mass
    steps: int = 0  # draft model forwards spent
    confidences: torch.Tensor | None = None  # [batch, k] the draft's own probability of each draft (CPU)
    siblings: Siblings | None = None  # a draft tree: alternatives beside the chain (None: a chain)
    checks: list[Check] = dataclasses.field(default_factory=list)  # draft finiteness, read with the verify result
    copied: torch.Tensor | None = None  # [batch] copy drafts after each row's chain (CPU; None: none)
    forced: torch.Tensor | None = None  # [batch] chain drafts the grammar forced, no draft forward spent (CPU)

    @property
    def chain_lengths(self) -> torch.Tensor:
        """[batch] the drafter's own drafts per row, copies aside."""
        return self.lengths if self.copied is None else self.lengths - self.copied.to(self.lengths.device)

    @functools.cached_property
    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree proposal's (tokens, parents, valid) over chain then siblings, built once."""
        assert self.siblings is not None, "a chain proposal has no tree"
        return self.siblings.tree(self.tokens, self.lengths)


def chain_accepted(proposal: Proposal, result) -> torch.Tensor:
    """[batch] chain drafts accepted: a chain's num_accepted; on a tree's path, the nodes before the
    siblings (a path that ends on a sibling accepted the chain drafts before it only)."""
    path = result.path
    if path is None:
        return result.num_accepted
    return ((path >= 0) & (path < proposal.tokens.shape[1])).sum(1)


def copies_accepted(proposal: Proposal, result) -> torch.Tensor:
    """[batch] copy drafts accepted per row (CPU): those past its whole accepted chain."""
    if proposal.copied is None:
        return torch.zeros(len(proposal.lengths), dtype=torch.long)
    chain = proposal.chain_lengths.cpu()
    return (chain_accepted(proposal, result).cpu() - chain).clamp(min=0)


def tree_outcome(proposal: Proposal, result) -> tuple[torch.Tensor, torch.Tensor]:
    """A verified tree round -> (chain drafts accepted per row [batch], siblings that won [batch, s])."""
    k = proposal.tokens.shape[1]
    path = torch.cat([result.path, result.path.new_full((len(result.path), 1), -1)], 1)
    accepted = chain_accepted(proposal, result)
    won = torch.zeros_like(proposal.siblings.valid)
    last = path.gather(1, (result.num_accepted - 1).clamp_min(0)[:, None])[:, 0]
    on_sibling = (result.num_accepted > 0) & (last >= k)
    won[on_sibling, (last - k)[on_sibling]] = True
    return accepted, won


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _integer_tensor(value, shape: tuple) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == len(shape)
        and all(want is None or got == want for got, want in zip(value.shape, shape))
        and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    )


def check_proposal_shape(proposal, name: str, max_lengths: torch.Tensor, vocab_size: int) -> None:
    """ValueError naming `name` unless `proposal` is a Proposal whose tokens are [batch, k] ids of the
    target's vocabulary (padding included: it is fed to the target), lengths [batch] within what was
    asked, probs None or [batch, k, vocab]."""
    batch = len(max_lengths)
    if not isinstance(proposal, Proposal):
        raise ValueError(
            f"{name} returned {type(proposal).__name__} from propose(); it must return a specdec.drafters.Proposal"
        )
    tokens, lengths, probs = proposal.tokens, proposal.lengths, proposal.probs
    if not _integer_tensor(tokens, (batch, None)):
        raise ValueError(
            f"{name}: proposal tokens must be an integer tensor [batch={batch}, k], got {_describe(tokens)}"
        )
    if not _integer_tensor(lengths, (batch,)):
        raise ValueError(
            f"{name}: proposal lengths must be an integer tensor [batch={batch}], got {_describe(lengths)}"
        )
    k, lengths, chain = tokens.shape[1], lengths.cpu(), proposal.chain_lengths.cpu()  # copies: past the asked
    if bool(((chain < 0) | (chain > max_lengths.cpu()) | (lengths > k)).any()):
        raise ValueError(
            f"{name}: proposal lengths {lengths.tolist()} must be in [0, asked] per row (asked "
            f"{max_lengths.tolist()}) and at most the {k} token columns"
        )
    if tokens.numel():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{name} proposed token id {low if low < 0 else high} outside the target's vocabulary "
                f"[0, {vocab_size}) (padding past a row's length is fed to the target too)"
            )
    if probs is not None and not (
        isinstance(probs, torch.Tensor) and probs.is_floating_point() and tuple(probs.shape) == (batch, k, vocab_size)
    ):
        raise ValueError(
            f"{name}: proposal probs must be None (point masses) or a float tensor [batch, k, vocab] = "
            f"[{batch}, {k}, {vocab_size}], got {_describe(probs)}"
        )
