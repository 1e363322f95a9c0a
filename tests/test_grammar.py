"""Structured output under speculation: a grammar is a processor of the target's law
(specdec.verify.grammar). Greedy output equals transformers' generate() with the same grammar as its
logits processor (tests/grammarcheck.SequentialMask), token for token in float32, for every drafter and
verification; sampled output follows the constrained law, enumerated on a vocabulary of 8 under a regex
and a Lark grammar at 6 sigma (tests/lawcheck); bad constraints fail before decoding.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from transformers import AutoTokenizer

from specdec import SpeculativeDecoder
from specdec.config import SpecConfig, check_request
from specdec.metrics import SpeculativeMetrics
from specdec.serving.openai_schema import StopTrimmer
from specdec.serving.server import ServeSettings, create_app, serving_in_thread
from specdec.verify.grammar import CompiledConstraint, Constraint, GrammarMask, constraint_of
from specdec.verify.sampling import Warping
from tests.grammarcheck import constrained_greedy, constrained_outcome_law
from tests.lawcheck import generate_warpers, outcome_violations
from tests.tiny import CharTokenizer, build, perturbed, save_char_tokenizer

EOS = 95  # the char tokenizer's last id (<unk>): the tiny models' EOS here

SCHEMA = {  # nested object, array of enums, bounded integer, number, optional field
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "inner": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "tags", "ok", "inner"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": dict(regex=r"[a-z]{2,5}@[a-z]{3}\.(com|org)"),
    "schema": dict(json_schema=SCHEMA),
    "lark": dict(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'),
    "gbnf": dict(grammar='root ::= "yes" | "no" | "maybe " [a-z]+'),
    "json": dict(response_format={"type": "json_object"}),
}
DRAFTS = {  # name -> generate() options beside the draft
    "model-k3": dict(num_draft_tokens=3),
    "model-tree-w3": dict(num_draft_tokens=3, draft_width=3),
    "model-race": dict(num_draft_tokens=4, verification="race"),
    "model-block": dict(num_draft_tokens=3, verification="block"),
    "ngram": dict(num_draft_tokens=4),
    "alone": dict(),
}
PROMPT = "name: ab@cd.org (1+2) ab@cd.org"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar-models")
    target = build("llama", 3, root / "target", sharpness=3.0)
    save_char_tokenizer(root / "target")
    target.generation_config.eos_token_id = EOS
    target.generation_config.save_pretrained(root / "target")  # the CLI loads it with its EOS
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.name_or_path = str(root / "target")
    return target, perturbed(target, 0.3, seed=4), tokenizer


def decoder_for(pair, draft: str) -> SpeculativeDecoder:
    target, near, tokenizer = pair
    drafter = {"ngram": "ngram", "alone": None}.get(draft.split("-")[0], near)
    return SpeculativeDecoder(target, drafter, tokenizer)


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_constrained_greedy_equals_the_target_alone_under_the_grammar(pair, name, draft):
    target, _, tokenizer = pair
    decoder = decoder_for(pair, draft)
    prompt = tokenizer(PROMPT)["input_ids"]
    result = decoder.generate(prompt, max_new_tokens=40, temperature=0, **CONSTRAINTS[name], **DRAFTS[draft])
    expected = constrained_greedy(target, prompt, 40, constraint_of(**CONSTRAINTS[name]), tokenizer)
    assert result.token_ids == expected
    if expected[-1] == EOS:  # ended by the grammar: a whole sentence of it
        text = tokenizer.decode(expected[:-1])
        if name in ("schema", "json"):
            json.loads(text)


def test_rows_with_and_without_constraints_share_a_batch(pair):
    target, _, tokenizer = pair
    decoder = decoder_for(pair, "model-k3")
    prompts = [tokenizer(p)["input_ids"] for p in (PROMPT, "zz (3+4) yes", PROMPT[::-1])]
    rows = [CONSTRAINTS["regex"], {}, CONSTRAINTS["schema"] | {"max_new_tokens": 30}]
    results = decoder.generate(prompts, max_new_tokens=24, temperature=0, num_draft_tokens=3, rows=rows)
    for prompt, options, result in zip(prompts, rows, results):
        budget = options.get("max_new_tokens", 24)
        constraint = constraint_of(**{k: v for k, v in options.items() if k != "max_new_tokens"})
        if constraint is None:
            plain = target.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, pad_token_id=EOS)
            assert result.token_ids == plain[0, len(prompt) :].tolist()
        else:
            assert result.token_ids == constrained_greedy(target, prompt, budget, constraint, tokenizer)


def test_a_draft_masked_by_the_grammar_is_accepted_more_often(pair):
    """Contract 1 under a grammar: the draft samples from its own masked law, so it proposes no token the
    grammar refuses; the same draft drafting unmasked (judged against the masked target) loses more."""
    target, near, tokenizer = pair
    prompt = tokenizer(PROMPT)["input_ids"]
    rates = {}
    for masked in (True, False):
        metrics, decoder = SpeculativeMetrics(), SpeculativeDecoder(target, near, tokenizer)
        if not masked:
            plain, _ = decoder.warping(SpecConfig.of(max_new_tokens=40, temperature=0))
            decoder.drafter.propose = _drafting_with(decoder.drafter.propose, plain)
        decoder.generate(prompt, max_new_tokens=40, temperature=0, num_draft_tokens=3, metrics=metrics,
                         prompt_lookup=False, **CONSTRAINTS["schema"])  # fmt: skip
        rates[masked] = metrics.acceptance_rate
    assert rates[True] > rates[False]


def _drafting_with(propose, plain):
    """propose, drafting under `plain` (bound to the round's prompt lengths) instead of the round's warping."""
    return lambda sequences, lengths, warping, generator, race=None: propose(
        sequences, lengths, plain.for_prompts(warping.prompt_lengths), generator, race=race
    )


def test_forced_tokens_are_free_drafts_that_save_rounds_and_draft_forwards(pair, monkeypatch):
    """Where the grammar allows one token, it is drafted without the draft model (and past the draft's own
    stop); the output is the same, in fewer rounds and draft forwards, than drafting it with the model."""
    target, near, tokenizer = pair
    runs = {}
    for free in (True, False):
        if not free:
            monkeypatch.setattr(Warping, "forced", lambda self, prefixes, rows: [None] * len(rows))
        metrics = SpeculativeMetrics()
        result = SpeculativeDecoder(target, near, tokenizer).generate(
            PROMPT, max_new_tokens=60, temperature=0, metrics=metrics, prompt_lookup=False, **CONSTRAINTS["schema"]
        )
        runs[free] = result.token_ids, metrics
    (free_ids, free), (drafted_ids, drafted) = runs[True], runs[False]
    assert free_ids == drafted_ids
    assert free.forced_tokens > 0 and drafted.forced_tokens == 0
    assert free.rounds < drafted.rounds and free.draft_forwards < drafted.draft_forwards


# ------------------------------------------------------------------ sampled laws, enumerated

VOCAB = 8
LAW_EOS = 6  # "g"
ROWS = 3000
STEPS = 3
LAWS = {  # over the tokens a..h (CharTokenizer), g the EOS
    "regex": Constraint("regex", "(a|b|e)c[def]+"),  # c forced second
    "lark": Constraint("grammar", 'start: ("a" | "bd" | "ef")+'),  # d forced after b, f after e
}


class Letters(CharTokenizer):
    """The letters a..h as the 8 tokens."""

    def __len__(self):
        return VOCAB


@pytest.fixture(scope="module")
def law_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar-law-models")
    target = build("llama", 20, root / "target", layers=1, hidden=16, vocab=VOCAB, sharpness=1.5)
    target.generation_config.eos_token_id = LAW_EOS
    return target, perturbed(target, 0.5, seed=21)


LAW_CASES = {
    "regex-model-k2-T1": dict(grammar="regex", num_draft_tokens=2),
    "regex-tree-w3-top3": dict(grammar="regex", num_draft_tokens=2, draft_width=3, top_k=3, temperature=0.7),
    "lark-model-k3-T1.5-top-p": dict(grammar="lark", num_draft_tokens=3, temperature=1.5, top_p=0.95),
    "lark-ngram-k3": dict(grammar="lark", draft="ngram", num_draft_tokens=3),
    "regex-race-k3": dict(grammar="regex", num_draft_tokens=3, verification="race"),
}


def law_run(case: dict, law_models, prompt=(1, 5, 2), metrics=None) -> list[list[int]]:
    target, near = law_models
    options = dict(case)
    grammar, draft = LAWS[options.pop("grammar")], options.pop("draft", near)
    decoder = SpeculativeDecoder(target, draft, Letters())
    temperature = options.pop("temperature", 1.0)
    out = decoder.generate([list(prompt)] * ROWS, max_new_tokens=STEPS, seed=0, temperature=temperature,
                           metrics=metrics, **{grammar.kind: grammar.source}, **options)  # fmt: skip
    return [row.token_ids for row in out]


@pytest.mark.parametrize("name", list(LAW_CASES))
def test_sampled_output_follows_the_constrained_law(law_models, name):
    case = LAW_CASES[name]
    target, _ = law_models
    metrics = SpeculativeMetrics()
    outputs = law_run(case, law_models, metrics=metrics)
    if case["grammar"] == "regex":  # c, forced second in every row: a free draft (rows force in lockstep)
        assert metrics.forced_tokens > 0
    if "draft" not in case:  # a draft model: both paths (accept and recover) run
        assert 0 < metrics.draft_acceptance_rate < 1
    warpers = generate_warpers(case.get("temperature", 1.0), case.get("top_k"), case.get("top_p"))
    law = constrained_outcome_law(target, (1, 5, 2), STEPS, LAWS[case["grammar"]], Letters(), LAW_EOS, warpers)
    assert outcome_violations(outputs, law) == []


def test_the_law_check_catches_a_mask_read_one_position_early(law_models, monkeypatch):
    """A broken variant: each position masked with the grammar's state one token before its own prefix."""
    original = GrammarMask.refused
    monkeypatch.setattr(GrammarMask, "refused", lambda self, prefix, vocab: original(self, prefix[:-1], vocab)
                        if len(prefix) > self.start else original(self, prefix, vocab))  # fmt: skip
    target, _ = law_models
    outputs = law_run(LAW_CASES["regex-model-k2-T1"], law_models)
    law = constrained_outcome_law(target, (1, 5, 2), STEPS, LAWS["regex"], Letters(), LAW_EOS, [])
    assert outcome_violations(outputs, law) != []


# ------------------------------------------------------------------ bad input, before decoding


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(regex="[a-"), "regex does not compile"),
        (dict(json_schema={"type": "objectx"}), "json schema does not compile"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(grammar="start: undefined_rule"), "grammar does not compile"),
        (dict(response_format={"type": "xml"}), "response_format type must be"),
        (dict(response_format={"type": "json_schema"}), "needs"),
        (dict(regex="a+", json_schema={"type": "object"}), "one output constraint"),
        (dict(regex=""), "non-empty text"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_any_model_runs(options, message):
    base = dict(max_new_tokens=8, num_draft_tokens=2, stop=None, stream=None, seed=None)
    with pytest.raises(ValueError, match=message):
        check_request(**base, temperature=None, top_k=None, top_p=None, do_sample=None, **options)


def test_a_constraint_needs_an_eos_token(pair):
    target, _, tokenizer = pair
    plain = copy.deepcopy(target)
    plain.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="needs an EOS token id"):
        SpeculativeDecoder(plain, None, tokenizer).generate("ab", max_new_tokens=4, regex="[a-z]+")


def test_a_minimum_length_beside_a_grammar_is_refused_before_decoding(pair):
    """The grammar may end the reply before the minimum: generate() would then mask every token (its greedy
    pick index 0, off the grammar). Refused, whether the call or the model's own config asks for it."""
    target, _, tokenizer = pair
    decoder = SpeculativeDecoder(target, None, tokenizer)
    for options in (dict(min_new_tokens=6), dict(min_length=30)):
        with pytest.raises(ValueError, match="refused beside structured output"):
            decoder.generate("ab", max_new_tokens=8, grammar='root ::= "yes" | "no"', **options)
    own = copy.deepcopy(target)
    own.generation_config.min_new_tokens = 3
    with pytest.raises(ValueError, match="refused beside structured output"):
        SpeculativeDecoder(own, None, tokenizer).generate("ab", max_new_tokens=8, regex="[a-z]+")
    assert SpeculativeDecoder(own, None, tokenizer).generate("ab", max_new_tokens=4, temperature=0).token_ids


def test_the_budget_ending_first_leaves_a_valid_prefix_that_is_not_complete(pair):
    target, _, tokenizer = pair
    result = decoder_for(pair, "model-k3").generate(PROMPT, max_new_tokens=5, temperature=0, json_schema=SCHEMA)
    constraint = CompiledConstraint(constraint_of(json_schema=SCHEMA), tokenizer, 96, {EOS})
    assert len(result.token_ids) == 5 and result.token_ids[-1] != EOS
    assert not constraint.complete(result.token_ids)
    matcher = constraint.matcher()
    assert matcher.try_consume_tokens(result.token_ids) == 5  # every token is legal


# ------------------------------------------------------------------ the server, through the openai client


class Reading(pydantic.BaseModel):
    """A reply every tiny model finishes within its budget: each field is bounded."""

    ok: bool
    level: int = pydantic.Field(ge=0, le=99)
    tag: Literal["a", "bb", "ccc"]


@pytest.fixture(scope="module")
def served(pair, tmp_path_factory):
    target, near, tokenizer = pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}: "
    decoder = SpeculativeDecoder(target, near, tokenizer)
    with serving_in_thread(create_app(decoder, ServeSettings(model="tiny", max_batch=4)), "critical") as base:
        yield decoder, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60), base


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_a_json_schema_equals_generate_and_validates(served, stream):
    decoder, client, _ = served
    messages = [{"role": "user", "content": "a record:"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=0,
                                           response_format=SCHEMA_FORMAT, stream=stream)  # fmt: skip
    if stream:
        chunks = list(reply)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
    else:
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    expected = decoder.generate(messages, chat=True, max_new_tokens=120, temperature=0, json_schema=SCHEMA)
    assert text == expected.text
    if finish == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:  # the budget ended first: a valid prefix, never called complete
        assert finish == "length" and len(expected.token_ids) == 120


def test_stream_gives_the_constrained_text_and_metrics_count_forced_tokens(served):
    decoder, client, base = served
    text = "".join(decoder.stream(PROMPT, max_new_tokens=40, temperature=0, json_schema=SCHEMA))
    assert text == decoder.generate(PROMPT, max_new_tokens=40, temperature=0, json_schema=SCHEMA).text
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a record:"}], max_tokens=60,
                                   temperature=0, response_format=SCHEMA_FORMAT)  # fmt: skip
    metrics = httpx.get(base + "/metrics").text
    forced = [line for line in metrics.splitlines() if line.startswith("specdec_forced_tokens_total")]
    assert forced and float(forced[0].split()[-1]) > 0  # the keys and separators the schema fixes


def test_the_clients_parse_helper_fills_a_pydantic_model(served):
    _, client, _ = served
    for seed in range(3):
        messages = [{"role": "user", "content": f"{seed}"}]
        completion = client.chat.completions.parse(
            model="tiny", messages=messages, response_format=Reading, max_tokens=60, seed=seed, temperature=1.0
        )
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(completion.choices[0].message.parsed, Reading)


def test_completions_take_json_mode_and_a_bad_schema_is_400_leaving_the_batch_alone(served):
    decoder, client, base = served
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(client.completions.create, model="tiny", prompt="zz", max_tokens=30, temperature=0)
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
        with pytest.raises(openai.BadRequestError, match="does not compile") as caught:
            client.completions.create(model="tiny", prompt="zz", max_tokens=8, extra_body={"response_format": bad})
        assert caught.value.body["param"] == "response_format"
        json_mode = pool.submit(client.completions.create, model="tiny", prompt="zz", max_tokens=60, temperature=0,
                                extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
        assert plain.result().choices[0].text == decoder.generate("zz", max_new_tokens=30, temperature=0).text
        reply = json_mode.result().choices[0]
    assert (
        reply.text
        == decoder.generate("zz", max_new_tokens=60, temperature=0, response_format={"type": "json_object"}).text
    )
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.text), dict)


# ------------------------------------------------------------------ the CLI


def test_the_cli_takes_a_schema_file_a_regex_and_a_grammar_and_refuses_a_bad_one(pair, tmp_path):
    from typer.testing import CliRunner

    from specdec_cli.app import app

    target, _, tokenizer = pair
    schema_file, grammar_file = tmp_path / "schema.json", tmp_path / "sum.lark"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file.write_text(CONSTRAINTS["lark"]["grammar"])
    base = ["generate", PROMPT, "--target", tokenizer.name_or_path, "--draft", "ngram", "-n", "30", "-t", "0"]
    base += ["--dtype", "float32", "--json"]
    decoder = SpeculativeDecoder(target, "ngram", tokenizer)
    for flag, value, options in [
        ("--json-schema", str(schema_file), dict(json_schema=SCHEMA)),
        ("--json-schema", json.dumps(SCHEMA), dict(json_schema=SCHEMA)),
        ("--regex", CONSTRAINTS["regex"]["regex"], CONSTRAINTS["regex"]),
        ("--grammar", str(grammar_file), CONSTRAINTS["lark"]),
    ]:
        result = CliRunner().invoke(app, [*base, flag, value])
        assert result.exit_code == 0, result.output
        expected = decoder.generate(PROMPT, max_new_tokens=30, temperature=0, **options)
        assert json.loads(result.stdout)["token_ids"] == expected.token_ids
    result = CliRunner().invoke(app, [*base, "--regex", "[a-"])
    assert result.exit_code != 0 and "regex does not compile" in result.output


def test_a_dead_end_ends_the_row_and_the_server_does_not_call_it_complete(pair):
    """The char tokenizer has no newline: after "ab" the grammar allows nothing, so EOS alone; the reply is
    the valid prefix, and the server's finish_reason for it is "length", never "stop"."""
    from specdec.serving.runners import Completion
    from specdec.serving.server import _finish_reason

    target, _, tokenizer = pair
    result = decoder_for(pair, "model-k3").generate("zz", max_new_tokens=10, temperature=0, regex="ab\ncd")
    assert result.token_ids == tokenizer("ab")["input_ids"] + [EOS]
    trimmer = StopTrimmer([])
    for regex, finish in (("ab\ncd", "length"), ("ab", "stop")):
        grammar = CompiledConstraint(Constraint("regex", regex), tokenizer, 96, {EOS})
        completion = Completion([1], 10, None, None, None, [], frozenset({EOS}), grammar=grammar)
        assert _finish_reason(completion, result, trimmer) == finish


def test_vllms_structured_outputs_take_a_regex_a_choice_a_grammar_and_a_schema(served):
    decoder, client, base = served
    for asked, options in [
        ({"regex": CONSTRAINTS["regex"]["regex"]}, CONSTRAINTS["regex"]),
        ({"choice": ["yes", "no", "maybe so"]}, dict(grammar='start: "yes" | "no" | "maybe so"')),
        ({"grammar": CONSTRAINTS["gbnf"]["grammar"]}, CONSTRAINTS["gbnf"]),
        ({"json": SCHEMA}, dict(json_schema=SCHEMA)),
    ]:
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": asked})  # fmt: skip
        assert reply.choices[0].text == decoder.generate(PROMPT, max_new_tokens=40, temperature=0, **options).text
    for body, message in [
        ({"structured_outputs": {"regex": "[a-"}}, "regex does not compile"),
        ({"structured_outputs": {"grammar": 'start: <[5000]> "a"'}}, "grammar does not compile"),  # this tokenizer's
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "one of json, regex, grammar or choice"),
        ({"structured_outputs": {"choice": []}}, "list of non-empty strings"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
    ]:
        response = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "zz", "max_tokens": 4, **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "structured_outputs"


def test_a_forced_token_the_draft_cannot_embed_is_fed_as_padding(pair, tmp_path):
    """A draft with one token fewer than the target: EOS (95) is forced at the grammar's end, and fed to the
    draft as padding (its context changes, never its law), so the run ends, equal to the target alone."""
    from specdec.drafters import ModelDrafter
    from specdec.models.adapters import HFCausalLM

    target, _, tokenizer = pair
    small = build("llama", 4, tmp_path / "small", vocab=95)
    decoder = SpeculativeDecoder(target, ModelDrafter(HFCausalLM(small), vocab_size=96), tokenizer)
    prompt = tokenizer("zz")["input_ids"]
    for regex in ("ab", "(ab|cd)e"):  # EOS forced right after the last letter, in the draft's chain
        result = decoder.generate(prompt, max_new_tokens=12, temperature=0, num_draft_tokens=4, regex=regex)
        assert result.token_ids == constrained_greedy(target, prompt, 12, constraint_of(regex=regex), tokenizer)


def test_a_grammar_naming_a_token_the_tokenizer_lacks_fails_before_decoding(pair):
    with pytest.raises(ValueError, match="grammar does not compile"):
        decoder_for(pair, "model-k3").generate("zz", max_new_tokens=4, grammar='start: <[5000]> "a"')
