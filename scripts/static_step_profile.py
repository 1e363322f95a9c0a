"""One-token step times of the static cache against the DynamicCache on SmolLM2-135M, at three context
lengths, each measured twice (median of 3 x 30 steps), and with --profile a torch profiler table of
20 steps of each at 200 tokens of context (--profile-context=N: at N; --profile-only: skip the step times).

    .venv/bin/python scripts/static_step_profile.py bfloat16 2 --profile
    cd scripts && ../.venv/bin/python static_step_profile.py float32 1 --profile-only --profile-context=1900
"""

import statistics
import sys

import torch
from static_cache_speed import step_ms

from specdec import load_model
from specdec.adapters import HFCausalLM
from specdec.adapters.static import StaticHFCausalLM


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dtype = args[0] if args else "bfloat16"
    torch.set_num_threads(int(args[1]) if len(args) > 1 else 2)
    model = load_model("smollm2-135m", dtype=dtype)
    dynamic, static = HFCausalLM(model), StaticHFCausalLM(model, max_length=2100)
    for context in () if "--profile-only" in sys.argv else (200, 1000, 1900):
        for _ in range(2):
            d = statistics.median(step_ms(dynamic, context, 30, 3))
            s = statistics.median(step_ms(static, context, 30, 3))
            print(f"context {context}: dynamic {d:.2f} ms, static {s:.2f} ms, dynamic / static {d / s:.3f}", flush=True)
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in sys.argv[1:] if a.startswith("--"))
    if "--profile" in flags or "--profile-only" in flags:
        context = int(flags.get("--profile-context", 200))
        from torch.profiler import profile

        for name, adapter in (("dynamic", dynamic), ("static", static)):
            ms = step_ms(adapter, context, 10, 1)[0]  # prefill, 3 warm-up steps, 10 timed; the profile goes on
            print(f"{name}: {ms:.1f} ms a step at {context} tokens, unprofiled")
            one, token = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long)
            with profile() as prof:
                for _ in range(20):
                    adapter.forward(token, one)
            print(name)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
