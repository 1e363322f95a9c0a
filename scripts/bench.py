"""Benchmark specdec against transformers side by side; writes JSON, markdown and plots.

    .venv/bin/python scripts/bench.py                      # the documented run (make bench)
    .venv/bin/python scripts/bench.py --quick              # a 1-minute smoke run on smollm2-135m

Outputs go to scripts/results/bench/ (or --out): <name>.json (stable keys), <name>.md, <name>-*.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specdec.bench.main import BenchSettings, run_benchmark
from specdec_cli.report import render

RUNS = {
    # The targets of the speed issue: the Qwen pair, greedy, bfloat16, 128 tokens.
    "qwen-greedy": BenchSettings(),
    "qwen-sampled": BenchSettings(temperature=0.7, ks=(4,), prompts_per_class=1),
    # The n-gram drafter against transformers' prompt lookup on the editing prompts.
    # float32: in bfloat16 the methods' outputs diverge at near-ties, so their speeds compare different texts.
    "smollm2-ngram": BenchSettings(
        target="smollm2-135m", draft=None, dtype="float32", classes=("editing",), ngram=True, ks=(), repeats=3
    ),
    # Where the speed comes from: each engine with the other's draft (code and chat prompts).
    "qwen-fairness": BenchSettings(ks=(4,), classes=("code", "chat"), prompts_per_class=1, swap_drafts=True),
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


def commit() -> str | None:
    """The checkout's commit (with "+changes" when the tree differs from it), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help=f"runs to do (default: all of {', '.join(RUNS)})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = parser.parse_args()
    runs = QUICK if args.quick else {name: RUNS[name] for name in (args.names or RUNS)}
    for name, settings in runs.items():
        if args.repeats:
            settings = BenchSettings(**{**settings.__dict__, "repeats": args.repeats})
        data = run_benchmark(settings, progress=lambda message: print(message, file=sys.stderr, flush=True))
        data["machine"]["commit"] = commit()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
        print(render(data, args.out, name))


if __name__ == "__main__":
    main()
