"""int8 models: torch.ao's dynamic Linears against specdec's (each op overload called directly), with and
without the q/k/v and gate/up projections packed into one matmul per group (specdec.quantize).

    .venv/bin/python scripts/int8_packing.py --out docs/bench/int8-packing-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/int8_packing.py \\
        --out docs/bench/int8-packing-avx2.json

Each variant of the model is loaded once. All get the same 200-token context; then 1- and 5-token
forwards (rolled back after each) are timed in turn, variant after variant, `--repeats` times; medians.
The logits of the context are compared bit for bit: packing must not change the model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import warnings

import torch

from specdec.adapters import HFCausalLM
from specdec.quantize import quantize_int8
from specdec.resolution import load_model

CONTEXT = 200


def torch_ao(name: str) -> torch.nn.Module:
    """torch.ao's own dynamic int8 Linears, every Linear per-tensor (the drafts' scheme before packing)."""
    model = load_model(name, dtype="float32", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--keep-outliers", action="store_true", help="the int8 target's scheme (no torch.ao row)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def specdec(fuse: bool) -> torch.nn.Module:
        model = load_model(args.model, dtype="float32", device="cpu")
        return quantize_int8(model, keep_outliers=args.keep_outliers, fuse=fuse)

    variants = {"separate": specdec(False), "packed": specdec(True)}
    if not args.keep_outliers:
        variants = {"torch.ao": torch_ao(args.model), **variants}
    adapters = {name: HFCausalLM(model, args.model) for name, model in variants.items()}
    ids = torch.randint(100, 5000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([CONTEXT])
    equal = {}
    with torch.inference_mode():
        reference = None
        for name, adapter in adapters.items():
            adapter.reset(1)
            logits = adapter.forward(ids, torch.ones_like(ids, dtype=torch.bool), keep_logits=CONTEXT)
            reference = logits if reference is None else reference
            equal[name] = bool(torch.equal(logits, reference))
        times = {(name, width): [] for width in (1, 5) for name in adapters}
        for _ in range(args.repeats):
            for width in (1, 5):
                for name, adapter in adapters.items():
                    x = torch.randint(100, 5000, (1, width))
                    start = time.perf_counter()
                    adapter.forward(x, torch.ones_like(x, dtype=torch.bool))
                    times[name, width].append(time.perf_counter() - start)
                    adapter.rollback(keep)
    medians = {f"{name} x{width}": 1e3 * statistics.median(t) for (name, width), t in times.items()}
    for key, ms in medians.items():
        print(f"{key:16} {ms:7.1f} ms")
    print("context logits equal to the first variant's:", equal)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    date=datetime.date.today().isoformat(),
                    isa=torch.backends.cpu.get_cpu_capability(),
                    threads=args.threads,
                    model=args.model,
                    keep_outliers=args.keep_outliers,
                    repeats=args.repeats,
                    median_ms=medians,
                    context_logits_equal=equal,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
