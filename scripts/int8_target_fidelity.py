"""How close the opt-in int8 target (target_quantization="int8") stays to the original model, before
and after int8 quantisation kept its outlier Linears in float (specdec.quantize).

    .venv/bin/python scripts/int8_target_fidelity.py --out docs/bench/int8-target-fidelity.json

Qwen2.5-Coder-1.5B, the bench's 6 prompts with the chat template. The reference is the bfloat16
target's greedy output (64 tokens, the target alone). Each int8 variant then:
- generates its own greedy output (the target alone): the tokens before its first difference from
  the reference, and the share of the 64 positions that match;
- is teacher-forced on the reference text: the share of positions where its argmax is the
  reference model's (one forward over prompt + text, as a prefill computes the prompt);
- is timed over 1 and 5 tokens after a 128-token context (interleaved medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec import SpeculativeDecoder, load_model
from specdec.bench import PROMPTS, _chat_ids, cpu_model
from specdec.quantize import quantize_int8

sys.path.insert(0, str(Path(__file__).parent))
from draft_quant_bench import interleaved_forward_times  # noqa: E402

TARGET = "qwen2.5-coder-1.5b"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    reference = SpeculativeDecoder.from_pretrained(TARGET, dtype="bfloat16")
    tokenizer = reference.tokenizer
    prompts = [(cls, _chat_ids(tokenizer, PROMPTS[cls][i])) for cls in ("code", "editing", "chat") for i in range(2)]
    greedy = dict(max_new_tokens=args.max_new_tokens, temperature=0)
    texts = [reference.generate(ids, **greedy).token_ids for _, ids in prompts]
    with torch.inference_mode():
        best = [
            reference.target.model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].argmax(-1)
            for (_, ids), out in zip(prompts, texts)
        ]
    variants = {
        "before": quantize_int8(load_model(TARGET, dtype="float32", device="cpu")),
        "after": quantize_int8(load_model(TARGET, dtype="float32", device="cpu"), keep_outliers=True),
    }
    results = {}
    for name, model in variants.items():
        decoder = SpeculativeDecoder(model, None, tokenizer)
        rows = []
        for (cls, ids), ref, ref_best in zip(prompts, texts, best):
            out = decoder.generate(ids, **greedy).token_ids
            prefix = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            with torch.inference_mode():
                forced = model(torch.tensor([ids + ref])).logits[0, len(ids) - 1 : -1].argmax(-1)
            rows.append(
                {
                    "class": cls,
                    "same_prefix_tokens": prefix,
                    "matching_positions": sum(a == b for a, b in zip(out, ref)) / len(ref),
                    "teacher_forced_agreement": float((forced == ref_best).float().mean()),
                }
            )
        results[name] = {"prompts": rows}
        for key in ("same_prefix_tokens", "matching_positions", "teacher_forced_agreement"):
            results[name][key] = statistics.mean(r[key] for r in rows)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "prompts"}), flush=True)
    adapters = {name: SpeculativeDecoder(model, None, tokenizer).target for name, model in variants.items()}
    for (name, width), seconds in interleaved_forward_times(adapters, rounds=4).items():
        results[name][f"forward_{width}_s"] = seconds
    print(json.dumps({n: {k: v for k, v in r.items() if k.startswith("forward")} for n, r in results.items()}))
    if args.out:
        data = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {
                "cpu": cpu_model(),
                "isa": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
            },
            "settings": vars(args),
            "float_linears_after": variants["after"].specdec_float_linears,
            "results": results,
        }
        Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
