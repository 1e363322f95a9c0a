"""int8 dynamic quantisation on CPU (the draft by default; the target on request).

For a draft it is exact by construction: verification uses the law the quantised
draft actually samples from, so only acceptance (and speed) change. A quantised
target is a different model, and output is exact with respect to it.

Activations are quantised per call with one scale per tensor (torch.ao's dynamic
scheme). That scale cannot hold the "massive activations" some layers of LLMs
feed their next Linear: Qwen2.5's MLP down-projections in its first and last
layers peak at ~1000x their mean, at the first token and a few delimiters. Over
a prompt (a prefill) that peak sets the scale of every position. keep_outliers
finds those few Linears by one forward over a fixed token sequence (their input's
peak-to-mean ratio is far above the model's median) and leaves them in float.

Call overhead. A one-token int8 matmul of a small projection costs ~50 us, most of it fixed (torch.ao's
module forward, the op packet's Python checks for its packed-weight argument, quantising the input).
The q/k/v projections, and the gate/up projections, read the same input, so they are packed into one
int8 matmul per group (SharedInputLinears; weights concatenated with one scale per output channel,
so every output is the same as the separate matmuls'), and every int8 Linear calls its op overload
directly (Int8Linear). On the 0.5B draft that cut a step by 5-6% on AVX-512 and on AVX2
(scripts/int8_packing.py, deleted: docs/notes/deleted-scripts.md).
"""

from __future__ import annotations

import statistics
import warnings

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from specdec.models.packing import SHARED_INPUTS, SharedInputPart, SharedInputs

__all__ = ["SharedInputPart", "SharedInputLinears", "quantize_int8", "outlier_linears"]  # SharedInputPart: kept files

_LINEAR = torch.ops.quantized.linear_dynamic.default  # the overload: skips the packet's Python argument checks
OUTLIER_RATIO = 10.0  # a Linear stays in float when its input's peak/mean is 10x the model's median
PROBE_TOKENS = 64  # the fixed token sequence the outliers are found on


def outlier_linears(model: torch.nn.Module, ratio: float = OUTLIER_RATIO) -> set[str]:
    """Names of the Linears whose input, over a fixed pseudo-random token sequence, peaks at more than
    `ratio` x the median (over all Linears) of max|x| / mean|x|. Massive activations sit in the same
    channels whatever the text, so no real text is needed."""
    peaks: dict[str, float] = {}

    def record(name):
        def hook(module, inputs):
            x = inputs[0].detach().abs().float()
            peaks[name] = float(x.max() / x.mean().clamp_min(1e-12))

        return hook

    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    handles = [m.register_forward_pre_hook(record(name)) for name, m in linears.items()]
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            model(input_ids=ids.to(model.get_input_embeddings().weight.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if not peaks:
        return set()
    typical = statistics.median(peaks.values())
    return {name for name, peak in peaks.items() if peak > ratio * typical}


def quantize_int8(model: torch.nn.Module, keep_outliers: bool = False, fuse: bool = True) -> torch.nn.Module:
    """Linear layers -> int8 weights with dynamic activation scales (CPU only).

    keep_outliers=False (drafts): every Linear, one weight scale per tensor; the fastest, and a draft's
    fidelity only matters through acceptance. keep_outliers=True (the opt-in int8 target, whose output
    is what the user gets): one weight scale per output channel, and the Linears fed massive
    activations (outlier_linears) stay in float32. On Qwen2.5-Coder-1.5B that doubles the share of
    greedy tokens equal to the original model's, for ~10% more time per forward; on the 0.5B draft
    it bought no end-to-end speed (docs/BENCHMARKS.md). fuse: pack the int8 projections that read one
    input into one matmul (fuse_shared_inputs; the same outputs, fewer calls)."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(
            "int8 quantisation runs on CPU only; on CUDA use --draft-quantization none and no --target-quantization"
        )
    model = model.float()
    mapping = {torch.nn.Linear: Int8Linear}
    if keep_outliers:
        keep = outlier_linears(model)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        spec = {n: qconfig for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in keep}
    else:
        keep, spec = set(), {torch.nn.Linear}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's eager quantisation is deprecated in favour of torchao
        model = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, mapping=mapping).eval()
    if fuse:
        fuse_shared_inputs(model)
    model.specdec_float_linears = sorted(keep)  # for reports: which Linears stayed in float
    model.specdec_weights = "int8"  # its weight form (specdec.models.forms), for the calibration's key
    return model


class Int8Linear(DynamicInt8Linear):
    """torch.ao's dynamic int8 Linear (qint8 weights, float activations) calling its op overload directly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR(x, self._packed_params._packed_params, True)  # reduce_range, as torch.ao's version 4


class SharedInputLinears(SharedInputs):
    """int8 Linears that read the same input, packed as one int8 matmul (the weights concatenated, one scale
    per output channel: every output is the separate matmuls')."""

    def __init__(self, linears: list[DynamicInt8Linear]):
        weights = [linear.weight() for linear in linears]
        super().__init__([w.shape[0] for w in weights])
        scales, zero_points = zip(*map(_channel_scales, weights))
        weight = torch._make_per_channel_quantized_tensor(
            torch.cat([w.int_repr() for w in weights]), torch.cat(scales), torch.cat(zero_points), 0
        )
        biases = [linear.bias() for linear in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([torch.zeros(n) if b is None else b for b, n in zip(biases, self.sizes)])
        self.packed = torch.ops.quantized.linear_prepack(weight, bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR(x, self.packed, True)


def _channel_scales(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantised weight's scale and zero point per output channel (a per-tensor one repeated)."""
    if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        return weight.q_per_channel_scales().double(), weight.q_per_channel_zero_points().long()
    rows = weight.shape[0]
    return torch.full((rows,), weight.q_scale(), dtype=torch.double), torch.full((rows,), weight.q_zero_point())


def fuse_shared_inputs(model: torch.nn.Module) -> int:
    """Replace each complete group of SHARED_INPUTS siblings that are all int8 Linears of one input width
    by SharedInputParts of one SharedInputLinears. Returns the number of groups packed."""
    groups = 0
    for parent in list(model.modules()):
        for names in SHARED_INPUTS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(isinstance(m, DynamicInt8Linear) and m._packed_params.dtype == torch.qint8 for m in linears):
                continue
            if len({m.in_features for m in linears}) != 1:
                continue
            group = SharedInputLinears(linears)
            for part, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, SharedInputPart(group, part, linear.in_features))
            groups += 1
    return groups
