"""`specdec bench ngram`: the n-gram drafter against transformers' prompt lookup, a guard that prints the ratio.

    .venv/bin/specdec bench ngram                 # SmolLM2-135M, editing prompts, float32, 3 repeats
    .venv/bin/specdec bench ngram -- --repeats 1  # a quicker look

specdec's `--draft ngram` (auto k) and transformers' `generate(prompt_lookup_num_tokens=10)` run on the
same loaded model, interleaved in one process (specdec.bench.main: hf_target, hf_prompt_lookup,
specdec_ngram), greedy, 128 new tokens. float32: in bfloat16 the two greedy outputs part at near-ties,
so their speeds would compare different texts. The ratio is of the median tokens/s of each method.
It prints "n-gram / transformers prompt lookup: X.XXx (goal >= 1.10x)"; below 1.0x the line starts
with FAIL and the exit status is 1, so a slip below transformers cannot pass unseen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.main import BenchSettings, run_benchmark

GOAL = 1.10  # issue 33: the n-gram path at least 10% above transformers' prompt lookup
FLOOR = 1.0  # below transformers' prompt lookup: the guard fails
METHODS = ("hf_target", "hf_prompt_lookup", "specdec_ngram")


def settings(
    repeats: int = 3, max_new_tokens: int = 128, target: str = "smollm2-135m", held_out: bool = False
) -> BenchSettings:
    """The guard's run: the n-gram drafter and transformers' prompt lookup (and the target alone), on the
    two editing prompts, or on the three held-out ones."""
    return BenchSettings(
        target=target,
        draft=None,
        dtype="float32",
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        ks=(),
        classes=("editing-new",) if held_out else ("editing",),
        prompts_per_class=3 if held_out else 2,
        ngram=True,
        only=METHODS,
    )


def verdict(summary: dict) -> tuple[float, str, int]:
    """(ratio, the line to print, exit status) from a bench summary's median tokens/s per method."""
    ratio = round(summary["specdec_ngram"]["tokens_per_second"] / summary["hf_prompt_lookup"]["tokens_per_second"], 4)
    line = f"n-gram / transformers prompt lookup: {ratio:.2f}x (goal >= {GOAL:.2f}x)"
    if ratio < FLOOR:
        return ratio, f"FAIL {line}: below transformers' prompt lookup", 1
    return ratio, line if ratio >= GOAL else f"{line}: below the goal", 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="passes over the two editing prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default="smollm2-135m", help="target model (a name specdec loads)")
    parser.add_argument("--held-out", action="store_true", help="the three editing prompts written for issue 39")
    parser.add_argument("--out", type=Path, default=None, help="write the bench's JSON here")
    args = parser.parse_args(argv)
    data = run_benchmark(settings(args.repeats, args.max_new_tokens, args.target, args.held_out))
    summary = data["summary"]
    for method in METHODS:
        print(f"{method}: {summary[method]['tokens_per_second']:.2f} tok/s")
    ratio, line, code = verdict(summary)
    data["ngram_vs_prompt_lookup"] = ratio
    if args.out is not None:
        args.out.write_text(json.dumps(data, indent=1))
    print(line)
    return code
