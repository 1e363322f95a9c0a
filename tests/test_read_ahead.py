"""The target alone with the host one round behind the device (Decoder.run_ahead, on by default on CUDA).

Forced on here, on any device: the same tokens as the plain loop (greedy, and sampled with the same
seed: the same verify calls in the same order), rows that finish at different times (EOS, budget, stop),
the cache invariant afterwards, one host read per round, and NaN errors with the round's step."""

import copy

import pytest
import torch

from specdec.adapters import HFCausalLM, NonFiniteLogitsError
from specdec.adapters.static import StaticHFCausalLM
from specdec.decoder import decode
from specdec.drafters import ModelDrafter, NoDrafter
from specdec.policy import DraftLengthPolicy
from specdec.sampling import SamplingConfig
from tests.tiny import DEVICE, build, hf_greedy

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


def new_tokens(batch):
    return [batch.new_tokens(row) for row in range(len(batch.sequences))]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static", "graphs"])
def test_greedy_equals_transformers_and_the_plain_loop(models, arch, cache):
    model = models[arch]
    target = adapter(model, cache)
    ahead, metrics = run(target, PROMPTS, read_ahead=True)
    assert new_tokens(ahead) == [hf_greedy(model, p, 24) for p in PROMPTS]
    assert metrics.rounds == 3 * 24 and metrics.target_forwards == 24 and metrics.generated_tokens == 3 * 24
    # The invariant after the run: each row holds its committed tokens but the last.
    assert target.lengths.tolist() == [len(s) - 1 for s in ahead.sequences]
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
    assert target.lengths.tolist() == [len(s) - 1 for s in ahead.sequences]
    plain, _ = run(adapter(model, cache), PROMPTS, False, max_new_tokens=30, eos_ids=eos)
    assert new_tokens(plain) == expected


def seen_by(seen: list):
    return lambda row, tokens: seen.extend(tokens)


def test_a_stop_cut_ends_the_row(models):
    model = models["gpt2"]
    free = hf_greedy(model, PROMPTS[0], 20)

    def stop(row, sequence, prompt_length, added):  # after the 8th new token, keep 5: a cut back into earlier rounds
        return 5 if len(sequence) - prompt_length >= 8 else None

    results = []
    for read_ahead in (True, False):
        seen, target = [], adapter(model, "dynamic")
        out, metrics = run(target, [PROMPTS[0]], read_ahead, max_new_tokens=20, stop=stop, on_commit=seen_by(seen))
        assert new_tokens(out) == [free[:5]]
        assert target.lengths.tolist() == [len(out.sequences[0]) - 1]
        results.append((seen, metrics.generated_tokens, metrics.rounds))
    assert results[0] == results[1]  # streamed the same tokens (the 6th and 7th before the cut), counted the same
    assert results[0][0] == free[:7]


def test_the_read_waits_until_the_next_forward_is_queued(models, monkeypatch):
    # The point of reading ahead: round s + 1's forward is queued before round s's result is read.
    import specdec.adapters as adapters_module

    events = []
    result = adapters_module.PendingRead.result
    monkeypatch.setattr(adapters_module.PendingRead, "result", lambda self: events.append("read") or result(self))
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
    import specdec.decoder as decoder_module

    calls = []
    real = decoder_module.Decoder.run_ahead
    monkeypatch.setattr(decoder_module.Decoder, "run_ahead", lambda self, batch: calls.append(1) or real(self, batch))
    model = models["qwen2"]
    plain = specdec.generate(PROMPTS, target=model, max_new_tokens=12, temperature=0, repetition_penalty=1.5)
    forced = lambda *args, **kwargs: decode(*args, **{**kwargs, "read_ahead": True})  # noqa: E731
    monkeypatch.setattr(specdec.api, "decode", forced)
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
    import specdec.decoder as decoder_module

    calls = []
    monkeypatch.setattr(decoder_module.Decoder, "run_ahead", lambda self, batch: calls.append(1))
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
    assert calls == []


class Contrarian(HFCausalLM):
    """The model with its own top token pushed down: as a draft of itself, never right under greedy."""

    def forward(self, *args, **kwargs):
        logits = super().forward(*args, **kwargs)
        return logits.scatter(-1, logits.argmax(-1, keepdim=True), -1e4)


def spec_run(model, prompts, read_ahead, drafter=None, policy=None, calls=None, max_new_tokens=60, **kwargs):
    """decode() with a draft and auto k (by default: the useless Contrarian draft, the prior costs);
    calls collects (rounds asked, rounds launched) of each run_ahead."""
    import specdec.decoder as decoder_module

    temperature, seed = kwargs.pop("temperature", 0.0), kwargs.pop("seed", None)
    generator = None if seed is None else torch.Generator(DEVICE).manual_seed(seed)
    policy = policy or DraftLengthPolicy(k=None)
    drafter = drafter or ModelDrafter(Contrarian(model), stop_below=None)
    real = decoder_module.Decoder.run_ahead
    if calls is not None:

        def counted(self, batch, rounds=None, step=0):
            launched, step = real(self, batch, rounds, step)
            calls.append((rounds, launched))
            return launched, step

        decoder_module.Decoder.run_ahead = counted
    try:
        out, metrics = decode(
            HFCausalLM(model),
            drafter,
            prompts,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=temperature),
            policy=policy,
            generator=generator,
            read_ahead=read_ahead,
            **kwargs,
        )
    finally:
        decoder_module.Decoder.run_ahead = real
    return out, metrics, policy


@pytest.mark.parametrize("prompts", [[PROMPTS[0]], PROMPTS])
def test_a_useless_draft_idles_as_the_target_alone_run_ahead(models, prompts):
    # With auto k the useless draft is soon at k = 0, probing now and then: the rounds between probes
    # run as the target alone, run ahead. The same tokens, the same decisions (probes at the same
    # rounds), the same rounds as the plain loop.
    model, calls = models["qwen2"], []
    ahead, metrics, policy = spec_run(model, prompts, True, calls=calls)
    plain, plain_metrics, plain_policy = spec_run(model, prompts, False)
    assert new_tokens(ahead) == new_tokens(plain) == [hf_greedy(model, p, 60) for p in prompts]
    assert policy.history == plain_policy.history and metrics.rounds == plain_metrics.rounds
    assert metrics.draft_forwards == plain_metrics.draft_forwards > 0 and metrics.accepted_tokens == 0
    ran = [launched for _, launched in calls]
    assert len(ran) >= 2 and sum(ran) >= policy.history.count(0) // 2  # most idle rounds ran ahead
    assert sum(ran) <= policy.history.count(0) and all(
        n == asked for asked, n in calls[:-1]
    )  # the last may meet the end


def test_a_useless_draft_run_ahead_keeps_the_sampled_tokens_of_a_seed(models):
    model = models["qwen2"]
    ahead, _, policy = spec_run(model, PROMPTS, True, temperature=0.8, seed=5)
    plain, _, plain_policy = spec_run(model, PROMPTS, False, temperature=0.8, seed=5)
    other, _, _ = spec_run(model, PROMPTS, True, temperature=0.8, seed=6)
    assert new_tokens(ahead) == new_tokens(plain) != new_tokens(other)
    assert policy.history == plain_policy.history


def test_copies_that_pay_end_an_idle_stretch(models):
    # Copy drafts pay where the text repeats: a stretch does not start while one would be appended, and
    # one that turns up in a committed text ends the stretch (the round already queued runs without it).
    # The output stays the target's own.
    model = models["qwen2"]
    for prompt in ([7], [50, 60, 70, 80]):
        calls = []
        ahead, metrics, _ = spec_run(model, [prompt], True, prompt_lookup=True, calls=calls)
        plain, plain_metrics, _ = spec_run(model, [prompt], False, prompt_lookup=True)
        assert new_tokens(ahead) == new_tokens(plain) == [hf_greedy(model, prompt, 60)]
        assert metrics.lookup_accepted > 0 and plain_metrics.lookup_accepted > 0
        assert any(launched < asked for asked, launched in calls[:-1])  # cut short where a copy turned up


def test_copies_without_a_draft_stop_a_stretch_for_good_too(models):
    # No draft model, copies only (k fixed at 0): every round is idle, the stretch has no end of its own,
    # and still a copy that pays ends it.
    model, calls = models["qwen2"], []
    prompt = [50, 60, 70, 80]
    runs = [
        spec_run(model, [prompt], ahead, NoDrafter(), DraftLengthPolicy(k=0), calls, prompt_lookup=True)
        for ahead in (True, False)
    ]
    (ahead, metrics, policy), (plain, plain_metrics, _) = runs
    assert new_tokens(ahead) == new_tokens(plain) == [hf_greedy(model, prompt, 60)]
    assert metrics.lookup_accepted > 0 and plain_metrics.lookup_accepted > 0
    assert calls and all(asked is None for asked, _ in calls) and len(calls) >= 2  # cut, then started again
    assert policy.history == []  # a fixed k records no decisions


def test_a_dear_draft_catches_up_after_each_stretch(models):
    # A perfect draft (the target itself) that the prior costs say not to use: k = 0 between probes that
    # keep every draft and grow, until k > 0 is chosen outright. After each stretch the draft's cache must
    # catch up on the tokens it skipped, or its drafts would be rejected: the same accepted tokens and
    # decisions as the plain loop.
    from specdec.calibration import Costs

    model = models["qwen2"]
    costs = Costs(0.85, tuple((w, 1.0 + 0.1 * (w - 1)) for w in (1, 2, 5, 11)))
    results = []
    for ahead in (True, False):
        calls = []
        drafter = ModelDrafter(HFCausalLM(model), stop_below=None)
        out, metrics, policy = spec_run(model, PROMPTS, ahead, drafter, DraftLengthPolicy(k=None, costs=costs), calls)
        results.append((new_tokens(out), metrics.accepted_tokens, metrics.drafted_tokens, policy.history, len(calls)))
    (tokens, accepted, drafted, history, stretches), plain = results
    assert tokens == [hf_greedy(model, p, 60) for p in PROMPTS]
    assert results[0][:4] == plain[:4] and accepted == drafted > 0
    assert stretches >= 3 and plain[4] == 0 and history[0] == 0 and max(history) > 1


def test_rows_that_finish_mid_stretch(models):
    # Rows meet their EOS at different rounds, some inside a stretch: each row's tokens are the target's
    # own up to its EOS, and the caches hold the committed tokens but the last.
    model, calls = models["qwen2"], []
    free = [hf_greedy(model, p, 60) for p in PROMPTS]

    def first_own(row, start):  # a token only this row makes, first made at or after start
        others = {t for other, tokens in enumerate(free) if other != row for t in tokens}
        return next(t for i, t in enumerate(free[row]) if i >= start and t not in free[row][:i] and t not in others)

    eos = {first_own(1, 30), first_own(2, 25)}  # rows 1 and 2 end mid-run, row 0 runs to its budget
    expected = []
    for tokens in free:
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
        expected.append(tokens[: cut + 1])
    ahead, metrics, _ = spec_run(model, PROMPTS, True, calls=calls, eos_ids=eos)
    plain, _, _ = spec_run(model, PROMPTS, False, eos_ids=eos)
    assert eos and new_tokens(ahead) == new_tokens(plain) == expected
    assert sum(n for _, n in calls) >= 20 and metrics.generated_tokens == sum(map(len, expected))
    assert len(expected[0]) == 60 and max(map(len, expected[1:])) < 60
