"""A Hugging Face causal LM over a preallocated (static) KV cache, with free rollback.

Words (as in specdec.models.adapters, plus):
- capacity: slots preallocated per layer.
- write pointer: the next free slot (`num_slots`); a forward of n columns
  writes slots [pointer, pointer + n) in place (transformers' StaticLayer,
  whose write offset is a device tensor, so writes need no host sync).
- stale slot: one at or past the write pointer that still holds old keys and
  values (a rolled-back draft). It is masked, then overwritten by later writes.
- window: the slots a forward attends to, [0, window), a view of the cache;
  slots in it past the write pointer are masked. Eager forwards use
  window = pointer + n, so their cost follows the length, not the capacity.
  Captured forwards need fixed shapes: their window is a power of two
  (>= MIN_WINDOW, capped at the capacity), or the capacity itself.

Rollback marks the dropped tokens' slots as holes and moves the write pointer
back to the last slot still used (+1): no tensor is copied or cut (StaticLayer's
crop only shifts its write offset). The same invariant and fresh-forward
equality hold as for HFCausalLM.

compile= captures the narrow forwards (draft steps, verify) with fixed shapes, one per
(batch, width, window); prefills run eagerly. The capture machinery (CUDA graphs over static
buffers, inductor) is specdec.models.adapters.capture's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel, StaticLayer
from transformers.cache_utils import get_layer_types_and_kwargs

from specdec.models.adapters import PAD_ID, HFCausalLM, check_context
from specdec.models.adapters.capture import Captures, check_capturable, compile_mode, reset_write_offsets
from specdec.verify.reads import to_device

DEFAULT_CAPACITY = 1024  # slots preallocated when neither max_length nor reset(capacity=) says more
CAPACITY_ALIGN = 16  # capacities are rounded up to this
MIN_WINDOW = 256  # the smallest window of a captured forward (compile_windows=True)


def _aligned(slots: int) -> int:
    return -(-slots // CAPACITY_ALIGN) * CAPACITY_ALIGN


class SlotLayer(StaticLayer):
    """transformers' StaticLayer that can attend to a prefix window of its slots.

    While `window` is set (eager forwards), update() returns views of the first `window` slots
    and the write offset is read from the host int `offset`, so building the mask needs no sync.
    With both None (captured forwards) it is exactly a StaticLayer."""

    window: int | None = None
    offset: int | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.window is None:
            return keys, values
        return keys[:, :, : self.window], values[:, :, : self.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.max_cache_len if self.window is None else self.window), 0

    def get_seq_length(self):
        return super().get_seq_length() if self.offset is None else self.offset


class SlotCache(Cache):
    """One SlotLayer per decoder layer (full attention only), `capacity` slots each."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlotLayer(max_cache_len=capacity) for _ in range(num_layers)])

    def set_window(self, offset: int | None, window: int | None) -> None:
        for layer in self.layers:
            layer.offset, layer.window = offset, window

    @property
    def is_compileable(self) -> bool:
        # False in eager forwards (host offset set): transformers then drops an all-true mask for a
        # single query, as with DynamicCache, and SDPA runs its faster unmasked GQA kernel.
        return self.layers[0].offset is None


class StaticHFCausalLM(HFCausalLM):
    """HFCausalLM with a preallocated SlotCache: writes at the write pointer, rollback by masking.

    max_length: slots to preallocate (prompt + new tokens + k + 1 is enough for one row; holes of
    ragged batches need a little more); the cache grows (one copy) if a run needs more.
    compile: capture narrow forwards (True or one of COMPILE_MODES; see the module notes). A
    forward of n columns runs as the smallest of `compile_widths` >= n, right-padded with masked
    columns (their slots stay free), so there is one graph per listed width; wider forwards and
    prefills run eagerly.
    compile_windows: captured forwards attend to power-of-two windows of the used slots (one
    graph per window reached), not to the whole capacity (one graph, attention over all of it).
    """

    supports_trees = False  # a tree forward needs its own mask and compaction here: not built
    can_select_rows = False  # finished rows stay in a static cache's forwards (its shapes are fixed)
    progress = None  # a one-line callback, told before each new shape is captured (SpeculativeDecoder.on_status)
    eager_on_failure = False  # compile="auto" sets it: a forward that fails to capture runs uncompiled instead

    def __init__(
        self,
        model: PreTrainedModel,
        name: str | None = None,
        *,
        max_length: int | None = None,
        compile: bool | str = False,
        compile_widths: Sequence[int] = tuple(range(1, 17)),
        compile_windows: bool = True,
    ):
        text_config = model.config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(
                f"the static cache supports full-attention layers only; {type(model).__name__} has "
                f"{sorted(set(layer_types))}; use HFCausalLM (cache='dynamic')"
            )
        self.num_layers = len(layer_types)
        if not compile_widths or min(compile_widths) < 1:
            raise ValueError(f"compile_widths must list widths >= 1; got {list(compile_widths)}")
        self.default_capacity = _aligned(max_length or DEFAULT_CAPACITY)
        self.cache: SlotCache | None = None
        self.capacity = 0
        self._used = 0  # the write pointer (host int: shapes and slices never wait on the device)
        self.compile_widths = sorted(compile_widths)
        self.compile_windows = compile_windows
        self.captures: Captures | None = None  # the captured forwards (compile=), made below
        super().__init__(model, name)  # calls reset(1)
        self.lean = None  # its own forward (slots, captured graphs) never runs the lean loop
        self.compile_mode = compile_mode(compile, self.device)
        if self.compile_mode is not None:
            check_capturable(self.compile_mode, self.model, getattr(text_config, "_attn_implementation", None))
            self.captures = Captures(
                self.compile_mode,
                self.model,
                self.device,
                max(self.compile_widths),
                self._call,
                self._mask_dtype,
                self._say,
            )

    # ------------------------------------------------------------ state

    @torch.inference_mode()  # the cache and slot table are updated in place: always as inference tensors
    def reset(self, batch: int, capacity: int | None = None) -> None:
        """Empty every row. The cache is reused (same tensors, so captured graphs stay valid) when it
        has this batch size and at least `capacity` slots; otherwise it is allocated afresh."""
        capacity = _aligned(capacity or self.default_capacity)
        reuse = self.cache is not None and self.slot_pos.shape[0] == batch and self.capacity >= capacity
        if reuse:
            self._move_pointer(0)
        else:
            self.capacity = capacity
            self.cache = SlotCache(self.num_layers, capacity)
            self._used = 0
            self._drop_graphs()
        self.slot_pos = torch.full((batch, self.capacity), -1, dtype=torch.long)  # on the CPU, -1: hole
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [batch] on the CPU

    @property
    def num_slots(self) -> int:
        return self._used

    @property
    def compile_seconds(self) -> float:
        """Warm-up: wall time of the first call of each captured shape."""
        return 0.0 if self.captures is None else self.captures.seconds

    def _drop_graphs(self) -> None:
        """Forget what was captured over the old cache's tensors (see Captures.drop)."""
        if self.captures is not None:
            self.captures.drop()

    def _move_pointer(self, slots: int) -> None:
        if slots != self._used:
            self.cache.crop(slots - self._used)  # StaticLayer: an in-place shift of the write offset, no copy
            self._used = slots

    def _grow(self, needed: int) -> None:
        """Reallocate to hold `needed` slots (doubling), copying the used slots once."""
        capacity = _aligned(max(needed, 2 * self.capacity))
        old, self.cache = self.cache, SlotCache(self.num_layers, capacity)
        for new, layer in zip(self.cache.layers, old.layers):
            if layer.is_initialized:  # each layer on its own device (device_map) with its own shapes
                new.lazy_initialization(layer.keys[:, :, :0], layer.values[:, :, :0])
                new.keys[:, :, : self._used] = layer.keys[:, :, : self._used]
                new.values[:, :, : self._used] = layer.values[:, :, : self._used]
                new.cumulative_length.fill_(self._used)
        self._drop_graphs()
        pad = torch.full((self.slot_pos.shape[0], capacity - self.capacity), -1, dtype=torch.long)
        self.slot_pos = torch.cat([self.slot_pos, pad], 1)
        self.capacity = capacity

    # ------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, valid: torch.Tensor, keep_logits: int = 1) -> torch.Tensor:
        """Write ids [batch, n] into slots [num_slots, num_slots + n); `valid` [batch, n] marks real tokens
        (read on the host: pass it from the CPU)."""
        width, valid = ids.shape[1], valid.cpu()
        positions = (self.lengths[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)  # [batch, n], on the host
        check_context(self, positions)
        captured = self._captured_width(width)
        run_width = captured or width
        if self._used + run_width > self.capacity:
            self._grow(self._used + run_width)
        start = self._used
        self.slot_pos[:, start : start + width] = torch.where(valid, positions, -1)
        ids = to_device(ids, self.device)
        logits = None
        if captured is not None:
            try:
                logits = self._forward_captured(ids, positions, start, width, captured, keep_logits)
            except Exception as error:
                if not self.eager_on_failure:
                    raise
                self._stop_capturing(error)
        if logits is None:
            logits = self._forward_eager(ids, positions, start, width, keep_logits)
        self._used += width
        self.lengths = self.lengths + valid.sum(1)
        return logits[:, -keep_logits:].to(self.device)

    def _forward_eager(self, ids, positions, start: int, width: int, keep_logits: int) -> torch.Tensor:
        self.cache.set_window(start, start + width)
        try:
            real = self.slot_pos[:, : start + width] >= 0
            mask = None if bool(real.all()) else to_device(real, self.device)  # None: no holes (as HFCausalLM)
            return self._eager(ids, mask, to_device(positions, self.device), keep_logits)
        finally:
            self.cache.set_window(None, None)

    def _forward_captured(self, ids, positions, start: int, width: int, run_width: int, keep_logits: int):
        if run_width > width:  # padding columns (their slots stay free); a pad of nothing would still copy
            pad = (0, run_width - width)
            ids, positions = torch.nn.functional.pad(ids, pad, value=PAD_ID), torch.nn.functional.pad(positions, pad)
        positions = to_device(positions, self.device)
        window = self._captured_window(start + run_width)
        self.cache.set_window(None, window)  # offset None: the write offset stays a device tensor
        try:
            real = to_device(self.slot_pos[:, :window] >= 0, self.device)  # [batch, window]
            logits = self.captures.run(self.cache, ids, real, positions, start)[:, width - keep_logits : width]
        finally:
            self.cache.set_window(None, None)
        if run_width > width:
            self.cache.crop(width - run_width)  # the padding columns' slots stay free
        return logits

    def _stop_capturing(self, error: Exception) -> None:
        """compile="auto" (eager_on_failure): a model whose forward cannot be captured runs uncompiled from
        here on, said once through `progress`; every layer's write offset goes back to ours."""
        reset_write_offsets(self.cache, self._used)
        self.compile_mode, self.captures.compiled = None, None
        self._drop_graphs()
        self._say(f"capture failed ({type(error).__name__}: {error}); running uncompiled")

    def _say(self, line: str) -> None:
        """One line to `progress`, naming this model."""
        if self.progress is not None:
            self.progress(f"{self.name}: {line}")

    def _captured_width(self, width: int) -> int | None:
        """The compiled width this forward runs as, or None to run it eagerly."""
        if self.compile_mode is None or self._used == 0 or not self.cache.layers[0].is_initialized:
            return None  # prefills (and the first write, which allocates the cache) stay eager
        return next((w for w in self.compile_widths if w >= width), None)

    def _captured_window(self, slots: int) -> int:
        """The fixed window that holds `slots` slots: a power of two, or the capacity."""
        if not self.compile_windows:
            return self.capacity
        return min(self.capacity, max(MIN_WINDOW, 1 << (slots - 1).bit_length()))

    def _kwargs(self, ids, mask, positions, keep_logits: int) -> dict:
        return dict(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep_logits,
            **{self._cache_kw: self.cache},
        )

    def _call(self, model, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        """One forward of `model` (this adapter's, or its compiled form) over this cache."""
        return model(**self._kwargs(ids, mask, positions, keep_logits)).logits

    def _eager(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        return self._call(self.model, ids, mask, positions, keep_logits)

    # ------------------------------------------------------------ rollback

    @torch.inference_mode()
    def rollback(self, keep_len: torch.Tensor) -> None:
        """Keep the first keep_len[b] real tokens of each row (absolute lengths): their slots stay,
        the others become holes, and the write pointer moves back past the last slot still used."""
        keep_len = keep_len.cpu()
        assert bool((keep_len <= self.lengths).all()), "rollback cannot grow the cache"
        self.slot_pos.masked_fill_(self.slot_pos >= keep_len[:, None], -1)
        self.lengths = keep_len.clone()
        used = (self.slot_pos[:, : self._used] >= 0).any(0).nonzero()  # [slots in use, 1], on the host
        self._move_pointer(int(used.max()) + 1 if used.numel() else 0)
