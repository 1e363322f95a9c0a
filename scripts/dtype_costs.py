"""A target forward's cost in float32 and bfloat16, per model, interleaved in one process (CPU).

    PYTHONPATH=. .venv/bin/python scripts/dtype_costs.py smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b

For each model: both dtypes loaded, then forwards of 1 and 9 new tokens after a 200-token random context,
through specdec's adapter (`specdec.bench._timed_forward`, one forward a call: the context prefilled, then
the timed forward), the dtypes and widths taken in turn (12 rounds, the first 2 dropped). Prints one line
per model: medians in ms and the bf16 / f32 ratio at each width. `dtype="auto"` picks bfloat16 on CPUs
with native bf16 by the ISA alone; this checks that choice per model on the host at hand.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdec.adapters import HFCausalLM
from specdec.bench import _timed_forward
from specdec.resolution import load_model

WIDTHS = (1, 9)
CONTEXT = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", help="comma-separated model names")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("torch capability:", torch.backends.cpu.get_cpu_capability(), "threads:", torch.get_num_threads())
    for name in args.models.split(","):
        models = {dtype: HFCausalLM(load_model(name, dtype=dtype), name) for dtype in ("float32", "bfloat16")}
        times = {(dtype, width): [] for dtype in models for width in WIDTHS}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for dtype, model in models.items():
                    for width in WIDTHS:
                        context = torch.randint(0, model.vocab_size, (1, CONTEXT + width))
                        times[(dtype, width)].append(_timed_forward(model, context, width, repeats=1))
        ms = {key: 1000 * statistics.median(values[2:]) for key, values in times.items()}
        ratios = ", ".join(f"{w} tokens {ms[('bfloat16', w)] / ms[('float32', w)]:.2f}" for w in WIDTHS)
        cells = ", ".join(f"{dtype} {w}: {value:.1f} ms" for (dtype, w), value in ms.items())
        print(f"{name}: {cells}; bf16 / f32: {ratios}", flush=True)


if __name__ == "__main__":
    main()
