"""Does the engine add speed, given the same draft? specdec at its defaults against transformers'
assisted generation handed specdec's own int8 draft (and with its unquantised one), interleaved,
Qwen2.5-Coder-0.5B drafting for 1.5B (bfloat16), 128 tokens, the bench's prompt classes.

    .venv/bin/python scripts/fairness_bench.py --out scripts/results/bench/fairness-trees.json
"""

from __future__ import annotations

import argparse
import json

from specdec.bench.main import BenchSettings, run_benchmark

METHODS = ("hf_target", "hf_assisted", "hf_assisted_int8_draft", "specdec_auto")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = BenchSettings(
        temperature=args.temperature,
        prompts_per_class=args.prompts_per_class,
        ks=(),
        swap_drafts=True,
        only=METHODS,
    )
    data = run_benchmark(settings, progress=lambda line: print(line, flush=True))
    summary = data["summary"]
    same_draft = summary["specdec_auto"]["tokens_per_second"] / summary["hf_assisted_int8_draft"]["tokens_per_second"]
    data["specdec_over_hf_with_the_same_int8_draft"] = same_draft
    print(json.dumps({m: summary[m]["tokens_per_second"] for m in METHODS} | {"same_draft_ratio": same_draft}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
