"""Diagnostics and lossy opt-ins: pure functions over target and draft laws.

Words:
- alpha (expected acceptance) at a position: sum over x of min(p_target, p_draft),
  the probability that the standard test accepts the draft token there.
- lenient acceptance (LOSSY): accept with min(1, leniency * p_target / p_draft),
  leniency >= 1. It emits more drafts per round but its output no longer
  follows the target's law; `lenient_output_law` gives the law it does follow,
  so its distance from the target can be measured exactly (docs/VERIFY.md).

Nothing here is used by the exact default path.
"""

from __future__ import annotations

import torch

from specdec.verify import VerifyResult, _assemble, _first_rejection, acceptance_probs, residual_distribution
from specdec.verify.sampling import sample


def expected_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p, q). [..., vocab] -> [...]."""
    return torch.minimum(target_probs.float(), draft_probs.float()).sum(-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last dim; inf where p has mass that q lacks."""
    p, q = p.double(), q.double()
    terms = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - q.clamp_min(0).log()), torch.zeros_like(p))
    return terms.sum(-1)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in nats (bounded by ln 2)."""
    m = 0.5 * (p.double() + q.double())
    return 0.5 * kl_divergence(p, m) + 0.5 * kl_divergence(q, m)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.double() - q.double()).abs().sum(-1)


def lenient_output_law(target_probs: torch.Tensor, draft_probs: torch.Tensor, leniency: float) -> torch.Tensor:
    """Exact law of the token emitted at one position by lenient acceptance. [..., vocab]."""
    accept = acceptance_probs(target_probs, draft_probs, leniency)
    kept = draft_probs.double() * accept
    reject_mass = 1 - kept.sum(-1, keepdim=True)
    return kept + reject_mass * residual_distribution(target_probs, draft_probs).double()


def lenient_verify(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor,  # [batch, k, vocab]
    *,
    leniency: float,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """LOSSY: speculative verification with the ratio scaled by `leniency` (>= 1).

    leniency = 1 is the standard exact algorithm; above 1 the output drifts from
    the target's law towards the draft's. Opt-in only.
    """
    if leniency < 1:
        raise ValueError(f"leniency must be >= 1 (1 is exact), got {leniency}")
    batch, k_plus_1, _ = target_probs.shape
    k = k_plus_1 - 1
    if k < 1:
        raise ValueError("lenient_verify needs at least one draft per row")
    rows = torch.arange(batch, device=target_probs.device)
    target_at = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    draft_at = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniforms = torch.rand(batch, k, dtype=torch.float64, generator=generator, device=target_probs.device)
    num_accepted = _first_rejection(uniforms < acceptance_probs(target_at, draft_at, leniency))
    bonus = num_accepted == k
    target_row = target_probs[rows, num_accepted]
    draft_row = torch.where(bonus[:, None], 0.0, draft_probs[rows, num_accepted.clamp(max=k - 1)])
    last = sample(residual_distribution(target_row, draft_row), generator)
    return VerifyResult(_assemble(draft_tokens, num_accepted, last), num_accepted, bonus)
