"""Sampling: logits -> the probabilities a token is drawn from.

Words:
- warping: temperature, then top-k, then top-p, in transformers' order, using
  transformers' own logits warpers.
- greedy: temperature 0. It is its own exact path (argmax), never
  "temperature 1e-5"; `SamplingConfig.greedy` tells callers to take it.

Draft and target go through the same `logits_to_probs`, so the draft
probabilities handed to verification are exactly the law each draft token was
drawn from (DESIGN.md, contract 1). Probabilities are float32 whatever the
model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingConfig:
    """How the target (and, identically, the draft) turns logits into a law."""

    temperature: float = 1.0
    top_k: int | None = None  # None or 0: no top-k
    top_p: float | None = None  # None or 1.0: no top-p

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or t != t or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None disables it), got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 or None disables it), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        """transformers' warpers for this config (empty for greedy)."""
        warpers = LogitsProcessorList()
        if self.greedy:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(self.top_p)))
        return warpers


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Warped float32 probabilities. logits: [..., vocab] -> [..., vocab].

    Greedy configs give the one-hot law of the argmax (a point mass), which is
    what a greedy drafter samples from.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).float()  # float32 softmax whatever the model dtype
    if config.greedy:
        probs = torch.zeros_like(flat)
        probs.scatter_(-1, flat.argmax(-1, keepdim=True), 1.0)
        return probs.reshape(logits.shape)
    warpers = config.warpers()
    if len(warpers):
        # The warpers ignore input_ids; an empty [rows, 0] tensor satisfies their signature.
        flat = warpers(flat.new_empty((flat.shape[0], 0), dtype=torch.long), flat)
    return torch.softmax(flat, dim=-1).reshape(logits.shape)


def _block_size(vocab: int) -> int:
    """The divisor of vocab nearest sqrt(vocab) from below (1 for a prime vocab)."""
    for size in range(int(vocab**0.5), 0, -1):
        if vocab % size == 0:
            return size
    return 1


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [rows, n] >= 0 with positive row sums, uniforms [rows] in [0, 1) -> index [rows].
    Never returns a zero-weight index."""
    cumulative = weights.double().cumsum(-1)  # [rows, n]
    index = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True).squeeze(-1)
    # u * total can round up to total; fall back to the last index with positive weight.
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).long().argmax(-1)
    return torch.minimum(index, last_positive)


def sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from unnormalised non-negative weights [..., vocab] -> [...] long.

    Two-level inverse CDF with float64 uniforms: pick a block of the vocabulary by
    its mass, then a token inside it. It reads the weights once and allocates only
    [rows, sqrt(vocab)] temporaries (torch.multinomial was 10x slower at vocab 151936).
    Block masses are float32 sums (float64 ones were 30x slower): the law sampled equals
    the given one to ~1e-7 relative, the precision of the float32 probabilities themselves.
    """
    vocab = weights.shape[-1]
    flat = weights.reshape(-1, vocab)
    rows, size = flat.shape[0], _block_size(vocab)
    uniforms = torch.rand(2, rows, dtype=torch.float64, generator=generator, device=flat.device)
    blocks = flat.reshape(rows, vocab // size, size)
    block = _inverse_cdf(blocks.sum(-1).double(), uniforms[0])  # [rows]; float32 sums: float64 ones are 30x slower
    inside = blocks[torch.arange(rows, device=flat.device), block]  # [rows, size]
    token = block * size + _inverse_cdf(inside, uniforms[1])
    return token.reshape(weights.shape[:-1])
