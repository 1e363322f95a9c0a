"""One SpeculativeDecoder shared by threads and streams: each call's output is what it gives alone.
Calls run one at a time (the models' KV caches are shared); a stream holds the decoder until its run
ends or its iterator is closed; closing or dropping the iterator stops its run."""

import gc
import threading

import pytest
from transformers import AutoTokenizer

from specdec import SpeculativeDecoder
from tests.tiny import build, noisy_pair, save_char_tokenizer

CHAIN = dict(draft_width=1, num_draft_tokens=3, chat=False, temperature=0)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return noisy_pair(tmp_path_factory.mktemp("shared"))  # a noisy draft: rollbacks


def alone(decoder, prompt, n):
    return decoder.generate(prompt, max_new_tokens=n, **CHAIN).token_ids


def test_two_threads_sharing_a_decoder_get_what_each_gets_alone(decoder):
    prompts = ["a b c a b", "hello world", "xyz xyz", "qqq rrr", "the cat sat"]
    expected = {p: alone(decoder, p, 24) for p in prompts}
    results, errors = [], []

    def work(offset):
        try:
            for i in range(15):
                prompt = prompts[(i + offset) % len(prompts)]
                results.append((prompt, alone(decoder, prompt, 24)))
        except Exception as error:  # noqa: BLE001 - any failure is the test's finding
            errors.append(error)

    threads = [threading.Thread(target=work, args=(offset,)) for offset in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert len(results) == 30 and all(ids == expected[prompt] for prompt, ids in results)


def test_a_call_after_an_abandoned_stream_gets_its_own_output(decoder):
    expected_stream = "".join(decoder.stream("a b c a b", max_new_tokens=120, **CHAIN))
    expected = alone(decoder, "hello world", 30)
    for _ in range(6):
        it = decoder.stream("a b c a b", max_new_tokens=120, **CHAIN)
        head = next(it) + next(it)
        assert alone(decoder, "hello world", 30) == expected  # the abandoned stream's run is not in the way
        assert head + "".join(it) == expected_stream  # and the stream, read on later, is whole


def test_interleaved_streams_each_give_their_own_text(decoder):
    prompts = ("a b c a b", "hello world")
    expected = ["".join(decoder.stream(p, max_new_tokens=60, **CHAIN)) for p in prompts]
    streams = [decoder.stream(p, max_new_tokens=60, **CHAIN) for p in prompts]
    texts, live = ["", ""], [True, True]
    while any(live):  # one delta from each in turn
        for i, stream in enumerate(streams):
            if live[i]:
                delta = next(stream, None)
                live[i] = delta is not None
                texts[i] += delta or ""
    assert texts == expected


@pytest.mark.parametrize("how", ["close", "drop"])
def test_closing_or_dropping_a_stream_stops_its_run(decoder, how):
    it = decoder.stream("a b c a b", max_new_tokens=400, **CHAIN)
    next(it)
    if how == "close":
        it.close()
    else:
        del it
        gc.collect()
    assert decoder._lock.acquire(blocking=False), "the stream's run still holds the decoder"  # stopped, not done
    decoder._lock.release()


def test_a_stream_never_started_holds_nothing(decoder):
    it = decoder.stream("a b c a b", max_new_tokens=400, **CHAIN)
    assert alone(decoder, "hello world", 8) == alone(decoder, "hello world", 8)
    del it


def test_a_call_from_inside_a_running_call_is_refused(decoder):
    def callback(_text):
        decoder.generate("hello", max_new_tokens=2, **CHAIN)

    with pytest.raises(RuntimeError, match="already running a call in this thread"):
        decoder.generate("a b c", max_new_tokens=8, stream=callback, **CHAIN)
    assert alone(decoder, "hello world", 8)  # and the decoder is free again


def test_eos_is_the_generation_configs_alone_as_in_generate(tmp_path):
    # generate() never reads the tokenizer's EOS: with generation_config.eos_token_id None it runs to the end.
    target = build("llama", 0, tmp_path / "t", sharpness=3.0)
    save_char_tokenizer(tmp_path / "t")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "t")
    plain = SpeculativeDecoder(target, None, tokenizer).generate([3, 4, 5], max_new_tokens=40, temperature=0)
    frequent = max(set(plain.token_ids), key=plain.token_ids.count)  # a token greedy picks early
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(frequent)
    assert tokenizer.eos_token_id == frequent and target.generation_config.eos_token_id is None
    out = SpeculativeDecoder(target, None, tokenizer).generate([3, 4, 5], max_new_tokens=40, temperature=0)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 40
    target.generation_config.eos_token_id = frequent  # the model's own config: there it stops, as generate() does
    try:
        stopped = SpeculativeDecoder(target, None, tokenizer).generate([3, 4, 5], max_new_tokens=40, temperature=0)
    finally:
        target.generation_config.eos_token_id = None
    assert stopped.token_ids == plain.token_ids[: plain.token_ids.index(frequent) + 1]
