"""What each exact verification method accepts on the real pair: token (Leviathan), block (Sun et al.)
and race (keyed Gumbel), at fixed k, sampled.

    .venv/bin/python scripts/method_acceptance.py --out docs/bench/method-acceptance.json

Acceptance counts do not depend on the host's timings (tokens/s are printed too, but read them only
on a quiet machine). Qwen2.5-Coder-0.5B (int8) drafting for 1.5B (dtype auto), chat prompts from the
bench's code and chat classes, k = 4 without early stop, T in {0.7, 1.0}, top_k 0, one seed per prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

from specdec import SpeculativeDecoder
from specdec.bench import PROMPTS
from specdec.drafters import ModelDrafter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    loaded = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", device="cpu")
    decoder = SpeculativeDecoder(loaded.target, ModelDrafter(loaded.drafter.adapter, stop_below=None), loaded.tokenizer)
    prompts = PROMPTS["code"] + PROMPTS["chat"]
    rows = []
    for temperature in (0.7, 1.0):
        for index, prompt in enumerate(prompts):
            for verification in ("token", "block", "race"):
                start = time.perf_counter()
                out = decoder.generate(
                    prompt,
                    chat=True,
                    max_new_tokens=args.new_tokens,
                    num_draft_tokens=args.k,
                    temperature=temperature,
                    top_k=0,
                    seed=index,
                    verification=verification,
                )
                seconds = time.perf_counter() - start
                m = out.metrics
                rows.append(
                    {
                        "temperature": temperature,
                        "prompt": index,
                        "verification": verification,
                        "accepted": m.accepted_tokens,
                        "drafted": m.drafted_tokens,
                        "rounds": m.rounds,
                        "generated": m.generated_tokens,
                        "tokens_per_second": m.generated_tokens / seconds,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for temperature in (0.7, 1.0):
        for verification in ("token", "block", "race"):
            chosen = [r for r in rows if r["temperature"] == temperature and r["verification"] == verification]
            accepted, drafted = sum(r["accepted"] for r in chosen), sum(r["drafted"] for r in chosen)
            rounds, generated = sum(r["rounds"] for r in chosen), sum(r["generated"] for r in chosen)
            summary[f"T{temperature}-{verification}"] = {
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
                "tokens_per_round": generated / rounds if rounds else 0.0,
            }
    result = {"date": datetime.date.today().isoformat(), "k": args.k, "summary": summary, "runs": rows}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
