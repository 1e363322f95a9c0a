"""Load once, generate many: a one-shot `specdec.generate` (loads the pair, quantises the draft)
against repeated `SpeculativeDecoder.generate` calls on one loaded decoder, for an 8-token reply.

    .venv/bin/python scripts/reuse_speed.py --out docs/bench/reuse.json

Prints and writes one JSON object: seconds of the one-shot call, of loading the decoder, and of
each repeated call; the ratio one-shot / median repeated call; and whether every call gave the
same tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

import specdec

PROMPT = "Write a Python function that reverses a string."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = dict(max_new_tokens=args.new_tokens, chat=True, temperature=0, num_draft_tokens="auto")

    start = time.perf_counter()
    one_shot = specdec.generate(PROMPT, target=args.target, draft=args.draft, device="cpu", **settings)
    one_shot_s = time.perf_counter() - start

    start = time.perf_counter()
    decoder = specdec.SpeculativeDecoder.from_pretrained(args.target, draft=args.draft, device="cpu")
    load_s = time.perf_counter() - start
    calls, tokens = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = decoder.generate(PROMPT, **settings)
        calls.append(time.perf_counter() - start)
        tokens.append(out.token_ids)
    result = {
        "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads(),
        "target": args.target,
        "draft": args.draft,
        "new_tokens": args.new_tokens,
        "one_shot_generate_s": one_shot_s,
        "decoder_load_s": load_s,
        "repeated_generate_s": calls,
        "one_shot_over_repeated": one_shot_s / statistics.median(calls[1:] or calls),
        "same_tokens": all(t == one_shot.token_ids for t in tokens),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
