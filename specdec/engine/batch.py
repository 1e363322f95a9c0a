"""A batch's committed tokens: what each row has emitted so far and whether it still generates.

Words (docs/DESIGN.md):
- committed tokens: a row's prompt, then every token a round emitted (accepted drafts, then the
  recovered or bonus token), cut at EOS, at a stop string or at the row's max_new_tokens.
- finished: a row that committed EOS, stopped, or spent its budget; later rounds skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# A row's stop strings: (committed sequence, prompt length, tokens just added) -> new tokens to keep, or None
StopCheck = Callable[[list[int], int, int], int | None]


@dataclass
class Batch:
    """Committed tokens per row and which rows still generate."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    max_new_tokens: list[int]  # per row
    finished: list[bool]

    def new_tokens(self, row: int) -> list[int]:
        return self.sequences[row][self.prompt_lengths[row] :]

    def remaining(self) -> torch.Tensor:  # [batch] tokens still allowed, 0 for finished rows
        return torch.tensor(
            [0 if done else self.max_new_tokens[b] - len(self.new_tokens(b)) for b, done in enumerate(self.finished)]
        )

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(s) for s in self.sequences])


def commit_row(batch: Batch, row: int, tokens: list[int], eos_ids: set[int], stop: StopCheck | None) -> int:
    """Append a round's tokens to a row, cut at EOS (kept, as transformers does), at a stop
    string (`stop`: that row's), or at max_new_tokens. Returns how many were committed."""
    room = batch.max_new_tokens[row] - len(batch.new_tokens(row))
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            tokens, batch.finished[row] = tokens[: i + 1], True
            break
    batch.sequences[row].extend(tokens)
    if stop is not None and tokens:
        keep = stop(batch.sequences[row], batch.prompt_lengths[row], len(tokens))
        if keep is not None:
            cut = len(batch.new_tokens(row)) - keep
            del batch.sequences[row][len(batch.sequences[row]) - cut :]
            # The cut can reach into earlier rounds (decoding is not prefix-monotone): emit none then.
            tokens, batch.finished[row] = tokens[: max(0, len(tokens) - cut)], True
    if len(batch.new_tokens(row)) >= batch.max_new_tokens[row]:
        batch.finished[row] = True
    return len(tokens)
