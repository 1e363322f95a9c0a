"""A target forward's cost in float32 and bfloat16, per model, interleaved in one process (CPU).

    PYTHONPATH=. .venv/bin/python scripts/dtype_costs.py smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b

For each model: both dtypes loaded, a 200-token random context cached, then forwards of 1 and 9 new
tokens taken in turn (12 rounds, the first 2 dropped), the cache cropped back after each. Prints one
line per model: medians in ms and the bf16 / f32 ratio at each width. `dtype="auto"` picks bfloat16 on
CPUs with native bf16 by the ISA alone; this checks that choice per model on the host at hand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.resolution import load_model

WIDTHS = (1, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", help="comma-separated model names")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("torch capability:", torch.backends.cpu.get_cpu_capability(), "threads:", torch.get_num_threads())
    for name in args.models.split(","):
        models = {dtype: load_model(name, dtype=dtype) for dtype in ("float32", "bfloat16")}
        vocab = models["float32"].config.vocab_size
        context = torch.randint(0, vocab, (1, 200))
        times = {(dtype, width): [] for dtype in models for width in WIDTHS}
        with torch.inference_mode():
            caches = {d: m(input_ids=context, use_cache=True).past_key_values for d, m in models.items()}
            for _ in range(args.rounds):
                for dtype, model in models.items():
                    for width in WIDTHS:
                        ids = torch.randint(0, vocab, (1, width))
                        start = time.perf_counter()
                        model(input_ids=ids, cache=caches[dtype], use_cache=True)
                        times[(dtype, width)].append(time.perf_counter() - start)
                        caches[dtype].crop(-width)
        ms = {key: 1000 * statistics.median(values[2:]) for key, values in times.items()}
        ratios = ", ".join(f"{w} tokens {ms[('bfloat16', w)] / ms[('float32', w)]:.2f}" for w in WIDTHS)
        cells = ", ".join(f"{dtype} {w}: {value:.1f} ms" for (dtype, w), value in ms.items())
        print(f"{name}: {cells}; bf16 / f32: {ratios}", flush=True)


if __name__ == "__main__":
    main()
