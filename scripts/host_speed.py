"""Defaults on this host: specdec as a new user runs it against the target alone, interleaved.

    .venv/bin/specdec bench host -- --out scripts/results/bench/host-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/specdec bench host -- --out scripts/results/bench/host-avx2.json

Methods (each on every prompt, in the order A B C A B C ...):
- target: the target alone through specdec's loop (draft=None), dtype auto;
- defaults: SpeculativeDecoder.from_pretrained(target, draft) as shipped (dtype auto, int8 draft on CPU,
  k auto from the calibration, learned confidence stop);
- target_plain / defaults_plain (--plain): the same with the target's Linears unpacked (specdec.models.packing);
- int8_target / int8_target_speculative: the opt-in int8 target (exact for that quantised model),
  alone and with the int8 draft at auto k; --int8-drafts adds int8_target_<draft> for other drafts
  of that same int8 target (e.g. smollm2-135m, a cross-tokenizer draft, or ngram).
Prints and writes one JSON object: tokens/s per method (median over prompts), ratios, acceptance,
the calibration auto used, the host's ISA as torch sees it, and the dtype auto chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec import SpeculativeDecoder
from specdec.bench.host import host_info
from specdec.bench.main import PROMPTS
from specdec.models.forms import parse_dtype
from specdec.models.resolution import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--classes", default="code,chat")
    parser.add_argument("--int8-target", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--int8-drafts", default="", help="more drafts for the int8 target, comma-separated")
    parser.add_argument("--no-defaults", action="store_true", help="skip the shipped-dtype target and defaults")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also the target and defaults with unpacked Linears (load_model pack=False)",
    )
    parser.add_argument("--out")
    return parser.parse_args(argv)


def build_decoders(args) -> dict[str, SpeculativeDecoder]:
    """The methods, by name, in the order they run on each prompt."""
    decoders = {}
    if not args.no_defaults:
        full = SpeculativeDecoder.from_pretrained(args.target, draft=args.draft, device="cpu")
        decoders = {"target": SpeculativeDecoder(full.target, None, full.tokenizer), "defaults": full}
        if args.plain:  # the same, before specdec.models.packing: a model passed as an object is not packed
            model = load_model(args.target, dtype="auto", device="cpu", pack=False)
            plain = SpeculativeDecoder.from_pretrained(model, draft=args.draft, device="cpu", tokenizer=full.tokenizer)
            decoders |= {
                "target_plain": SpeculativeDecoder(plain.target, None, full.tokenizer),
                "defaults_plain": plain,
            }
    if args.int8_target:
        quantised = SpeculativeDecoder.from_pretrained(
            args.target, draft=args.draft, device="cpu", target_quantization="int8"
        )
        decoders["int8_target"] = SpeculativeDecoder(quantised.target, None, quantised.tokenizer)
        decoders["int8_target_speculative"] = quantised
        for draft in [d for d in args.int8_drafts.split(",") if d]:
            decoders[f"int8_target_{draft}"] = SpeculativeDecoder.from_pretrained(
                quantised.target, draft=draft, device="cpu", tokenizer=quantised.tokenizer
            )
    return decoders


def measure(decoders: dict, prompts: list[str], new_tokens: int) -> tuple[dict, dict, dict]:
    """Every method on every prompt, interleaved, after an untimed warm-up:
    -> tokens/s and mean acceptance length per method and prompt, and each method's calibration."""
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    accepted: dict[str, list[float]] = {name: [] for name in decoders}
    calibration = {}
    for decoder in decoders.values():  # warm-up and calibration, untimed
        decoder.generate(prompts[0], max_new_tokens=4, chat=True, num_draft_tokens="auto")
    for prompt in prompts:
        for name, decoder in decoders.items():
            start = time.perf_counter()
            out = decoder.generate(prompt, max_new_tokens=new_tokens, chat=True, num_draft_tokens="auto")
            rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
            accepted[name].append(out.metrics.mean_acceptance_length)
            calibration[name] = out.calibration
            print(f"{name}: {rates[name][-1]:.2f} tok/s, mean acceptance length {accepted[name][-1]:.2f}", flush=True)
    return rates, accepted, calibration


def report(args, decoders: dict, prompts: list[str], rates: dict, accepted: dict, calibration: dict) -> dict:
    """The JSON object: medians, ratios, acceptance, calibration and the host."""
    median = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "host": host_info(),
        "dtype_auto": str(parse_dtype("auto", "cpu")),
        "new_tokens": args.new_tokens,
        "prompts": len(prompts),
        "tokens_per_second": median,
        "per_prompt_tokens_per_second": rates,
        "mean_acceptance_length": {name: statistics.mean(a) for name, a in accepted.items()},
        "defaults_vs_target": median["defaults"] / median["target"] if "defaults" in median else None,
        "calibration": calibration,
    }
    if args.plain:  # per prompt, then the median
        result["packed_vs_plain_by_prompt"] = {
            name: statistics.median(a / b for a, b in zip(rates[name], rates[f"{name}_plain"]))
            for name in ("target", "defaults")
        }
    if args.int8_target:
        result["int8_speculative_vs_int8_target"] = median["int8_target_speculative"] / median["int8_target"]
        # per prompt, then the median: each prompt's runs sat side by side
        result["int8_vs_int8_target_by_prompt"] = {
            name: statistics.median(a / b for a, b in zip(rates[name], rates["int8_target"]))
            for name in decoders
            if name.startswith("int8_target_")
        }
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    decoders = build_decoders(args)
    prompts = [text for c in args.classes.split(",") for text in PROMPTS[c]]
    rates, accepted, calibration = measure(decoders, prompts, args.new_tokens)
    result = report(args, decoders, prompts, rates, accepted, calibration)
    print(json.dumps({k: v for k, v in result.items() if k != "calibration"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
