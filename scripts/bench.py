"""`specdec bench runs`: the named runs behind docs/BENCHMARKS.md, specdec against transformers side by
side in one process, interleaved (the harness: specdec.bench.main); each writes JSON, markdown and plots.

    .venv/bin/specdec bench runs                          # every run below (make bench, ~2 h)
    .venv/bin/specdec bench runs -- qwen-trees --repeats 2
    .venv/bin/specdec bench runs -- --quick               # a 1-minute smoke run on smollm2-135m
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/specdec bench runs -- qwen-greedy --dtype float32

Outputs go to scripts/results/bench/ (or --out): <name>.json (stable keys), <name>.md, <name>-*.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specdec.bench.main import BenchSettings, run_benchmark
from specdec_cli.report import render

TREES = ("hf_target", "hf_assisted", "specdec_auto")  # the baselines beside the tree and race variants
RUNS = {
    # The targets of the speed issue: the Qwen pair, greedy, bfloat16, 128 tokens.
    "qwen-greedy": BenchSettings(),
    "qwen-sampled": BenchSettings(temperature=0.7, ks=(4,), prompts_per_class=1),
    # The n-gram drafter against transformers' prompt lookup on the editing prompts.
    # float32: in bfloat16 the methods' outputs diverge at near-ties, so their speeds compare different texts.
    "smollm2-ngram": BenchSettings(
        target="smollm2-135m", draft=None, dtype="float32", classes=("editing",), ngram=True, ks=(), repeats=3
    ),
    # Where the speed comes from: each engine with the other's draft, and transformers' assisted generation
    # handed specdec's own int8 draft (hf_assisted_int8_draft).
    "qwen-fairness": BenchSettings(ks=(4,), classes=("code", "chat"), prompts_per_class=1, swap_drafts=True),
    # Draft trees (draft_width) and race verification beside the chain, at k auto.
    "qwen-trees": BenchSettings(
        ks=(),
        prompts_per_class=1,
        variants=("w2", "w4", "wauto"),
        only=(*TREES, "specdec_auto_w2", "specdec_auto_w4", "specdec_auto_wauto"),
    ),
    "qwen-trees-t0.7": BenchSettings(
        temperature=0.7,
        ks=(),
        prompts_per_class=1,
        variants=("wauto", "race", "race+wauto"),
        only=(*TREES, "specdec_auto_wauto", "specdec_auto_race", "specdec_auto_race+wauto"),
    ),
}
QUICK = {
    "quick": BenchSettings(
        target="smollm2-135m",
        draft="smollm2-135m",
        max_new_tokens=32,
        ks=(2, 4),
        classes=("code", "editing"),
        prompts_per_class=1,
        ngram=True,
    )
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"runs to do (default: all of {', '.join(RUNS)})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="the models' dtype (float32 on AVX2 hosts: their default)")
    parser.add_argument("--out", type=Path, default=Path("scripts/results/bench"))
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in RUNS]
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    runs = QUICK if args.quick else {name: RUNS[name] for name in (args.names or RUNS)}
    for name, settings in runs.items():
        changes = {"repeats": args.repeats, "dtype": args.dtype}
        settings = dataclasses.replace(settings, **{key: value for key, value in changes.items() if value})
        data = run_benchmark(settings, progress=lambda message: print(message, file=sys.stderr, flush=True))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
        print(render(data, args.out, name))
