"""`auto` against fixed k, on a quiet host and with another process keeping a core busy (issue: speed
that holds on the machine it runs on). Qwen2.5-Coder-0.5B (int8) drafting for 1.5B (bfloat16), 128
greedy tokens, one prompt per class, specdec at its defaults (draft_width auto) with k in {2, 3, 4, 6}
and auto, interleaved; the load is a pure-Python busy loop in a second process.

    .venv/bin/python scripts/load_bench.py --out docs/bench/load.json
    .venv/bin/python scripts/load_bench.py --conditions quiet --classes chat --out docs/bench/load-chat-quiet.json
    .venv/bin/python scripts/load_bench.py --conditions quiet --classes chat --prompts-per-class 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

from specdec.bench import BenchSettings, run_benchmark


def busy(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _pooled(runs: list[dict], costs: dict | None) -> dict:
    """Per method: tokens/s over all its runs (total tokens / total seconds), and the same from counts
    alone, timed by the run's calibration (draft forwards x draft step + target forwards x target
    forward). The counts are the same on every repeat (auto learns from counts), so that figure is free
    of the host's noise; it ignores that wider verifies cost a little more."""
    out = {}
    for method in sorted({r["method"] for r in runs}):
        mine = [r for r in runs if r["method"] == method]
        tokens = sum(r["new_tokens"] for r in mine)
        row = {"tokens_per_second": tokens / sum(r["seconds"] for r in mine)}
        if costs is not None:
            seconds = sum(
                r["metrics"]["draft_forwards"] * costs["draft_step_s"]
                + r["metrics"]["target_forwards"] * costs["target_step_s"]
                for r in mine
            )
            row["counted_tokens_per_second"] = tokens / seconds
        out[method] = row
    return out


def summary(data: dict) -> dict:
    out = {}
    for prompt_class in data["by_class"]:
        pooled = _pooled([r for r in data["runs"] if r["prompt_class"] == prompt_class], data["costs"])
        row = {}
        for key in ("tokens_per_second", "counted_tokens_per_second"):
            if key not in pooled["specdec_auto"]:
                continue
            fixed = {m: r[key] for m, r in pooled.items() if m.startswith("specdec_k")}
            best = max(fixed, key=fixed.get)
            name = "wall" if key == "tokens_per_second" else "counted"
            row[name] = {
                "auto_tok_s": pooled["specdec_auto"][key],
                "best_fixed": best,
                "best_fixed_tok_s": fixed[best],
                "auto_over_best_fixed": pooled["specdec_auto"][key] / fixed[best],
                "auto_over_target": pooled["specdec_auto"][key] / pooled["specdec_target"][key],
                "by_method": {m: r[key] for m, r in pooled.items()},
            }
        out[prompt_class] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--conditions", default="quiet,loaded", help="quiet, loaded or both")
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--prompts-per-class", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        prompts_per_class=args.prompts_per_class,
        repeats=args.repeats,
        ks=(2, 3, 4, 6),
        hf_methods=False,
        classes=tuple(args.classes.split(",")),
    )
    results = {}
    for condition in args.conditions.split(","):
        stop = multiprocessing.Event()
        worker = multiprocessing.Process(target=busy, args=(stop,)) if condition == "loaded" else None
        if worker is not None:
            worker.start()
            time.sleep(1)
        try:
            data = run_benchmark(settings, progress=lambda line, c=condition: print(c, line, flush=True))
        finally:
            if worker is not None:
                stop.set()
                worker.join()
        results[condition] = {"summary": summary(data), "bench": data}
        print(condition, json.dumps(results[condition]["summary"], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
