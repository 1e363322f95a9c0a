"""Continuous batching with speculation (specdec.serving.session): requests that join a running batch at
different rounds, with their own options, get token for token what generate() gives each alone
(greedy in float32; sampled rows by race verification keyed on their own seed)."""

import pytest
import torch
from transformers import AutoTokenizer

from specdec import SpeculativeDecoder
from specdec.config import check_request
from specdec.serving.session import QueueFull, Session
from tests.tiny import build, perturbed, save_char_tokenizer

REQUESTS = [
    ("a b c a b", dict(temperature=0, max_new_tokens=25)),
    ("hello world", dict(temperature=0.8, seed=3, max_new_tokens=20)),
    ("xyz xyz", dict(temperature=1.2, top_p=0.9, seed=4, max_new_tokens=30, stop=["q"])),
    ("qqq", dict(temperature=0, max_new_tokens=5)),
    ("the cat sat", dict(temperature=0.7, top_k=20, seed=5, max_new_tokens=18)),
]


def config(**options):
    base = dict(max_new_tokens=20, num_draft_tokens="auto", stop=None, stream=None, seed=None, temperature=None)
    base |= dict(top_k=None, top_p=None, do_sample=None, verification="race")
    return check_request(**base | options)


@pytest.fixture(scope="module", params=["model", "ngram", None])
def decoder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    target = build("llama", 0, root / "target", sharpness=3.0)
    save_char_tokenizer(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    draft = perturbed(target, 0.3, seed=5) if request.param == "model" else request.param
    return SpeculativeDecoder(target, draft, tokenizer)


def ids(decoder, text):
    return decoder.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("chunk", [None, 3], ids=["prompt-at-once", "chunked-prefill"])
def test_requests_joining_at_different_rounds_get_what_each_gets_alone(decoder, chunk, monkeypatch):
    alone = [decoder.generate(text, config=config(**options)).token_ids for text, options in REQUESTS]
    monkeypatch.setattr("specdec.serving.session.PREFILL_CHUNK", chunk)  # 3: every prompt joins over rounds
    session = Session(decoder, max_batch=3)
    rows, joins = [], {0: 0, 1: 0, 2: 3, 3: 4, 4: 9}  # request -> the step before which it is submitted
    for step in range(400):
        for request, at in joins.items():
            if at == step:
                text, options = REQUESTS[request]
                rows.append(session.submit(ids(decoder, text), config(**options)))
        session.step()
        if len(rows) == len(REQUESTS) and all(row.done.is_set() for row in rows):
            break
    for row, expected, (_, options) in zip(rows, alone, REQUESTS):
        assert row.finish_reason in ("length", "stop") and row.error is None
        assert row.tokens == expected, options
    assert session.running == 0 and decoder.target.num_slots == 0  # every row left, and its cache with it
    assert session.metrics.generated_tokens == sum(len(t) for t in alone)


def test_a_long_prompt_joins_in_chunks_while_the_running_row_commits_every_round(decoder):
    long_prompt = "the cat sat on the mat. " * 12  # 288 tokens: three chunks of PREFILL_CHUNK (128)
    expected = [decoder.generate(text, config=config(temperature=0, max_new_tokens=40)).token_ids
                for text in ("a b c a b", long_prompt)]  # fmt: skip
    session = Session(decoder, max_batch=2)
    running = session.submit(ids(decoder, "a b c a b"), config(temperature=0, max_new_tokens=40))
    session.step()
    joining = session.submit(ids(decoder, long_prompt), config(temperature=0, max_new_tokens=40))
    rounds, stalled = 0, 0
    while not joining.tokens:  # the rounds that feed the long prompt, then its first round
        before = len(running.tokens)
        session.step()
        rounds += 1
        stalled += len(running.tokens) == before and not running.done.is_set()
    assert rounds == 3 and stalled == 0  # two chunks, then the rest with its first drafts; the running row went on
    while not (running.done.is_set() and joining.done.is_set()):
        session.step()
    assert [running.tokens, joining.tokens] == expected


def test_a_cancelled_row_leaves_within_one_round_and_the_others_go_on(decoder):
    alone = decoder.generate("hello world", config=config(temperature=0, max_new_tokens=20)).token_ids
    session = Session(decoder, max_batch=4)
    doomed = session.submit(ids(decoder, "a b c a b"), config(temperature=0, max_new_tokens=200))
    kept = session.submit(ids(decoder, "hello world"), config(temperature=0, max_new_tokens=20))
    session.step()
    session.step()
    doomed.cancel()
    generated = len(doomed.tokens)
    session.step()
    assert doomed.done.is_set() and doomed.finish_reason == "cancelled" and len(doomed.tokens) == generated
    while not kept.done.is_set():
        session.step()
    assert kept.tokens == alone


def test_a_failing_round_fails_its_rows_and_the_session_goes_on(decoder, monkeypatch):
    session = Session(decoder, max_batch=2)
    session.step()  # started: costs measured, caches empty
    victim = session.submit(ids(decoder, "a b c"), config(temperature=0, max_new_tokens=8))
    real = decoder.target.model.forward

    def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        out.logits = torch.full_like(out.logits, float("nan"))
        return out

    monkeypatch.setattr(decoder.target.model, "forward", broken)
    session.step()
    monkeypatch.setattr(decoder.target.model, "forward", real)
    assert victim.done.is_set() and victim.finish_reason == "error" and "NaN" in str(victim.error)
    after = session.submit(ids(decoder, "hello world"), config(temperature=0, max_new_tokens=8))
    while not after.done.is_set():
        session.step()
    assert after.tokens == decoder.generate("hello world", config=config(temperature=0, max_new_tokens=8)).token_ids


def test_a_full_queue_is_refused(decoder):
    session = Session(decoder, max_batch=1, max_queue=2)
    for _ in range(2):
        session.submit(ids(decoder, "a b"), config(max_new_tokens=2))
    with pytest.raises(QueueFull):
        session.submit(ids(decoder, "a b"), config(max_new_tokens=2))


def test_a_row_whose_logits_fail_is_told_apart_and_the_batch_goes_on(decoder, monkeypatch):
    # Non-finite logits for any row whose forward input holds the poison token: the batch's round fails,
    # each row reruns a round alone, and only the poisoned one gets the error.
    poison = ids(decoder, "~")[0]
    real = decoder.target.model.forward

    def poisoned(*args, input_ids=None, **kwargs):
        out = real(*args, input_ids=input_ids, **kwargs)
        bad = (input_ids == poison).any(1)
        out.logits[bad] = float("nan")
        return out

    monkeypatch.setattr(decoder.target.model, "forward", poisoned)
    expected = decoder.generate("hello world", config=config(temperature=0, max_new_tokens=12)).token_ids
    session = Session(decoder, max_batch=4)
    healthy = session.submit(ids(decoder, "hello world"), config(temperature=0, max_new_tokens=12))
    session.step()  # a round in: it has committed tokens when the poisoned row joins
    victim = session.submit(ids(decoder, "a ~ b"), config(temperature=0, max_new_tokens=12))
    for _ in range(100):
        session.step()
        if healthy.done.is_set() and victim.done.is_set():
            break
    assert victim.finish_reason == "error" and "NaN" in str(victim.error)
    assert healthy.finish_reason == "length" and healthy.tokens == expected


def test_rows_of_equal_settings_share_a_warping_and_a_foreign_eos_is_refused(decoder):
    session = Session(decoder, max_batch=3)
    first = session.submit(ids(decoder, "a b"), config(temperature=0.7, seed=1, max_new_tokens=6))
    second = session.submit(ids(decoder, "c d"), config(temperature=0.7, seed=2, max_new_tokens=6))
    session.step()
    assert first.warping is second.warping  # one Warping for the batch, not a per-row copy
    with pytest.raises(ValueError, match="differ from the model's"):
        session.submit(ids(decoder, "a b"), config(eos_token_id=5, max_new_tokens=4))


class ComputeClock:
    """A clock that a forward over batch x width tokens advances by `per_token` x batch x width (+ `fixed`)
    seconds, the draft by `draft` x that: the costs a serving batch really has, in the test's hands."""

    def __init__(self, per_token: float, fixed: float, draft: float):
        self.now, self.per_token, self.fixed, self.draft = 0.0, per_token, fixed, draft

    def __call__(self) -> float:
        return self.now

    def charge(self, adapter, scale: float) -> None:
        real = adapter.forward

        def forward(ids, *args, **kwargs):
            self.now += scale * (self.fixed + self.per_token * ids.numel())
            return real(ids, *args, **kwargs)

        adapter.forward = forward


def run_with_clock(tmp_path, per_token: float, fixed: float):
    """Eight greedy rows, one batch, under a ComputeClock: (k of each round, tokens per row, alone, metrics)."""
    target = build("llama", 0, tmp_path / "target", sharpness=3.0)
    save_char_tokenizer(tmp_path / "target")
    draft = perturbed(target, 0.1, seed=5)
    decoder = SpeculativeDecoder(target, draft, AutoTokenizer.from_pretrained(tmp_path / "target"))
    texts = ["a b c a b", "hello world", "xyz xyz", "the cat sat", "qqq", "abc abc", "one two", "zz top"]
    alone = [decoder.generate(text, config=config(temperature=0, max_new_tokens=60)).token_ids for text in texts]
    clock = ComputeClock(per_token, fixed, draft=0.1)
    session = Session(decoder, max_batch=8, clock=clock)
    session.step()  # started: the calibration measured on the host's clock, before the test's clock counts
    clock.charge(decoder.target, 1.0)
    clock.charge(decoder.drafter.adapter, 0.1)
    rows = [session.submit(ids(decoder, text), config(temperature=0, max_new_tokens=60)) for text in texts]
    while not all(row.done.is_set() for row in rows):
        session.step()
    return list(session.policy.history), [row.tokens for row in rows], alone, session.metrics


def test_auto_k_prices_rounds_by_the_batchs_own_clock(tmp_path):
    # A draft close to the target. Where a forward's time grows with its tokens (compute-bound), a round
    # of k drafts costs about k + 1 forwards for at most k + 1 tokens, and the
    # batch's own clock turns speculation off; where it does not (memory-bound), speculation stays.
    # The calibration on this host's clock says otherwise in one of the two: only the rounds' clocks
    # can tell them apart. Either way every row gets what it gets alone.
    compute, tokens, alone, metrics = run_with_clock(tmp_path / "compute", per_token=1.0, fixed=0.0)
    assert tokens == alone
    later = compute[len(compute) // 2 :]
    assert sum(k == 0 for k in later) >= 0.75 * len(later), compute
    # ... and the drafter's own stop reads the same clocks: past k it does not draft on at the calibration's
    # cheap widths (the stop priced by the calibration alone drafted 136 tokens for these 480 here, now 48).
    assert metrics.drafted_tokens <= 0.2 * metrics.generated_tokens
    memory, tokens, alone, _ = run_with_clock(tmp_path / "memory", per_token=0.0, fixed=1.0)
    assert tokens == alone
    later = memory[len(memory) // 2 :]
    assert sum(k > 0 for k in later) >= 0.75 * len(later), memory


def test_rows_of_equal_sampling_and_other_budgets_keep_their_own_budget_bound_processors(decoder):
    # forced_eos_token_id forces a token at each row's own last position: rows that agree on sampling but
    # not on max_new_tokens must not share one warping (sampling_key holds the budget).
    forced = ids(decoder, "z")[0]
    asks = [("a b", 5), ("c d e", 9), ("a b", 7)]
    alone = [
        decoder.generate(text, config=config(temperature=0, max_new_tokens=n, forced_eos_token_id=forced)).token_ids
        for text, n in asks
    ]
    assert [tokens[-1] for tokens in alone] == [forced] * 3 and [len(t) for t in alone] == [5, 9, 7]
    session = Session(decoder, max_batch=3)
    rows = [
        session.submit(ids(decoder, t), config(temperature=0, max_new_tokens=n, forced_eos_token_id=forced))
        for t, n in asks
    ]
    while not all(row.done.is_set() for row in rows):
        session.step()
    assert [row.tokens for row in rows] == alone


def test_equal_prompts_with_their_own_seeds_are_each_keyed_as_alone(decoder):
    # Two rows of one prompt, each with its own seed, joining in either order: each row's race is keyed on its
    # prompt and seed, never on its place among equal prompts.
    options = dict(temperature=1.0, max_new_tokens=16)
    alone = {seed: decoder.generate("hello world", config=config(seed=seed, **options)).token_ids for seed in (3, 8)}
    assert alone[3] != alone[8]
    for order in ((3, 8), (8, 3), (8, 8)):
        session = Session(decoder, max_batch=3)
        rows = [session.submit(ids(decoder, "hello world"), config(seed=seed, **options)) for seed in order]
        while not all(row.done.is_set() for row in rows):
            session.step()
        assert [row.tokens for row in rows] == [alone[seed] for seed in order], order
