"""The static cache's captured forwards: one fixed-shape forward per (batch, width, window), replayed.

Words (as in specdec.models.adapters.static, plus):
- shape: (batch, width, window) of a narrow forward (draft steps, verify); each is captured once.
- capture: recording a shape's forward so a later call replays it without the host building it again.

compile= modes (StaticHFCausalLM captures the narrow forwards; prefills run eagerly):
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
from collections.abc import Callable

import torch

from specdec.models.resolution import cache_dir

COMPILE_MODES = ("graphs", "inductor", "inductor-graphs")
GRAPH_MODES = ("graphs", "inductor-graphs")  # the modes that capture our own CUDA graphs over static buffers

# (model, ids, mask, positions, keep_logits) -> logits: one forward of `model` over the adapter's cache
Call = Callable[..., torch.Tensor]


def compile_mode(compile: bool | str, device: torch.device) -> str | None:
    """compile= -> None (eager) or one of COMPILE_MODES; True picks CUDA graphs on CUDA, inductor elsewhere."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "graphs" if device.type == "cuda" else "inductor"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be a bool or one of {', '.join(COMPILE_MODES)}; got {compile!r}")
    return compile


def check_capturable(mode: str, model, attention: str | None) -> None:
    """GRAPH_MODES build an additive mask (sdpa or eager attention) and capture one device's kernels."""
    if mode not in GRAPH_MODES:
        return
    if (attention or "eager") not in ("sdpa", "eager"):
        raise ValueError(
            f"compile={mode!r} builds an additive attention mask for sdpa or eager attention; "
            f"this model uses {attention!r}: load it with attn_implementation='sdpa', or use compile='inductor'"
        )
    if len({p.device for p in model.parameters()}) > 1:
        raise ValueError(f"compile={mode!r} captures one device's kernels; this model is split over several")


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


def reset_write_offsets(cache, slots: int) -> None:
    """Every layer's device-side write offset back to the host's pointer (after a failed capture)."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.fill_(slots)


class Captures:
    """One static-cache adapter's captured forwards, made on each shape's first use (its time counted
    as warm-up, `seconds`): a CapturedForward per shape (GRAPH_MODES), or inductor's compiled call."""

    def __init__(self, mode: str, model, device: torch.device, max_width: int, call: Call, mask_dtype, say):
        self.mode, self.model, self.device, self.max_width = mode, model, device, max_width
        self.call = call
        self.mask_dtype = mask_dtype  # () -> the additive mask's dtype
        self.say = say  # one line before each new shape is captured
        self.seconds = 0.0
        self.shapes: set[tuple[int, ...]] = set()
        self.graphs: dict[tuple[int, ...], CapturedForward] = {}  # GRAPH_MODES: one per shape
        self.pool = None  # GRAPH_MODES: one CUDA memory pool shared by every captured shape
        self.masks: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # see _mask_parts
        self.logits: torch.Tensor | None = None  # see _outputs
        self.compiled = None  # inductor, inductor-graphs: the compiled model
        if mode in ("inductor", "inductor-graphs"):
            keep_compile_cache()
        if mode == "inductor-graphs":  # compiled on first use, inside the first capture's warm-up
            self.compiled = torch.compile(model, fullgraph=True, dynamic=None)
        if mode == "inductor":
            cuda = device.type == "cuda"
            self.compiled = torch.compile(
                model, dynamic=False, fullgraph=True, mode="reduce-overhead" if cuda else None
            )

    def drop(self) -> None:
        """Forget the graphs captured over an old cache's tensors, their memory pool (a pool whose graphs
        are all freed cannot take new captures) and their logits buffer."""
        self.graphs.clear()
        self.pool = None
        self.logits = None

    def run(self, cache, ids, real, positions, start: int) -> torch.Tensor:
        """One captured forward of ids, positions [batch, width] (on the device) writing slots [start,
        start + width) of a cache whose window [0, window) has real slots `real` [batch, window] (device
        bool) -> the logits of every column [batch, width, vocab]."""
        if self.mode in GRAPH_MODES:
            return self._replay(cache, ids, self._graph_mask(real, start, ids.shape[1]), positions, start)
        return self._compiled_call(cache, ids, real, positions)

    def _eager(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        return self.call(self.model, ids, mask, positions, keep_logits)

    def _fused(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        """The compiled model's forward ("inductor-graphs"), captured in place of `_eager`."""
        with torch._dynamo.config.patch(recompile_limit=64):
            return self.call(self.compiled, ids, mask, positions, keep_logits)

    def _compiled_call(self, cache, ids, mask, positions) -> torch.Tensor:
        """One compiled forward; all columns' logits are kept, so each (width, window) is one graph."""
        shape = (*ids.shape, mask.shape[1])
        first = shape not in self.shapes
        if first:
            self._announce(shape)
        start = time.perf_counter()
        if self.device.type == "cuda":
            if first:  # weights and cache stay where they are: a CUDA graph must not copy them in per call
                self._mark_static(cache)
            torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(recompile_limit=64):
            logits = self.call(self.compiled, ids, mask, positions, ids.shape[1])
        if self.device.type == "cuda":
            logits = logits.clone()  # a CUDA graph's output buffer is overwritten by its next replay
        if first:
            self.shapes.add(shape)
            self.seconds += time.perf_counter() - start
        return logits

    def _announce(self, shape: tuple[int, ...]) -> None:
        """Say that a forward shape (batch, width, window) is about to be captured."""
        batch, width, window = shape
        how = {"graphs": "capturing a CUDA graph", "inductor": "compiling"}.get(self.mode, "compiling and capturing")
        self.say(f"{how} for {batch} x {width} tokens over {window} cache slots (once per shape)")

    def _graph_mask(self, real: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """The additive mask [batch, 1, width, window] of a captured forward whose columns sit in slots
        [start, start + width): a column attends to the real tokens in slots up to its own, and to its
        own slot (so padding columns stay finite; a real column's own slot is real anyway)."""
        offset, attend, block = self._mask_parts(width, real.shape[1])
        own = offset == start  # [width, window]: column i's own slot, start + i
        allowed = (real[:, None, :] & (offset <= start)) | own
        return torch.where(allowed, attend, block)[:, None]

    def _mask_parts(self, width: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per (width, window), made once: slot - column [width, window] (slot j is at or before column
        i's own slot start + i iff j - i <= start), and the additive mask's two values in the model's dtype."""
        key = (width, window)
        if key not in self.masks:
            dtype = self.mask_dtype()
            offset = torch.arange(window, device=self.device) - torch.arange(width, device=self.device)[:, None]
            attend = torch.zeros((), dtype=dtype, device=self.device)
            self.masks[key] = (offset, attend, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device))
        return self.masks[key]

    def _replay(self, cache, ids, mask, positions, start: int) -> torch.Tensor:
        """One captured forward (GRAPH_MODES): captured on first use of its shape, then replayed."""
        shape = (*ids.shape, mask.shape[-1])
        graph = self.graphs.get(shape)
        if graph is None:
            self._announce(shape)
            graph = self._capture_shape(
                shape,
                cache,
                start,
                lambda forward: CapturedForward(forward, cache, ids, mask, positions, self.pool, self._outputs),
            )
        return graph(ids, mask, positions)

    def _capture_shape(self, shape: tuple[int, ...], cache, slots: int, build):
        """Capture a new shape: `build(forward)` makes its CapturedForward over the eager or compiled forward
        and this adapter's pool; it is kept, and its time counted as warm-up."""
        start = time.perf_counter()
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        try:
            captured = build(self._fused if self.mode == "inductor-graphs" else self._eager)
        except BaseException:  # a warm-up that failed part-way: every layer's write offset back to ours
            reset_write_offsets(cache, slots)
            raise
        self.graphs[shape] = captured
        self.shapes.add(shape)
        self.seconds += time.perf_counter() - start
        return captured

    def _outputs(self, batch: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """The logits buffer [batch, widest compiled width, vocab] every graph of this adapter writes."""
        buffer = self.logits
        if buffer is None or buffer.shape[0] != batch or buffer.shape[2] != vocab or buffer.dtype != dtype:
            buffer = torch.empty(batch, self.max_width, vocab, dtype=dtype, device=self.device)
            self.logits = buffer
        return buffer

    def _mark_static(self, cache) -> None:
        """Tell the compiler the weights and the KV cache keep their addresses, so captured graphs read
        them in place (unmarked, every replay copied them into the graph's own input buffers)."""
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            torch._dynamo.mark_static_address(tensor)
        for layer in cache.layers:
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)


def warm_up(run, cache, slots: int, device: torch.device):
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

    def __init__(self, forward, cache, ids, mask, positions, pool=None, outputs=None):
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
