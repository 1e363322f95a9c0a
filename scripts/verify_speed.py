"""Cost of speculative_verify against one pass over its input, interleaved, same process.

    .venv/bin/python scripts/verify_speed.py [--batch 64 --k 8 --vocab 151936 --repeats 15]

"One pass" is reading target_probs and draft_probs once (a sum over each).
Prints one JSON object.
"""

import argparse
import json
import statistics
import time

import torch

from specdec.verify import greedy_verify, speculative_verify


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    b, k, v = args.batch, args.k, args.vocab
    target_probs = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 3, -1)
    draft_probs = torch.softmax(torch.randn(b, k, v, generator=g) * 3, -1)
    drafts = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=g).reshape(b, k)
    logits = torch.randn(b, k + 1, v, generator=g)
    runs = {
        "one_pass": lambda: (target_probs.sum(), draft_probs.sum()),
        "verify": lambda: speculative_verify(target_probs, drafts, draft_probs, generator=g, check_inputs=False),
        "verify_checked": lambda: speculative_verify(target_probs, drafts, draft_probs, generator=g),
        "verify_point_mass": lambda: speculative_verify(target_probs, drafts, generator=g, check_inputs=False),
        "greedy_verify": lambda: greedy_verify(logits, drafts, check_inputs=False),
    }
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved: A B C A B C ...
        for name, fn in runs.items():
            times[name].append(timed(fn))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        json.dumps(
            {
                "shape": {"batch": b, "k": k, "vocab": v},
                "threads": torch.get_num_threads(),
                "median_ms": {n: round(1e3 * t, 2) for n, t in median.items()},
                "ratio_to_one_pass": {n: round(t / median["one_pass"], 3) for n, t in median.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
