"""A draft head over part of the vocabulary (FR-Spec; EAGLE-3's reduced draft vocabulary), opt-in.

A small draft spends part of its step in its output layer: Qwen2.5-0.5B's head holds 136M of its
494M weights. `VocabHead` computes the logits of a subset of token ids only. The drafter puts
them back at their ids in the target's vocabulary and gives every other id probability 0 in the
draft's law. That is exact: verification uses the law the draft samples from, so only acceptance
can change, and only where the target emits a token outside the subset.

Measured on the Qwen pair (docs/BENCHMARKS.md, "Partial draft head"): the int8 head took 6.5 ms of
a ~60 ms draft step in place, 2.9 ms over 65,536 ids, but the per-token acceptance fell by ~1.4%
(teacher-forced), which costs about what the step saves. So it is off by default
(`draft_vocab=None`); `draft_vocab=N` turns it on.

Words:
- base: the ids every run starts from: the first `base_size` ids (BPE merge order, the most
  common tokens first) and the tokenizer's special ids above them.
- extra: ids added during a run, from the prompt and from the tokens the target commits, so a
  word the run uses is proposable from its second occurrence on. The extra rows are rebuilt when
  they change; past MAX_EXTRA they are merged into the base for the rest of the run. `reset()`
  (each run) drops them, so a run's draft law depends only on its own tokens: the same seed gives
  the same tokens.

Rows are copied from the draft's own head (an int8 head keeps its int8 values and scale), so
the subset's logits equal the full head's at those ids.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from specdec.packing import PackedLinear

MAX_EXTRA = 2048  # extra rows kept apart (rebuilt on change) before they are merged into the base


class VocabHead(torch.nn.Module):
    """An LM head that computes logits for `ids` only: [..., hidden] -> [..., len(ids)]."""

    def __init__(self, head: torch.nn.Module, base_ids: Iterable[int]):
        super().__init__()
        self.in_features = _in_features(head)
        self.out_features = self.vocab_size = _out_features(head)  # the full head's: ids index this vocabulary
        if isinstance(head, DynamicQuantizedLinear):
            weight = head.weight()
            self._rows, self._qweight = weight.int_repr(), weight  # int8 values, and the scheme to restore
            self._bias = head.bias()
        elif isinstance(head, torch.nn.Linear):
            self._rows, self._qweight, self._bias = head.weight.detach(), None, head.bias
        elif isinstance(head, PackedLinear):  # a float head packed at load (specdec.packing)
            self._rows, self._qweight, self._bias = head.dense_weight(), None, head.bias
        else:
            raise TypeError(
                f"a draft vocabulary needs a Linear (float, packed or int8 dynamic) head, got {type(head).__name__}"
            )
        self._initial = sorted(set(int(i) for i in base_ids if 0 <= int(i) < self.vocab_size))
        self._initial_member = bytearray(self.vocab_size)  # membership of the initial ids, copied at each reset
        for i in self._initial:
            self._initial_member[i] = 1
        self._initial_index = torch.tensor(self._initial, dtype=torch.long)
        self._base_ids, self._base_index, self.base = self._initial, self._initial_index, self._build(self._initial)
        self.reset()

    # ------------------------------------------------------------ rows

    def _build(self, ids: list[int]) -> torch.nn.Module:
        """A Linear over the given rows of the full head, in its own format."""
        index = torch.tensor(ids, dtype=torch.long, device=self._rows.device)
        rows = self._rows.index_select(0, index)
        bias = None if self._bias is None else self._bias.detach().index_select(0, index)
        if self._qweight is None:
            linear = torch.nn.Linear(
                self.in_features, len(ids), bias=bias is not None, device=rows.device, dtype=rows.dtype
            )
            with torch.no_grad():
                linear.weight.copy_(rows)
                if bias is not None:
                    linear.bias.copy_(bias)
            return linear.eval().requires_grad_(False)
        scheme = self._qweight.qscheme()
        if scheme == torch.per_tensor_affine:
            qrows = torch._make_per_tensor_quantized_tensor(rows, self._qweight.q_scale(), self._qweight.q_zero_point())
        elif scheme in (torch.per_channel_affine, torch.per_channel_affine_float_qparams):
            scales = self._qweight.q_per_channel_scales().index_select(0, index)
            zeros = self._qweight.q_per_channel_zero_points().index_select(0, index)
            qrows = torch._make_per_channel_quantized_tensor(rows, scales, zeros, 0)
        else:
            raise TypeError(f"unsupported int8 head quantisation scheme {scheme}")
        linear = DynamicQuantizedLinear(self.in_features, len(ids), dtype=torch.qint8)
        linear.set_weight_bias(qrows, bias)
        return linear

    def reset(self) -> None:
        """Back to the base ids (each run starts here)."""
        if self._base_ids is not self._initial:  # a run merged its extra rows into the base
            self._base_ids, self._base_index, self.base = self._initial, self._initial_index, self._build(self._initial)
        self._member = bytearray(self._initial_member)
        self._extra_ids: list[int] = []
        self.extra = None
        self._set_ids()

    def _set_ids(self) -> None:
        self.ids = torch.cat([self._base_index, torch.tensor(self._extra_ids, dtype=torch.long)])

    def cover(self, tokens: Iterable[int]) -> int:
        """Add the tokens not yet in the subset; returns how many were added."""
        member = self._member
        new = sorted({t for t in tokens if 0 <= t < self.vocab_size and not member[t]})
        if not new:
            return 0
        for t in new:
            member[t] = 1
        self._extra_ids += new
        if len(self._extra_ids) > MAX_EXTRA:  # merge: one wider base, no extra
            self._base_ids = sorted(self._base_ids + self._extra_ids)
            self._base_index = torch.tensor(self._base_ids, dtype=torch.long)
            self.base, self._extra_ids, self.extra = self._build(self._base_ids), [], None
        else:
            self.extra = self._build(self._extra_ids)
        self._set_ids()
        return len(new)

    @property
    def base_size(self) -> int:
        """Rows every run starts from."""
        return len(self._initial)

    @property
    def size(self) -> int:
        return len(self._base_ids) + len(self._extra_ids)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        if self.extra is not None:
            logits = torch.cat([logits, self.extra(hidden).to(logits.dtype)], -1)
        return logits


def _in_features(head) -> int:
    return head.in_features if hasattr(head, "in_features") else head.weight.shape[1]


def _out_features(head) -> int:
    return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]


def base_ids(vocab_size: int, base_size: int, special_ids: Iterable[int] = ()) -> list[int]:
    """The first base_size ids and the special ids (EOS, chat markers), which a run must be able to draft."""
    return sorted(set(range(min(base_size, vocab_size))) | {int(i) for i in special_ids if 0 <= int(i) < vocab_size})


def with_vocab_head(model: torch.nn.Module, ids: Iterable[int]) -> torch.nn.Module:
    """A shallow copy of `model` (same weights, same submodules) whose output layer is a VocabHead
    over `ids`; `model` itself is left as it was."""
    head = VocabHead(model.get_output_embeddings(), ids)
    trimmed = copy.copy(model)
    trimmed._modules = dict(model._modules)  # a new module table: setting the head leaves `model` alone
    trimmed.set_output_embeddings(head)
    return trimmed


def vocab_head(model) -> VocabHead | None:
    """The model's VocabHead, if its output layer is one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if isinstance(head, VocabHead) else None


def check_draft_vocab(setting) -> None:
    if setting is None or (isinstance(setting, int) and not isinstance(setting, bool) and setting > 0):
        return
    raise ValueError(f"draft_vocab must be None (the full head) or a number of token ids > 0, got {setting!r}")


def resolve_draft_vocab(setting: int | None, vocab_size: int, special_ids: Iterable[int] = ()) -> list[int] | None:
    """The base ids of a draft's head for a `draft_vocab` setting, or None for the full head."""
    check_draft_vocab(setting)
    if setting is None or setting >= vocab_size:
        return None
    return base_ids(vocab_size, setting, special_ids)
