"""The target's log-probabilities of every emitted token (generate(logprobs=n), the server's `logprobs`):
free from the verify forward, and what the target alone computes at each position (float32), for chains,
trees, sampled and batched rows alike; in OpenAI's shapes, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from specdec import SpeculativeDecoder
from tests import test_serve
from tests.test_serve import MODEL, live, post
from tests.tiny import build, perturbed, save_char_tokenizer

tiny = test_serve.tiny  # the served pair (a char tokenizer: one character a token)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = build("llama", 0, root / "target", sharpness=3.0)
    save_char_tokenizer(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    return SpeculativeDecoder(target, perturbed(target, 0.3, seed=5), tokenizer)


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
