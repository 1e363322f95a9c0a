"""Per-step costs behind the speed levers, on the embedded Qwen pair (CPU).

    .venv/bin/python scripts/lever_costs.py

Median of 7 timed forwards each, 128-token context, 2 threads. Prints one JSON object:
draft step in bfloat16 / float32 / int8, the draft's LM head (full vs a 32k-row slice),
and the target's forward for 1, 5 and 9 new tokens in bfloat16.
"""

import json
import statistics
import time

import torch

from specdec import SpeculativeDecoder
from specdec.bench import _timed_forward


def load(name: str, **options):
    """The library's one loading path; the target adapter is what gets timed."""
    return SpeculativeDecoder.from_pretrained(name, device="cpu", **options).target


def median_seconds(fn, repeats: int = 7, warmup: int = 1) -> float:
    """Median seconds of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    context = torch.randint(0, 1000, (1, 128))
    out = {"threads": torch.get_num_threads()}
    draft_bf16 = load("qwen2.5-coder-0.5b", dtype="bfloat16")
    out["draft_step_s"] = {
        "bfloat16": _timed_forward(draft_bf16, context, 1, repeats=7),
        "float32": _timed_forward(load("qwen2.5-coder-0.5b", dtype="float32"), context, 1, 7),
        "int8": _timed_forward(load("qwen2.5-coder-0.5b", target_quantization="int8"), context, 1, 7),
    }
    hidden = torch.randn(1, draft_bf16.model.config.hidden_size, dtype=torch.bfloat16)
    head = draft_bf16.model.lm_head.weight
    out["draft_head_s"] = {
        "full_151936": median_seconds(lambda: hidden @ head.T),
        "first_32768": median_seconds(lambda: hidden @ head[:32768].T),
    }
    del draft_bf16
    target = load("qwen2.5-coder-1.5b", dtype="bfloat16")
    out["target_forward_s"] = {n: _timed_forward(target, context, n, repeats=7) for n in (1, 5, 9)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
