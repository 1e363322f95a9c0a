"""The cost of one grammar mask over a real vocabulary: xgrammar against llguidance, interleaved.

For each library: build its tokenizer view once, compile a JSON schema, then walk a valid document
token by token, timing the mask of the next position (filled, then applied to one float32 row of the
model's vocabulary) and the matcher's step over the token. Repeats alternate the libraries.

    specdec bench masks -- --model qwen2.5-coder-1.5b --repeats 5

Prints one JSON object (per library: tokenizer-view and compile ms, mask µs per token median and p90).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from specdec.models.resolution import fetch_alias

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "city", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "city": "London", '
    '"tags": ["maths", "engines"], "active": true}'
)


def xgrammar_walk(tokenizer, vocab: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    view = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    done = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    masks = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        masks.append(time.perf_counter() - t0)
        assert matcher.accept_token(token), token
    return {"view_ms": 1e3 * (view - start), "compile_ms": 1e3 * (done - view), "masks": masks}


def llguidance_walk(tokenizer, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    view = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    done = time.perf_counter()
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    masks = []
    for token in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        masks.append(time.perf_counter() - t0)
        assert matcher.consume_token(token), (token, matcher.get_error())
    return {"view_ms": 1e3 * (view - start), "compile_ms": 1e3 * (done - view), "masks": masks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    path = fetch_alias(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = tokenizer(DOCUMENT)["input_ids"]
    walks = {"xgrammar": xgrammar_walk, "llguidance": llguidance_walk}
    runs: dict[str, list[dict]] = {name: [] for name in walks}
    for _ in range(args.repeats):
        for name, walk in walks.items():
            runs[name].append(walk(tokenizer, vocab, ids))
    report = {"model": args.model, "vocab": vocab, "document_tokens": len(ids), "repeats": args.repeats}
    for name, done in runs.items():
        masks = sorted(m for run in done[1:] or done for m in run["masks"])  # the first repeat warms caches
        report[name] = {
            "view_ms": round(statistics.median(r["view_ms"] for r in done), 1),
            "compile_ms": round(statistics.median(r["compile_ms"] for r in done), 1),
            "mask_us_median": round(1e6 * statistics.median(masks), 1),
            "mask_us_mean": round(1e6 * statistics.mean(masks), 1),
            "mask_us_p90": round(1e6 * masks[int(0.9 * (len(masks) - 1))], 1),
            "mask_us_max": round(1e6 * masks[-1], 1),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
