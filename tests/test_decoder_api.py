"""SpeculativeDecoder: load once and generate many, the target's generation config, streaming,
and every bad input answered with one clear error (or correct output)."""

import json

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TopKLogitsWarper
from typer.testing import CliRunner

import specdec
from specdec import SpeculativeDecoder
from specdec.bench.export import serving_config
from specdec.models.adapters import HFCausalLM
from specdec_cli.app import app
from tests.lawcheck import bin_violations
from tests.tiny import VOCAB, CharTokenizer, build, hf_greedy, save_char_tokenizer

runner = CliRunner()
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    target = build("llama", 0, root / "target", layers=2)
    draft = build("llama", 1, root / "draft", layers=1)
    save_char_tokenizer(root / "target")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "target")
    return {"root": root, "target": target, "draft": draft, "dir": str(root / "target"), "tokenizer": tokenizer}


# ------------------------------------------------------------------ load once, generate many


def test_second_generate_reuses_the_loaded_models(tiny, monkeypatch):
    loads = []
    real = specdec.loading.load_model
    monkeypatch.setattr(specdec.loading, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    decoder = SpeculativeDecoder.from_pretrained(tiny["dir"], draft=tiny["dir"], dtype="float32", device="cpu")
    assert len(loads) == 2
    first = decoder.generate([3, 1, 4], max_new_tokens=12, temperature=0)
    second = decoder.generate([3, 1, 4], max_new_tokens=12, temperature=0)
    assert len(loads) == 2  # no reload
    assert first.token_ids == second.token_ids == hf_greedy(decoder.target.model, [3, 1, 4], 12)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_gives_a_target_alone_bfloat16_and_a_verifying_target_float32_without_native_bf16(
    tiny, monkeypatch, native
):
    monkeypatch.setattr("specdec.models.forms.native_bf16", lambda: native)
    for draft, expected in ((None, torch.bfloat16), ("none", torch.bfloat16), ("ngram", None), (tiny["dir"], None)):
        decoder = SpeculativeDecoder.from_pretrained(tiny["dir"], draft=draft, device="cpu")
        dtype = next(decoder.target.model.parameters()).dtype
        assert dtype == (expected or (torch.bfloat16 if native else torch.float32)), (draft, native)


def test_batch_results_carry_row_metrics_and_the_batch_total(tiny):
    decoder = SpeculativeDecoder(tiny["target"], tiny["draft"])
    out = decoder.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0, num_draft_tokens=3)
    assert [r.metrics.generated_tokens for r in out] == [6, 6]
    assert out[0].batch_metrics is out[1].batch_metrics and out[0].batch_metrics.generated_tokens == 12
    assert sum(r.metrics.accepted_tokens for r in out) == out[0].batch_metrics.accepted_tokens


def test_stream_yields_the_text_of_generate(tiny):
    decoder = SpeculativeDecoder.from_pretrained(tiny["dir"], draft="ngram", dtype="float32", device="cpu")
    deltas = list(decoder.stream("hello hello hello", max_new_tokens=20, temperature=0))
    whole = decoder.generate("hello hello hello", max_new_tokens=20, temperature=0).text
    assert "".join(deltas) == whole and len(deltas) >= 1


def test_stream_raises_the_error_of_its_run(tiny):
    decoder = SpeculativeDecoder(tiny["target"], None, tiny["tokenizer"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(decoder.stream("hi", max_new_tokens=0))


class WordTokenizer(CharTokenizer):
    """Every token a word of its own, so each one is streamed as it is committed."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) + " " for i in ids)


def test_closing_a_stream_stops_its_run_and_frees_the_decoder(tiny):
    import threading

    from specdec.metrics import SpeculativeMetrics

    decoder = SpeculativeDecoder(tiny["target"], tiny["draft"], WordTokenizer())
    threads, counts = threading.active_count(), SpeculativeMetrics()
    deltas = decoder.stream([1, 2, 3], max_new_tokens=400, temperature=0, num_draft_tokens=2, metrics=counts)
    for _ in deltas:
        break
    deltas.close()
    assert threading.active_count() == threads  # the worker has finished
    assert counts.generated_tokens < 400  # it stopped instead of decoding on
    after = decoder.generate([1, 2, 3], max_new_tokens=40, temperature=0, num_draft_tokens=2)
    fresh = SpeculativeDecoder(tiny["target"], tiny["draft"], WordTokenizer())
    assert after.token_ids == fresh.generate([1, 2, 3], max_new_tokens=40, temperature=0, num_draft_tokens=2).token_ids


def test_a_closed_stream_stops_at_a_commit_that_finishes_no_word():
    from specdec.text import DeltaQueue, DeltaStreamer, StreamClosed

    class Symbols(CharTokenizer):  # every token is "#": transformers' streamer holds symbols until a space
        def decode(self, ids, skip_special_tokens=True):
            return "#" * len(ids)

    deltas = DeltaQueue()
    streamer = DeltaStreamer(Symbols(), deltas)
    streamer(0, [1, 2])
    assert deltas.items.empty()
    deltas.closed.set()  # the consumer has gone
    with pytest.raises(StreamClosed):
        streamer(0, [3])


# ------------------------------------------------------------------ the target's generation config


@pytest.mark.parametrize(
    "settings",
    [
        {"repetition_penalty": 1.3},
        {"no_repeat_ngram_size": 2},
        {"min_p": 0.2, "repetition_penalty": 1.2},
        {"bad_words_ids": [[5], [7]], "suppress_tokens": [9]},
    ],
)
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_follows_the_models_generation_config(tiny, settings, draft):
    target = tiny["target"]
    saved = target.generation_config
    target.generation_config = GenerationConfig(**settings, pad_token_id=0)
    try:
        for prompt in ([3, 1, 4, 1, 5], [7, 7, 2]):
            expected = hf_greedy(target, prompt, 24)
            drafter = tiny["draft"] if draft == "model" else "ngram"
            out = specdec.generate(prompt, target=target, draft=drafter, max_new_tokens=24, num_draft_tokens=3)
            assert out.token_ids == expected, settings
    finally:
        target.generation_config = saved


def test_explicit_arguments_override_the_generation_config(tiny):
    target = tiny["target"]
    saved = target.generation_config
    target.generation_config = GenerationConfig(repetition_penalty=1.3, pad_token_id=0)
    try:
        out = specdec.generate([3, 1, 4], target=target, max_new_tokens=16, repetition_penalty=1.0)
        target.generation_config = GenerationConfig(pad_token_id=0)
        assert out.token_ids == hf_greedy(target, [3, 1, 4], 16)
    finally:
        target.generation_config = saved


def test_forced_eos_comes_where_generate_puts_it(tiny):
    """forced_eos_token_id reads max_length: prompt length + max_new_tokens, per row, as in a
    left-padded batch of generate() (not the default max_length of 20)."""
    target, prompts = tiny["target"], [[5, 9, 11, 3, 8], [2, 6, 4]]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, forced_eos_token_id=7
        )
        expected.append(out[0, len(prompt) :].tolist())
    out = specdec.generate(
        prompts, target=target, draft=tiny["draft"], max_new_tokens=24, temperature=0, forced_eos_token_id=7
    )
    assert [r.token_ids for r in out] == expected and all(row[-1] == 7 for row in expected)


def test_sampling_applies_transformers_default_top_k(tiny):
    """With top_k unset, generate() samples under top-k 50: the other 46 tokens must never appear."""
    target, prompt, rows = tiny["target"], [3, 1, 4], 4000
    out = specdec.generate(
        [prompt] * rows, target=target, draft=tiny["draft"], max_new_tokens=1, temperature=1.0, seed=0
    )
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in out]), minlength=VOCAB)
    with torch.inference_mode():
        logits = target(torch.tensor([prompt])).logits[0, -1].float()
    law = torch.softmax(TopKLogitsWarper(50)(None, logits[None])[0], -1)
    assert bin_violations(counts, law, rows) == []
    assert int((law == 0).sum()) == VOCAB - 50


def test_sampled_law_with_repetition_penalty(tiny):
    """A prefix-reading processor under sampling: the second token's law depends on the first."""
    target, prompt, rows = tiny["target"], [3, 1], 3000
    out = specdec.generate(
        [prompt] * rows,
        target=target,
        draft=tiny["draft"],
        max_new_tokens=2,
        temperature=1.0,
        top_k=0,
        repetition_penalty=3.0,
        seed=1,
        num_draft_tokens=2,
    )
    firsts = torch.tensor([r.token_ids[0] for r in out])
    with torch.inference_mode():
        logits = target(torch.tensor([prompt])).logits[0, -1].float()
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    law = torch.softmax(RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([prompt]), logits[None])[0], -1)
    assert bin_violations(torch.bincount(firsts, minlength=VOCAB), law, rows) == []
    assert not bool((firsts == 3).any() and law[3] == 0)


# ------------------------------------------------------------------ bad inputs, one by one (issue 12's list)


def test_1_same_adapter_as_target_and_draft_gives_target_output(tiny):
    adapter = HFCausalLM(tiny["target"])
    out = specdec.generate([5, 6, 7], target=adapter, draft=adapter, max_new_tokens=16, num_draft_tokens=3)
    assert out.token_ids == hf_greedy(tiny["target"], [5, 6, 7], 16)
    assert out.metrics.draft_acceptance_rate == 1.0  # the draft's own drafts (copy drafts may still miss)


def test_2_tiny_temperature_is_refused(tiny):
    with pytest.raises(ValueError, match="temperature"):
        specdec.generate([1, 2], target=tiny["target"], temperature=1e-300)
    result = runner.invoke(app, ["generate", "hi", "--target", tiny["dir"], "-t", "1e-300"])
    assert result.exit_code == 2 and "--temperature" in result.output and "Traceback" not in result.output


@pytest.fixture()
def broken_dir(tiny, tmp_path):
    import shutil

    directory = tmp_path / "broken"
    shutil.copytree(tiny["dir"], directory)
    return directory


def test_3_truncated_safetensors_is_one_clear_error(broken_dir):
    weights = broken_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        specdec.load_model(str(broken_dir))
    result = runner.invoke(app, ["generate", "hi", "--target", str(broken_dir)])
    assert result.exit_code == 2 and "corrupt or truncated" in result.output and "Traceback" not in result.output


def test_4_corrupt_gguf_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUFgarbage")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        specdec.load_model(str(bad))
    result = runner.invoke(app, ["generate", "hi", "--target", str(bad)])
    assert result.exit_code == 2 and "not a readable GGUF" in result.output and "Traceback" not in result.output


def test_5_invalid_utf8_prompt(tiny):
    with pytest.raises(ValueError, match="not valid UTF-8"):
        specdec.generate("bad \udcff text", target=tiny["target"], tokenizer=tiny["tokenizer"], max_new_tokens=2)
    result = runner.invoke(app, ["generate", "bad \udcff", "--target", tiny["dir"], "-n", "2"])
    assert result.exit_code == 2 and "UTF-8" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["generate", "--target", tiny["dir"], "-n", "2"], input=b"caf\xe9 \xff\xfe")
    assert result.exit_code == 2 and "UTF-8" in result.output and "Traceback" not in result.output


def test_6_json_with_ctrl_c_is_still_json(tiny, monkeypatch):
    def interrupted(self, prompt, *, config=None, metrics=None, **kwargs):  # the CLI passes its SpecConfig
        config.stream("partial text")
        metrics.generated_tokens = 2
        raise KeyboardInterrupt

    monkeypatch.setattr(SpeculativeDecoder, "generate", interrupted)
    result = runner.invoke(app, ["generate", "hi", "--target", tiny["dir"], "--json"])
    assert result.exit_code == 130
    data = json.loads(result.stdout)
    assert data["text"] == "partial text" and data["interrupted"] is True and data["metrics"]["generated_tokens"] == 2


def test_6_ctrl_c_keeps_the_last_word_of_the_committed_tokens(tiny, monkeypatch):
    args = ["generate", "hi", "--target", tiny["dir"], "-n", "60", "-k", "3", "--no-chat", "--json", "-t", "0"]
    full = json.loads(runner.invoke(app, args).stdout)
    real, calls = specdec.api.decode, []

    def interrupted_clock():
        calls.append(None)
        if len(calls) == 30:  # some rounds in, past a symbol the streamer holds back until a space
            raise KeyboardInterrupt
        return float(len(calls))

    def interrupted(target, drafter, rows, plan, watch):
        watch.clock = interrupted_clock
        return real(target, drafter, rows, plan, watch)

    monkeypatch.setattr(specdec.api, "decode", interrupted)
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    data = json.loads(result.stdout)
    committed = full["token_ids"][: data["metrics"]["generated_tokens"]]
    assert 0 < len(committed) < 60
    assert data["text"] == tiny["tokenizer"].decode(committed)


def test_7_local_directory_problems_name_their_cause(broken_dir):
    (broken_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights"):
        specdec.load_model(str(broken_dir))
    (broken_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        specdec.load_model(str(broken_dir))


@pytest.mark.parametrize(
    "prompt, message",
    [([1.5, 2.7], "integer token ids"), ([1, "a"], "integer token ids"), (torch.tensor([1.0, 2.0]), "integer")],
)
def test_8_bad_prompt_types(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        specdec.generate(prompt, target=tiny["target"], max_new_tokens=2)


@pytest.mark.parametrize("prompt", [torch.tensor([3, 1, 4]), np.array([3, 1, 4]), [np.int64(3), np.int32(1), 4]])
def test_8_tensor_array_and_numpy_int_prompts_work(tiny, prompt):
    out = specdec.generate(prompt, target=tiny["target"], max_new_tokens=4, temperature=0)
    assert out.prompt_ids == [3, 1, 4] and out.token_ids == hf_greedy(tiny["target"], [3, 1, 4], 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [None]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"tokenizer": 42}, "tokenizer"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"num_draft_tokens": True}, "num_draft_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"do_sample": "yes"}, "do_sample"),
    ],
)
def test_9_bad_arguments_are_value_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        specdec.generate([1, 2], target=tiny["target"], **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temprature": 0.5}, "unknown generate.. argument 'temprature'; did you mean temperature"),
        ({"num_beams": 4}, "num_beams=4 is not supported: .*no beam search"),
        ({"max_length": 5}, "use max_new_tokens"),
        ({"stop_strings": ["a"]}, "use stop="),
        ({"num_return_sequences": 2}, "as a batch"),
        ({"cache_implementation": "static"}, "from_pretrained"),
        ({"cache": "static"}, "loading option.*from_pretrained"),
        ({"compile": True}, "loading option.*from_pretrained"),
    ],
)
def test_9_unknown_or_unsupported_generation_arguments_are_refused(tiny, kwargs, message):
    decoder = SpeculativeDecoder(tiny["target"], None)
    with pytest.raises(ValueError, match=message):
        decoder.generate([1, 2], max_new_tokens=2, **kwargs)


def test_9_settings_that_change_nothing_and_fields_specdec_honours_are_accepted(tiny):
    decoder = SpeculativeDecoder(tiny["target"], None)
    neutral = {"num_beams": 1, "use_cache": True, "output_scores": False, "max_length": None}
    out = decoder.generate([1, 2], max_new_tokens=4, temperature=0, min_new_tokens=2, **neutral)
    assert out.token_ids == hf_greedy(tiny["target"], [1, 2], 4)


def test_9_one_shot_generate_passes_loading_options_on(tiny):
    with pytest.raises(ValueError, match="needs CUDA"):
        specdec.generate([1, 2], target=tiny["target"], max_new_tokens=2, cache="dynamic", compile=True)
    out = specdec.generate([1, 2], target=tiny["target"], max_new_tokens=4, temperature=0, cache="static")
    assert out.token_ids == hf_greedy(tiny["target"], [1, 2], 4)


def test_9_custom_target_refuses_generation_config_fields(tiny):
    decoder = SpeculativeDecoder(HFCausalLM(tiny["target"]), None)
    decoder.target.model = None  # a TargetModel that is not a transformers model
    with pytest.raises(ValueError, match="repetition_penalty need a transformers target"):
        decoder.generate([1, 2], max_new_tokens=2, repetition_penalty=1.2)


def test_9_bad_arguments_fail_before_loading(monkeypatch):
    monkeypatch.setattr(specdec.loading, "load_model", lambda *a, **k: pytest.fail("loaded before checking arguments"))
    for kwargs in ({"stream": "yes"}, {"seed": -1}, {"stop": [""]}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            specdec.generate("hi", target="qwen2.5-coder-1.5b", **kwargs)


def test_9_tokenizer_given_by_name(tiny, monkeypatch):
    out = specdec.generate("abc", target=tiny["target"], tokenizer=tiny["dir"], max_new_tokens=3, temperature=0)
    assert out.text is not None and len(out.token_ids) == 3
    monkeypatch.setattr("specdec.models.resolution._hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ValueError, match="cannot be reached"):
        specdec.generate("abc", target=tiny["target"], tokenizer="x", max_new_tokens=3)


def test_a_draft_with_the_targets_tokenizer_files_is_not_loaded_a_tokenizer(tiny, monkeypatch, tmp_path):
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny["root"] / "draft", draft)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny["root"] / "target" / name, draft / name)
    loaded = []
    real = specdec.models.resolution.load_tokenizer
    monkeypatch.setattr(specdec.loading, "load_tokenizer", lambda name, **k: loaded.append(name) or real(name, **k))
    decoder = specdec.SpeculativeDecoder.from_pretrained(tiny["dir"], str(draft), device="cpu", dtype="float32")
    assert loaded == [tiny["dir"]] and isinstance(decoder.drafter, specdec.drafters.ModelDrafter)
    loaded.clear()  # the caller's own tokenizer may not be the files': the draft's is loaded to compare
    specdec.SpeculativeDecoder.from_pretrained(
        tiny["dir"], str(draft), tokenizer=tiny["tokenizer"], device="cpu", dtype="float32"
    )
    assert loaded == [str(draft)]
    (draft / "tokenizer_config.json").write_text((draft / "tokenizer_config.json").read_text() + " ")
    assert not specdec.models.resolution.same_tokenizer_files(
        tiny["dir"], str(draft)
    )  # one byte apart: compared by loading


def test_10_empty_stop_string_is_refused(tiny):
    with pytest.raises(ValueError, match="non-empty"):
        specdec.generate([1, 2], target=tiny["target"], tokenizer=CharTokenizer(), stop=[""])


def test_11_target_vocabulary_larger_than_drafts(tmp_path):
    target = build("llama", 3, tmp_path / "t", vocab=VOCAB + 8, sharpness=4.0)
    with torch.no_grad():  # make the target emit ids the draft cannot embed
        target.lm_head.weight[VOCAB:] *= 3.0
    draft = build("llama", 4, tmp_path / "d", layers=1)
    prompt = [1, 2, 3]
    expected = hf_greedy(target, prompt, 24)
    assert max(expected) >= VOCAB
    out = specdec.generate(
        prompt, target=target, draft=draft, tokenizer=CharTokenizer(), max_new_tokens=24, num_draft_tokens=3
    )
    assert out.token_ids == expected


def test_12_stop_string_spanning_the_prompt_end(tiny):
    tokenizer, target = CharTokenizer(), tiny["target"]
    prompt = [0, 1]  # "ab"
    free = specdec.generate(prompt, target=target, tokenizer=tokenizer, max_new_tokens=8, temperature=0)
    stop = "b" + free.text[0]  # starts in the prompt, ends with the first new character
    assert stop not in free.text
    out = specdec.generate(prompt, target=target, tokenizer=tokenizer, max_new_tokens=8, temperature=0, stop=stop)
    assert out.token_ids == free.token_ids[:1]


def test_stop_strings_cut_each_row_of_a_batch(tiny):
    tokenizer, target = CharTokenizer(), tiny["target"]
    prompts = [[0, 1, 2], [5, 4], [9]]
    free = specdec.generate(prompts, target=target, tokenizer=tokenizer, max_new_tokens=10, temperature=0)
    stops = [r.text[3:5] for r in free]
    out = specdec.generate(
        prompts, target=target, draft=tiny["draft"], tokenizer=tokenizer, max_new_tokens=10, temperature=0, stop=stops
    )
    for free_row, row in zip(free, out):
        first = min(free_row.text.find(s) + len(s) for s in stops if s in free_row.text)
        assert row.text == free_row.text[:first]


class ByteTokenizer:
    """Token i is the byte i, as byte-level BPE vocabularies hold them: a character may span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop", ["🦜", "é😀", "😀 🦜"])
def test_stop_string_found_whatever_the_round_boundaries(stop):
    from specdec.text import StopStrings

    text, prompt_length = "say hello é😀 🦜 then", 2
    ids = list(text.encode())
    expected = len(text[: text.index(stop) + len(stop)].encode()) - prompt_length  # through the stop's last byte
    stops = StopStrings([stop], ByteTokenizer())
    assert stops(ids, prompt_length, len(ids) - prompt_length) == expected  # one round
    for size in (1, 2, 3):  # rounds of `size` new tokens
        for end in range(prompt_length + size, len(ids) + 1, size):
            keep = stops(ids[:end], prompt_length, size)
            if keep is not None:
                break
        assert keep == expected, (size, end)


# ------------------------------------------------------------------ chat and export


def test_chat_with_piped_turns(tiny):
    turns = "hello\n/stats\nsecond turn\n/reset\nthird\n"
    result = runner.invoke(app, ["chat", "--target", tiny["dir"], "-n", "6", "--dtype", "float32"], input=turns)
    assert result.exit_code == 0, result.output
    assert result.output.count("tok/s") == 3  # one summary line per reply
    assert "history cleared" in result.output and "acceptance rate" in result.output


@pytest.fixture
def chat_prompts(monkeypatch):
    """The message contents of each prompt `specdec chat` hands to generate, in order."""
    seen = []
    real = SpeculativeDecoder.generate

    def spy(self, prompt, **kwargs):
        seen.append([m["content"] for m in prompt])
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    return seen


def test_chat_survives_a_turn_that_fails(tiny, chat_prompts):
    seen = chat_prompts
    turns = "one\n" + "x" * 600 + "\nthree\n"  # the second turn outgrows the context of 512
    result = runner.invoke(app, ["chat", "--target", tiny["dir"], "-n", "3", "--dtype", "float32"], input=turns)
    assert result.exit_code == 0, result.output
    assert result.output.count("error:") == 1 and "exceeds the context" in result.output
    assert "Traceback" not in result.output and result.output.count("tok/s") == 2
    assert len(seen) == 3 and len(seen[2]) == 3 and seen[2][-1] == "three"  # the failed turn left the history


def test_chat_history_reaches_the_model(tiny, chat_prompts):
    seen = chat_prompts
    turns = "one\ntwo\n/reset\nx\n"
    runner.invoke(app, ["chat", "--target", tiny["dir"], "-n", "3", "--system", "be brief"], input=turns)
    assert seen[0] == ["be brief", "one"]
    assert seen[1][:2] == ["be brief", "one"] and seen[1][-1] == "two" and len(seen[1]) == 4
    assert seen[2] == ["be brief", "x"]


# Documented option names: vLLM's SpeculativeConfig (docs.vllm.ai, vllm/config/speculative.py) and
# SGLang's server arguments (docs.sglang.io, advanced_features/speculative_decoding).
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
VLLM_METHODS = {"ngram", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp"}
SGLANG_FLAGS = {
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
}


@pytest.mark.parametrize("draft", ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "ngram"])
def test_export_uses_the_engines_documented_names(draft):
    config, command = serving_config("vllm", "Qwen/Qwen2.5-Coder-1.5B-Instruct", draft, 4)
    assert set(config) <= VLLM_KEYS and config["method"] in VLLM_METHODS and config["num_speculative_tokens"] == 4
    assert command.startswith("vllm serve ") and json.dumps(config) in command
    config, command = serving_config("sglang", "Qwen/Qwen2.5-Coder-1.5B-Instruct", draft, 4)
    assert set(config) <= SGLANG_FLAGS and config["speculative_algorithm"] in {"STANDALONE", "NGRAM"}
    assert "--speculative-algorithm" in command


def test_bench_export_prints_a_valid_vllm_config(tmp_path):
    bench = {
        "settings": {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b"},
        "summary": {"specdec_k2": {"tokens_per_second": 9.0}, "specdec_k4": {"tokens_per_second": 11.0}},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    result = runner.invoke(app, ["bench", "--export", "vllm", "--from-json", str(path)])
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    assert config == {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}


def test_the_method_and_the_module_generate_share_one_signature(tmp_path):
    import inspect

    from specdec.api import Call

    method = list(inspect.signature(SpeculativeDecoder.generate).parameters)
    assert method[0] == "self" and method[1:] == list(inspect.signature(Call.of).parameters)
    module = inspect.signature(specdec.generate).parameters
    assert set(module) & set(method) == {"prompt"}  # every decoding option reaches the method through **options
    # and is checked before anything loads: a misspelt option, not the missing model, is the error
    with pytest.raises(ValueError, match="unknown generate\\(\\) argument 'temprature'"):
        specdec.generate("hi", target=str(tmp_path / "no-such-model"), temprature=0.5)
    with pytest.raises(ValueError, match="rows= takes one dict of options per prompt"):
        specdec.generate(["a", "b"], target=str(tmp_path / "no-such-model"), rows=[{}])
