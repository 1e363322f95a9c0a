"""`auto` against fixed k, on a quiet host and with another process keeping a core busy (issue: speed
that holds on the machine it runs on). Qwen2.5-Coder-0.5B (int8) drafting for 1.5B (bfloat16), 128
greedy tokens, one prompt per class, specdec at its defaults (draft_width auto) with k in {2, 3, 4, 6}
and auto, interleaved; the load is a pure-Python busy loop in a second process.

    .venv/bin/python scripts/load_bench.py --out docs/bench/load.json
    .venv/bin/python scripts/load_bench.py --conditions quiet --classes chat --out docs/bench/load-chat-quiet.json
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


def summary(data: dict) -> dict:
    out = {}
    for prompt_class, rows in data["by_class"].items():
        fixed = {m: r["tokens_per_second"] for m, r in rows.items() if m.startswith("specdec_k")}
        best = max(fixed, key=fixed.get)
        out[prompt_class] = {
            "auto_tok_s": rows["specdec_auto"]["tokens_per_second"],
            "best_fixed": best,
            "best_fixed_tok_s": fixed[best],
            "auto_over_best_fixed": rows["specdec_auto"]["tokens_per_second"] / fixed[best],
            "auto_over_target": rows["specdec_auto"]["speedup_vs_target"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--conditions", default="quiet,loaded", help="quiet, loaded or both")
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        prompts_per_class=1,
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
