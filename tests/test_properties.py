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
