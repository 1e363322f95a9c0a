"""Draft trees and verification methods on the real pair, interleaved with transformers (issue: past
the single chain). Qwen2.5-Coder-0.5B (int8) drafting for 1.5B (bfloat16), 128 tokens, the bench's
prompt classes; specdec at its defaults (k auto, confidence stop auto) and its variants: draft_width
2, 4 and auto, race verification (sampled); transformers' target alone and
assisted generation (defaults) as the baselines. The run in progress when this changed named the
variants specdec_auto_w{width}[_race] (w1_race = race alone).

    .venv/bin/python scripts/tree_bench.py --temperature 0 --out scripts/results/bench/trees-greedy.json
    .venv/bin/python scripts/tree_bench.py --temperature 0.7 --out scripts/results/bench/trees-t0.7.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/tree_bench.py --dtype float32 \
        --variants w1 --out scripts/results/bench/trees-avx2.json  # simulated AVX2: specdec_auto is the default
"""

from __future__ import annotations

import argparse
import json

from specdec.bench.main import BenchSettings, run_benchmark


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype (float32 on AVX2 hosts: their default)")
    parser.add_argument(
        "--variants",
        default="w2,w4,wauto,race,race+w2,race+w4,race+wauto",
        help="specdec variants beside specdec_auto ('+'-joined: w<N>, wauto, race); race only when sampling",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = tuple(v for v in args.variants.split(",") if args.temperature > 0 or "race" not in v)
    names = ["hf_target", "hf_assisted", "specdec_auto"] + [f"specdec_auto_{v}" for v in variants]
    settings = BenchSettings(
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        prompts_per_class=args.prompts_per_class,
        dtype=args.dtype,
        ks=(),
        variants=variants,
        only=tuple(names),
    )
    data = run_benchmark(settings, progress=lambda line: print(line, flush=True))
    summary = data["summary"]
    print(json.dumps({name: summary.get(name) for name in names}, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
