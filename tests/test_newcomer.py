"""A newcomer's report, one test per defect: the model card, neutral fields, bounded stop lists, the
field a context error names, numpy scalars, help that shows its defaults, one-line usage errors, chat's
unknown commands, and no acceptance rate where nothing was drafted."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from typer.testing import CliRunner

from specdec import SpeculativeDecoder, config
from specdec.config import SpecConfig
from specdec.metrics import SpeculativeMetrics
from specdec.serving.server import ServeSettings, create_app
from specdec_cli.app import app, metrics_table, summary_line
from tests import test_cli_hostile, test_serve
from tests.test_cli_hostile import chat
from tests.test_serve import COMPLETION, MODEL, error_of, live, post

# The fixtures of the server's and the CLI's tests, built once for this module.
tiny, url, client = test_serve.tiny, test_serve.url, test_serve.client  # the served pair, a server, its client
target, loads = test_cli_hostile.target, test_cli_hostile.loads  # a target with a chat template; no loading
runner = CliRunner()
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def roomy(tiny):
    """A server with no prompt limit of its own: only the model's context (512) bounds a prompt."""
    with live(tiny["decoder"]) as base:
        yield base


# ------------------------------------------------------------------ 2. GET /v1/models/{id}


def test_the_openai_client_retrieves_the_served_model_card_as_listed(client):
    card = client.models.retrieve(MODEL)
    listed = client.models.list().data[0]
    assert card.model_dump() == listed.model_dump()
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "specdec") and card.created > 0


def test_an_unknown_model_id_is_404_in_openais_error_schema(url, client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4")
    error = error_of(httpx.get(url + "/v1/models/gpt-4", timeout=10), 404)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"


def test_a_served_name_with_a_slash_is_retrieved_by_its_whole_id(tiny):
    from fastapi.testclient import TestClient

    served = TestClient(create_app(tiny["decoder"], ServeSettings(model="org/tiny")), base_url="http://localhost")
    assert served.get("/v1/models/org/tiny").json()["id"] == "org/tiny"
    assert served.get("/v1/models/org%2Ftiny").json()["id"] == "org/tiny"  # the openai client's encoding
    assert served.get("/v1/models/org").status_code == 404


# ------------------------------------------------------------------ 5. fields whose value changes nothing


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": {}},
        {"metadata": {"team": "docs"}},
        {"parallel_tool_calls": False},
        {"parallel_tool_calls": True},
        {"store": False},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"user": "u-1"},
        {"safety_identifier": "u-1"},
        {"prompt_cache_key": "k"},
    ],
)
def test_a_chat_field_at_a_value_that_changes_nothing_is_accepted(url, extra):
    response = post(url, "/v1/chat/completions", {**CHAT, **extra})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("store", True),
        ("service_tier", "flex"),
        ("metadata", "team"),
        ("metadata", {"team": 5}),
        ("parallel_tool_calls", "yes"),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_a_chat_field_at_a_value_that_would_change_the_reply_is_still_refused(url, field, value):
    error = error_of(post(url, "/v1/chat/completions", {**CHAT, field: value}), 400)
    assert error["param"].split(".")[0] == field


# ------------------------------------------------------------------ 6. a bounded stop list


def test_generate_refuses_too_many_or_too_long_stop_strings_and_takes_the_most_it_allows():
    most, longest = config.MAX_STOPS, config.MAX_STOP_CHARS
    with pytest.raises(ValueError, match=f"at most {most} stop strings"):
        SpecConfig.of(stop=["x"] * (most + 1))
    with pytest.raises(ValueError, match=f"at most {longest} characters"):
        SpecConfig.of(stop=["y" * (longest + 1)])
    assert len(SpecConfig.of(stop=["z" * longest] * most).stops) == most


def test_the_server_refuses_a_huge_stop_list_as_400_naming_stop(url):
    error = error_of(post(url, "/v1/completions", {**COMPLETION, "stop": [str(i) for i in range(200)]}), 400)
    assert error["param"] == "stop" and f"at most {config.MAX_STOPS}" in error["message"]
    assert post(url, "/v1/completions", {**COMPLETION, "stop": ["a", "b", "c", "d"]}).status_code == 200


# ------------------------------------------------------------------ 7. which field a context error names


def test_a_prompt_past_the_context_names_the_prompt_not_max_tokens(roomy):
    error = error_of(post(roomy, "/v1/completions", {**COMPLETION, "prompt": "x" * 600, "max_tokens": 4}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert "shorten the prompt" in error["message"]
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 600}]}
    for budget in ({"max_tokens": 4}, {"max_tokens": None}):  # chat's default budget is what the context leaves
        error = error_of(post(roomy, "/v1/chat/completions", {**long_chat, **budget}), 400)
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_a_prompt_that_fits_with_a_budget_that_does_not_names_max_tokens(roomy):
    error = error_of(post(roomy, "/v1/completions", {**COMPLETION, "prompt": "x" * 500, "max_tokens": 20}), 400)
    assert error["param"] == "max_tokens" and "lower max_tokens to 12" in error["message"]


# ------------------------------------------------------------------ 8. numpy scalars


def test_numpy_scalars_are_taken_as_python_numbers():
    numbers = dict(max_new_tokens=np.int64(4), seed=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(5),
                   top_p=np.float32(0.5), num_draft_tokens=np.int16(2), repetition_penalty=np.float16(1.5))  # fmt: skip
    resolved = SpecConfig.of(**numbers)
    assert (resolved.max_new_tokens, resolved.k, resolved.seed) == (4, 2, 3)
    assert all(type(v) is int for v in (resolved.max_new_tokens, resolved.k, resolved.seed, resolved.sampling["top_k"]))
    sampled = resolved.sampling
    assert (type(sampled["temperature"]), type(sampled["top_p"]), type(sampled["repetition_penalty"])) == (float,) * 3
    assert (sampled["temperature"], sampled["repetition_penalty"]) == (0.5, 1.5)
    with pytest.raises(ValueError, match="seed"):
        SpecConfig.of(seed=np.float64(3.0))  # a float is still not a seed
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpecConfig.of(max_new_tokens=np.bool_(True))


def test_generate_with_a_numpy_seed_and_temperature_equals_generate_with_python_numbers(tiny):
    decoder = tiny["decoder"]
    ask = dict(max_new_tokens=6, verification="race")
    plain = decoder.generate("Hello", seed=3, temperature=0.5, **ask)
    numpy = decoder.generate("Hello", seed=np.int64(3), temperature=np.float32(0.5), **ask)
    assert numpy.token_ids == plain.token_ids
    assert decoder.generate("Hello", seed=np.int64(3), temperature=1, **ask).token_ids == (
        decoder.generate("Hello", seed=3, temperature=1, **ask).token_ids
    )


# ------------------------------------------------------------------ 9. help shows its defaults, flags take no value


def help_text(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], terminal_width=200, max_content_width=200)  # no wrapping
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_names_the_default_pair(command):
    shown = help_text(command)
    assert "or alias [default: qwen2.5-coder-1.5b]" in shown
    assert "[default: qwen2.5-coder-0.5b with the default target, else none]" in shown


def test_help_shows_the_defaults_written_in_help_strings():
    assert "[default: the target's generation config, greedy if it has none]" in help_text("generate")
    assert "[default: when the tokenizer has one]" in help_text("generate")
    assert "[default: the context]" in help_text("serve")


def test_boolean_options_are_flags_without_a_value_in_help():
    assert "--debug Show tracebacks" in help_text()
    for command in ("generate", "serve", "bench"):
        assert "<bool>" not in help_text(command)


# ------------------------------------------------------------------ 10. usage errors are one line naming the flag


def one_line(result, *words) -> str:
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert "\n" not in text and text.startswith("error: "), result.output
    for word in words:
        assert word in text, text
    return text


@pytest.mark.parametrize(
    "args, words",
    [
        (["-n", "0"], ["--max-new-tokens", "1", "(got 0)"]),
        (["-n", "many"], ["--max-new-tokens", "many"]),
        (["-k", "fast"], ["--num-draft-tokens", "fast"]),
        (["--draft-width", "wide"], ["--draft-width", "wide"]),
        (["--prompt-lookup", "maybe"], ["--prompt-lookup", "maybe"]),
        (["--verification", "foo"], ["--verification", "foo"]),
        (["--max-new-token", "4"], ["--max-new-token", "--max-new-tokens"]),  # a misspelt flag, with the close one
        (["--temperature"], ["--temperature", "argument"]),
    ],
)
def test_a_bad_generate_flag_is_one_line_naming_it(loads, args, words):
    one_line(runner.invoke(app, ["generate", "hi", "--target", "t", *args]), *words)
    assert loads == []


def test_a_value_given_to_a_global_flag_is_one_line():
    one_line(runner.invoke(app, ["--debug", "true", "generate", "hi"]), "no such command 'true'")


def test_an_unknown_command_is_one_line():
    one_line(runner.invoke(app, ["generat", "hi"]), "generat")


# ------------------------------------------------------------------ 11. chat's unknown commands


def test_chat_refuses_an_unknown_command_and_sends_only_real_turns(target, monkeypatch):
    seen = []
    real = SpeculativeDecoder.generate

    def spy(self, prompt, **kwargs):
        seen.append(prompt[-1]["content"])
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    result = chat(target, input="/bogus\n/usr/bin/env\nhi\n")
    assert result.exit_code == 0, result.output
    assert seen == ["/usr/bin/env", "hi"]  # a path is a turn
    line = next(line for line in result.output.splitlines() if "unknown command" in line)
    assert "/bogus" in line and "/reset" in line and "/stats" in line


# ------------------------------------------------------------------ 12. no acceptance rate where nothing was drafted


def test_metrics_have_no_acceptance_rate_where_nothing_was_drafted():
    nothing = SpeculativeMetrics(rounds=3, generated_tokens=3, wall_time_s=1.0)
    assert nothing.acceptance_rate is None and nothing.to_dict()["acceptance_rate"] is None
    some = SpeculativeMetrics(rounds=3, drafted_tokens=4, accepted_tokens=1, generated_tokens=4, wall_time_s=1.0)
    assert some.acceptance_rate == 0.25 and some.to_dict()["acceptance_rate"] == 0.25
    assert (nothing + some).acceptance_rate == 0.25


def test_the_cli_shows_no_rate_where_nothing_was_drafted():
    from rich.console import Console

    console = Console(record=True, width=120)
    metrics = SpeculativeMetrics(rounds=3, generated_tokens=3, wall_time_s=1.0).to_dict()
    console.print(metrics_table(metrics))
    row = next(line for line in console.export_text().splitlines() if "acceptance rate" in line)
    assert "-  (nothing drafted)" in row and "%" not in row
    assert "nothing drafted" in summary_line(metrics) and "%" not in summary_line(metrics)


def test_bench_results_with_a_null_rate_are_read_back_and_shown_without_one(tmp_path):
    saved = tmp_path / "bench.json"
    row = {"tokens_per_second": 3.0, "speedup_vs_target": 1.0, "acceptance_rate": None}  # the target alone
    saved.write_text(json.dumps({"settings": {"target": "t", "draft": None}, "summary": {"alone": row}}))
    result = runner.invoke(app, ["bench", "--from-json", str(saved)], terminal_width=200)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "alone" in line)
    assert "%" not in line and "3.00" in line


def test_a_target_alone_server_reports_a_null_rate_and_no_rate_sample(tiny):
    alone = SpeculativeDecoder.from_pretrained(tiny["dir"], draft=None, dtype="float32", device="cpu")
    with live(alone) as base:
        reply = post(base, "/v1/completions", {**COMPLETION, "temperature": 0}).json()
        assert reply["specdec"]["drafted_tokens"] == 0 and reply["specdec"]["acceptance_rate"] is None
        text = httpx.get(base + "/metrics", timeout=10).text
    assert "# TYPE specdec_acceptance_rate gauge" in text
    assert not any(line.startswith("specdec_acceptance_rate") for line in text.splitlines())


# ------------------------------------------------------------------ serve: the drafting flags of generate


@pytest.mark.parametrize("max_batch", [8, 1], ids=["batch", "one-at-a-time"])
def test_serve_drafts_as_its_flags_say_and_replies_as_generate(tiny, max_batch):
    from specdec.drafters.lookup import PromptLookup
    from specdec.serving.session import DraftChoices

    alone = tiny["decoder"].generate("abc", max_new_tokens=24, temperature=0)
    with live(tiny["decoder"], max_batch=max_batch, drafting=DraftChoices(2, 1, False)) as base:
        reply = post(base, "/v1/completions", {**COMPLETION, "max_tokens": 24, "temperature": 0}).json()
    assert reply["choices"][0]["text"] == alone.text
    counts = reply["specdec"]
    assert 0 < counts["drafted_tokens"] <= 2 * counts["rounds"]  # never more than k = 2 drafts a round
    if max_batch > 1:
        app = create_app(tiny["decoder"], ServeSettings(model=MODEL, drafting=DraftChoices(3, 1, False)))
        session = app.state.runner.session
        plan = session.engine.plan
        assert session.policy.k == 3 and plan.width == 1 and not plan.copies
        assert not isinstance(session.engine.drafter, PromptLookup)


def test_serve_passes_its_drafting_flags_to_the_batch(tiny, monkeypatch):
    from specdec.serving import server
    from specdec.serving.session import DraftChoices

    made = []

    def made_app(decoder, settings):
        made.append(settings)
        raise ValueError("stop here")

    monkeypatch.setattr("specdec_cli.serve.load_decoder", lambda *args, **kwargs: (tiny["decoder"], "t", "d"))
    monkeypatch.setattr(server, "create_app", made_app)
    flags = ["-k", "3", "--draft-width", "1", "--prompt-lookup", "off"]
    result = runner.invoke(app, ["serve", "--target", "t", "--port", "0", *flags])
    assert "stop here" in result.output and [s.drafting for s in made] == [DraftChoices(3, 1, False)]


def test_a_bad_serve_drafting_flag_is_one_line_before_loading(loads):
    one_line(runner.invoke(app, ["serve", "--target", "t", "--port", "0", "-k", "fast"]), "--num-draft-tokens")
    assert loads == []


@pytest.mark.parametrize("args, flag", [(["-k", "0"], "num-draft-tokens"), (["-k", "-3"], "num-draft-tokens"),
                                        (["--draft-width", "0"], "width")])  # fmt: skip
def test_a_draft_setting_generate_refuses_is_refused_by_serve_before_loading(loads, args, flag):
    one_line(runner.invoke(app, ["serve", "--target", "t", "--port", "0", *args]), flag)
    assert loads == []


def test_a_model_card_request_is_counted_under_one_label(url):
    httpx.get(url + "/v1/models/" + MODEL, timeout=10)
    httpx.get(url + "/v1/models/nope", timeout=10)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'path="/v1/models/{id}"' in text and "/v1/models/nope" not in text
