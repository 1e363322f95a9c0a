"""A partial draft head (draft_vocab) against the full one, interleaved, on the real pair.

    .venv/bin/python scripts/draft_vocab_bench.py --out docs/bench/draft-vocab.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/draft_vocab_bench.py \
        --dtype float32 --out docs/bench/draft-vocab-avx2.json

Qwen2.5-Coder-0.5B (int8) drafts for 1.5B at the shipped defaults (k auto, draft_width auto), once
with each head: the full vocabulary, and the base sizes given (--sizes). One target, one draft model;
each head is a shallow copy of the draft with its own adapter (and its own calibration). Per prompt,
every method runs back to back, with specdec's target-alone loop as the baseline.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specdec import SpeculativeDecoder
from specdec.adapters import HFCausalLM
from specdec.api import _special_ids
from specdec.bench import PROMPTS, _chat_ids
from specdec.draft_vocab import base_ids, with_vocab_head
from specdec.drafters import ModelDrafter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32768,65536", help="base sizes of the partial heads")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    loaded = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype=args.dtype)
    target, tokenizer, draft = loaded.target, loaded.tokenizer, loaded.drafter.adapter.model
    specials = _special_ids(tokenizer, target)
    decoders = {"target alone": SpeculativeDecoder(target, None, tokenizer), "full head": loaded}
    for size in [int(s) for s in args.sizes.split(",") if s]:
        trimmed = with_vocab_head(draft, base_ids(target.vocab_size, size, specials))
        drafter = ModelDrafter(HFCausalLM(trimmed, name=f"qwen2.5-coder-0.5b head {size}"), target.vocab_size)
        decoders[f"head {size}"] = SpeculativeDecoder(target, drafter, tokenizer)
    for decoder in decoders.values():
        decoder.calibration(1)  # measured (or read from disk) before any timed run
    prompts = [
        (c, i, _chat_ids(tokenizer, PROMPTS[c][i]))
        for c in ("code", "editing", "chat")
        for i in range(args.prompts_per_class)
    ]
    runs = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = {"temperature": 0} if temperature == 0 else {"temperature": temperature, "top_k": 0}
        for cls, index, ids in prompts:
            for name, decoder in decoders.items():
                k = 1 if name == "target alone" else "auto"
                start = time.perf_counter()
                out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, num_draft_tokens=k, seed=0, **sampling)
                seconds = time.perf_counter() - start
                m = out.metrics
                head = getattr(decoder.drafter, "head", None)
                runs.append(
                    {
                        "temperature": temperature,
                        "class": cls,
                        "prompt": index,
                        "method": name,
                        "tokens": len(out.token_ids),
                        "seconds": seconds,
                        "tokens_per_s": len(out.token_ids) / seconds,
                        "mean_acceptance_length": m.mean_acceptance_length,
                        "draft_ms_per_step": 1000 * m.draft_time_s / max(m.draft_forwards, 1),
                        "rounds": m.rounds,
                        "head_rows_at_end": head.size if head is not None else None,
                    }
                )
                r = runs[-1]
                print(
                    f"T={temperature} {cls}{index} {name}: {r['tokens_per_s']:.2f} tok/s, acc len "
                    f"{r['mean_acceptance_length']:.2f}, draft {r['draft_ms_per_step']:.1f} ms/step",
                    flush=True,
                )
    summary = {}
    for temperature in sorted({r["temperature"] for r in runs}):
        rows = [r for r in runs if r["temperature"] == temperature]
        base = {(r["class"], r["prompt"]): r["tokens_per_s"] for r in rows if r["method"] == "target alone"}
        for name in decoders:
            mine = [r for r in rows if r["method"] == name]
            summary[f"T={temperature} {name}"] = {
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "median_vs_target_alone": statistics.median(
                    r["tokens_per_s"] / base[(r["class"], r["prompt"])] for r in mine
                ),
                "mean_acceptance_length": statistics.mean(r["mean_acceptance_length"] for r in mine),
                "median_draft_ms_per_step": statistics.median(r["draft_ms_per_step"] for r in mine),
            }
    for key, value in summary.items():
        print(key, json.dumps({k: round(v, 3) for k, v in value.items()}))
    if args.out:
        data = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {
                "platform": platform.platform(),
                "isa": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
            },
            "settings": vars(args),
            "costs": {name: d.calibration(1).to_dict() for name, d in decoders.items() if name != "target alone"},
            "summary": summary,
            "runs": runs,
        }
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
