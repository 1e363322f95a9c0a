"""Structured output on a real pair: speed against transformers' target alone with the same grammar, and
validity of sampled replies (docs/BENCHMARKS.md, "Structured output").

    specdec bench structured -- speed --repeats 2          # Qwen2.5-Coder 1.5B with its 0.5B draft
    specdec bench structured -- validity --replies 200     # sampled replies checked with jsonschema

speed: extraction prompts (fill a six-field schema from a paragraph), greedy, each mode in turn per prompt and
repeat, in one process: specdec constrained, transformers' generate() with the same llguidance grammar as its
logits processor (tests/grammarcheck.SequentialMask), specdec and transformers unconstrained, and specdec
constrained with its draft drafting unmasked. It reports seconds per token, the speedups, whether the
constrained outputs are equal, the share of forced tokens and the acceptance with and without the draft's mask.
validity: replies sampled (temperature 0.8) across five schemas, each parsed and validated with jsonschema.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.metrics import SpeculativeMetrics  # noqa: E402
from specdec.verify.grammar import constraint_of  # noqa: E402
from specdec.verify.sampling import Warping  # noqa: E402
from tests.grammarcheck import SequentialMask  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "languages", "married"],
    "additionalProperties": False,
}
PARAGRAPHS = [
    "Maria Gonzalez is a 34-year-old civil engineer who lives in Valencia. She speaks Spanish, Catalan and "
    "English, and has been married to her husband Luis for six years.",
    "Kenji Watanabe, 58, runs a small ramen shop in Osaka. He is a widower and speaks only Japanese, though he "
    "is learning a little English from his customers.",
    "Amara Okafor is a software developer from Lagos. At 27 she is single, speaks English, Yoruba and French, "
    "and is moving to Berlin next spring.",
    "Lars Eriksson is a retired sailor of 71 living in Gothenburg. He speaks Swedish, Norwegian and German and "
    "has been married for forty years.",
]
SHORT = {"type": "string", "maxLength": 40}  # validity: strings bounded, so a sampled reply ends within its budget
SCHEMAS = {  # validity: nested objects, arrays, enums, numbers, optional fields
    "person": {
        **PERSON,
        "properties": {
            **PERSON["properties"],
            "name": SHORT,
            "city": SHORT,
            "occupation": SHORT,
            "languages": {"type": "array", "items": SHORT, "maxItems": 4},
        },
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 4,
            },
            "total": {"type": "number", "minimum": 0, "maximum": 10000},
            "status": {"enum": ["pending", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": SHORT,
            "when": {
                "type": "object",
                "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}, "month": {"type": "string"}},
                "required": ["day", "month"],
            },
            "online": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["work", "family", "sport", "music"]}, "maxItems": 4},
        },
        "required": ["title", "when", "online"],
        "additionalProperties": False,  # closed, as OpenAI's strict mode requires: open, a reply may add fields
    },  # fmt: skip
    "rating": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 5}, "comment": SHORT},
        "required": ["score"],
        "additionalProperties": False,
    },
    "point": {
        "type": "array",
        "items": {"type": "number", "minimum": -1000, "maximum": 1000},
        "minItems": 2,
        "maxItems": 3,
    },
}
VALIDITY_PROMPTS = {
    "person": "Describe a fictional person as JSON.",
    "order": "Write a shop order as JSON.",
    "event": "Describe an upcoming event as JSON.",
    "rating": "Rate a film you like, as JSON.",
    "point": "Give a point in space as a JSON array.",
}


MODES = ("specdec_constrained", "hf_constrained", "specdec_plain", "hf_plain", "specdec_draft_unmasked")
OTHER_MODES = ("specdec_unforced",)  # constrained, forced tokens drafted by the draft model


def chat_ids(decoder, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return decoder.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def extraction(paragraph: str) -> str:
    fields = "name, age, city, occupation, languages and married"
    return f"Extract the person described below as JSON with {fields}.\n\n{paragraph}"


def hf_greedy(decoder, ids: list[int], n: int, constrained: bool) -> tuple[list[int], float]:
    model, tokenizer = decoder.target.model, decoder.tokenizer
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    processors = LogitsProcessorList()
    if constrained:
        processors.append(SequentialMask(constraint_of(json_schema=PERSON), tokenizer, model.config.vocab_size, eos))
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, do_sample=False,
                             pad_token_id=eos[0], logits_processor=processors)  # fmt: skip
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def specdec_greedy(decoder, ids, n: int, constrained: bool, unmasked_draft: bool = False, unforced: bool = False):
    metrics, options = SpeculativeMetrics(), dict(json_schema=PERSON) if constrained else {}
    forced = Warping.forced
    if unforced:  # forced tokens drafted by the draft model, as any other
        Warping.forced = lambda self, prefixes, rows: [None] * len(rows)
    if unmasked_draft:  # the draft drafts under the unconstrained warping; the target still masks
        plain, _ = decoder.warping(SpecConfig.of(max_new_tokens=n, temperature=0))
        propose = decoder.drafter.propose

        def unmasked(sequences, lengths, warping, generator, race=None):
            return propose(sequences, lengths, plain.for_prompts(warping.prompt_lengths), generator, race=race)

        decoder.drafter.propose = unmasked
    start = time.perf_counter()
    try:
        result = decoder.generate(ids, max_new_tokens=n, temperature=0, metrics=metrics, **options)
    finally:
        decoder.drafter.__dict__.pop("propose", None)
        Warping.forced = forced
    return result.token_ids, time.perf_counter() - start, metrics


def speed(args) -> dict:
    decoder = SpeculativeDecoder.from_pretrained(args.target, draft=args.draft, dtype=args.dtype)
    prompts = [chat_ids(decoder, extraction(p)) for p in PARAGRAPHS[: args.prompts]]
    specdec_greedy(decoder, prompts[0], 16, True)  # warm-up: calibration, the tokenizer's grammar view
    modes = tuple(args.modes.split(","))
    runs = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for ids in prompts:
            for mode in modes:
                constrained = "constrained" in mode or "unmasked" in mode or "unforced" in mode
                if mode.startswith("hf"):
                    tokens, seconds = hf_greedy(decoder, ids, args.max_new_tokens, constrained)
                    metrics = None
                else:
                    tokens, seconds, metrics = specdec_greedy(decoder, ids, args.max_new_tokens, constrained,
                                                              "unmasked" in mode, "unforced" in mode)  # fmt: skip
                runs[mode].append(dict(tokens=tokens, seconds=seconds, metrics=metrics and metrics.to_dict()))
    per_token = {m: statistics.median(r["seconds"] / max(1, len(r["tokens"])) for r in runs[m]) for m in modes}
    total = lambda m, key: sum(r["metrics"][key] for r in runs[m])  # noqa: E731
    rate = lambda m: round(total(m, "accepted_tokens") / max(1, total(m, "drafted_tokens")), 3)  # noqa: E731
    equal = lambda a, b: [x["tokens"] == y["tokens"] for x, y in zip(runs[a], runs[b])]  # noqa: E731
    lengths = {m: round(statistics.mean(r["metrics"]["mean_acceptance_length"] for r in runs[m]), 2)
               for m in modes if m.startswith("specdec")}  # fmt: skip
    report = {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "repeats": args.repeats,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "ms_per_token": {m: round(1e3 * v, 1) for m, v in per_token.items()},
        "acceptance": {m: rate(m) for m in modes if m.startswith("specdec")},
        "mean_acceptance_length": lengths,
        "forced_share": {m: round(total(m, "forced_tokens") / total(m, "generated_tokens"), 3)
                         for m in modes if m.startswith("specdec")},
        "draft_forwards": {m: total(m, "draft_forwards") for m in modes if m.startswith("specdec")},
    }  # fmt: skip
    for name, (ours, theirs) in {"constrained": ("specdec_constrained", "hf_constrained"),
                                 "unconstrained": ("specdec_plain", "hf_plain")}.items():  # fmt: skip
        if ours in runs and theirs in runs:
            report[f"speedup_{name}"] = round(per_token[theirs] / per_token[ours], 3)
            report[f"{name}_equal"] = equal(ours, theirs)
    if "specdec_unforced" in runs and "specdec_constrained" in runs:
        report["unforced_equal"] = equal("specdec_constrained", "specdec_unforced")
    report["replies"] = [decoder.tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in runs[modes[0]]]
    return report


def validity(args) -> dict:
    import jsonschema

    decoder = SpeculativeDecoder.from_pretrained(args.target, draft=args.draft, dtype=args.dtype)
    counts, failures, lengths = {}, [], 0
    chosen = {name: SCHEMAS[name] for name in args.schemas.split(",")}
    per_schema = -(-args.replies // len(chosen))
    for name, schema in chosen.items():
        ids = chat_ids(decoder, VALIDITY_PROMPTS[name])
        results = []
        for start in range(0, per_schema, args.batch):  # a batch of sampled rows, one seed per call
            rows = min(args.batch, per_schema - start)
            results += decoder.generate([ids] * rows, max_new_tokens=args.max_new_tokens, temperature=0.8,
                                        seed=start, json_schema=schema)  # fmt: skip
        valid = 0
        for result in results:
            eos = decoder.target.model.generation_config.eos_token_id
            ended = result.token_ids and result.token_ids[-1] in (eos if isinstance(eos, list) else [eos])
            try:
                jsonschema.validate(json.loads(result.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as error:
                failures.append(dict(schema=name, ended=bool(ended), text=result.text[-80:], error=str(error)[:120]))
            lengths += len(result.token_ids)
        counts[name] = dict(replies=len(results), valid=valid)
    total = sum(c["replies"] for c in counts.values())
    return {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "temperature": 0.8,
        "max_new_tokens": args.max_new_tokens, "replies": total, "valid": sum(c["valid"] for c in counts.values()),
        "per_schema": counts, "mean_tokens": round(lengths / max(1, total), 1), "failures": failures[:10],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("speed", "validity"))
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help="validity: the schemas to sample (SCHEMAS)")
    parser.add_argument("--modes", default=",".join(MODES), help="speed: the modes to interleave (MODES)")
    args = parser.parse_args(argv)
    report = speed(args) if args.what == "speed" else validity(args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
