"""Cross-tokenizer drafting, measured: SmolLM2-135M (its own tokenizer) drafting for Qwen2.5-Coder-1.5B.

Methods, run back to back on each prompt (A B C A B C ...), greedy then sampled (T=0.7, no top-k/top-p):
- hf_target: transformers `generate`, the target alone.
- hf_uag: transformers' Universal Assisted Generation (`assistant_model=` SmolLM2 in the target's
  dtype, `tokenizer=`, `assistant_tokenizer=`), its defaults. Under sampling transformers switches
  to its token-intersection generator, which prunes the assistant's head: each mode gets its own copy.
- specdec_target: specdec's loop with no draft.
- specdec_text_k{k} (a chain), specdec_text_k{k}_w{w} (draft trees, --widths), specdec_text_auto (the
  defaults: k and width auto): SmolLM2 in text mode, loaded as specdec loads a draft by name
  (`SpeculativeDecoder.from_pretrained(target, "smollm2-135m")`: int8 on CPU).
- specdec_qwen05_auto: Qwen2.5-Coder-0.5B (the target's tokenizer, int8), the same-family draft.

Writes the JSON (runs and summaries) after every run, then a markdown table.

    OMP_NUM_THREADS=1 .venv/bin/specdec bench tokenizers --            # ~25 min
    .venv/bin/specdec bench tokenizers -- --prompts-per-class 1 --max-new-tokens 32   # smoke run
    .venv/bin/specdec bench tokenizers -- --uag-law    # is transformers' sampled UAG lossless? (~1 min)

`--uag-law` runs the law check of tests/test_crosstok.py (the tiny two-tokenizer pair, the exact law
of the first three tokens enumerated from the target, 6 sigma per bin) on transformers' UAG with
do_sample=True, and on plain sampling as the control.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import specdec
from specdec.bench.host import host_info
from specdec.bench.main import PROMPTS
from specdec.drafters.crosstok import CrossTokenizerDrafter
from specdec.metrics import SpeculativeMetrics

TARGET, DRAFT, SAME_FAMILY = "qwen2.5-coder-1.5b", "smollm2-135m", "qwen2.5-coder-0.5b"
SAMPLED_TEMPERATURE = 0.7
SEED = 0


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def hf_runner(model, sampled: bool, **assist):
    kwargs = dict(do_sample=True, temperature=SAMPLED_TEMPERATURE, top_k=0, top_p=1.0) if sampled else {}
    kwargs = kwargs or {"do_sample": False}

    def run(ids: list[int], max_new_tokens: int):
        inputs = torch.tensor([ids])
        torch.manual_seed(SEED)
        with torch.inference_mode():
            out = model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens, **kwargs, **assist
            )
        return out[0, len(ids) :].tolist(), None

    return run


def specdec_runner(decoder, sampled: bool, k, width="auto"):
    sampling = dict(temperature=SAMPLED_TEMPERATURE, top_k=0, top_p=1.0) if sampled else dict(temperature=0)

    def run(ids: list[int], max_new_tokens: int):
        out = decoder.generate(
            ids, max_new_tokens=max_new_tokens, num_draft_tokens=k, seed=SEED, draft_width=width, **sampling
        )
        return out.token_ids, out.metrics.to_dict()

    return run


def build(args, progress) -> tuple[dict, object]:
    """-> {mode: {method: runner}}, tokenizer. Every specdec decoder shares the one target model."""
    progress(f"loading {TARGET} ({args.dtype}) with {DRAFT} through specdec's public API")
    text = specdec.SpeculativeDecoder.from_pretrained(TARGET, DRAFT, dtype=args.dtype, device="cpu")
    assert isinstance(text.drafter, CrossTokenizerDrafter), "the pair must be drafted through text"
    tokenizer, target = text.tokenizer, text.target
    cross = text.drafter
    alone = specdec.SpeculativeDecoder(target, None, tokenizer)
    more_ranks = {}  # text mode with more runners-up per draft step as sibling candidates (--sibling-ranks)
    for ranks in args.sibling_ranks:
        ranked = CrossTokenizerDrafter(cross.adapter, cross.draft_tokenizer, tokenizer, target.vocab_size)
        ranked.SIBLING_RANKS = ranks
        more_ranks[ranks] = specdec.SpeculativeDecoder(target, ranked, tokenizer)
    same_family = specdec.SpeculativeDecoder.from_pretrained(target.model, SAME_FAMILY, dtype=args.dtype, device="cpu")
    smol_tokenizer = specdec.load_tokenizer(DRAFT)
    methods = {}
    for mode in args.modes:
        sampled = mode == "sampled"
        assistant = specdec.load_model(DRAFT, dtype=args.dtype, device="cpu")  # one per mode: sampling prunes it
        runners = {
            "hf_target": hf_runner(target.model, sampled),
            "specdec_target": specdec_runner(alone, sampled, 1),
            "hf_uag": hf_runner(
                target.model,
                sampled,
                assistant_model=assistant,
                tokenizer=tokenizer,
                assistant_tokenizer=smol_tokenizer,
            ),
        }
        for k in args.ks:
            runners[f"specdec_text_k{k}"] = specdec_runner(text, sampled, k, width=1)  # a chain
            for width in args.widths:  # draft trees: the draft's runners-up as siblings
                runners[f"specdec_text_k{k}_w{width}"] = specdec_runner(text, sampled, k, width)
        runners["specdec_text_auto"] = specdec_runner(text, sampled, "auto")  # the defaults (trees where they pay)
        for ranks, decoder in more_ranks.items():
            runners[f"specdec_text_auto_r{ranks}"] = specdec_runner(decoder, sampled, "auto")
        runners["specdec_qwen05_auto"] = specdec_runner(same_family, sampled, "auto")
        if args.only:
            runners = {name: run for name, run in runners.items() if name in args.only}
        methods[mode] = runners
    progress("calibrating (auto's costs for each pair, measured once before any timed run)")
    text.calibration(1)
    same_family.calibration(1)
    return methods, tokenizer


def summarise(runs: list[dict]) -> dict:
    """Per method: median tokens/s over prompts, ratios to the baselines, pooled acceptance."""
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        by_method.setdefault(run["method"], []).append(run)
    median = {m: statistics.median(r["tokens_per_second"] for r in rs) for m, rs in by_method.items()}
    summary = {}
    for method, method_runs in by_method.items():
        row = {"tokens_per_second": median[method], "runs": len(method_runs)}
        for base in ("hf_target", "specdec_target", "hf_uag"):
            if base in median:
                row[f"vs_{base}"] = median[method] / median[base]
        merged = [SpeculativeMetrics.from_dict(r["metrics"]) for r in method_runs if r["metrics"]]
        if merged and any(m.drafted_tokens for m in merged):
            total = sum(merged[1:], merged[0])
            row |= {
                "acceptance_rate": total.acceptance_rate,
                "mean_acceptance_length": total.mean_acceptance_length,
                "draft_share": total.draft_time_s / total.wall_time_s if total.wall_time_s else 0.0,
            }
        summary[method] = row
    return summary


def markdown(data: dict) -> str:
    lines = []
    for mode, summary in data["summary"].items():
        label = "greedy" if mode == "greedy" else f"sampled, T={SAMPLED_TEMPERATURE}"
        lines += [
            f"{label}:",
            "",
            "| method | tokens/s | vs target alone (hf) | vs specdec target | vs UAG | acceptance | mean acc. length |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for method, row in summary.items():
            acceptance = f"{row['acceptance_rate']:.1%}" if "acceptance_rate" in row else ""
            length = f"{row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else ""
            lines.append(
                f"| {method} | {row['tokens_per_second']:.2f} | {row.get('vs_hf_target', 0):.2f}x | "
                f"{row.get('vs_specdec_target', 0):.2f}x | {row.get('vs_hf_uag', 0):.2f}x | {acceptance} | {length} |"
            )
        lines.append("")
    return "\n".join(lines)


def uag_law_check(rows: int = 2000) -> dict:
    """transformers' UAG (different tokenizers, do_sample=True) against the target's exact law."""
    import sys
    import tempfile

    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' tiny pair and law check
    from tests import test_crosstok as tiny_pair
    from tests.lawcheck import outcome_law, outcome_violations
    from tests.tiny import build

    root = Path(tempfile.mkdtemp())
    target = build("llama", 40, root / "target", layers=1, hidden=16, vocab=len(tiny_pair.ALPHABET), sharpness=20.0)
    tiny_pair.target_tokenizer().save_pretrained(root / "target")
    draft = tiny_pair.draft_model(target, tiny_pair.draft_tokenizer(), root / "draft", seed=41, scale=0.4)
    tokenizer, draft_tokenizer = (
        AutoTokenizer.from_pretrained(root / "target"),
        AutoTokenizer.from_pretrained(root / "draft"),
    )
    prompt, steps = tiny_pair.PROMPTS[0], 3
    law = outcome_law(target, prompt, steps, temperature=1.0, top_k=0, top_p=1.0)
    inputs = torch.tensor([prompt])
    common = dict(attention_mask=torch.ones_like(inputs), max_new_tokens=steps, do_sample=True, top_k=0, pad_token_id=0)
    assisted = dict(assistant_model=draft, tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
    torch.manual_seed(SEED)
    result = {}
    for name, extra in (("hf_uag_sampled", assisted), ("hf_sampled", {})):
        outputs = [target.generate(inputs, **common, **extra)[0, len(prompt) :].tolist() for _ in range(rows)]
        problems = outcome_violations(outputs, law)
        result[name] = {"rows": rows, "violations": len(problems), "examples": problems[:4]}
        print(name, result[name], flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--classes", default="code,chat")
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--ks", default="4", help="fixed draft lengths for the SmolLM2 drafters")
    parser.add_argument(
        "--widths", default="", help="draft widths (trees) for SmolLM2 text mode at each k, e.g. 2,auto"
    )
    parser.add_argument(
        "--sibling-ranks", default="", help="also run the defaults with N runners-up per step, e.g. 3,4"
    )
    parser.add_argument("--only", default="", help="comma-separated method names to run (default: all)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="scripts/results/bench/crosstok.json")
    parser.add_argument("--markdown", default="scripts/results/bench/crosstok.md", help="where the markdown tables go")
    parser.add_argument("--uag-law", action="store_true", help="only the law check of transformers' sampled UAG")
    return parser.parse_args(argv)


def split_lists(args) -> None:
    """The comma-separated options as lists, in place (--classes stays as given)."""
    args.modes = args.modes.split(",")
    args.ks = [int(k) for k in args.ks.split(",")]
    args.widths = [w if w == "auto" else int(w) for w in args.widths.split(",") if w]
    args.only = [name for name in args.only.split(",") if name]
    args.sibling_ranks = [int(r) for r in args.sibling_ranks.split(",") if r]


def write_uag_law(out: Path) -> None:
    """The law check of transformers' sampled UAG, added to the benchmark's JSON."""
    data = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps(data | {"uag_law_check": uag_law_check()}, indent=1))


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def new_data(args, classes: list[str]) -> dict:
    """The JSON's settings, machine and date, with no runs yet."""
    return {
        "settings": {**vars(args), "classes": classes, "target": TARGET, "draft": DRAFT, "same_family": SAME_FAMILY},
        "machine": host_info(),
        "date": datetime.date.today().isoformat(),
        "runs": [],
        "summary": {},
    }


def run_all(args, methods: dict, prompts: list, data: dict, started: float) -> None:
    """Warm every method up, then each mode's methods back to back on each prompt; the JSON is
    rewritten after every run."""
    progress("warm-up (4 tokens per method)")
    for runners in methods.values():
        for run in runners.values():
            run(prompts[0][2], 4)
    for mode, runners in methods.items():
        for prompt_class, index, ids in prompts:
            for method, run in runners.items():
                start = time.perf_counter()
                tokens, metrics = run(ids, args.max_new_tokens)
                seconds = time.perf_counter() - start
                data["runs"].append(
                    {
                        "mode": mode,
                        "method": method,
                        "prompt_class": prompt_class,
                        "prompt_index": index,
                        "new_tokens": len(tokens),
                        "seconds": seconds,
                        "tokens_per_second": len(tokens) / seconds,
                        "metrics": metrics,
                    }
                )
                progress(f"{mode} {prompt_class}[{index}] {method}: {len(tokens) / seconds:.2f} tok/s")
                data["summary"][mode] = summarise([r for r in data["runs"] if r["mode"] == mode])
                data["wall_s"] = time.perf_counter() - started
                Path(args.out).write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.uag_law:
        write_uag_law(Path(args.out))
        return
    split_lists(args)
    classes = args.classes.split(",")
    started = time.perf_counter()
    methods, tokenizer = build(args, progress)
    prompts = [(c, i, chat_ids(tokenizer, PROMPTS[c][i])) for c in classes for i in range(args.prompts_per_class)]
    data = new_data(args, classes)
    run_all(args, methods, prompts, data, started)
    Path(args.markdown).write_text(markdown(data))
    print(markdown(data))
