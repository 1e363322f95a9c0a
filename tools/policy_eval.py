"""Draft-length decisions compared by counts: tokens per modelled second, free of the host's noise.

    .venv/bin/python tools/policy_eval.py auto k2 k3 k4 k6 --out scripts/results/bench/policy-eval.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python tools/policy_eval.py auto k1 k2

The Qwen pair at specdec's defaults (dtype auto, int8 draft, draft_width auto), 128 greedy tokens on
the bench's 6 prompts (chat template). Each round's draft steps and verify width (chain + siblings) are
recorded; its modelled time is steps x draft step + target forward at that width, from this host's
calibration (the one `auto` decides with, cached on disk). With a seed-free greedy run and costs fixed,
the counts, and so the figure, do not depend on how busy the host is; it does not see host work the
calibration misses (tree masks, the stop's own bookkeeping), so confirm a change by wall clock
(`specdec bench host`, `specdec bench runs`). Figures are x the target alone (tokens x target forward / modelled time).
In bfloat16 a policy's verify widths can flip near-ties, so variants may score slightly different texts;
with --dtype float32 every variant's greedy text is the target's own. `--dtype float32 --costs-dtype
bfloat16` has both: float32 texts (the same for every variant), while `auto` decides, and the rounds are
timed, with the bfloat16 pair's calibration (the costs this host's defaults see).
"""

from __future__ import annotations

import argparse
import json

import specdec.engine.decoder as decoder_module
from specdec.api import SpeculativeDecoder
from specdec.bench.host import host_info
from specdec.bench.main import EXTRA_PROMPTS, PROMPTS

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
ROUNDS: list[tuple[int, int]] = []  # (draft steps, verify width) of each round of the current run
_score = decoder_module.score


def _recording_score(target, batch, active, proposal, *rest):
    siblings = 0 if proposal.siblings is None else proposal.siblings.tokens.shape[1]
    ROUNDS.append((proposal.steps, proposal.tokens.shape[1] + 1 + siblings))  # copy drafts are in tokens
    return _score(target, batch, active, proposal, *rest)


def modelled_seconds(costs) -> float:
    """The recorded rounds' time by the calibration: draft steps x draft step + the verify at its width."""
    return sum(steps * costs.draft_step_s + costs.target(width) for steps, width in ROUNDS)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", default=["auto"], help="auto or kN")
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--dtype", default="auto", help="float32: every variant scores the same greedy text")
    parser.add_argument("--costs-dtype", help="decide and time with this dtype's calibration (e.g. bfloat16)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--prompt-set", choices=["bench", "extra", "all"], default="bench", help="all: the bench's 2 + 2 more per class"
    )
    parser.add_argument("--out")
    return parser.parse_args()


def load_decoder(args) -> SpeculativeDecoder:
    """The pair at --dtype, deciding with --costs-dtype's calibration where that is given."""
    borrowed = None
    if args.costs_dtype:  # the other dtype's pair, loaded only for its calibration (measured once, cached)
        pair = SpeculativeDecoder.from_pretrained(TARGET, draft=DRAFT, dtype=args.costs_dtype)
        borrowed = pair.calibration(1)
        del pair
    decoder = SpeculativeDecoder.from_pretrained(TARGET, draft=DRAFT, dtype=args.dtype)
    if borrowed is not None:
        decoder.calibration = lambda batch: borrowed
    return decoder


def run_all(args, decoder: SpeculativeDecoder, costs) -> list[dict]:
    """Every variant on every prompt, its rounds recorded and timed by the calibration."""
    runs = []
    for prompt_class in args.classes.split(","):
        bench, extra = PROMPTS[prompt_class], EXTRA_PROMPTS[prompt_class]
        texts = {"bench": bench, "extra": extra, "all": bench + extra}[args.prompt_set]
        for index, prompt in enumerate(texts):
            for variant in args.variants:
                ROUNDS.clear()
                k = "auto" if variant == "auto" else int(variant.removeprefix("k"))
                result = decoder.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, num_draft_tokens=k)
                modelled = modelled_seconds(costs)
                tokens = len(result.token_ids)
                run = dict(prompt_class=prompt_class, prompt_index=index, variant=variant, tokens=tokens)
                run.update(rounds=len(ROUNDS), modelled_s=modelled, counted_speedup=tokens * costs.target(1) / modelled)
                runs.append(run)
                print(
                    f"{prompt_class}[{index}] {variant}: {tokens} tokens, {len(ROUNDS)} rounds, "
                    f"{run['counted_speedup']:.3f}x the target alone (counted)",
                    flush=True,
                )
    return runs


def summarise(runs: list[dict], costs) -> dict:
    """Per class and variant: pooled tokens x target forward / pooled modelled time."""
    summary = {}
    for run in runs:
        cell = summary.setdefault(run["prompt_class"], {}).setdefault(run["variant"], [0, 0.0])
        cell[0] += run["tokens"]
        cell[1] += run["modelled_s"]
    return {c: {v: n * costs.target(1) / s for v, (n, s) in row.items()} for c, row in summary.items()}


def write(args, costs, summary: dict, runs: list[dict]) -> None:
    result = dict(
        dtype=args.dtype,
        prompt_set=args.prompt_set,
        max_new_tokens=args.max_new_tokens,
        costs_dtype=args.costs_dtype or args.dtype,
        host=host_info(),
        costs=costs.to_dict(),
        summary=summary,
        runs=runs,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    args = parse_args()
    decoder_module.score = _recording_score
    decoder = load_decoder(args)
    costs = decoder.calibration(1)
    runs = run_all(args, decoder, costs)
    summary = summarise(runs, costs)
    for prompt_class, row in summary.items():
        print(prompt_class, {v: round(x, 3) for v, x in row.items()})
    if args.out:
        write(args, costs, summary, runs)


if __name__ == "__main__":
    main()
