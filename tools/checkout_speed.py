"""One JSON line: the Qwen pair's speed at the API defaults (3 prompts x 64 tokens, greedy and T=0.7),
for comparing two checkouts of specdec on this host. Run it from each, alternating:

    for i in 1 2; do for tree in /tmp/oldtree .; do
        PYTHONPATH=$tree .venv/bin/python tools/checkout_speed.py $tree
    done; done

(`git worktree add /tmp/oldtree REV` makes the other checkout.) The token hash compares outputs; in
bfloat16 it can differ between runs of one checkout too (near-ties, calibrated choices).
"""

import json
import sys
import time

import torch

from specdec import SpeculativeDecoder

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a hash map is in two sentences.",
    "Write a Python class for a stack with push and pop.",
]


def main() -> None:
    torch.manual_seed(0)
    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    decoder.generate(PROMPTS[0], max_new_tokens=8)  # warm-up (and calibration, once per host)
    speeds, outputs = {}, []
    for temperature in (0.0, 0.7):
        tokens, seconds = 0, 0.0
        for prompt in PROMPTS:
            start = time.perf_counter()
            out = decoder.generate(prompt, max_new_tokens=64, temperature=temperature, seed=0)
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
            outputs.append(out.token_ids)
        speeds[f"T{temperature}"] = tokens / seconds
    print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else ".", **speeds, "hash": hash(str(outputs))}))


if __name__ == "__main__":
    main()
