"""Render a benchmark JSON (from `specdec bench` or scripts/bench.py) as markdown and PNG plots.

    .venv/bin/python -m specdec_cli.report RESULT.json [--out DIR]

Reads the JSON only; never runs models.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specdec.bench.host import describe  # noqa: E402


def fmt(value, spec=".2f", none="-"):
    return none if value is None else format(value, spec)


def markdown_table(summary: dict) -> str:
    lines = [
        "| method | tokens/s | vs target alone | vs best transformers | acceptance | mean acc. length "
        "| Leviathan bound | share of bound | engine overhead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in summary.items():
        lines.append(
            f"| {method} | {fmt(row['tokens_per_second'])} | {fmt(row['speedup_vs_target'])}x "
            f"| {fmt(row.get('speedup_vs_hf_best'))}x | {fmt(row.get('acceptance_rate'), '.1%')} "
            f"| {fmt(row.get('mean_acceptance_length'))} | {fmt(row.get('bound'))}x "
            f"| {fmt(row.get('share_of_bound'), '.0%')} | {fmt(row.get('engine_overhead_share'), '.1%')} |"
        )
    return "\n".join(lines)


def plot_speedup_vs_k(data: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, summary in [("all", data["summary"])] + list(data["by_class"].items()):
        ks = sorted(int(m[9:]) for m in summary if m.startswith("specdec_k"))
        if ks:
            ax.plot(
                ks,
                [summary[f"specdec_k{k}"]["speedup_vs_target"] for k in ks],
                marker="o",
                label=f"specdec fixed k ({name})",
                linewidth=2.5 if name == "all" else 1,
            )
    styles = {"specdec_auto": "-", "hf_assisted": "--", "hf_assisted_pinned": ":", "hf_prompt_lookup": "-."}
    for method, style in styles.items():
        if method in data["summary"]:
            ax.axhline(
                data["summary"][method]["speedup_vs_target"],
                linestyle=style,
                color="gray" if method.startswith("hf") else "black",
                label=f"{method} (all)",
            )
    ax.axhline(1.0, color="red", linewidth=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over the target alone")
    ax.legend(fontsize=7)
    ax.set_title("Speedup vs draft length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_position(data: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, row in data["summary"].items():
        rates = row.get("acceptance_rate_per_position")
        if rates and method.startswith("specdec_") and method != "specdec_target":
            ax.plot(range(1, len(rates) + 1), rates, marker=".", label=method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (of tokens drafted there)")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_split(data: dict, path: Path) -> None:
    rows = [(m, r["time_split"]) for m, r in data["summary"].items() if "time_split" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [m.replace("specdec_", "") for m, _ in rows]
    bottom = [0.0] * len(rows)
    for part, color in (("draft", "tab:blue"), ("target", "tab:orange"), ("other", "tab:gray")):
        shares = [split[part] / split["wall"] if split["wall"] else 0 for _, split in rows]
        ax.bar(names, shares, bottom=bottom, label=part, color=color)
        bottom = [b + s for b, s in zip(bottom, shares)]
    ax.set_ylabel("share of wall time")
    ax.legend()
    ax.set_title("Where the time goes (specdec)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(data: dict, out: Path, stem: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "speedup": out / f"{stem}-speedup-vs-k.png",
        "positions": out / f"{stem}-per-position.png",
        "time": out / f"{stem}-time-split.png",
    }
    plot_speedup_vs_k(data, plots["speedup"])
    plot_per_position(data, plots["positions"])
    plot_time_split(data, plots["time"])
    s = data["settings"]
    parts = [
        f"### {s['target']} <- {s['draft']}, {s['dtype']}, temperature {s['temperature']}, "
        f"{s['max_new_tokens']} new tokens, {data['date']}",
        "",
        describe(data.get("machine", {})),
        "",
        "All prompts:",
        "",
        markdown_table(data["summary"]),
    ]
    for name, summary in data["by_class"].items():
        parts += ["", f"Prompt class `{name}`:", "", markdown_table(summary)]
    if data.get("costs"):
        c = data["costs"]
        growth = ", ".join(f"k={k}: {v:.2f}" for k, v in c["target_k_plus_1_s"].items())
        parts += [
            "",
            f"Measured costs: draft step {c['draft_step_s'] * 1e3:.1f} ms, target forward "
            f"{c['target_step_s'] * 1e3:.1f} ms, cost ratio c = {c['ratio']:.3f}; target cost for k+1 "
            f"positions relative to 1: {growth}.",
        ]
    parts += ["", *(f"![{key}]({path.name})" for key, path in plots.items())]
    markdown = "\n".join(parts) + "\n"
    (out / f"{stem}.md").write_text(markdown)
    return markdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    data = json.loads(args.result.read_text())
    print(render(data, args.out or args.result.parent, args.result.stem))


if __name__ == "__main__":
    main()
