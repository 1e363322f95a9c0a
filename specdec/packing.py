"""Float Linear weights packed once for oneDNN (CPU).

`F.linear` on CPU hands a plain [out, in] weight to the BLAS at every call, which
re-blocks it for a matrix of more than one row: on a 2-core host a Qwen2.5-1.5B
MLP projection over 3-9 tokens took 2-3x its one-token time, and the verify
forward grew with its width for that alone. oneDNN's linear on a weight reordered
once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the packing
torch.compile's CPU freezing does) skips that work: the 1.5B target's forward ran
1.8-1.9x faster for one token and 1.3-3x for 2-11 tokens, float32 on AVX2 and
bfloat16 on AVX-512 (scripts/linear_packing.py; docs/BENCHMARKS.md).

The packed model computes the same function up to float rounding (bfloat16 outputs
were equal bit for bit in the measurements; float32 differs in the last bits, as
any other GEMM path would). It is the model specdec loads, so target-alone runs,
verification and transformers' `generate` on it all use it.

Only models loaded by name are packed (specdec.resolution.load_model): a model the
user passes is left as it is. Weights shared with another module (tied heads) are
not packed, which would hold a second copy.
"""

from __future__ import annotations

import torch

_LINEAR = torch.ops.mkldnn._linear_pointwise.default
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Module):
    """A Linear whose weight is held in oneDNN's blocked layout (the bias stays a plain tensor)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR(x, self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a copy): for code that needs the rows, e.g. a partial draft head."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module) -> int:
    """Replace the model's float32 / bfloat16 CPU Linears by PackedLinears, in place; returns how many.
    Nothing is packed where oneDNN cannot pack the dtype on this CPU (bfloat16 without AVX-512 or
    AVX-NE-CONVERT), and a weight another parameter shares stays a plain Linear."""
    if not torch.backends.mkldnn.is_available():
        return 0
    shared = _shared_storages(model)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKED_DTYPES
        and child.weight.data_ptr() not in shared
    ]
    packed = 0
    for parent, name, linear in targets:
        try:
            setattr(parent, name, PackedLinear(linear))
        except RuntimeError:  # oneDNN cannot pack this dtype on this CPU: the rest would fail alike
            break
        packed += 1
    model.specdec_packed_linears = packed  # for reports and the calibration's signature
    return packed


def _shared_storages(model: torch.nn.Module) -> set[int]:
    """Data held by more than one parameter (tied embeddings and heads)."""
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        ptr = parameter.data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    return {ptr for ptr, count in seen.items() if count > 1}
