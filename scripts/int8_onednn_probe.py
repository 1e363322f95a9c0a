"""One int8 matmul of the 0.5B draft's shapes: fbgemm's dynamic linear (specdec's int8 path) against oneDNN's
qlinear, with the activation quantised per call (per-tensor uint8) and per-channel int8 weights. Medians of
30 after 3 warm-ups, one row. The two MLP shapes fit in this host's L3 when called in a loop, so only the
head (151936 x 896, 136 MB of int8) reads its weight from memory as a draft step does.

    PYTHONPATH=. .venv/bin/python scripts/int8_onednn_probe.py
"""

import torch

from scripts.lever_costs import median_seconds

SHAPES = ((9728, 896), (896, 4864), (151936, 896))  # gate/up packed, down, the head: [out, in]


def fbgemm(weight: torch.Tensor):
    scale = weight.abs().max().item() / 127
    packed = torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(weight, scale, 0, torch.qint8), None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def onednn(weight: torch.Tensor):
    out_features, in_features = weight.shape
    scales = weight.abs().amax(1) / 127
    packed = torch.ops.onednn.qlinear_prepack(
        torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8), [1, in_features]
    )
    zero_points = torch.zeros(out_features, dtype=torch.long)

    def run(x: torch.Tensor) -> torch.Tensor:
        low, high = x.min().item(), x.max().item()
        scale = (high - low) / 255
        zero = int(round(-low / scale))
        xq = torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(
            xq, scale, zero, packed, scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )

    return run


def main() -> None:
    torch.manual_seed(0)
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        x = torch.randn(1, in_features)
        reference = x @ weight.T
        row = {}
        for name, build in (("fbgemm", fbgemm), ("onednn", onednn)):
            run = build(weight)
            error = (run(x) - reference).abs().max() / reference.abs().max()
            seconds = median_seconds(lambda run=run, x=x: run(x), repeats=30, warmup=3)
            row[name] = {"ms": round(seconds * 1e3, 3), "relative_error": round(float(error), 4)}
        print(out_features, in_features, row, flush=True)


if __name__ == "__main__":
    main()
