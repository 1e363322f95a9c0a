"""Exact verification of drafted tokens: pure tensor functions, no models.

Words (DESIGN.md):
- accepted token: a draft token x at position i kept by the test
  u < min(1, target_probs[i, x] / draft_probs[i, x]), u ~ U[0, 1) in float64.
- recovered token: drawn at the first rejected position from the residual
  norm(max(0, target_probs - draft_probs)).
- bonus token: drawn from target_probs[K] (the (K+1)-th row of a sequence with
  K drafts) when all its drafts were accepted.
- point-mass draft: `draft_probs=None`; each draft token was chosen
  deterministically (argmax, n-gram). Accept with probability target_probs[x];
  on rejection draw from target_probs with x zeroed and renormalised.

Each sequence emits `num_accepted + 1` tokens: its accepted drafts, then one
recovered or bonus token; `tokens` is -1 after that. Ragged rows carry
`draft_lengths` (a row may have 0 drafts: it emits one plain target token).

Cost: besides reading the K gathered probabilities per row, only one residual
row per sequence is built (at its first rejection), never the whole
[B, K, V] residual tensor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from specdec.sampling import sample


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [batch, k + 1] emitted tokens, -1 after the last
    num_accepted: torch.Tensor  # [batch] accepted drafts per row
    bonus: torch.Tensor  # [batch] bool: the last emitted token is a bonus (else recovered)


# ---------------------------------------------------------------- validation


def _check_tokens(draft_tokens: torch.Tensor, batch: int, k: int, vocab: int) -> None:
    if draft_tokens.dim() != 2 or tuple(draft_tokens.shape) != (batch, k):
        raise ValueError(f"draft_tokens must have shape [batch={batch}, k={k}], got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(
            f"draft_tokens must be token ids in [0, {vocab}); got values in "
            f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]"
        )


def _check_lengths(draft_lengths: torch.Tensor | None, batch: int, k: int, device) -> torch.Tensor:
    if draft_lengths is None:
        return torch.full((batch,), k, dtype=torch.long, device=device)
    draft_lengths = torch.as_tensor(draft_lengths, device=device)
    if tuple(draft_lengths.shape) != (batch,):
        raise ValueError(f"draft_lengths must have shape [batch={batch}], got {tuple(draft_lengths.shape)}")
    if draft_lengths.numel() and (draft_lengths.min() < 0 or draft_lengths.max() > k):
        raise ValueError(f"draft_lengths must lie in [0, k={k}], got {draft_lengths.tolist()}")
    return draft_lengths.long()


def _check_distribution(name: str, probs: torch.Tensor, atol: float = 1e-3) -> None:
    """Two reductions, no temporaries: NaN/inf poison the row sums, negatives show in the min."""
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {probs.dtype}")
    sums = probs.sum(-1)
    if not torch.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or inf")
    if probs.numel() and probs.amin() < 0:
        raise ValueError(f"{name} has negative entries: not a distribution")
    if ((sums - 1).abs() > atol).any():
        worst = float((sums - 1).abs().max())
        raise ValueError(
            f"{name} rows must sum to 1 (a distribution over the vocabulary); worst row is off by {worst:.3g}"
        )


# ---------------------------------------------------------------- pure helpers


def acceptance_probs(target_at: torch.Tensor, draft_at: torch.Tensor, leniency: float = 1.0) -> torch.Tensor:
    """min(1, p_target / p_draft) per drafted token; a draft probability of 0 rejects.
    leniency > 1 is the LOSSY lenient test of specdec.diagnostics; the exact path uses 1."""
    ratio = leniency * target_at.double() / draft_at.double().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(draft_at > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_target - p_draft)) over the last dim; falls back to p_target where
    the difference has no mass (p == q, where rejection has probability 0 anyway).
    The reference form, for diagnostics and tests; speculative_verify builds the same
    residual in place, one row per sequence."""
    residual = (target_probs.float() - draft_probs.float()).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs.float())


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[N] = (1 - alpha^(k+1)) / (1 - alpha): tokens emitted per round (Leviathan et al.)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """S = E[N] / (k c + 1): speedup over the target alone, verify-cost growth ignored."""
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return expected_tokens_per_round(alpha, k) / (k * cost_ratio + 1)


def best_draft_length(alpha: float, cost_ratio: float, max_k: int = 16) -> int:
    """The k in [0, max_k] that maximises expected_speedup (k = 0: target alone, S = 1)."""
    return max(range(max_k + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio))


# ---------------------------------------------------------------- verification


_local = threading.local()  # per-thread scratch buffers: concurrent decoders never share one


def _scratch_rows(source: torch.Tensor, batch_index: torch.Tensor, position: torch.Tensor, slot: int) -> torch.Tensor:
    """source[batch_index, position] as float32 [batch, vocab], copied into a reused buffer:
    fresh 40 MB tensors cost more in page faults than the copy itself."""
    batch, steps, vocab = source.shape
    scratch = _local.__dict__.setdefault("buffers", {})
    # Inference-mode tensors cannot be written outside inference mode (and the reverse): key on it.
    key = (slot, batch, vocab, source.device, torch.is_inference_mode_enabled())
    buffer = scratch.get(key)
    if buffer is None:
        if len(scratch) > 8:
            scratch.clear()
        buffer = scratch[key] = torch.empty(batch, vocab, dtype=torch.float32, device=source.device)
    flat_index = batch_index * steps + position
    flat = source.reshape(batch * steps, vocab)
    if flat.dtype != torch.float32:  # convert only the selected rows, never the whole tensor
        return buffer.copy_(flat.index_select(0, flat_index))
    return torch.index_select(flat, 0, flat_index, out=buffer)


def _subtract_draft(weights: torch.Tensor, draft_rows: torch.Tensor) -> None:
    """In place: weights <- max(0, weights - draft_rows), the unnormalised residual."""
    weights.sub_(draft_rows).clamp_(min=0)


def _first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """accepted: [batch, k] bool -> [batch] count of leading True."""
    return accepted.long().cumprod(-1).sum(-1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((batch, 1), -1, dtype=torch.long)], 1)
    tokens = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return tokens


def speculative_verify(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor | None = None,  # [batch, k, vocab], or None for point-mass drafts
    *,
    draft_lengths: torch.Tensor | None = None,  # [batch], each in [0, k]
    generator: torch.Generator | None = None,
    check_inputs: bool = True,
) -> VerifyResult:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    The emitted tokens follow target_probs exactly, whatever the draft law.
    `check_inputs=False` skips the validation pass (for callers that built the
    distributions themselves, like the decoder).
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must have shape [batch, k+1, vocab], got {tuple(target_probs.shape)}")
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if k < 0:
        raise ValueError("target_probs needs at least one position (k + 1 >= 1)")
    lengths = _check_lengths(draft_lengths, batch, k, target_probs.device)
    if check_inputs:
        _check_tokens(draft_tokens, batch, k, vocab)
        _check_distribution("target_probs", target_probs)
        if draft_probs is not None:
            if tuple(draft_probs.shape) != (batch, k, vocab):
                raise ValueError(
                    f"draft_probs must have shape [batch={batch}, k={k}, vocab={vocab}], got {tuple(draft_probs.shape)}"
                )
            _check_distribution("draft_probs", draft_probs)
    draft_tokens = draft_tokens.long()
    rows = torch.arange(batch, device=target_probs.device)

    target_at = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
    if draft_probs is None:
        draft_at = torch.ones_like(target_at)
    else:
        draft_at = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
    # float64 uniforms: float32 rand can return values whose spacing biases the test near 1.
    uniforms = torch.rand(batch, k, dtype=torch.float64, generator=generator, device=target_probs.device)
    in_range = torch.arange(k, device=target_probs.device) < lengths[:, None]
    accepted = (uniforms < acceptance_probs(target_at, draft_at)) & in_range
    num_accepted = _first_rejection(accepted)  # [batch]
    bonus = num_accepted == lengths

    # One row per sequence: its residual at the first rejection, or the target law after its last draft.
    weights = _scratch_rows(target_probs, rows, num_accepted, 0)  # [batch, vocab], a copy: edited in place
    if k > 0 and not bool(bonus.all()):
        reject_at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:  # point mass: the residual is the target law with the draft token zeroed
            rejected = rows[~bonus]
            weights[rejected, draft_tokens[rejected, reject_at[rejected]]] = 0.0
        else:
            draft_rows = _scratch_rows(draft_probs, rows, reject_at, 1)  # [batch, vocab]
            draft_rows[bonus] = 0.0  # bonus rows sample the target law itself
            _subtract_draft(weights, draft_rows)
        empty = weights.sum(-1) <= 0  # p == q up to rounding: rejection had probability ~0
        if bool(empty.any()):
            weights[empty] = target_probs[rows[empty], num_accepted[empty]].float()
    last = sample(weights, generator)
    return VerifyResult(_assemble(draft_tokens, num_accepted, last), num_accepted, bonus)


def greedy_verify(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    *,
    draft_lengths: torch.Tensor | None = None,  # [batch]
    check_inputs: bool = True,
) -> VerifyResult:
    """Greedy (temperature 0): accept while the draft equals the target argmax, then emit the argmax."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must have shape [batch, k+1, vocab], got {tuple(target_logits.shape)}")
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    lengths = _check_lengths(draft_lengths, batch, k, target_logits.device)
    if check_inputs:
        _check_tokens(draft_tokens, batch, k, vocab)
        if target_logits.is_floating_point() and torch.isnan(target_logits).any():
            raise ValueError("target_logits contains NaN")
    argmax = target_logits.argmax(-1)  # [batch, k + 1]
    in_range = torch.arange(k, device=target_logits.device) < lengths[:, None]
    num_accepted = _first_rejection((draft_tokens.long() == argmax[:, :k]) & in_range)
    last = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(_assemble(draft_tokens, num_accepted, last), num_accepted, num_accepted == lengths)
