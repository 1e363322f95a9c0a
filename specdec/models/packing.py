"""Float Linear weights packed once for oneDNN (CPU).

`F.linear` on CPU hands a plain [out, in] weight to the BLAS at every call, which
re-blocks it for a matrix of more than one row: on a 2-core host a Qwen2.5-1.5B
MLP projection over 3-9 tokens took 2-3x its one-token time, and the verify
forward grew with its width for that alone. oneDNN's linear on a weight reordered
once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the packing
torch.compile's CPU freezing does) skips that work: the 1.5B target's forward ran
1.8-1.9x faster for one token and 1.3-3x for 2-11 tokens, float32 on AVX2 and
bfloat16 on AVX-512 (deleted scripts/linear_packing.py: docs/notes/deleted-scripts.md and the notebook).

The packed model computes the same function up to float rounding (bfloat16 outputs
were equal bit for bit in the measurements; float32 differs in the last bits, as
any other GEMM path would). It is the model specdec loads, so target-alone runs,
verification and transformers' `generate` on it all use it.

Only models loaded by name are packed (specdec.models.resolution.load_model): a model the
user passes is left as it is. A weight shared with another module (a head tied to the embeddings) is
packed as a copy, the embedding keeping the plain one: the copy costs the head's size again (113 MB for
SmolLM2-135M in float32) and ran its float32 forward at 0.64-0.84x the time for 1-11 tokens (2026-11-28,
docs/BENCHMARKS.md "The forward per width"), where the plain head's F.linear re-blocked it every call.

The projections that read one input (q/k/v, gate/up), all packed, are packed as one weight, their rows
concatenated (PackedInputs; each output row is still its own weight row's dot product with the input), one
oneDNN call where there were three or two: the 1.5B's forward in bf16 ran 0.86-0.96x the time at 1-8 rows,
its target alone 1.05-1.15x the tokens per second, the same tokens (Intel AMX, 2026-12-02), and 0.97x at one
row, 1.0x at 4-8 in float32 on simulated AVX2. The int8 groups of specdec.models.quantize are the same idea.

Which form each Linear shape runs in is measured on the host, not read from its CPU flags: the same kernel
won on one host class and lost on another (issue 49: packing paid 1.8x for the 1.5B's MLP on an AMD EPYC and
cost 1.4x on an Intel Xeon with AMX). `measured_forms` times each form of `FORMS` on the model's own weights of
that shape at TIMED_WIDTHS, once per (shape, dtype, host), and keeps the table on disk beside the
calibration (`kernel_table`); `pack_linears` then runs each shape in the form fastest at the rows the
model's forwards run (one for a target alone or a draft's steps, 1-8 for a verifying target), where it beats
packed by more than MARGIN. A shape whose weights fit in a cache (less than MEASURED_BYTES in all) is not
timed, since its timing says nothing of its cost in a forward: it is packed (DEFAULT).

Whether a packed input of one to three rows is padded to MIN_ROWS is measured for the whole model
(`pad_inputs`): its one-token forward, padded and not, interleaved, kept in the same table. Timed shape by
shape, padding sat inside a noisy host's spread (AMD EPYC, 2026-12-02: the down-projection's one-row ratio
read 0.84, 1.00 and 1.06 in three timings) while the whole forward showed it, 0.90x the time.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models.ready import reorder, write_kept

_LINEAR = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)  # None: a build without it
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's bfloat16 linear on AVX-512 (no AMX) streams its weights slower for one or two rows than for
# three to six: 25-28 GB/s against 36-41 GB/s for the 1.5B's MLP and head shapes (2026-11-28, AMD EPYC,
# docs/BENCHMARKS.md "The forward per width"), and rows 2-4 give the same values row by row. So one form
# pads an input of fewer rows with zero rows to MIN_ROWS (there: 0.92x the unpadded forward at one token,
# 0.82x at two); whether it does is measured on the whole forward (pad_inputs).
MIN_ROWS = 4
TIMED_WIDTHS = (1, 2, 4, 8)  # the rows a form is timed at: the target alone, and verifies of k = 1 to 7
MEASURED_BYTES = 64 << 20  # a shape with less weight in all stays in a cache: not timed, packed (DEFAULT)
SAMPLE_BYTES = 256 << 20  # the weights of one shape timed per pass (cycled: no call finds its weight in cache)
# Another form than DEFAULT is taken only where it is this much faster: forms within a few percent of each other
# swap places between timings (1.5B, bf16, Intel AMX, 2026-12-02: plain down-projections, 4% faster at 2-8 rows
# but 30% slower at one, were chosen by a sum over widths and cost the target alone 11%; notes of that day).
MARGIN = 0.05


@dataclass(frozen=True)
class LinearForm:
    """How a float Linear runs: its plain weight through its own forward (F.linear), or packed once for oneDNN."""

    packed: bool

    @property
    def name(self) -> str:
        return "packed" if self.packed else "plain"


FORMS = (LinearForm(packed=False), LinearForm(packed=True))
DEFAULT = FORMS[1]


class PackedLinear(torch.nn.Module):
    """A Linear whose weight is held in oneDNN's blocked layout (the bias stays a plain tensor)."""

    def __init__(self, weight, bias: torch.nn.Parameter | None, min_rows: int = 1, packs=None, name: str = ""):
        """weight: [out, in], as torch.nn.Linear holds it, or a function that makes it (with its shape and dtype).
        packs: where the packed weight is kept under `name` (models.ready.KeptPacks); this module then holds the
        bytes it reads (kept)."""
        super().__init__()
        make = weight if callable(weight) else lambda: weight
        if packs is None:
            packed, self.kept = reorder(make()), None
        else:
            packed, self.kept = packs.pack(name, tuple(weight.shape), weight.dtype, make)
        self.out_features, self.in_features = packed.shape
        self.min_rows = min_rows
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias

    @classmethod
    def of(cls, module: torch.nn.Module, min_rows: int = 1, packs=None, name: str = "") -> PackedLinear:
        """From a torch.nn.Linear, or transformers' Conv1D (GPT-2: its weight is [in, out])."""
        return cls(_weight(module), module.bias, min_rows, packs, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= self.min_rows:
            return _LINEAR(x, self.packed, self.bias, "none", [], "")
        flat = x.reshape(rows, self.in_features)
        padded = torch.cat([flat, flat.new_zeros(self.min_rows - rows, self.in_features)])
        return _LINEAR(padded, self.packed, self.bias, "none", [], "")[:rows].reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read one input


class SharedInputs:
    """Several Linears that read the same input, run as one matmul (`matmul`, of the subclass): the first part
    asked for an input computes every part's output; the others are then served from it (each part once)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self._input, self._outputs, self._pending = None, None, set()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output(self, x: torch.Tensor, part: int) -> torch.Tensor:
        if x is not self._input or part not in self._pending:
            self._outputs = self.matmul(x).split(self.sizes, -1)
            self._input, self._pending = x, set(range(len(self.sizes)))
        self._pending.discard(part)
        out = self._outputs[part]
        if not self._pending:  # every part served: hold no activations between forwards
            self._input = self._outputs = None
        return out


class SharedInputPart(torch.nn.Module):
    """One Linear of a SharedInputs group, in the place of the Linear it replaces."""

    def __init__(self, group: SharedInputs, part: int, in_features: int):
        super().__init__()
        self.group, self.part = group, part
        self.in_features, self.out_features = in_features, group.sizes[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.part)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.part}"


class PackedInputs(SharedInputs):
    """Float Linears that read the same input (q/k/v, gate/up), packed as one weight: their rows concatenated
    (each output row is a dot product of the input with its own weight row, as in the separate Linears)."""

    def __init__(self, linears: list[torch.nn.Module], packs=None, name: str = ""):
        weights = [_weight(linear) for linear in linears]
        super().__init__([w.shape[0] for w in weights])
        bias = None
        if any(linear.bias is not None for linear in linears):
            parts = [m.bias if m.bias is not None else w.new_zeros(w.shape[0]) for m, w in zip(linears, weights)]
            bias = torch.cat([b.detach() for b in parts])
        self.linear = PackedLinear(_Joined(weights), bias, packs=packs, name=name)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _Joined:
    """The weights' rows joined (`_joined`), made only when called: a kept packed form needs no join."""

    def __init__(self, weights: list[torch.Tensor]):
        self.weights = weights
        self.shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
        self.dtype = weights[0].dtype

    def __call__(self) -> torch.Tensor:
        return _joined(self.weights)


def _joined(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights' rows as one tensor, for the time of their packing: a view where they lie end to end in
    memory (gate and up of a kept safetensors file, which orders tensors by name, each its own storage over
    the mapped file: no copy of 1.5 GB at load for the 1.5B, 0.45 s), else a copy."""
    first = weights[0].detach()
    ptr, adjacent = first.data_ptr(), True
    for w in weights:
        same = w.dtype == first.dtype and w.shape[1:] == first.shape[1:] and w.is_contiguous()
        adjacent, ptr = adjacent and same and w.data_ptr() == ptr, ptr + w.nbytes
    if not adjacent:
        return torch.cat([w.detach() for w in weights])
    memory = (ctypes.c_byte * (ptr - first.data_ptr())).from_address(first.data_ptr())
    return torch.frombuffer(memory, dtype=first.dtype).view(-1, *first.shape[1:])


def pack_linears(
    model: torch.nn.Module, release=None, forms: dict[str, LinearForm] | None = None, fuse: bool = True, packs=None
) -> int:
    """Replace the model's float32 / bfloat16 CPU Linears (and GPT-2's Conv1Ds) by PackedLinears, in
    place; returns how many. `forms`: the form of each shape (`shape_key`; `measured_forms`), DEFAULT where
    none is given; a Linear whose form is plain stays as it is. fuse: siblings that read one input
    (SHARED_INPUTS), all packed, are packed as one weight (PackedInputs). `release`, where given, is called
    with each plain weight once it is packed. A dtype oneDNN cannot pack on this CPU (`packable`) stays
    plain. A weight another parameter shares (a tied head) is packed as a copy and stays where it is for
    the other (the module notes). `packs`: where the packed weights are kept (models.ready.KeptPacks), by
    their modules' names; `packs.keep()` is the caller's."""
    forms = forms or {}
    shared = _shared_data(model)
    packed = []

    def done(linear):
        packed.append(linear)
        if release is not None and linear.weight.data_ptr() not in shared:  # its memory may go (models.ready)
            release(linear.weight)

    for path, parent in list(model.named_modules()) if fuse else []:
        for names in SHARED_INPUTS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear and _is_float_cpu(m) for m in linears):
                continue
            group_forms = [forms.get(shape_key(m), DEFAULT) for m in linears]
            if not all(f.packed for f in group_forms) or len({(m.in_features, m.weight.dtype) for m in linears}) > 1:
                continue
            group = PackedInputs(linears, packs, f"{path}.{'+'.join(names)}")
            for part, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, SharedInputPart(group, part, linear.in_features))
                done(linear)
    paths = {id(module): path for path, module in model.named_modules()}
    for parent, name, linear in _float_linears(model):
        form = forms.get(shape_key(linear), DEFAULT)
        if form.packed:
            setattr(parent, name, PackedLinear.of(linear, packs=packs, name=paths[id(linear)]))
            done(linear)
    model.specdec_packed_linears = len(packed)  # for reports and the calibration's signature
    model.specdec_packed_rows = 1  # and these two, for the signature too (pad_inputs sets the rows)
    model.specdec_linear_forms = dict(sorted(forms.items()))
    return len(packed)


def plain_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of the Linears (and Conv1Ds) left plain, each streamed whole by every forward."""
    return list({id(m.weight): m.weight for m in model.modules() if type(m) in _linear_types()}.values())


def _float_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, name, module) of each Linear (or Conv1D) oneDNN can pack here: on CPU, a packable dtype."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in _linear_types() and _is_float_cpu(child)
    ]


def _is_float_cpu(module: torch.nn.Module) -> bool:
    return module.weight.device.type == "cpu" and packable(module.weight.dtype)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A Linear's weight as [out, in] (transformers' Conv1D holds it as [in, out])."""
    return module.weight if isinstance(module, torch.nn.Linear) else module.weight.t()


def shape_key(module: torch.nn.Module) -> str:
    """What a form is measured for: the weight's dtype and [out, in] shape, e.g. "bfloat16:8960x1536"."""
    weight = _weight(module)
    return f"{str(weight.dtype).removeprefix('torch.')}:{weight.shape[0]}x{weight.shape[1]}"


def measured_forms(
    model: torch.nn.Module, table: Path | None = None, progress=None, widths=TIMED_WIDTHS
) -> dict[str, LinearForm]:
    """The form (FORMS) of each timed Linear shape of the model on this host (`kernel_table`): the fastest
    summed over `widths` (the rows the model's forwards run at, of TIMED_WIDTHS), where it beats DEFAULT
    by more than MARGIN; DEFAULT otherwise, and for shapes not timed."""
    by_name = {form.name: form for form in FORMS}
    return {
        key: by_name[fastest(timings, widths, DEFAULT.name)]
        for key, timings in kernel_table(model, table, progress).items()
    }


def fastest(timings: dict[str, list[float]], widths, default: str) -> str:
    """The name in `timings` (seconds at each of TIMED_WIDTHS) least summed over `widths`, where it beats
    `default` by more than MARGIN; `default` otherwise."""
    picked = [TIMED_WIDTHS.index(width) for width in widths]
    return fastest_of({name: sum(seconds[i] for i in picked) for name, seconds in timings.items()}, default)


def fastest_of(seconds: dict[str, float], default: str) -> str:
    """The name of the least seconds, where they beat `default`'s by more than MARGIN; `default` otherwise: how
    every timed choice here (a Linear shape's form, padding, a draft's weight form) is made."""
    best = min(seconds, key=seconds.get)
    return best if seconds[best] < (1 - MARGIN) * seconds[default] else default


def kernel_table(model: torch.nn.Module, table: Path | None = None, progress=None) -> dict[str, dict[str, list]]:
    """Seconds per call of each form at each of TIMED_WIDTHS (`time_forms`), for each Linear shape of the
    model with MEASURED_BYTES of weights or more. Read from the JSON file `table` (keyed by shape and
    `host_id`), or timed once and added to it (None: timed, not kept); `progress` is told when a shape is timed."""
    groups: dict[str, list[torch.nn.Module]] = {}
    for _, _, linear in _float_linears(model):
        groups.setdefault(shape_key(linear), []).append(linear)
    kept, host = read_timings(table), host_id()
    timed, new = {}, {}  # every timed shape's timings; those timed now, for the table
    for key, linears in groups.items():
        if sum(_weight(m).nbytes for m in linears) < MEASURED_BYTES:
            continue
        timed[key] = _timings(kept.get(f"{key}|{host}"))
        if timed[key] is None:
            if progress is not None:
                progress(f"timing the Linear forms of {key} on this host, once (kept in {table})")
            timed[key] = new[f"{key}|{host}"] = time_forms(linears)
    keep_timings(table, new)
    return timed


def time_forms(linears: list[torch.nn.Module], widths=TIMED_WIDTHS, repeats: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each form (FORMS, by name) at each width: the least over `repeats` interleaved
    passes over up to SAMPLE_BYTES of these Linears (one shape), each called once per pass."""
    sample, total = [], 0
    for linear in linears:
        if sample and total >= SAMPLE_BYTES:
            break
        sample.append(linear)
        total += _weight(linear).nbytes
    packed = [PackedLinear.of(linear) for linear in sample]  # a copy: the model's weights are not touched
    modules = {form.name: sample if not form.packed else packed for form in FORMS}
    weight = _weight(sample[0])
    best = {form.name: [float("inf")] * len(widths) for form in FORMS}
    with torch.inference_mode():
        for i, width in enumerate(widths):
            x = torch.randn(width, weight.shape[1], generator=torch.Generator().manual_seed(width)).to(weight.dtype)
            for timed in [False] + [True] * repeats:  # the first pass builds each kernel (oneDNN's JIT)
                for form in FORMS:
                    begin = time.perf_counter()
                    for module in modules[form.name]:
                        module(x)
                    if timed:
                        seconds = (time.perf_counter() - begin) / len(sample)
                        best[form.name][i] = min(best[form.name][i], seconds)
    return best


def pad_inputs(model: torch.nn.Module, table: Path | None = None, progress=None) -> dict[str, float]:
    """Pad every packed input of fewer than MIN_ROWS rows (PackedLinear.min_rows) where the model's one-token
    forward runs more than MARGIN faster so (`time_padding`, read from or kept in the JSON file `table` as
    kernel_table keeps its own), not otherwise; returns those timings. A model whose packed weights fit in a
    cache (less than MEASURED_BYTES) is not timed ({}): it does not pad."""
    linears = packed_linears(model)
    rows, kept = 1, {}
    if sum(m.packed.nbytes for m in linears) >= MEASURED_BYTES:
        shapes = {}
        for m in linears:
            shape = f"{str(m.packed.dtype).removeprefix('torch.')}:{m.out_features}x{m.in_features}"
            shapes[shape] = shapes.get(shape, 0) + 1
        key = "padding:" + ",".join(f"{shape}*{count}" for shape, count in sorted(shapes.items())) + f"|{host_id()}"
        kept = read_timings(table).get(key)
        if not (isinstance(kept, dict) and all(isinstance(kept.get(str(r)), float) for r in (1, MIN_ROWS))):
            if progress is not None:
                progress(f"timing the model's forward with and without padding, once (kept in {table})")
            kept = time_padding(model)
            keep_timings(table, {key: kept})
        rows = int(fastest_of({r: kept[r] for r in ("1", str(MIN_ROWS))}, "1"))
    set_padding(model, rows)
    return kept


def time_padding(model: torch.nn.Module, passes: int = 3, calls: int = 3) -> dict[str, float]:
    """Seconds of the model's one-token forward (`time_forwards`) with its packed inputs padded to 1 and to
    MIN_ROWS rows ("1", "4")."""
    variants = {str(rows): functools.partial(_padded, model, rows) for rows in (1, MIN_ROWS)}
    return time_forwards(variants, passes, calls)


def _padded(model: torch.nn.Module, rows: int) -> torch.nn.Module:
    set_padding(model, rows)
    return model


def time_forwards(variants: dict, passes: int = 3, calls: int = 3) -> dict[str, float]:
    """Seconds of a one-token forward (no cache) of each variant (name -> a call that readies its model and
    returns it): the median over `passes` interleaved passes of `calls` forwards each, the order reversed
    every other pass, after one pass that builds each kernel."""
    seconds = {name: [] for name in variants}
    with torch.inference_mode():
        for i in range(passes + 1):
            for name in list(variants) if i % 2 else list(variants)[::-1]:
                model = variants[name]()
                ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
                for _ in range(calls):
                    begin = time.perf_counter()
                    model(input_ids=ids, use_cache=False)
                    if i:
                        seconds[name].append(time.perf_counter() - begin)
    return {name: statistics.median(s) for name, s in seconds.items()}


def keep_timings(table: Path | None, entries: dict) -> None:
    """Add entries to the JSON table (`kernel_table`'s file); a cache: one not kept is timed again next time."""
    if entries and table is not None:
        with contextlib.suppress(OSError):
            table.parent.mkdir(parents=True, exist_ok=True)
            write_kept(table, functools.partial(_write_json, read_timings(table) | entries))


def set_padding(model: torch.nn.Module, rows: int) -> None:
    """Every packed Linear of the model (fused groups too) pads an input of fewer than `rows` rows."""
    for linear in packed_linears(model):
        linear.min_rows = rows
    model.specdec_packed_rows = rows  # for the calibration's signature


def packed_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """The model's PackedLinears, those that run a fused group (PackedInputs) included, each once."""
    found = {}
    for module in model.modules():
        group = getattr(module, "group", None) if isinstance(module, SharedInputPart) else None
        linear = group.linear if isinstance(group, PackedInputs) else module
        if isinstance(linear, PackedLinear):
            found[id(linear)] = linear
    return list(found.values())


def host_id(threads: bool = True) -> str:
    """What makes two hosts' timings alike: the CPU's model name and flags, the threads, torch's version and
    the ISA limits set for it (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). threads=False: what makes their
    packed layouts alike (the same, without the threads)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        name = ""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    limits = ",".join(os.environ.get(v, "") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    threads = f"threads={torch.get_num_threads()}|" if threads else ""
    return f"{name}|{flags}|{threads}torch={torch.__version__}|{limits}"


def _timings(entry) -> dict[str, list[float]] | None:
    """A table entry as kernel_table keeps it, or None (timed again) where it is not that."""
    try:
        timings = {form.name: [float(s) for s in entry[form.name]] for form in FORMS}
    except (TypeError, KeyError, ValueError):
        return None
    return timings if all(len(t) == len(TIMED_WIDTHS) for t in timings.values()) else None


def _write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1))


def read_timings(path: Path | None) -> dict:
    """The kept table; missing, unreadable or not a JSON object: empty (it is a cache, timed again)."""
    try:
        data = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@functools.cache
def _linear_types() -> tuple[type, ...]:
    """torch.nn.Linear, and transformers' Conv1D (a Linear with its weight transposed: GPT-2)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return (torch.nn.Linear,)
    return (torch.nn.Linear, Conv1D)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo (and lscpu) list them; none where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return set(next(line for line in lines if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a Linear of this dtype on this CPU, and gets F.linear's answer:
    a probe, once per dtype and process (bfloat16 needs AVX-512 or AVX-NE-CONVERT; other builds and
    CPUs may lack the ops)."""
    if dtype not in PACKED_DTYPES or _LINEAR is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=generator).to(dtype)
    x = torch.randn(3, 16, generator=generator).to(dtype)
    try:
        out = _LINEAR(x, reorder(weight), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(out.float(), torch.nn.functional.linear(x, weight).float(), atol=0.05, rtol=0.05)


def _shared_data(model: torch.nn.Module) -> set[int]:
    """Data held by more than one parameter (tied embeddings and heads)."""
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        ptr = parameter.data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    return {ptr for ptr, count in seen.items() if count > 1}
