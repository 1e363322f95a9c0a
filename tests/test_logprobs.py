"""The target's log-probabilities of every emitted token (generate(logprobs=n), the server's `logprobs`):
free from the verify forward, and what the target alone computes at each position (float32), for chains,
trees, sampled and batched rows alike; in OpenAI's shapes, streamed and not."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.engine.decoder import KINDS
from tests import test_serve
from tests.test_serve import MODEL, live, post
from tests.tiny import build, noisy_pair, perturbed, save_char_tokenizer

tiny = test_serve.tiny  # the served pair (a char tokenizer: one character a token)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return noisy_pair(tmp_path_factory.mktemp("logprobs"))


def target_laws(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """[new tokens, vocab]: the target alone's raw log-softmax at each new token's position, one forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + new_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(new_ids)]


def assert_target_alone(model, out, top: int) -> None:
    laws = target_laws(model, out.prompt_ids, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) > 0
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(entry.logprob - laws[j, token].item()) < 1e-5, j
        best = laws[j].topk(top)
        assert [i for i, _ in entry.top] == best.indices.tolist(), j
        assert all(abs(v - w) < 1e-5 for (_, v), w in zip(entry.top, best.values.tolist()))


CASES = {
    "greedy-chain-k3": dict(temperature=0, num_draft_tokens=3, draft_width=1),
    "sampled-token-k2": dict(temperature=0.8, seed=1, num_draft_tokens=2, draft_width=1),
    "greedy-tree-w2": dict(temperature=0, num_draft_tokens=3, draft_width=2),
    "race-tree-w3": dict(temperature=0.9, seed=2, verification="race", draft_width=3, num_draft_tokens=2),
    "stop-string": dict(temperature=0, num_draft_tokens=3, stop=["b c"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_tokens_logprob_is_the_target_alones_at_its_position(decoder, name):
    out = decoder.generate("a b c a b", max_new_tokens=40, logprobs=3, **CASES[name])
    assert_target_alone(decoder.target.model, out, 3)
    if "tree" in name and CASES[name]["temperature"] == 0:
        assert out.metrics.accepted_tokens > 0 and out.metrics.tree_nodes > 0  # tree columns were read


def test_batched_rows_and_the_target_alone_get_the_target_alones_logprobs(decoder):
    rows = decoder.generate(["a b c a b", "hello world", "xyz"], max_new_tokens=20, temperature=0, logprobs=2)
    for out in rows:
        assert_target_alone(decoder.target.model, out, 2)
    alone = SpeculativeDecoder(decoder.target.model, None, decoder.tokenizer)
    assert_target_alone(decoder.target.model, alone.generate("hello", max_new_tokens=12, logprobs=0), 0)
    assert decoder.generate("hello", max_new_tokens=4).logprobs is None  # not asked: none


def test_logprobs_out_of_range_are_refused(decoder):
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            decoder.generate("hi", max_new_tokens=2, logprobs=bad)


# ------------------------------------------------------------------ the server


def alone_logprobs(tiny, prompt: str, n: int, top: int):
    return tiny["decoder"].generate(prompt, max_new_tokens=n, temperature=0, logprobs=top)


def test_completions_logprobs_are_generates_in_openais_shape_streamed_or_not(tiny):
    alone = alone_logprobs(tiny, "def fib(n):", 20, 2)
    with live(tiny["decoder"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, prompt="def fib(n):", max_tokens=20, temperature=0, logprobs=2)
        whole = client.completions.create(**ask).choices[0]
        chunks = list(client.completions.create(**ask, stream=True))
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text == alone.text  # one character a token
    assert lp.token_logprobs == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)
    assert lp.text_offset == list(range(len(whole.text)))
    assert [len(top) for top in lp.top_logprobs] == [2] * 20
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    for chunk in chunks:  # each chunk's logprobs are those of the tokens its text holds
        if chunk.choices and chunk.choices[0].logprobs:
            assert "".join(chunk.choices[0].logprobs.tokens) == chunk.choices[0].text


def test_chat_logprobs_parse_in_the_openai_client_streamed_or_not(tiny):
    messages = [{"role": "user", "content": "hi"}]
    expected = tiny["decoder"].generate(messages, chat=True, max_new_tokens=12, temperature=0, logprobs=3)
    with live(tiny["decoder"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
        bare = client.chat.completions.create(**{**ask, "top_logprobs": None}).choices[0]
        refused = post(base, "/v1/chat/completions", {**ask, "logprobs": False})
    content = whole.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert [c.top_logprobs[0].logprob for c in content] == pytest.approx([e.top[0][1] for e in expected.logprobs])
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.top_logprobs for c in bare.logprobs.content] == [[]] * len(content)  # logprobs: true alone
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def test_a_stop_string_drops_the_logprobs_of_the_tokens_it_cut(tiny):
    text = alone_logprobs(tiny, "abc", 16, 0).text
    stop = text[5:7]  # the reply ends before it: its tokens (and the completing one) have no logprobs here
    with live(tiny["decoder"]) as base:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "temperature": 0, "logprobs": 0, "stop": [stop]}
        reply = post(base, "/v1/completions", body).json()["choices"][0]
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    cut = text[: text.index(stop)]
    assert reply["text"] == cut and "".join(reply["logprobs"]["tokens"]) == cut
    streamed = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert "".join(streamed) == cut


def test_streamed_logprobs_one_request_at_a_time_are_refused_not_dropped(tiny):
    with live(tiny["decoder"], max_batch=1) as base:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "logprobs": 1}
        assert post(base, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
        refused = post(base, "/v1/completions", {**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


# ------------------------------------------------------------------ what emitted each token


def kinds_of(out) -> list[str]:
    return [kind for kind, _, _ in out.kinds]


def assert_rounds_are_drafts_then_one_target_token(out) -> None:
    """Within a round: accepted drafts first, then at most one token of the target, which ends it."""
    rounds = [r for _, r, _ in out.kinds]
    assert len(out.kinds) == len(out.token_ids) and rounds == sorted(rounds) and rounds[0] == 1
    for kind, (_, next_round, _), (_, this_round, _) in zip(kinds_of(out), out.kinds[1:], out.kinds):
        if kind in ("recovered", "bonus", "target"):
            assert next_round == this_round + 1, out.kinds  # the target's token ends its round


@pytest.mark.parametrize(
    "draft, options, expected",
    [
        ("model", dict(num_draft_tokens=3, draft_width=1, prompt_lookup=False), {"draft", "recovered"}),
        ("itself", dict(num_draft_tokens=2, draft_width=1, prompt_lookup=False), {"draft", "bonus"}),
        ("model", dict(num_draft_tokens=3, draft_width=2, prompt_lookup=False), {"draft", "sibling", "recovered"}),
        ("ngram", dict(num_draft_tokens=3), {"copy", "target"}),
        (None, dict(), {"target"}),
    ],
    ids=["model-chain", "perfect-draft", "model-tree", "ngram", "target-alone"],
)
def test_each_token_says_what_emitted_it_and_the_counts_agree_with_the_metrics(decoder, draft, options, expected):
    model = decoder.target.model
    drafter = {"model": decoder.drafter, "itself": copy.deepcopy(model)}.get(draft, draft)
    run = SpeculativeDecoder(model, drafter, decoder.tokenizer)
    out = run.generate("a b c a b a b c a b", max_new_tokens=60, temperature=0, **options)
    kinds = kinds_of(out)
    assert expected <= set(kinds) <= set(KINDS), kinds
    assert_rounds_are_drafts_then_one_target_token(out)
    m = out.metrics
    assert sum(kinds.count(k) for k in ("draft", "copy", "sibling")) == m.accepted_tokens
    assert kinds.count("sibling") == m.sibling_tokens and kinds.count("copy") >= m.lookup_accepted
    assert out.kinds[-1][1] == m.rounds


def test_copy_drafts_after_a_model_chain_are_told_apart(decoder):
    out = decoder.generate("the cat sat. the cat sat. the cat", max_new_tokens=60, temperature=0, num_draft_tokens=2,
                           draft_width=1, prompt_lookup=True)  # fmt: skip
    assert kinds_of(out).count("copy") == out.metrics.lookup_accepted > 0


# ------------------------------------------------------------------ the terminal


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A target and a draft that agrees with it often (saved: the CLI loads by path)."""
    root = tmp_path_factory.mktemp("kinds")
    target = build("llama", 0, root / "target", sharpness=3.0)
    save_char_tokenizer(root / "target")
    perturbed(target, 0.3, seed=5).save_pretrained(root / "draft")
    save_char_tokenizer(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft")}


def test_show_tokens_colours_each_token_by_kind_and_json_lists_them(pair_dirs):
    from typer.testing import CliRunner

    from specdec_cli.app import TOKEN_STYLES, app

    base = ["generate", "a b c a b", "--target", pair_dirs["target"], "--draft", pair_dirs["draft"], "-n", "24"]
    base += ["-k", "3", "--dtype", "float32", "-t", "0", "--no-chat"]
    data = json.loads(CliRunner().invoke(app, [*base, "--json"]).stdout)
    assert [t["id"] for t in data["tokens"]] == data["token_ids"]
    assert "".join(t["text"] for t in data["tokens"]) == data["text"]
    kinds = [t["kind"] for t in data["tokens"]]
    accepted = sum(kinds.count(kind) for kind in ("draft", "copy", "sibling"))
    assert set(kinds) <= set(KINDS) and accepted == data["metrics"]["accepted_tokens"] > 0
    shown = CliRunner().invoke(app, [*base, "--show-tokens"], env={"FORCE_COLOR": "1", "COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert all(label in shown.stdout for _, label in TOKEN_STYLES.values())  # the legend
    assert "\x1b[32m" in shown.stdout  # green: accepted from the draft model


def test_the_server_tells_each_tokens_kind_on_request_and_the_openai_client_still_parses(tiny):
    with live(tiny["decoder"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0)
        plain = client.completions.create(**ask).choices[0]
        told = client.completions.create(**ask, extra_body={"specdec_tokens": True}).choices[0]
        chunks = list(client.completions.create(**ask, stream=True, extra_body={"specdec_tokens": True}))
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"specdec_tokens": True}).choices[0]  # fmt: skip
    assert "specdec_tokens" not in (plain.model_extra or {})  # opt-in: standard replies are unchanged
    tokens = told.model_extra["specdec_tokens"]
    assert "".join(t["text"] for t in tokens) == told.text == plain.text
    rounds = [t["round"] for t in tokens]
    assert {t["kind"] for t in tokens} <= set(KINDS) and rounds == sorted(rounds)
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("specdec_tokens", [])]
    # the same tokens (their kinds may differ: the batch's drafting learns from the requests before)
    assert [t["text"] for t in streamed] == [t["text"] for t in tokens] and {t["kind"] for t in streamed} <= set(KINDS)
    for c in chunks:  # each chunk's tokens are the text it carries
        if c.choices and c.choices[0].model_extra.get("specdec_tokens"):
            assert "".join(t["text"] for t in c.choices[0].model_extra["specdec_tokens"]) == c.choices[0].text
    assert "".join(t["text"] for t in chat.model_extra["specdec_tokens"]) == chat.message.content


def test_echo_scores_the_prompt_as_the_target_alone_and_echoes_its_text(tiny):
    decoder = tiny["decoder"]
    prompt = decoder.tokenizer("def fib(n):")["input_ids"]
    with live(decoder) as base:
        body = {"model": MODEL, "prompt": [prompt], "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
        scored = post(base, "/v1/completions", body).json()["choices"][0]
        plain = post(base, "/v1/completions", {**body, "logprobs": None}).json()["choices"][0]
        refused = post(base, "/v1/completions", {**body, "stream": True})
    laws = target_laws(decoder.target.model, prompt[:1], prompt[1:])
    lp = scored["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first
    want = [laws[j, token].item() for j, token in enumerate(prompt[1:])]
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-5)
    assert len(lp["tokens"]) == len(prompt) + 3 and scored["text"].startswith("def fib(n):")
    assert plain["text"] == scored["text"] and plain["logprobs"] is None
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_stream_with_tokens_hands_each_delta_the_tokens_it_begins_as_generate_tells_them(decoder):
    options = dict(max_new_tokens=40, temperature=0, num_draft_tokens=3, draft_width=1, logprobs=1)
    out = decoder.generate("a b c a b", **options)
    deltas = list(decoder.stream("a b c a b", tokens=True, **options))
    tokens = [t for d in deltas for t in d.tokens]
    assert "".join(deltas) == out.text and [t["id"] for t in tokens] == out.token_ids
    assert [(t["kind"], t["round"]) for t in tokens] == [(kind, r) for kind, r, _ in out.kinds]
    assert [t["logprob"] for t in tokens] == [e.logprob for e in out.logprobs]
    assert all("".join(t["text"] for t in d.tokens) == d for d in deltas)  # one character a token here
    assert all(not hasattr(d, "tokens") for d in decoder.stream("a b", max_new_tokens=4))  # plain str otherwise


def test_a_last_token_with_no_text_still_reaches_a_token_stream(decoder):
    from specdec.text import DeltaStreamer, TokenSpans

    tokenizer, got = decoder.tokenizer, []
    ids = tokenizer("ab c")["input_ids"] + [tokenizer.unk_token_id]  # a special token: no text (as EOS)
    spans = TokenSpans(tokenizer)
    streamer = DeltaStreamer(tokenizer, got.append, spans)
    spans.add(ids, ids)
    streamer(0, ids)
    streamer.end()
    assert "".join(got) == "ab c" and [t for delta in got for t in delta.tokens] == ids


def test_token_offsets_count_a_character_once_its_bytes_are_whole():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from specdec.text import TokenSpans

    corpus = ["日本語 ok and more: é à ü 🙂 done", "def fib(n):\n    return n", "  two  spaces\t\ttabs"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    for text in corpus[:3]:
        ids = tokenizer(text)["input_ids"]
        spans = TokenSpans(tokenizer)
        spans.add(ids, ids)
        truth = [len(tokenizer.decode(ids[:j]).rstrip("\ufffd")) for j in range(len(ids))]
        assert spans.offsets == truth and spans.length == len(text), text  # linear, as the quadratic truth
