"""The int8 draft quantised every Linear per tensor (what drafts use) against keeping its outlier
layers in float with per-channel weights (quantize_int8(keep_outliers=True), what the opt-in int8
target uses), on the real pair: Qwen2.5-Coder-0.5B drafting for 1.5B (dtype auto), the bench's 6 prompts, chat template.

    .venv/bin/python scripts/draft_quant_bench.py --out docs/bench/draft-quant.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/draft_quant_bench.py --steps-only
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/draft_quant_bench.py \
        --classes code,chat --prompts-per-class 1 --max-new-tokens 64 --out docs/bench/draft-quant-avx2.json

Three decoders share one target: the target alone, the draft quantised "before" (torch.ao dynamic
int8, one weight scale per tensor, every Linear) and "after" (per-channel weights; the Linears fed
massive activations stay float32). The "after" scheme bought no end-to-end speed, so drafts stayed
on "before" (docs/BENCHMARKS.md). Per prompt and temperature they run back to back (interleaved),
at specdec's defaults (k auto, draft width auto), 128 new tokens. Reported:
- agreement: teacher-forced on the target-alone greedy text of each prompt, the share of positions
  where each draft's argmax is the target's, and at T = 0.7 the expected acceptance sum min(p, q).
  Free of timing noise.
- tokens/s pooled per class (total tokens / total seconds), and "counted" tokens/s: each run's draft
  and target forwards timed by the decoder's own calibration (no clocks in that figure).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specdec import SpeculativeDecoder, load_model
from specdec.adapters import HFCausalLM
from specdec.bench import PROMPTS, _chat_ids, _timed_forward, cpu_model
from specdec.quantize import quantize_int8

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def agreement(draft_model, target_model, sequences) -> dict:
    out = {}
    with torch.inference_mode():
        for cls, start, seq in sequences:
            p = target_model(seq).logits[0, start - 1 : -1].float()
            q = draft_model(seq).logits[0, start - 1 : -1].float()
            greedy = float((q.argmax(-1) == p.argmax(-1)).float().mean())
            sampled = float(torch.minimum(torch.softmax(p / 0.7, -1), torch.softmax(q / 0.7, -1)).sum(-1).mean())
            row = out.setdefault(cls, {"greedy": [], "t0.7": []})
            row["greedy"].append(greedy)
            row["t0.7"].append(sampled)
    return {cls: {k: sum(v) / len(v) for k, v in row.items()} for cls, row in out.items()}


def interleaved_forward_times(adapters: dict, rounds: int, widths=(1, 5)) -> dict:
    """{(name, width): median seconds} of each adapter's forward over `width` tokens after a fixed
    128-token context; the adapters take turns, `rounds` times, 3 timed forwards each turn."""
    context = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    times = {(name, width): [] for name in adapters for width in widths}
    for _ in range(rounds):
        for name, adapter in adapters.items():
            for width in widths:
                times[name, width].append(_timed_forward(adapter, context, width, repeats=3))
    return {key: statistics.median(t) for key, t in times.items()}


def step_times(repeats: int = 5) -> dict:
    """Each draft's forward over 1 and 5 tokens after a 128-token context, interleaved, medians."""
    drafts = {
        "before": HFCausalLM(quantize_int8(load_model(DRAFT, dtype="float32", device="cpu")), DRAFT),
        "after": HFCausalLM(quantize_int8(load_model(DRAFT, dtype="float32", device="cpu"), keep_outliers=True), DRAFT),
    }
    out = {f"{name} width {width}": t for (name, width), t in interleaved_forward_times(drafts, repeats).items()}
    out["after / before, width 1"] = out["after width 1"] / out["before width 1"]
    out["after / before, width 5"] = out["after width 5"] / out["before width 5"]
    return {"isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), **out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--steps-only", action="store_true", help="time the two drafts' steps, interleaved; no runs")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.steps_only:
        return print(json.dumps(step_times(), indent=1))
    base = SpeculativeDecoder.from_pretrained(TARGET)
    target, tokenizer = base.target, base.tokenizer
    new_model = quantize_int8(load_model(DRAFT, dtype="float32", device="cpu"), keep_outliers=True)
    drafts = {
        "before": HFCausalLM(quantize_int8(load_model(DRAFT, dtype="float32", device="cpu")), f"{DRAFT}-int8-v1"),
        "after": HFCausalLM(new_model, f"{DRAFT}-int8-v2"),
    }
    decoders = {"target": base} | {name: SpeculativeDecoder(target, d, tokenizer) for name, d in drafts.items()}
    for name in drafts:
        decoders[name].calibration(1)  # measured before the timed runs
    runs, texts = [], []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for cls in args.classes.split(","):
            for index in range(args.prompts_per_class):
                ids = _chat_ids(tokenizer, PROMPTS[cls][index])
                for name, decoder in decoders.items():
                    start = time.perf_counter()
                    out = decoder.generate(
                        ids,
                        max_new_tokens=args.max_new_tokens,
                        num_draft_tokens="auto",
                        temperature=temperature,
                        top_k=0,
                        top_p=1.0,
                        seed=0,
                    )
                    seconds = time.perf_counter() - start
                    m = out.metrics.to_dict()
                    runs.append(
                        {
                            "method": name,
                            "temperature": temperature,
                            "class": cls,
                            "index": index,
                            "tokens": len(out.token_ids),
                            "seconds": seconds,
                            "metrics": m,
                        }
                    )
                    print(
                        f"T={temperature} {cls}[{index}] {name}: {len(out.token_ids) / seconds:.2f} tok/s, "
                        f"mean acceptance length {m['mean_acceptance_length']:.2f}",
                        flush=True,
                    )
                    if name == "target" and temperature == 0:
                        texts.append((cls, len(ids), torch.tensor([ids + out.token_ids])))
    summary = {}
    for temperature in sorted({r["temperature"] for r in runs}):
        for cls in ("all", *args.classes.split(",")):
            row = {}
            for name, decoder in decoders.items():
                mine = [
                    r
                    for r in runs
                    if r["method"] == name and r["temperature"] == temperature and cls in ("all", r["class"])
                ]
                tokens = sum(r["tokens"] for r in mine)
                entry = {"tokens_per_second": tokens / sum(r["seconds"] for r in mine)}
                if name != "target":  # one target cost for both drafts: only their draft steps differ
                    step, forward = decoder.calibration(1).draft_step_s, decoders["before"].calibration(1).target(1)
                    counted = sum(
                        r["metrics"]["draft_forwards"] * step + r["metrics"]["target_forwards"] * forward for r in mine
                    )
                    entry["counted_tokens_per_second"] = tokens / counted
                    entry["mean_acceptance_length"] = sum(r["metrics"]["mean_acceptance_length"] for r in mine) / len(
                        mine
                    )
                row[name] = entry
            row["after_vs_before"] = row["after"]["tokens_per_second"] / row["before"]["tokens_per_second"]
            row["after_vs_before_counted"] = (
                row["after"]["counted_tokens_per_second"] / row["before"]["counted_tokens_per_second"]
            )
            row["after_vs_target"] = row["after"]["tokens_per_second"] / row["target"]["tokens_per_second"]
            row["before_vs_target"] = row["before"]["tokens_per_second"] / row["target"]["tokens_per_second"]
            summary[f"T={temperature} {cls}"] = row
            print(f"T={temperature} {cls}: " + json.dumps({k: v for k, v in row.items() if "vs" in k}), flush=True)
    agree = {name: agreement(d.model, target.model, texts) for name, d in drafts.items()}
    print("agreement", json.dumps(agree), flush=True)
    data = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "isa": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
        },
        "settings": vars(args),
        "float_linears_after": new_model.specdec_float_linears,
        "costs": {name: decoders[name].calibration(1).to_dict() for name in drafts},
        "agreement": agree,
        "summary": summary,
        "runs": runs,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
