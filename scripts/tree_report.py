"""Tables and the per-depth acceptance plot of the tree bench (scripts/tree_bench.py).

    .venv/bin/python scripts/tree_report.py docs/bench/trees-greedy.json docs/bench/trees-t0.7.json \
        --out docs/bench/trees --default-width 1          # runs made while the default was a chain
    .venv/bin/python scripts/tree_report.py docs/bench/trees-greedy-extension.json \
        docs/bench/trees-t0.7-extension.json --out docs/bench/trees-extension

writes docs/bench/trees.md (method x width, per temperature) and docs/bench/trees-depth.png
(acceptance by depth: the share of rounds that drafted a token at depth d whose path reached past d;
with trees a path may end on a sibling there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_WIDTH = "auto"  # specdec_auto's draft width: "auto" since commit 87d3453; the runs before it had 1


def label(method: str) -> str:
    if method.startswith("hf_"):
        return {"hf_target": "transformers, target alone", "hf_assisted": "transformers assisted (defaults)"}.get(
            method, method
        )
    variant = method.removeprefix("specdec_auto").lstrip("_") or f"w{DEFAULT_WIDTH}"
    width = next((o for o in variant.split("+") if o.startswith("w")), f"w{DEFAULT_WIDTH}")
    verification = "race" if "race" in variant else "token"
    extra = ", lookup first (tried, removed)" if "lookup" in variant else ""
    return f"specdec auto, {verification}, draft_width={width[1:]}{extra}"


def table(data: dict) -> str:
    s = data["settings"]
    lines = [
        f"T = {s['temperature']}, {s['max_new_tokens']} tokens, {s['prompts_per_class']} prompt(s) per class "
        f"({', '.join(s['classes'])}); medians over prompts; {data['date']}",
        "",
        "| method | tok/s | vs target alone | vs transformers assisted | mean acceptance length "
        "| rounds ending on a sibling |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, row in data["summary"].items():
        rounds = sibling = 0
        for run in data["runs"]:
            if run["method"] == method and run["metrics"]:
                rounds += run["metrics"]["rounds"]
                sibling += run["metrics"].get("sibling_tokens", 0)
        mal = row.get("mean_acceptance_length")
        lines.append(
            f"| {label(method)} | {row['tokens_per_second']:.2f} | {row['speedup_vs_target']:.2f}x | "
            f"{row['speedup_vs_hf_best']:.2f}x | {'-' if mal is None else f'{mal:.2f}'} | "
            f"{'-' if not rounds else f'{sibling / rounds:.0%}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--out", default="docs/bench/trees")
    parser.add_argument("--default-width", default="auto", help="specdec_auto's draft width when the runs were made")
    args = parser.parse_args()
    global DEFAULT_WIDTH
    DEFAULT_WIDTH = args.default_width
    runs = [json.loads(Path(p).read_text()) for p in args.inputs]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, data in zip(axes[0], runs):
        for method, row in data["summary"].items():
            rates = row.get("acceptance_rate_per_position")
            if rates and method.startswith("specdec_"):
                ax.plot(range(1, len(rates) + 1), rates, marker=".", label=label(method).replace("specdec auto, ", ""))
        ax.set_xlabel("depth")
        ax.set_ylabel("acceptance at this depth")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"T = {data['settings']['temperature']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{args.out}-depth.png", dpi=110)
    text = "\n\n".join(table(data) for data in runs)
    Path(f"{args.out}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
