"""Property tests (hypothesis) for the verification functions: random shapes, vocabularies,
draft lengths, laws with zeros, p == q and one-hot rows."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.drafters import NgramDrafter
from specdec.verify import greedy_verify, speculative_verify
from specdec.verify.sampling import sample


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 6))
    k = draw(st.integers(0, 6))
    vocab = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["random", "equal", "one_hot", "sparse", "point_mass"]))
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(batch, k + 1, vocab, generator=g, dtype=torch.float64)
    if kind == "sparse":
        weights = weights * (torch.rand(batch, k + 1, vocab, generator=g, dtype=torch.float64) > 0.7)
        weights[..., draw(st.integers(0, vocab - 1))] += 0.1  # never an all-zero row
    if kind == "one_hot":
        weights = torch.nn.functional.one_hot(torch.randint(0, vocab, (batch, k + 1), generator=g), vocab).double()
    target = (weights / weights.sum(-1, keepdim=True)).float()
    if kind == "equal":
        draft = target[:, :k].clone()
    else:
        draft_weights = torch.rand(batch, k, vocab, generator=g, dtype=torch.float64) ** 4
        draft = (draft_weights / draft_weights.sum(-1, keepdim=True)).float()
    drafts = sample(draft, g) if k else torch.zeros(batch, 0, dtype=torch.long)
    lengths = torch.randint(0, k + 1, (batch,), generator=g)
    return target, drafts, None if kind == "point_mass" else draft, lengths, seed


@settings(max_examples=150, deadline=None)
@given(cases())
def test_speculative_verify_invariants(case):
    target, drafts, draft, lengths, seed = case
    batch, k_plus_1, vocab = target.shape
    result = speculative_verify(
        target, drafts, draft, draft_lengths=lengths, generator=torch.Generator().manual_seed(seed)
    )
    again = speculative_verify(
        target, drafts, draft, draft_lengths=lengths, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(result.tokens, again.tokens)  # same seed, same tokens
    assert result.tokens.shape == (batch, k_plus_1)
    for row in range(batch):
        n = int(result.num_accepted[row])
        assert 0 <= n <= int(lengths[row])
        tokens = result.tokens[row]
        assert (tokens[: n + 1] >= 0).all() and (tokens[n + 1 :] == -1).all()  # emitted = accepted + 1
        assert torch.equal(tokens[:n], drafts[row, :n])  # accepted drafts are the drafts
        assert 0 <= int(tokens[n]) < vocab
        assert target[row, n, tokens[n]] > 0  # never a token the target forbids
        assert bool(result.bonus[row]) == (n == int(lengths[row]))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_greedy_verify_invariants(case):
    target, drafts, _, lengths, _ = case
    logits = target.log()
    result = greedy_verify(logits, drafts, draft_lengths=lengths)
    argmax = logits.argmax(-1)
    for row in range(target.shape[0]):
        n = int(result.num_accepted[row])
        assert torch.equal(result.tokens[row, : n + 1], argmax[row, : n + 1])
        assert (result.tokens[row, n + 1 :] == -1).all()
        if n < int(lengths[row]):
            assert drafts[row, n] != argmax[row, n]  # stopped at the first mismatch


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_sample_never_picks_zero_weight(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(8, vocab, generator=g) * (torch.rand(8, vocab, generator=g) > 0.8)
    weights[:, torch.randint(0, vocab, (1,), generator=g)] += 1e-30  # tiny but positive
    picks = sample(weights, g)
    assert (weights.gather(1, picks[:, None]) > 0).all()


def _find_by_scanning(sequence, k, max_ngram, min_ngram, match):
    """NgramDrafter.find as first written: the longest suffix n-gram, every start tried in order."""
    seq = list(sequence)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        starts = range(len(seq) - n) if match == "earliest" else range(len(seq) - n - 1, -1, -1)
        for start in starts:
            if seq[start : start + n] == suffix:
                return n, seq[start + n : start + n + k]
    return 0, []


@settings(max_examples=300, deadline=None)
@given(
    sequence=st.lists(st.integers(0, 4), max_size=40),
    k=st.integers(0, 6),
    ngrams=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    match=st.sampled_from(["earliest", "latest"]),
)
def test_vectorised_ngram_find_matches_the_scan(sequence, k, ngrams, match):
    """The vectorised find gives the scan's (n, continuation) on short texts over a small alphabet
    (many repeats, overlaps, matches that run into the suffix)."""
    min_ngram, max_ngram = ngrams[0], ngrams[0] + ngrams[1]
    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram, match=match)
    assert drafter.find(sequence, k) == _find_by_scanning(sequence, k, max_ngram, min_ngram, match)


# ------------------------------------------------------------------ stop strings in the server's replies

ALPHABET = "ab \n:"


def first_stop(text: str, head: int, stops: list[str]) -> int | None:
    """Where the reply is cut: the earliest start of a stop string that ends after `head` characters."""
    starts = [i for s in stops for i in range(len(text) - len(s) + 1) if text.startswith(s, i) and i + len(s) > head]
    return min(starts, default=None)


@st.composite
def replies(draw):
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=7), min_size=1, max_size=3))
    before = draw(st.text(ALPHABET, max_size=10))  # often shorter than a stop string (the leak's cause)
    tokens = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=12))
    if draw(st.booleans()):  # a stop string that begins in the prompt and ends in the reply
        start, end = draw(st.integers(0, len(before))), draw(st.integers(1, 8))
        stops.append(before[start:] + "".join(tokens)[:end] or "a")  # never empty: the API refuses ""
    # the decoder ends the reply with the first token that completes a stop string (specdec.text.StopStrings)
    for n in range(1, len(tokens) + 1):
        if first_stop(before + "".join(tokens[:n]), len(before), stops) is not None:
            tokens = tokens[:n]
            break
    deltas, i = [], 0  # the streamed deltas: runs of whole tokens, as DeltaStreamer sends them
    while i < len(tokens):
        j = draw(st.integers(i + 1, len(tokens)))
        deltas.append("".join(tokens[i:j]))
        i = j
    return stops, before, deltas


@settings(max_examples=2000, deadline=None)
@given(replies())
def test_a_reply_never_holds_a_stop_string_nor_the_part_of_one_that_began_in_the_prompt(case):
    from specdec.serving.openai_schema import StopTrimmer

    stops, before, deltas = case
    reply = "".join(deltas)
    cut = first_stop(before + reply, len(before), stops)
    expected = reply if cut is None else reply[: max(0, cut - len(before))]
    whole = StopTrimmer(stops, before=before)
    assert whole.feed(reply) + whole.end() == expected and whole.stopped == (cut is not None)
    streamed = StopTrimmer(stops, before=before)
    assert "".join(streamed.feed(d) for d in deltas) + streamed.end() == expected
    assert not any(s in expected for s in stops)
