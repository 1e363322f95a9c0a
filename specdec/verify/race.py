"""Exponential-race (Gumbel) sampling: every token is a keyed race winner (Kobus & Gunduz 2025,
arXiv 2504.15475).

Words (docs/DESIGN.md):
- race noise: Gumbel noise G keyed on (seed, row key, absolute position, token id), a pure
  function of the key, the same on every device and in every batch.
- race winner: argmax(log p + G), a sample from p; with keyed G the target's token at a
  position is fixed before any draft is seen.
- race verification: accept a draft iff it equals the target's winner; emit the winner at
  the first mismatch (or after the last draft). The output is path-independent: with a
  seed, the same tokens with any drafter, any k and any batch composition, or no draft.

A drafter proposes its own winner race_sample(draft_probs, G) with the same noise, so it
agrees with the target exactly where its law puts the winner first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.verify import VerifyResult, _check_distribution, greedy_verify


@dataclass(frozen=True)
class Race:
    """The keys of one generation's races: a seed and one key per row."""

    seed: int
    row_keys: torch.Tensor  # [batch] int64
    vocab: int
    row_seeds: torch.Tensor | None = None  # [batch] int64: each row's own seed (None: `seed` for every row)
    # (row key, position, device) -> noise [vocab]: the drafter and the verify of a round race at the
    # same positions, and a tree's siblings share their depth's; each is hashed once.
    memo: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)
    MEMO_ENTRIES = 96  # about 60 MB at a 151,936-token vocabulary

    @classmethod
    def for_prompts(
        cls, seed: int, prompts: Sequence[Sequence[int]], vocab: int, row_seeds: Sequence[int | None] | None = None
    ) -> Race:
        """Row keys from each prompt's tokens and its occurrence among equal prompts: a row gets the
        same key alone or in any batch, and repeated prompts get independent races.
        row_seeds: per row, its own seed (None: `seed`). A row with its own seed is keyed as if it ran
        alone (occurrence 0), so its tokens are the same whatever else is in the batch."""
        seen: dict[tuple[int, ...], int] = {}
        keys = []
        own = [None] * len(prompts) if row_seeds is None else list(row_seeds)
        for prompt, own_seed in zip(prompts, own):
            ids = tuple(int(t) for t in prompt)
            occurrence = seen.get(ids, 0) if own_seed is None else 0
            seen[ids] = seen.get(ids, 0) + (own_seed is None)
            word = occurrence
            for token in ids:  # FNV-1a style fold into 63 bits: any fixed function of the prompt will do
                word = ((word ^ (token + 1)) * 1099511628211) & ((1 << 63) - 1)
            keys.append(word)
        seed &= (1 << 63) - 1
        if row_seeds is None or all(own_seed is None or own_seed == seed for own_seed in own):
            return cls(seed, torch.tensor(keys, dtype=torch.int64), vocab)
        seeds = [seed if own_seed is None else own_seed & ((1 << 63) - 1) for own_seed in own]
        return cls(seed, torch.tensor(keys, dtype=torch.int64), vocab, torch.tensor(seeds, dtype=torch.int64))

    def noise(self, positions: torch.Tensor, device=None) -> torch.Tensor:
        """positions [batch, n] absolute -> Gumbel noise [batch, n, vocab] (float32), the same as
        race_noise; (row, position) pairs seen recently are read from the memo, the others hashed
        together in one call."""
        device = torch.device(device) if device is not None else positions.device
        seeds = [self.seed] * len(self.row_keys) if self.row_seeds is None else self.row_seeds.tolist()
        keys = [
            (seed, key, pos, device)
            for seed, key, row in zip(seeds, self.row_keys.tolist(), positions.tolist())
            for pos in row
        ]
        missing = list(dict.fromkeys(k for k in keys if k not in self.memo))
        if missing:
            row_seeds = torch.tensor([s for s, _, _, _ in missing], dtype=torch.int64, device=device)
            rows = torch.tensor([k for _, k, _, _ in missing], dtype=torch.int64, device=device)
            where = torch.tensor([[p] for _, _, p, _ in missing], dtype=torch.int64, device=device)
            fresh = race_noise(row_seeds, rows, where, self.vocab, device)[:, 0]  # [missing, vocab]
            for key, value in zip(missing, fresh):
                self.memo[key] = value
        for key in keys:
            self.memo.move_to_end(key)
        out = torch.stack([self.memo[key] for key in keys]).reshape(*positions.shape, self.vocab)
        while len(self.memo) > max(self.MEMO_ENTRIES, len(keys)):
            self.memo.popitem(last=False)
        return out


def _int64(word: int) -> int:
    """A 64-bit word as the signed value torch's int64 holds (arithmetic wraps modulo 2^64)."""
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >= 1 << 63 else word


_GOLDEN = _int64(0x9E3779B97F4A7C15)  # splitmix64's stream increment
_MIX_1 = _int64(0xBF58476D1CE4E5B9)
_MIX_2 = _int64(0x94D049BB133111EB)


def _mix(words: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection on 64-bit words, in place on `words` (which it returns).
    One temporary reused across the rounds: [batch, n, vocab] allocations are not free."""
    shifted = torch.empty_like(words)
    for bits, multiplier in ((30, _MIX_1), (27, _MIX_2), (31, None)):
        torch.bitwise_right_shift(words, bits, out=shifted)
        shifted &= (1 << (64 - bits)) - 1  # a logical shift: torch's >> copies the sign bit
        words ^= shifted
        if multiplier is not None:
            words *= multiplier
    return words


def race_bits(seed: int | torch.Tensor, row_keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[batch] row keys, [batch, n] positions -> [batch, n, vocab] int64 hash words of
    (seed, row key, position, token id): integer ops only, so every device gives the same bits.
    seed: one for every row, or a [batch] tensor of each row's own."""
    if isinstance(seed, torch.Tensor):
        seed_word = _mix(seed.to(device=positions.device, dtype=torch.int64).clone())
    else:
        seed_word = _mix(torch.tensor([_int64(seed)], dtype=torch.int64, device=positions.device))
    rows = _mix(seed_word + row_keys.long() * _GOLDEN)  # [batch]
    base = _mix(rows[:, None] + positions.long() * _GOLDEN)  # [batch, n]
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=positions.device) * _GOLDEN  # [vocab]
    return _mix(base[..., None] + tokens)  # a splitmix64 stream per (row, position)


def race_noise(
    seed: int,
    row_keys: torch.Tensor,  # [batch] int
    positions: torch.Tensor,  # [batch, n] int, absolute positions in each sequence
    vocab: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Gumbel noise [batch, n, vocab] float32, a pure function of (seed, row key, position, token id):
    independent of the batch it is computed in, and of the device. The same key gives the same
    noise to the target and to a drafter, which proposes race_sample(draft_probs, noise)."""
    if not isinstance(seed, (int, torch.Tensor)):
        raise ValueError(f"seed must be an int (or a [batch] tensor of per-row seeds), got {type(seed).__name__}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    row_keys = torch.as_tensor(row_keys, device=device)
    positions = torch.as_tensor(positions, device=device)
    if row_keys.dim() != 1 or positions.dim() != 2 or positions.shape[0] != row_keys.shape[0]:
        raise ValueError(
            f"row_keys must have shape [batch] and positions [batch, n]; got {tuple(row_keys.shape)} "
            f"and {tuple(positions.shape)}"
        )
    if row_keys.is_floating_point() or positions.is_floating_point():
        raise ValueError("row_keys and positions must be integer tensors")
    words = race_bits(seed, row_keys, positions, vocab)
    # 52 low bits m: (m + 0.5) / 2^52 is exact in float64 and lies strictly inside (0, 1).
    uniforms = (words & ((1 << 52) - 1)).double().add_(0.5).mul_(2.0**-52)
    return uniforms.log_().neg_().log_().neg_().float()  # -log(-log u): Gumbel; float64 keeps the tail exact


def race_sample(
    probs: torch.Tensor,  # [..., vocab]
    noise: torch.Tensor,  # [..., vocab], from race_noise
) -> torch.Tensor:
    """The race winner argmax(log probs + noise) -> [...] long. A probability-0 token never wins."""
    if probs.shape != noise.shape:
        raise ValueError(f"probs and noise must have the same shape, got {tuple(probs.shape)} and {tuple(noise.shape)}")
    return torch.log(probs.float()).add_(noise).argmax(-1)


def race_verify(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_tokens: torch.Tensor,  # [batch, k]
    *,
    noise: torch.Tensor,  # [batch, k + 1, vocab], race_noise at the k + 1 absolute positions
    draft_lengths: torch.Tensor | None = None,  # [batch], each in [0, k]
    check_inputs: bool = True,
) -> VerifyResult:
    """Race verification (Kobus & Gunduz 2025, arXiv 2504.15475): accept while a draft equals the
    target's race winner, then emit the winner (recovered at a mismatch, bonus after the last draft).
    Every emitted token is the target's own winner: the output does not depend on the drafts."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must have shape [batch, k+1, vocab], got {tuple(target_probs.shape)}")
    if noise.shape != target_probs.shape:
        raise ValueError(
            f"noise must have the shape of target_probs {tuple(target_probs.shape)}, got {tuple(noise.shape)}"
        )
    if check_inputs:
        _check_distribution("target_probs", target_probs)
    # Greedy verification of the noised log-probabilities is exactly the race rule.
    scores = torch.log(target_probs.float()).add_(noise)
    return greedy_verify(scores, draft_tokens, draft_lengths=draft_lengths, check_inputs=check_inputs)
