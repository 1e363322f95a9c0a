"""The target alone with the host one round behind the device (Decoder.run_ahead, on by default on CUDA).

Forced on here, on any device: the same tokens as the plain loop (greedy, and sampled with the same
seed: the same verify calls in the same order), rows that finish at different times (EOS, budget, stop),
the cache invariant afterwards, one host read per round, and NaN errors with the round's step."""

import copy

import pytest
import torch

from specdec.drafters import ModelDrafter, NoDrafter
from specdec.models.adapters import HFCausalLM
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.reads import NonFiniteLogitsError
from specdec.verify.sampling import SamplingConfig
from tests.tiny import DEVICE, build, decode, hf_greedy

PROMPTS = [[5, 17, 3, 44, 8, 61, 2, 9], [7], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("read-ahead")
    return {arch: build(arch, 0, root / arch, layers=2, hidden=32) for arch in ("gpt2", "qwen2")}


def adapter(model, cache: str):
    if cache == "dynamic":
        return HFCausalLM(model)
    return StaticHFCausalLM(model, max_length=96, compile="graphs" if cache == "graphs" else False)


def run(target, prompts, read_ahead: bool, max_new_tokens=24, temperature=0.0, seed=None, **kwargs):
    generator = None if seed is None else torch.Generator(DEVICE).manual_seed(seed)
    return decode(
        target,
        NoDrafter(),
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=temperature, top_p=0.9 if temperature else 1.0),
        policy=DraftLengthPolicy(k=0),
        generator=generator,
        read_ahead=read_ahead,
        **kwargs,
    )


def new_tokens(rows):
    return [row.new_tokens for row in rows]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static", "graphs"])
def test_greedy_equals_transformers_and_the_plain_loop(models, arch, cache):
    model = models[arch]
    target = adapter(model, cache)
    ahead, metrics = run(target, PROMPTS, read_ahead=True)
    assert new_tokens(ahead) == [hf_greedy(model, p, 24) for p in PROMPTS]
    assert metrics.rounds == 3 * 24 and metrics.target_forwards == 24 and metrics.generated_tokens == 3 * 24
    # The invariant after the run: each row holds its committed tokens but the last.
    assert target.lengths.tolist() == [len(s) - 1 for s in (row.sequence for row in ahead)]
    plain, plain_metrics = run(adapter(model, cache), PROMPTS, read_ahead=False)
    assert new_tokens(plain) == new_tokens(ahead)
    assert plain_metrics.rounds == metrics.rounds


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_same_seed_same_sampled_tokens_as_the_plain_loop(models, cache):
    for prompts in ([PROMPTS[0]], PROMPTS):
        ahead, _ = run(adapter(models["qwen2"], cache), prompts, True, temperature=0.8, seed=3)
        plain, _ = run(adapter(models["qwen2"], cache), prompts, False, temperature=0.8, seed=3)
        other, _ = run(adapter(models["qwen2"], cache), prompts, True, temperature=0.8, seed=4)
        assert new_tokens(ahead) == new_tokens(plain)
        assert new_tokens(ahead) != new_tokens(other)


@pytest.mark.parametrize("cache", ["dynamic", "graphs"])
def test_rows_that_finish_early_commit_nothing_after(models, cache):
    # Each row meets its EOS at a different round, one row runs to its budget; the token the device
    # sampled for a finished row's queued round must never be committed.
    model = models["qwen2"]
    free = [hf_greedy(model, p, 30) for p in PROMPTS]
    # The first token of row 0 past its 3rd, and of row 2 past its 6th, that the middle row never makes.
    eos = {next(t for t in free[row][start:] if t not in free[1]) for row, start in ((0, 3), (2, 6))}
    expected = []
    for tokens in free:
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
        expected.append(tokens[: cut + 1])
    target = adapter(model, cache)
    ahead, metrics = run(target, PROMPTS, True, max_new_tokens=30, eos_ids=eos)
    assert new_tokens(ahead) == expected
    assert metrics.generated_tokens == sum(map(len, expected)) == metrics.rounds
    assert target.lengths.tolist() == [len(s) - 1 for s in (row.sequence for row in ahead)]
    plain, _ = run(adapter(model, cache), PROMPTS, False, max_new_tokens=30, eos_ids=eos)
    assert new_tokens(plain) == expected


def seen_by(seen: list):
    return lambda row, tokens: seen.extend(tokens)


def test_a_stop_cut_ends_the_row(models):
    model = models["gpt2"]
    free = hf_greedy(model, PROMPTS[0], 20)

    def stop(sequence, prompt_length, added):  # after the 8th new token, keep 5: a cut back into earlier rounds
        return 5 if len(sequence) - prompt_length >= 8 else None

    results = []
    for read_ahead in (True, False):
        seen, target = [], adapter(model, "dynamic")
        out, metrics = run(target, [PROMPTS[0]], read_ahead, max_new_tokens=20, stop=[stop], on_commit=seen_by(seen))
        assert new_tokens(out) == [free[:5]]
        assert target.lengths.tolist() == [len(out[0].sequence) - 1]
        results.append((seen, metrics.generated_tokens, metrics.rounds))
    assert results[0] == results[1]  # streamed the same tokens (the 6th and 7th before the cut), counted the same
    assert results[0][0] == free[:7]


def test_the_read_waits_until_the_next_forward_is_queued(models, monkeypatch):
    # The point of reading ahead: round s + 1's forward is queued before round s's result is read.
    import specdec.verify.reads as reads_module

    events = []
    result = reads_module.PendingRead.result
    monkeypatch.setattr(reads_module.PendingRead, "result", lambda self: events.append("read") or result(self))
    target = adapter(models["qwen2"], "dynamic")
    forward = target.forward
    target.forward = lambda *args, **kwargs: events.append("forward") or forward(*args, **kwargs)
    run(target, [PROMPTS[0]], True, max_new_tokens=5)
    # the first round feeds the prompt (forward), then each later round: queue the forward, read the last round
    assert events == ["forward"] + ["forward", "read"] * 4 + ["read"]


def test_prefix_reading_warpers_and_unembeddable_ids_use_the_plain_loop(models, monkeypatch):
    # A repetition penalty reads the committed prefix, which is one token behind while a round is queued:
    # such runs take the plain loop, with the plain loop's tokens.
    import specdec
    import specdec.api
    from specdec.engine.decoder import Decoder

    calls = []
    real = Decoder.run_ahead
    monkeypatch.setattr(Decoder, "run_ahead", lambda decoder: calls.append(1) or real(decoder))
    model = models["qwen2"]
    plain = specdec.generate(PROMPTS, target=model, max_new_tokens=12, temperature=0, repetition_penalty=1.5)
    plan_for = specdec.api.plan_for
    forced = lambda *args, **kwargs: plan_for(*args, **{**kwargs, "read_ahead": True})  # noqa: E731
    monkeypatch.setattr(specdec.api, "plan_for", forced)
    ahead = specdec.generate(PROMPTS, target=model, max_new_tokens=12, temperature=0, repetition_penalty=1.5)
    assert [r.token_ids for r in ahead] == [r.token_ids for r in plain] and calls == []
    specdec.generate(PROMPTS, target=model, max_new_tokens=3, temperature=0)  # the check sees a forced run
    assert calls == [1]
    narrow = HFCausalLM(model)
    narrow.embed_size = narrow.vocab_size - 1  # a head wider than the embeddings: ids fed back could not embed
    run(narrow, [PROMPTS[0]], True, max_new_tokens=3)
    assert calls == [1]


def test_one_host_read_per_round(models, host_reads):
    _, metrics = run(adapter(models["qwen2"], "graphs"), [PROMPTS[0]], True, max_new_tokens=20)
    assert len(host_reads) == metrics.target_forwards == 20


def test_non_finite_logits_name_the_target_and_step(models):
    broken = copy.deepcopy(models["qwen2"])
    with torch.no_grad():
        broken.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match=r"target model .* step 1"):
        run(HFCausalLM(broken), [PROMPTS[0]], True, max_new_tokens=4)


def test_only_the_target_alone_reads_ahead(models, monkeypatch):
    from specdec.engine.decoder import Decoder

    calls = []
    monkeypatch.setattr(Decoder, "run_ahead", lambda decoder: calls.append(1))
    run(HFCausalLM(models["gpt2"]), [PROMPTS[0]], True, max_new_tokens=3)
    assert calls == [1]
    calls.clear()
    run(
        HFCausalLM(models["gpt2"]),
        [PROMPTS[0]],
        True,
        max_new_tokens=3,
        verification="race",
        race_seed=1,
        temperature=0.5,
    )
    run(HFCausalLM(models["gpt2"]), [PROMPTS[0]], False, max_new_tokens=3)
    decode(  # a round with a draft is the plain loop's, even where auto k drafts nothing
        HFCausalLM(models["gpt2"]),
        ModelDrafter(HFCausalLM(models["qwen2"])),
        [PROMPTS[0]],
        max_new_tokens=3,
        sampling=SamplingConfig(temperature=0),
        policy=DraftLengthPolicy(k=None),
        read_ahead=True,
    )
    assert calls == []
