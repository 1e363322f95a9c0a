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

Which kernels oneDNN runs here is read from the CPU's feature flags (`cpu_flags`, also read by the
dtype choice and the bench's host report): `onednn_amx`, whether its bfloat16 kernels run on AMX tiles.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_LINEAR = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)  # None: a build without it
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's bfloat16 linear on AVX-512 (no AMX) streams its weights slower for one or two rows than for
# three to six: 25-28 GB/s against 36-41 GB/s for the 1.5B's MLP and head shapes (2026-11-28, AMD EPYC,
# docs/BENCHMARKS.md "The forward per width"), and rows 2-4 give the same values row by row. So a bfloat16
# input of fewer rows is padded with zero rows to MIN_ROWS there; float32 (fastest at one row) is not.
MIN_ROWS = 4  # measured: 0.92x the unpadded forward at one token, 0.82x at two (docs/BENCHMARKS.md)


class PackedLinear(torch.nn.Module):
    """A Linear whose weight is held in oneDNN's blocked layout (the bias stays a plain tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.nn.Parameter | None):
        """weight: [out, in], as torch.nn.Linear holds it."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.min_rows = MIN_ROWS if weight.dtype == torch.bfloat16 and not _has_amx() else 1
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias

    @classmethod
    def of(cls, module: torch.nn.Module) -> PackedLinear:
        """From a torch.nn.Linear, or transformers' Conv1D (GPT-2: its weight is [in, out])."""
        weight = module.weight if isinstance(module, torch.nn.Linear) else module.weight.t()
        return cls(weight, module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= self.min_rows:
            return _LINEAR(x, self.packed, self.bias, "none", [], "")
        flat = x.reshape(rows, self.in_features)
        padded = torch.cat([flat, flat.new_zeros(self.min_rows - rows, self.in_features)])
        return _LINEAR(padded, self.packed, self.bias, "none", [], "")[:rows].reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module, release=None) -> int:
    """Replace the model's float32 / bfloat16 CPU Linears (and GPT-2's Conv1Ds) by PackedLinears, in
    place; returns how many. `release`, where given, is called with each plain weight once it is packed.
    A dtype oneDNN cannot pack on this CPU (`packable`) stays plain. A weight another parameter shares (a
    tied head) is packed as a copy and stays where it is for the other (the module notes)."""
    shared = _shared_data(model)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in _linear_types() and child.weight.device.type == "cpu" and packable(child.weight.dtype)
    ]
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear.of(linear))
        if release is not None and linear.weight.data_ptr() not in shared:  # its memory may go (models.ready)
            release(linear.weight)
    model.specdec_packed_linears = len(targets)  # for reports and the calibration's signature
    model.specdec_packed_rows = max((m.min_rows for m in model.modules() if isinstance(m, PackedLinear)), default=1)
    return len(targets)


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


def onednn_amx() -> bool:
    """Do oneDNN's bfloat16 kernels run on AMX tiles here: the CPU has them and ONEDNN_MAX_CPU_ISA, where set,
    allows them? (torch's dispatch names no ISA past AVX512: the CPU's flags tell AMX apart.)"""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return "amx_bf16" in cpu_flags() and (not limit or "AMX" in limit or limit.startswith(("ALL", "DEFAULT")))


@functools.cache
def _has_amx() -> bool:
    """AMX tiles (Intel Xeon 4th gen and later): bfloat16 linears there were not measured for MIN_ROWS.
    Asked once per process (every PackedLinear asks)."""
    return onednn_amx()


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
        out = _LINEAR(x, torch.ops.mkldnn._reorder_linear_weight(weight, 1), None, "none", [], "")
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
