"""One client of `specdec serve` against `SpeculativeDecoder.generate` on the same prompts, in one process
(issue 39: the server must decode as fast as the engine it wraps).

    .venv/bin/specdec bench session -- --repeats 2 --out scripts/results/serve-vs-generate.json

One SpeculativeDecoder is loaded once. Each repeat runs, in turn (interleaved, so drift falls on both):
- generate: the held-out prompts of the serve bench (specdec.bench.serve.PROMPTS) one after another,
  chat template on, greedy, --max-tokens each;
- serve: the same prompts through the OpenAI API (one streaming client, /v1/chat/completions) of the
  server app on uvicorn in this process, over the same decoder.
tokens/s = completion tokens / the wall time of the whole pass. Greedy: both give the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import time
from pathlib import Path

from specdec import SpeculativeDecoder
from specdec.bench.host import host_info
from specdec.bench.serve import PROMPTS, run_cell
from specdec.serving.server import ServeSettings, create_app, serving_in_thread


def generate_pass(decoder, prompts, max_tokens: int) -> tuple[int, float, list[str]]:
    began, tokens, texts = time.perf_counter(), 0, []
    for prompt in prompts:
        out = decoder.generate(
            [{"role": "user", "content": prompt}], chat=True, max_new_tokens=max_tokens, temperature=0
        )
        tokens += len(out.token_ids)
        texts.append(out.text)
    return tokens, time.perf_counter() - began, texts


def serve_and_generate(base: str, decoder, prompts: list, args) -> list[dict]:
    """The warm-ups, then each repeat's generate pass and serve pass, interleaved."""
    generate_pass(decoder, prompts[:1], 16)  # warm-up: the pair's costs measured (or read) at batch 1
    asyncio.run(run_cell(base, "bench", 1, prompts[:1], 16, "chat", 600, 600))  # the session's costs
    rows = []
    for repeat in range(args.repeats):
        tokens, seconds, texts = generate_pass(decoder, prompts, args.max_tokens)
        rows.append({"repeat": repeat, "path": "generate", "tokens": tokens, "seconds": seconds})
        records, wall = asyncio.run(run_cell(base, "bench", 1, prompts, args.max_tokens, "chat", 3600, 3600))
        served = sum(r["completion_tokens"] or 0 for r in records if r.get("ok"))
        rows.append({"repeat": repeat, "path": "serve", "tokens": served, "seconds": wall,
                     "failed": sum(not r.get("ok") for r in records)})  # fmt: skip
        for row in rows[-2:]:
            print(f"repeat {repeat} {row['path']:8s} {row['tokens']} tokens in {row['seconds']:.1f} s: "
                  f"{row['tokens'] / row['seconds']:.2f} tok/s", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    decoder = SpeculativeDecoder.from_pretrained(args.target, args.draft, dtype=args.dtype)
    prompts = list(PROMPTS[: args.prompts])
    app = create_app(decoder, ServeSettings(model="bench", max_batch=8))
    with serving_in_thread(app) as base:
        rows = serve_and_generate(base, decoder, prompts, args)
    rate = {p: sum(r["tokens"] for r in rows if r["path"] == p) / sum(r["seconds"] for r in rows if r["path"] == p)
            for p in ("generate", "serve")}  # fmt: skip
    ratios = [s["tokens"] / s["seconds"] / (g["tokens"] / g["seconds"]) for g, s in zip(rows[::2], rows[1::2])]
    print(f"serve / generate, one client: {rate['serve'] / rate['generate']:.3f} (per repeat: "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        data = {"date": date, "settings": vars(args), "host": host_info(), "rows": rows, "tok_s": rate}
        data["ratio"] = rate["serve"] / rate["generate"]
        args.out.write_text(json.dumps(data, indent=1, default=str))
