"""int8 dynamic quantisation on CPU (the draft by default; the target on request).

Exact by construction: verification uses the law the quantised model actually
samples from, so only acceptance (and speed) change, never the output law.

Weights are int8 per output channel, activations are quantised per call
(torch.ao's dynamic scheme). One scale per activation tensor cannot hold the
"massive activations" some layers of LLMs feed their next Linear (Qwen2.5's
MLP down-projections in its first and last layers peak at ~1000x their mean).
Those few Linears stay in float: found by one forward over a fixed token
sequence, as the ones whose input peak-to-mean ratio is far above the model's
median. On Qwen2.5-Coder-0.5B that keeps 5 of 169 Linears, costs ~10% of a
draft step and lifts greedy agreement with the 1.5B target from 0.58-0.88 to
0.73-0.95 (docs/BENCHMARKS.md, "int8 drafts that keep their outlier layers").
"""

from __future__ import annotations

import statistics
import warnings

import torch

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


def quantize_int8(model: torch.nn.Module, keep_outliers: bool = True) -> torch.nn.Module:
    """Linear layers -> int8 weights (per output channel) with dynamic activation scales (CPU only);
    with keep_outliers, the Linears fed massive activations (outlier_linears) stay in float32."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 quantisation runs on CPU only; use --draft-quantization none on CUDA")
    model = model.float()
    keep = outlier_linears(model) if keep_outliers else set()
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    spec = {name: qconfig for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name not in keep}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's eager quantisation is deprecated in favour of torchao
        model = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8).eval()
    model.specdec_float_linears = sorted(keep)  # for reports: which Linears stayed in float
    return model
