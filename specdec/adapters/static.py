"""A Hugging Face causal LM over a preallocated (static) KV cache, with free rollback.

Words (as in specdec.adapters, plus):
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

compile= captures the narrow forwards (draft steps, verify) with fixed shapes,
one per (batch, width, window); prefills run eagerly:
- "graphs" (True on CUDA): each shape's eager forward is captured once as a
  torch.cuda.CUDAGraph over static input buffers (ids, positions, and an
  additive attention mask built outside the graph), with the weights and the
  KV cache read in place. A replay is three buffer copies and one launch.
  On a device without CUDA graphs the same buffers and mask run eagerly (the
  tests' path to this code on CPU).
- "inductor" (True on CPU): torch.compile(fullgraph=True, dynamic=False).
- "inductor-graphs": as "graphs", but the captured forward is torch.compile's
  (inductor's fused kernels, fewer and larger than the eager model's) rather
  than the eager model's. Compiling takes tens of seconds per new shape
  (dynamic shapes after the first recompile, so widths share one kernel set).
Nothing inside a captured call reads a device value on the host.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel, StaticLayer
from transformers.cache_utils import get_layer_types_and_kwargs

from specdec.adapters import PAD_ID, HFCausalLM, check_context, to_device
from specdec.resolution import cache_dir

DEFAULT_CAPACITY = 1024  # slots preallocated when neither max_length nor reset(capacity=) says more
CAPACITY_ALIGN = 16  # capacities are rounded up to this
MIN_WINDOW = 256  # the smallest window of a captured forward (compile_windows=True)
COMPILE_MODES = ("graphs", "inductor", "inductor-graphs")
GRAPH_MODES = ("graphs", "inductor-graphs")  # the modes that capture our own CUDA graphs over static buffers


def compile_mode(compile: bool | str, device: torch.device) -> str | None:
    """compile= -> None (eager) or one of COMPILE_MODES; True picks CUDA graphs on CUDA, inductor elsewhere."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "graphs" if device.type == "cuda" else "inductor"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be a bool or one of {', '.join(COMPILE_MODES)}; got {compile!r}")
    return compile


def keep_compile_cache() -> None:
    """Inductor's on-disk caches (compiled graphs and kernels) beside specdec's own (~/.cache/specdec/inductor
    or $SPECDEC_CACHE_DIR/inductor) rather than under /tmp, so later processes and reboots compile from them.
    A TORCHINDUCTOR_CACHE_DIR the user chose is left as it is. (Importing torch._dynamo already sets the
    variable to torch's default under /tmp; that value counts as unset.)"""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: only fill in an unset variable
        default_cache_dir = None
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or (default_cache_dir is not None and os.path.abspath(current) == default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


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
    select_rows = None  # finished rows stay in a static cache's forwards (its shapes are fixed)
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
        self.compile_seconds = 0.0  # warm-up: wall time of the first call of each compiled shape
        self._compiled = None  # inductor, inductor-graphs: the compiled model
        self._compiled_shapes: set[tuple[int, ...]] = set()
        self._graphs: dict[tuple[int, ...], CapturedForward] = {}  # graphs: one per shape
        self._pool = None  # graphs: one CUDA memory pool shared by every captured shape
        self._mask_cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # graphs: see _mask_parts
        self._logits_buffer: torch.Tensor | None = None  # graphs: see _outputs
        super().__init__(model, name)  # calls reset(1)
        self.compile_mode = compile_mode(compile, self.device)
        if self.compile_mode in GRAPH_MODES:
            attention = getattr(text_config, "_attn_implementation", None) or "eager"
            if attention not in ("sdpa", "eager"):
                raise ValueError(
                    f"compile={self.compile_mode!r} builds an additive attention mask for sdpa or eager attention; "
                    f"this model uses {attention!r}: load it with attn_implementation='sdpa', or use compile='inductor'"
                )
            if len({p.device for p in self.model.parameters()}) > 1:
                raise ValueError(
                    f"compile={self.compile_mode!r} captures one device's kernels; this model is split over several"
                )
        if self.compile_mode in ("inductor", "inductor-graphs"):
            keep_compile_cache()
        if self.compile_mode == "inductor-graphs":  # compiled on first use, inside the first capture's warm-up
            self._compiled = torch.compile(self.model, fullgraph=True, dynamic=None)
        if self.compile_mode == "inductor":
            cuda = self.device.type == "cuda"
            self._compiled = torch.compile(
                self.model, dynamic=False, fullgraph=True, mode="reduce-overhead" if cuda else None
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

    def _drop_graphs(self) -> None:
        """Forget the graphs captured over the old cache's tensors, their memory pool (a pool whose
        graphs are all freed cannot take new captures) and their logits buffer."""
        self._graphs.clear()
        self._pool = None
        self._logits_buffer = None

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
            if self.compile_mode in GRAPH_MODES:
                logits = self._replay(ids, self._graph_mask(start, run_width, window), positions)
            else:
                logits = self._captured(ids, to_device(self.slot_pos[:, :window] >= 0, self.device), positions)
            logits = logits[:, width - keep_logits : width]
        finally:
            self.cache.set_window(None, None)
        if run_width > width:
            self.cache.crop(width - run_width)  # the padding columns' slots stay free
        return logits

    def _stop_capturing(self, error: Exception) -> None:
        """compile="auto" (eager_on_failure): a model whose forward cannot be captured runs uncompiled from
        here on, said once through `progress`; every layer's write offset goes back to ours."""
        self._reset_write_offsets()
        self.compile_mode, self._compiled = None, None
        self._drop_graphs()
        if self.progress is not None:
            self.progress(f"{self.name}: capture failed ({type(error).__name__}: {error}); running uncompiled")

    def _reset_write_offsets(self) -> None:
        """Every layer's device-side write offset back to the host's pointer (after a failed capture)."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(self._used)

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

    def _eager(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        return self.model(**self._kwargs(ids, mask, positions, keep_logits)).logits

    def _fused(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        """The compiled model's forward ("inductor-graphs"), captured in place of `_eager`."""
        with torch._dynamo.config.patch(recompile_limit=64):
            return self._compiled(**self._kwargs(ids, mask, positions, keep_logits)).logits

    def _captured(self, ids, mask, positions) -> torch.Tensor:
        """One compiled forward; all columns' logits are kept, so each (width, window) is one graph."""
        shape = (*ids.shape, mask.shape[1])
        first = shape not in self._compiled_shapes
        if first:
            self._announce(shape)
        start = time.perf_counter()
        if self.device.type == "cuda":
            if first:  # weights and cache stay where they are: a CUDA graph must not copy them in per call
                self._mark_static()
            torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(recompile_limit=64):
            logits = self._compiled(**self._kwargs(ids, mask, positions, ids.shape[1])).logits
        if self.device.type == "cuda":
            logits = logits.clone()  # a CUDA graph's output buffer is overwritten by its next replay
        if first:
            self._compiled_shapes.add(shape)
            self.compile_seconds += time.perf_counter() - start
        return logits

    def _announce(self, shape: tuple[int, ...]) -> None:
        """Tell `progress` that a forward shape (batch, width, window) is about to be captured."""
        if self.progress is not None:
            batch, width, window = shape
            how = {"graphs": "capturing a CUDA graph", "inductor": "compiling"}.get(
                self.compile_mode, "compiling and capturing"
            )
            self.progress(f"{self.name}: {how} for {batch} x {width} tokens over {window} cache slots (once per shape)")

    def _graph_mask(self, start: int, width: int, window: int) -> torch.Tensor:
        """The additive mask [batch, 1, width, window] of a captured forward whose columns sit in slots
        [start, start + width): a column attends to the real tokens in slots up to its own, and to its
        own slot (so padding columns stay finite; a real column's own slot is real anyway)."""
        offset, attend, block = self._mask_parts(width, window)
        own = offset == start  # [width, window]: column i's own slot, start + i
        real = to_device(self.slot_pos[:, :window] >= 0, self.device)  # [batch, window]
        allowed = (real[:, None, :] & (offset <= start)) | own
        return torch.where(allowed, attend, block)[:, None]

    def _mask_parts(self, width: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per (width, window), made once: slot - column [width, window] (slot j is at or before column
        i's own slot start + i iff j - i <= start), and the additive mask's two values in the model's dtype."""
        key = (width, window)
        if key not in self._mask_cache:
            dtype = self._mask_dtype()
            offset = torch.arange(window, device=self.device) - torch.arange(width, device=self.device)[:, None]
            attend = torch.zeros((), dtype=dtype, device=self.device)
            self._mask_cache[key] = (
                offset,
                attend,
                torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device),
            )
        return self._mask_cache[key]

    def _replay(self, ids, mask, positions) -> torch.Tensor:
        """One captured forward (GRAPH_MODES): captured on first use of its shape, then replayed."""
        shape = (*ids.shape, mask.shape[-1])
        graph = self._graphs.get(shape)
        if graph is None:
            self._announce(shape)
            graph = self._capture_shape(
                shape,
                lambda forward: CapturedForward(forward, self.cache, ids, mask, positions, self._pool, self._outputs),
            )
        return graph(ids, mask, positions)

    def _capture_shape(self, shape: tuple[int, ...], build):
        """Capture a new shape: `build(forward)` makes its CapturedForward over the eager or compiled forward
        and this cache's pool; it is kept, and its time counted as warm-up."""
        start = time.perf_counter()
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        try:
            captured = build(self._fused if self.compile_mode == "inductor-graphs" else self._eager)
        except BaseException:  # a warm-up that failed part-way: every layer's write offset back to ours
            self._reset_write_offsets()
            raise
        self._graphs[shape] = captured
        self._compiled_shapes.add(shape)
        self.compile_seconds += time.perf_counter() - start
        return captured

    def _outputs(self, batch: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """The logits buffer [batch, widest compiled width, vocab] every graph of this cache writes."""
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] != batch or buffer.shape[2] != vocab or buffer.dtype != dtype:
            buffer = torch.empty(batch, max(self.compile_widths), vocab, dtype=dtype, device=self.device)
            self._logits_buffer = buffer
        return buffer

    def _mark_static(self) -> None:
        """Tell the compiler the weights and the KV cache keep their addresses, so captured graphs read
        them in place (unmarked, every replay copied them into the graph's own input buffers)."""
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            torch._dynamo.mark_static_address(tensor)
        for layer in self.cache.layers:
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)

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


def warm_up(run, cache: SlotCache, slots: int, device: torch.device):
    """Run `run` twice on a side stream (lazy kernel and workspace set-up must happen outside a capture);
    each run writes `slots` slots, which the first replay overwrites, and the crop takes the write offset
    back. Returns the last run's output."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            out = run()
            cache.crop(-slots)
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def capture(graph: torch.cuda.CUDAGraph, run, pool, device: torch.device):
    """Capture `run` into `graph` (nothing runs) and return its output. No garbage collection inside the
    capture: a dead cycle freed there (say, a pinned host buffer of an earlier read) makes CUDA calls
    that invalidate it, and torch no longer collects first."""
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            return run()
    finally:
        if collecting:  # as the application had it
            gc.enable()


class CapturedForward:
    """One fixed-shape forward over static input buffers. On CUDA it is captured once as a CUDA
    graph: the model's kernels read the weights and the KV cache in place and write the cache at its
    device-side write offset, so a replay is three buffer copies and one graph launch, with no host
    sync. Elsewhere (no CUDA graphs) the same buffers run eagerly, so tests on CPU cover this path.
    The graph copies its logits into `outputs(batch, vocab, dtype)`, a buffer the adapter shares by
    all its graphs (the graphs' own outputs stay in the pool, free for the next capture); a replay's
    logits are cloned from it, since the next replay overwrites it."""

    def __init__(self, forward, cache: SlotCache, ids, mask, positions, pool=None, outputs=None):
        self.forward = forward
        self.ids, self.mask, self.positions = ids.clone(), mask.clone(), positions.clone()
        self.width = ids.shape[1]
        self.graph = self.output = None
        if ids.device.type != "cuda":
            return
        device = ids.device
        with torch.cuda.device(device):  # the capture stream and the kernels on the adapter's GPU
            logits = warm_up(self._run, cache, self.width, device)
            shared = outputs(logits.shape[0], logits.shape[-1], logits.dtype)
            self.output = shared[:, : self.width]
            del logits
            self.graph = torch.cuda.CUDAGraph()
            capture(self.graph, lambda: self.output.copy_(self._run()), pool, device)

    def _run(self) -> torch.Tensor:
        return self.forward(self.ids, self.mask, self.positions, self.width)

    def __call__(self, ids, mask, positions) -> torch.Tensor:
        self.ids.copy_(ids)
        self.mask.copy_(mask)
        self.positions.copy_(positions)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.output.clone()
