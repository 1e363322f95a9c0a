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


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row. probs: [..., vocab] (rows may be unnormalised) -> [...] long."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
