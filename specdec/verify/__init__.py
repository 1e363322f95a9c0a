"""Exact verification of drafted tokens: pure tensor functions, no models.

Words (docs/DESIGN.md):
- accepted token: a draft token x at position i kept by the test
  u < min(1, target_probs[i, x] / draft_probs[i, x]), u ~ U[0, 1) in float64.
- recovered token: drawn at the first rejected position from the residual
  norm(max(0, target_probs - draft_probs)).
- bonus token: drawn from target_probs[K] (the (K+1)-th row of a sequence with
  K drafts) when all its drafts were accepted.
- point-mass draft: `draft_probs=None`; each draft token was chosen
  deterministically (argmax, n-gram). Accept with probability target_probs[x];
  on rejection draw from target_probs with x zeroed and renormalised.
- block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): the
  drafted block is judged jointly. Its scale p_i = min(1, p_(i-1) * target/draft
  at the i-th draft) (p_0 = 1) caps the running likelihood ratio; its threshold
  h_i keeps the prefix of length i when the longer ones were not kept. The
  longest prefix whose coin passes is accepted; the recovered token is drawn
  from norm(max(0, p_tau * target_probs - draft_probs)) at the next position.
  Never fewer accepted tokens in expectation than token-level verification.
- race sampling (Kobus & Gunduz 2025, arXiv 2504.15475): every token is
  argmax(log p + G) with Gumbel noise G keyed on (seed, row key, absolute
  position, token id); a draft is accepted iff it equals the target's race
  winner, so the emitted tokens do not depend on the drafts at all.

Each sequence emits `num_accepted + 1` tokens: its accepted drafts, then one
recovered or bonus token; `tokens` is -1 after that. Ragged rows carry
`draft_lengths` (a row may have 0 drafts: it emits one plain target token).

Cost: besides reading the K gathered probabilities per row, only one residual
row per sequence is built (at its first rejection), never the whole
[B, K, V] residual tensor. Block verification adds one [B, K-1, V] pass for
the residual masses behind its thresholds; race sampling hashes every
(row, position, token): [B, K+1, V] integer work in race_noise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from specdec.verify.sampling import sample

VERIFICATIONS = ("token", "block", "race")  # the rules a sampled run may take (greedy is one rule for all)
MAX_DRAFT_WIDTH = 1024  # checked before any model is known: a tree scores width x drafts nodes in one forward


def check_draft_width(draft_width) -> None:
    if draft_width != "auto" and (
        isinstance(draft_width, bool) or not isinstance(draft_width, int) or not 1 <= draft_width <= MAX_DRAFT_WIDTH
    ):
        raise ValueError(f"draft_width must be an integer in [1, {MAX_DRAFT_WIDTH}] or 'auto', got {draft_width!r}")


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [batch, k + 1] emitted tokens, -1 after the last
    num_accepted: torch.Tensor  # [batch] accepted drafts per row
    bonus: torch.Tensor  # [batch] bool: the last emitted token is a bonus (else recovered)
    path: torch.Tensor | None = None  # a draft tree's: [batch, depth] accepted node indices (-1 after); None: a chain


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


def _check_lengths(draft_lengths: torch.Tensor | None, batch: int, k: int, device, check: bool = True) -> torch.Tensor:
    """The [batch] draft lengths on `device`; their range is checked (two host reads) unless check=False."""
    if draft_lengths is None:
        return torch.full((batch,), k, dtype=torch.long, device=device)
    draft_lengths = torch.as_tensor(draft_lengths, device=device)
    if tuple(draft_lengths.shape) != (batch,):
        raise ValueError(f"draft_lengths must have shape [batch={batch}], got {tuple(draft_lengths.shape)}")
    if check and draft_lengths.numel() and (draft_lengths.min() < 0 or draft_lengths.max() > k):
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


def _check_verify_inputs(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_lengths: torch.Tensor | None,
    check_inputs: bool,
) -> torch.Tensor:
    """The shared contract of speculative_verify and block_verify; returns the [batch] draft lengths."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must have shape [batch, k+1, vocab], got {tuple(target_probs.shape)}")
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if k < 0:
        raise ValueError("target_probs needs at least one position (k + 1 >= 1)")
    lengths = _check_lengths(draft_lengths, batch, k, target_probs.device, check_inputs)
    if check_inputs:
        _check_tokens(draft_tokens, batch, k, vocab)
        _check_distribution("target_probs", target_probs)
        if draft_probs is not None:
            if tuple(draft_probs.shape) != (batch, k, vocab):
                raise ValueError(
                    f"draft_probs must have shape [batch={batch}, k={k}, vocab={vocab}], got {tuple(draft_probs.shape)}"
                )
            _check_distribution("draft_probs", draft_probs)
    return lengths


# ---------------------------------------------------------------- pure helpers


def acceptance_probs(target_at: torch.Tensor, draft_at: torch.Tensor, leniency: float = 1.0) -> torch.Tensor:
    """min(1, p_target / p_draft) per drafted token; a draft probability of 0 rejects.
    leniency > 1 is the LOSSY lenient test of specdec.verify.diagnostics; the exact path uses 1."""
    ratio = leniency * target_at.double() / draft_at.double().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(draft_at > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(max(0, scale * p_target - p_draft)) over the last dim (scale [...] defaults to 1;
    block verification passes its p_tau); falls back to p_target where the difference has
    no mass (p == q, where rejection has probability 0 anyway).
    The reference form, for diagnostics and tests; the verifiers build the same
    residual in place, one row per sequence."""
    scaled = target_probs.float() if scale is None else target_probs.float() * scale.float()[..., None]
    residual = (scaled - draft_probs.float()).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs.float())


# ---------------------------------------------------------------- verification


_local = threading.local()  # per-thread scratch buffers: concurrent decoders never share one


def _scratch(slot: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A reused float32 buffer of this shape for this thread."""
    scratch = _local.__dict__.setdefault("buffers", {})
    # Inference-mode tensors cannot be written outside inference mode (and the reverse): key on it.
    key = (slot, shape, device, torch.is_inference_mode_enabled())
    buffer = scratch.get(key)
    if buffer is None:
        if len(scratch) > 8:
            scratch.clear()
        buffer = scratch[key] = torch.empty(shape, dtype=torch.float32, device=device)
    return buffer


def _scratch_rows(source: torch.Tensor, batch_index: torch.Tensor, position: torch.Tensor, slot: int) -> torch.Tensor:
    """source[batch_index, position] as float32 [batch, vocab], copied into a reused buffer:
    fresh 40 MB tensors cost more in page faults than the copy itself."""
    batch, steps, vocab = source.shape
    buffer = _scratch(slot, (batch, vocab), source.device)
    flat_index = batch_index * steps + position
    flat = source.reshape(batch * steps, vocab)
    if flat.dtype != torch.float32:  # convert only the selected rows, never the whole tensor
        return buffer.copy_(flat.index_select(0, flat_index))
    return torch.index_select(flat, 0, flat_index, out=buffer)


def _subtract_draft(weights: torch.Tensor, draft_rows: torch.Tensor) -> None:
    """In place: weights <- max(0, weights - draft_rows), the unnormalised residual."""
    weights.sub_(draft_rows).clamp_(min=0)


def _may_hold(flags: torch.Tensor) -> bool:
    """Whether any flag may be set: asked on the CPU, where it is free; assumed on an accelerator,
    where asking is a host sync (the masked work that follows then runs for every row, same result)."""
    return flags.device.type != "cpu" or bool(flags.any())


def _refill_empty(
    weights: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor, num_accepted: torch.Tensor
) -> None:
    """In place: rows of `weights` with no mass left (p == q up to rounding, where rejection had
    probability ~0) take the target law at their position instead."""
    empty = weights.sum(-1) <= 0  # [batch]
    if _may_hold(empty):
        fallback = target_probs[rows, num_accepted].float()  # [batch, vocab]
        torch.where(empty[:, None], fallback, weights, out=weights)


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
    lengths = _check_verify_inputs(target_probs, draft_tokens, draft_probs, draft_lengths, check_inputs)
    batch, k = draft_tokens.shape
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
    if k > 0 and _may_hold(~bonus):
        reject_at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:  # point mass: the residual is the target law with the draft token zeroed
            drafted = draft_tokens.gather(1, reject_at[:, None])  # [batch, 1]
            kept = weights.gather(1, drafted)
            weights.scatter_(1, drafted, kept.masked_fill(~bonus[:, None], 0.0))  # bonus rows keep theirs
        else:
            draft_rows = _scratch_rows(draft_probs, rows, reject_at, 1)  # [batch, vocab]
            draft_rows.masked_fill_(bonus[:, None], 0.0)  # bonus rows sample the target law itself
            _subtract_draft(weights, draft_rows)
        _refill_empty(weights, target_probs, rows, num_accepted)
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
    lengths = _check_lengths(draft_lengths, batch, k, target_logits.device, check_inputs)
    if check_inputs:
        _check_tokens(draft_tokens, batch, k, vocab)
        if target_logits.is_floating_point() and torch.isnan(target_logits).any():
            raise ValueError("target_logits contains NaN")
    argmax = target_logits.argmax(-1)  # [batch, k + 1]
    in_range = torch.arange(k, device=target_logits.device) < lengths[:, None]
    num_accepted = _first_rejection((draft_tokens.long() == argmax[:, :k]) & in_range)
    last = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(_assemble(draft_tokens, num_accepted, last), num_accepted, num_accepted == lengths)


# ---------------------------------------------------------------- block verification


def _block_scales(target_at: torch.Tensor, draft_at: torch.Tensor) -> torch.Tensor:
    """[batch, k] gathered probabilities -> [batch, k] float64 scales p_i = min(1, p_(i-1) t_i / d_i),
    p_0 = 1; a draft probability of 0 gives p = 0 from there on.
    Closed form, no loop over k: log p_i = S_i - max(S_0..S_i), S the prefix sums of log(t/d), S_0 = 0."""
    log_ratio = target_at.double().log() - draft_at.double().log()
    log_ratio = log_ratio.masked_fill(draft_at <= 0, -torch.inf)
    sums = torch.cat([torch.zeros_like(log_ratio[:, :1]), log_ratio.cumsum(-1)], -1)  # [batch, k + 1]; -inf absorbs
    return (sums - sums.cummax(-1).values)[:, 1:].exp()


def _residual_masses(target_probs: torch.Tensor, draft_probs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """r_i = sum_x max(0, p_i * target_probs[i](x) - draft_probs[i](x)) for i = 1 .. k-1 (0-based rows 1 .. k-1),
    the mass a rejection right after i accepted drafts would be drawn from. -> [batch, k - 1] float64.
    One float32 [batch, k-1, vocab] pass into a reused buffer."""
    batch, k, vocab = draft_probs.shape
    buffer = _scratch(2, (batch, k - 1, vocab), target_probs.device)
    torch.mul(target_probs[:, 1:k], scales[:, : k - 1, None].float(), out=buffer)
    return buffer.sub_(draft_probs[:, 1:k]).clamp_(min=0).sum(-1).double()


def _block_thresholds(scales: torch.Tensor, masses: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """h_i = r_i / (r_i + 1 - p_i) below a row's length L, h_L = p_L, 0 past L. -> [batch, k] float64.
    p_i = 1 gives h_i = 1 (r_i / r_i, or 0 / 0 where the next target and draft laws coincide)."""
    batch, k = scales.shape
    inner = scales[:, : k - 1]
    stop = torch.where(inner >= 1, torch.ones_like(inner), masses / (masses + 1 - inner).clamp_min(1e-300))
    stop = torch.cat([stop, scales[:, k - 1 :]], -1)  # the last column is always a row's own length
    length = torch.arange(1, k + 1, device=scales.device)[None, :]  # the prefix length each column judges
    thresholds = torch.where(length == lengths[:, None], scales, stop)
    return thresholds.masked_fill(length > lengths[:, None], 0.0)


def _residual_scale(scales: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """p_tau per row ([batch] float32), p_0 = 1: the weight of the target law in the block residual."""
    padded = torch.cat([torch.ones_like(scales[:, :1]), scales], -1)  # [batch, k + 1]
    return padded.gather(1, num_accepted[:, None]).squeeze(1).float()


def block_acceptance(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor,  # [batch, k, vocab]
    lengths: torch.Tensor,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's scales p_1..p_k and thresholds h_1..h_k, both [batch, k] float64.
    P(num_accepted = i) = h_i * prod_(j > i) (1 - h_j) (h_0 := 1): the exact law, for tests and diagnostics."""
    draft_tokens = draft_tokens.long()
    k = draft_tokens.shape[1]
    target_at = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
    draft_at = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
    scales = _block_scales(target_at, draft_at)
    return scales, _block_thresholds(scales, _residual_masses(target_probs, draft_probs, scales), lengths)


def block_verify(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor | None = None,  # [batch, k, vocab], or None for point-mass drafts
    *,
    draft_lengths: torch.Tensor | None = None,  # [batch], each in [0, k]
    generator: torch.Generator | None = None,
    check_inputs: bool = True,
) -> VerifyResult:
    """Block verification (Sun, Mendlovic, Leviathan et al., ICLR 2025, arXiv 2403.10444, Algorithm 2).

    Same contract as speculative_verify; the emitted tokens follow target_probs exactly,
    and the expected number of accepted drafts is never smaller. Row i (0-based) of the
    [batch, k+1, vocab] inputs is the position after i accepted drafts, so
    r_i = sum_x max(0, p_i * target_probs[i](x) - draft_probs[i](x)) and
    h_i = r_i / (r_i + 1 - p_i) for i < L (the row's length), h_L = p_L.
    With eta_i ~ U[0, 1) fresh from `generator`, num_accepted = tau = max{i : eta_i < h_i}
    (0 if none); the last token is the bonus from target_probs[L] when tau = L, else it is
    drawn from norm(max(0, p_tau * target_probs[tau] - draft_probs[tau])).
    """
    if draft_probs is None:
        # A point mass draft has p_i = prod t_j and r_i = p_i (1 - t_(i+1)), so h_i reduces to the
        # token test's conditional law: block and token verification coincide in law.
        return speculative_verify(
            target_probs, draft_tokens, draft_lengths=draft_lengths, generator=generator, check_inputs=check_inputs
        )
    lengths = _check_verify_inputs(target_probs, draft_tokens, draft_probs, draft_lengths, check_inputs)
    batch, k = draft_tokens.shape
    if k == 0:  # no drafts: one plain target token, as speculative_verify emits it
        return speculative_verify(target_probs, draft_tokens, draft_probs, generator=generator, check_inputs=False)
    draft_tokens = draft_tokens.long()
    rows = torch.arange(batch, device=target_probs.device)
    scales, thresholds = block_acceptance(target_probs, draft_tokens, draft_probs, lengths)  # [batch, k] each
    # float64 uniforms, as in speculative_verify; a threshold of 0 never passes, 1 always does.
    uniforms = torch.rand(batch, k, dtype=torch.float64, generator=generator, device=target_probs.device)
    passed = uniforms < thresholds
    num_accepted = (passed.long() * torch.arange(1, k + 1, device=target_probs.device)).amax(-1)  # longest passing
    bonus = num_accepted == lengths

    weights = _scratch_rows(target_probs, rows, num_accepted, 0)  # [batch, vocab], a copy: edited in place
    if _may_hold(~bonus):
        weights.mul_(_residual_scale(scales, num_accepted).masked_fill(bonus, 1.0)[:, None])
        draft_rows = _scratch_rows(draft_probs, rows, num_accepted.clamp(max=k - 1), 1)  # [batch, vocab]
        draft_rows.masked_fill_(bonus[:, None], 0.0)  # bonus rows sample the target law itself
        _subtract_draft(weights, draft_rows)
        _refill_empty(weights, target_probs, rows, num_accepted)
    last = sample(weights, generator)
    return VerifyResult(_assemble(draft_tokens, num_accepted, last), num_accepted, bonus)


# ---------------------------------------------------------------- draft trees


def tree_children(parents: list[int], valid: list[bool]) -> dict[int, list[int]]:
    """parents (-1: the root) -> {node: its valid children in index order}; the root is -1."""
    children: dict[int, list[int]] = {}
    for node, (parent, ok) in enumerate(zip(parents, valid)):
        if ok:
            children.setdefault(parent, []).append(node)
    return children


def tree_verify(
    target_probs: torch.Tensor | None,  # [batch, n + 1, vocab]: column 0 the root's law, column 1 + j node j's
    draft_tokens: torch.Tensor,  # [batch, n]
    parents: torch.Tensor,  # [batch, n]: parents[b, j] < j, -1 for a child of the root
    *,
    node_valid: torch.Tensor | None = None,  # [batch, n] bool
    draft_probs: torch.Tensor | None = None,  # [batch, m, vocab]: nodes j < m were sampled from draft_probs[:, j]
    winners: torch.Tensor | None = None,  # [batch, n + 1]: the target's token at each column is fixed
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Exact verification of a draft tree: walk from the root, one emitted token per level.

    At each node the target's token y is drawn from its law there (or read from `winners`:
    greedy argmax, race winners) and the walk descends into the child whose token is y; the
    first y no child holds is emitted and ends the round (recovered; bonus at a leaf). A node's
    first child, when it was sampled from the draft law q (j < m), is judged first by the
    token-level test u < p(x) / q(x); if it fails, y is drawn from the residual norm(max(0, p - q))
    and matched against the other children. Either way the emitted token at each level follows p:
    the multi-candidate rule of SpecInfer (Miao et al. 2024) with point-mass siblings."""
    batch, n = draft_tokens.shape
    if winners is None and target_probs is None:
        raise ValueError("give target_probs (sampling) or winners (greedy, race)")
    sampled_nodes = 0 if draft_probs is None else draft_probs.shape[1]
    tokens, parent_lists = draft_tokens.tolist(), parents.tolist()
    valid = node_valid.tolist() if node_valid is not None else [[True] * n for _ in range(batch)]
    fixed = winners.tolist() if winners is not None else None
    emitted, paths, bonus = [], [], []
    for b in range(batch):
        children, node, path = tree_children(parent_lists[b], valid[b]), -1, []
        while True:
            kids = children.get(node, [])
            if fixed is not None:
                y = fixed[b][node + 1]
            else:
                p = target_probs[b, node + 1].double()
                if kids and kids[0] < sampled_nodes:
                    x, q = tokens[b][kids[0]], draft_probs[b, kids[0]].double()
                    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=p.device))
                    if u * q[x] < p[x]:  # u < min(1, p(x) / q(x))
                        node = kids[0]
                        path.append(node)
                        continue
                    residual = (p - q).clamp_min(0)
                    p = residual if residual.sum() > 0 else p  # no mass: p == q, where rejection never happens
                    kids = kids[1:]
                y = int(sample(p, generator))
            match = next((j for j in kids if tokens[b][j] == y), None)
            if match is None:
                emitted.append(path_tokens(tokens[b], path) + [y])
                paths.append(path)
                bonus.append(node not in children)
                break
            node = match
            path.append(node)
    depth = max(len(p) for p in paths) if paths else 0
    out = torch.full((batch, depth + 1), -1, dtype=torch.long)
    path_out = torch.full((batch, depth), -1, dtype=torch.long)
    for b in range(batch):
        out[b, : len(emitted[b])] = torch.tensor(emitted[b])
        if paths[b]:
            path_out[b, : len(paths[b])] = torch.tensor(paths[b])
    return VerifyResult(out, torch.tensor([len(p) for p in paths], dtype=torch.long), torch.tensor(bonus), path_out)


def path_tokens(tokens: list[int], path: list[int]) -> list[int]:
    return [tokens[j] for j in path]
