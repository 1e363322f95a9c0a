"""Prompt lookup after the draft (specdec.lookup), on and off, against the target alone, interleaved.

    .venv/bin/python scripts/lookup_bench.py --out docs/bench/lookup-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/lookup_bench.py \
        --target-quantization int8 --out docs/bench/lookup-avx2-int8.json

One SpeculativeDecoder (the shipped defaults: dtype auto, int8 draft, auto k, draft width auto),
called with prompt_lookup="auto" (on: the default) and False, and the target alone through the same
loop, each prompt in the order A B C, `--repeats` times. Greedy by default. Prints and writes: tokens/s
per method pooled per class (tokens / seconds over prompts and repeats), per-prompt ratios, the copy
drafts proposed and accepted, and the host's ISA as torch sees it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from specdec import SpeculativeDecoder
from specdec.bench import PROMPTS

COPY_FIELDS = ("lookup_accepted", "lookup_tokens")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--target-quantization", default=None)
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    decoder = SpeculativeDecoder.from_pretrained(
        args.target, draft=args.draft, device="cpu", target_quantization=args.target_quantization
    )
    alone = SpeculativeDecoder(decoder.target, None, decoder.tokenizer)
    methods = {
        "target": (alone, {}),
        "lookup_off": (decoder, {"prompt_lookup": False}),
        "defaults": (decoder, {}),  # prompt_lookup="auto"
    }
    prompts = [(c, i, text) for c in args.classes.split(",") for i, text in enumerate(PROMPTS[c])]
    options = dict(chat=True, num_draft_tokens="auto", temperature=args.temperature, seed=0)
    for _, (dec, extra) in methods.items():  # warm-up and calibration, untimed
        dec.generate(prompts[0][2], max_new_tokens=4, **options, **extra)
    runs = []
    for repeat in range(args.repeats):
        for cls, index, text in prompts:
            for name, (dec, extra) in methods.items():
                start = time.perf_counter()
                out = dec.generate(text, max_new_tokens=args.new_tokens, **options, **extra)
                seconds = time.perf_counter() - start
                m = out.metrics
                runs.append(
                    {
                        "method": name,
                        "class": cls,
                        "prompt": index,
                        "repeat": repeat,
                        "tokens": len(out.token_ids),
                        "seconds": seconds,
                        "rounds": m.rounds,
                        "mean_acceptance_length": m.mean_acceptance_length,
                        "lookup_tokens": m.lookup_tokens,
                        "lookup_accepted": m.lookup_accepted,
                        "draft_forwards": m.draft_forwards,
                    }
                )
                print(
                    f"{cls}[{index}] #{repeat + 1} {name}: {len(out.token_ids) / seconds:.2f} tok/s, "
                    f"{m.rounds} rounds, copies {m.lookup_accepted}/{m.lookup_tokens}",
                    flush=True,
                )

    def pooled(method: str, cls: str | None = None) -> float:
        chosen = [r for r in runs if r["method"] == method and (cls is None or r["class"] == cls)]
        return sum(r["tokens"] for r in chosen) / sum(r["seconds"] for r in chosen)

    def ratios(a: str, b: str) -> list[float]:  # per prompt and repeat: a's tok/s over b's, side by side
        key = lambda r: (r["class"], r["prompt"], r["repeat"])  # noqa: E731
        rate = {(r["method"], key(r)): r["tokens"] / r["seconds"] for r in runs}
        return [rate[a, key(r)] / rate[b, key(r)] for r in runs if r["method"] == a]

    classes = args.classes.split(",")
    result = {
        "date": datetime.date.today().isoformat(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "target_quantization": args.target_quantization,
        "temperature": args.temperature,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "pooled_tokens_per_second": {m: {c: pooled(m, c) for c in classes} | {"all": pooled(m)} for m in methods},
        "median_ratio_vs_target": {m: statistics.median(ratios(m, "target")) for m in ("lookup_off", "defaults")},
        "median_ratio_defaults_vs_lookup_off": statistics.median(ratios("defaults", "lookup_off")),
        "copies_accepted_proposed": {
            c: [sum(r[f] for r in runs if r["method"] == "defaults" and r["class"] == c) for f in COPY_FIELDS]
            for c in classes
        },
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
