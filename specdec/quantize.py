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


def quantize_int8(model: torch.nn.Module, keep_outliers: bool = False) -> torch.nn.Module:
    """Linear layers -> int8 weights with dynamic activation scales (CPU only).

    keep_outliers=False (drafts): every Linear, one weight scale per tensor; the fastest, and a draft's
    fidelity only matters through acceptance. keep_outliers=True (the opt-in int8 target, whose output
    is what the user gets): one weight scale per output channel, and the Linears fed massive
    activations (outlier_linears) stay in float32. On Qwen2.5-Coder-1.5B that doubles the share of
    greedy tokens equal to the original model's, for ~10% more time per forward; on the 0.5B draft
    it bought no end-to-end speed (docs/BENCHMARKS.md)."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(
            "int8 quantisation runs on CPU only; on CUDA use --draft-quantization none and no --target-quantization"
        )
    model = model.float()
    if keep_outliers:
        keep = outlier_linears(model)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        spec = {n: qconfig for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in keep}
    else:
        keep, spec = set(), {torch.nn.Linear}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's eager quantisation is deprecated in favour of torchao
        model = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8).eval()
    model.specdec_float_linears = sorted(keep)  # for reports: which Linears stayed in float
    return model
