"""GPU check: random-weight GPT-2 (draft) and GPT-2-large (target) built on the device from their
configs (no download), timed side by side with transformers, interleaved.

    python scripts/gpu_bench.py --out result.json

Measures: the cost ratio of the two models on this GPU, the engine's overhead at acceptance 1
(draft = target), specdec vs transformers' assisted generation on the same pair, and that CUDA
KV-cache rollback keeps greedy output equal to transformers' greedy output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import specdec
from specdec.adapters import HFCausalLM
from specdec.drafters import ModelDrafter


def build(config: GPT2Config, seed: int, dtype) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to("cuda", dtype).eval()


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_bench.json")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.float16
    small = GPT2Config(eos_token_id=None, bos_token_id=None)  # gpt2: 12 layers, 768 hidden
    large = GPT2Config(n_layer=36, n_embd=1280, n_head=20, eos_token_id=None, bos_token_id=None)  # gpt2-large
    draft, target = build(small, 0, dtype), build(large, 1, dtype)
    prompt = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(0)).tolist()[0]
    n = args.new_tokens
    target_adapter = HFCausalLM(target, name="gpt2-large (random)")
    self_drafter = ModelDrafter(HFCausalLM(target, name="gpt2-large as draft"), stop_below=None)
    small_drafter = ModelDrafter(HFCausalLM(draft, name="gpt2 (random)"), stop_below=None)
    inputs = torch.tensor([prompt], device="cuda")

    def hf(**extra):
        return lambda: target.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )[0, 64:].tolist()

    def ours(drafter, k):
        return lambda: specdec.generate(
            prompt, target=target_adapter, draft=drafter, max_new_tokens=n, num_draft_tokens=k
        )

    methods = {
        "hf_target": hf(),
        "hf_assisted": hf(assistant_model=draft),
        "specdec_target": ours(None, 1),
        "specdec_self_k4": ours(self_drafter, 4),
        "specdec_gpt2_k4": ours(small_drafter, 4),
        "specdec_gpt2_auto": ours(small_drafter, "auto"),
    }
    for fn in methods.values():  # warm-up: CUDA kernels, allocator
        fn()
    times = {name: [] for name in methods}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            seconds, out = timed(fn)
            times[name].append(seconds)
            outputs[name] = out
    reference = outputs["hf_target"]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(dtype),
        "new_tokens": n,
        "tokens_per_second": {m: n / statistics.median(t) for m, t in times.items()},
        "greedy_equal_to_hf": {
            m: (o.token_ids if hasattr(o, "token_ids") else o) == reference for m, o in outputs.items()
        },
        "metrics": {m: o.metrics.to_dict() for m, o in outputs.items() if hasattr(o, "metrics")},
    }
    base = result["tokens_per_second"]["hf_target"]
    result["speedup_vs_hf_target"] = {m: v / base for m, v in result["tokens_per_second"].items()}
    step = {}
    for name, model in (("gpt2", draft), ("gpt2-large", target)):
        adapter = HFCausalLM(model)
        adapter.reset(1)
        adapter.feed([prompt], torch.tensor([True]))
        one = torch.tensor([[5]], device="cuda")
        valid = torch.ones(1, 1, dtype=torch.bool, device="cuda")
        samples = []
        for _ in range(20):
            seconds, _ = timed(partial(adapter.forward, one, valid))
            samples.append(seconds)
        step[name] = statistics.median(samples)
    result["step_seconds"] = step
    result["cost_ratio"] = step["gpt2"] / step["gpt2-large"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
