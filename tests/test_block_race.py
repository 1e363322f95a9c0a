"""Block verification and race sampling: exact laws by enumeration of every draft block,
statistical laws with broken variants that the same checks must catch, ragged batches,
keyed noise and path independence."""

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

import specdec.verify as verify
from specdec.verify import (
    acceptance_probs,
    block_acceptance,
    block_verify,
    residual_distribution,
    speculative_verify,
)
from specdec.verify.race import race_bits, race_noise, race_sample, race_verify
from specdec.verify.sampling import sample
from tests.lawcheck import bin_violations, token_law_violations

ROWS = 60_000
Law = Callable[[tuple[int, ...]], torch.Tensor]  # a prefix of tokens -> [vocab] float64 law of the next one


def random_law(*shape: int, generator: torch.Generator, zeros: float = 0.3) -> torch.Tensor:
    """Random float64 distributions over the last dim, with some zero-probability entries."""
    weights = torch.rand(*shape, generator=generator, dtype=torch.float64) ** 3
    weights = weights * (torch.rand(*shape, generator=generator, dtype=torch.float64) > zeros)
    weights[..., 0] += 1e-3  # never an all-zero row
    return weights / weights.sum(-1, keepdim=True)


def context_law(seed: int, vocab: int) -> Law:
    """A different random law after every prefix, a pure function of (seed, prefix)."""

    @functools.cache
    def law(prefix: tuple[int, ...]) -> torch.Tensor:
        key = functools.reduce(lambda code, token: code * (vocab + 1) + token + 1, prefix, seed)
        return random_law(vocab, generator=torch.Generator().manual_seed(key))

    return law


def fixed_law(probs) -> Law:
    """The same law after every prefix (a context-free model)."""
    row = torch.tensor(probs, dtype=torch.float64)
    return lambda prefix: row


# ------------------------------------------------------------------ exact enumeration


def enumerate_blocks(target: Law, draft: Law, vocab: int, k: int):
    """Every draft block of length k as one batch: its tokens [n, k], the target laws along it
    [n, k+1, vocab], the draft laws [n, k, vocab] and the block's draft probability [n]."""
    blocks = list(itertools.product(range(vocab), repeat=k))
    tokens = torch.tensor(blocks, dtype=torch.long).reshape(len(blocks), k)
    target_probs = torch.stack([torch.stack([target(b[:j]) for j in range(k + 1)]) for b in blocks])
    draft_probs = torch.stack([torch.stack([draft(b[:j]) for j in range(k)]) for b in blocks])
    weight = draft_probs.gather(-1, tokens[..., None]).squeeze(-1).prod(-1)
    return blocks, tokens, target_probs, draft_probs, weight


def emitted_laws(target_probs, draft_probs, lengths, scales=None) -> torch.Tensor:
    """[n, k+1, vocab]: the law of the last emitted token given i accepted drafts: the residual
    (scaled by scales[:, i], p_0 = 1, when given) below a row's length, the target law at it."""
    n, k = draft_probs.shape[:2]
    scale = None if scales is None else torch.cat([torch.ones(n, 1, dtype=scales.dtype), scales], 1)[:, :k]
    laws = torch.cat([residual_distribution(target_probs[:, :k], draft_probs, scale), target_probs[:, k:]], 1)
    at_length = torch.arange(k + 1)[None, :] == lengths[:, None]
    return torch.where(at_length[..., None], target_probs.float(), laws).double()


def token_rule(target_probs, tokens, draft_probs, lengths):
    """Token-level verification: P(i accepted) [n, k+1] and the emitted laws given i."""
    k = tokens.shape[1]
    target_at = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    draft_at = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    accept = acceptance_probs(target_at, draft_at).masked_fill(torch.arange(k) >= lengths[:, None], 0)
    reach = torch.cat([torch.ones(len(tokens), 1, dtype=torch.float64), accept.cumprod(-1)], 1)  # all i accepted
    stop = reach * (1 - torch.cat([accept, torch.zeros(len(tokens), 1, dtype=torch.float64)], 1))
    return stop, emitted_laws(target_probs, draft_probs, lengths)


def block_rule(target_probs, tokens, draft_probs, lengths, scaled_residual=True):
    """Block verification, from the library's own scales and thresholds:
    P(tau = i) = h_i * prod_(j > i) (1 - h_j), h_0 = 1."""
    scales, thresholds = block_acceptance(target_probs, tokens, draft_probs, lengths)
    n = len(tokens)
    after = (1 - thresholds).flip(-1).cumprod(-1).flip(-1)  # [n, k]: column i is prod_(j > i) (1 - h_j)
    after = torch.cat([after, torch.ones(n, 1, dtype=torch.float64)], 1)  # [n, k+1]
    stop = torch.cat([torch.ones(n, 1, dtype=torch.float64), thresholds], 1) * after
    return stop, emitted_laws(target_probs, draft_probs, lengths, scales if scaled_residual else None)


def exact_law(rule, target: Law, draft: Law, vocab: int, k: int, length: int | None = None):
    """(law of the first k+1 tokens {sequence: probability} when the target continues after the
    round, the law the target alone gives them, law of the accepted count [k+1]), from every draft block."""
    length = k if length is None else length
    blocks, tokens, target_probs, draft_probs, weight = enumerate_blocks(target, draft, vocab, k)
    stop, emit = rule(target_probs, tokens, draft_probs, torch.full((len(blocks),), length))
    stop, emit, weight = stop.tolist(), emit.tolist(), weight.tolist()
    emitted = defaultdict(float)  # the round's output (accepted drafts + one token) -> probability
    for n, block in enumerate(blocks):
        for i in range(k + 1):
            for y in range(vocab):
                emitted[block[:i] + (y,)] += weight[n] * stop[n][i] * emit[n][i][y]
    next_law = functools.cache(lambda prefix: target(prefix).tolist())
    got, want = {}, {}
    for s in itertools.product(range(vocab), repeat=k + 1):
        steps = [next_law(s[:j])[s[j]] for j in range(k + 1)]
        want[s] = math.prod(steps)
        got[s] = sum(emitted.get(s[:m], 0.0) * math.prod(steps[m:]) for m in range(1, k + 2))
    accepted = [sum(w * row[i] for w, row in zip(weight, stop)) for i in range(k + 1)]
    return got, want, torch.tensor(accepted, dtype=torch.float64)


def law_error(rule, target, draft, vocab, k, length=None) -> float:
    got, want, _ = exact_law(rule, target, draft, vocab, k, length)
    return max(abs(got[s] - want[s]) for s in want)


def expected_accepted(rule, target, draft, vocab, k) -> float:
    law = exact_law(rule, target, draft, vocab, k)[2]
    return float((law * torch.arange(k + 1)).sum())


def test_paper_toy_case_block_accepts_11_9_token_10_9():
    target, draft = fixed_law([1 / 3, 2 / 3]), fixed_law([2 / 3, 1 / 3])
    assert expected_accepted(token_rule, target, draft, 2, 2) == pytest.approx(10 / 9, abs=1e-6)
    assert expected_accepted(block_rule, target, draft, 2, 2) == pytest.approx(11 / 9, abs=1e-6)
    assert law_error(token_rule, target, draft, 2, 2) < 1e-6
    assert law_error(block_rule, target, draft, 2, 2) < 1e-6


def test_paper_toy_case_sampled_means():
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([1 / 3, 2 / 3]).expand(ROWS, 3, 2)
    draft_probs = torch.tensor([2 / 3, 1 / 3]).expand(ROWS, 2, 2)
    drafts = sample(draft_probs, g)
    for verify_fn, mean in ((speculative_verify, 10 / 9), (block_verify, 11 / 9)):
        accepted = verify_fn(target, drafts, draft_probs, generator=g).num_accepted.double()
        assert abs(accepted.mean().item() - mean) < 6 * accepted.std().item() / ROWS**0.5


@pytest.mark.parametrize("seed, vocab, k", [(0, 3, 3), (1, 3, 3), (2, 4, 2), (3, 2, 4)])
def test_block_is_exact_and_accepts_at_least_as_much_as_token(seed, vocab, k):
    target, draft = context_law(seed, vocab), context_law(seed + 100, vocab)
    assert law_error(block_rule, target, draft, vocab, k) < 1e-6
    assert law_error(token_rule, target, draft, vocab, k) < 1e-6  # the enumeration itself is sound
    block = expected_accepted(block_rule, target, draft, vocab, k)
    assert block >= expected_accepted(token_rule, target, draft, vocab, k) - 1e-6


# A draft that nearly never proposes token 0, which the target likes: p_i swings well above and
# below 1, so each broken variant below is off by many standard deviations at ROWS rows.
SKEWED_TARGET, SKEWED_DRAFT = [0.3, 0.33, 0.37], [0.01, 0.25, 0.74]


def thresholds_equal_scales(scales, masses, lengths):
    """Broken: h_i = p_i (the last threshold's rule at every length)."""
    return scales.masked_fill(torch.arange(1, scales.shape[1] + 1) > lengths[:, None], 0.0)


def test_enumeration_catches_broken_block_rules(monkeypatch):
    target, draft = fixed_law(SKEWED_TARGET), fixed_law(SKEWED_DRAFT)
    assert law_error(block_rule, target, draft, 3, 3) < 1e-6
    unscaled = lambda *args: block_rule(*args, scaled_residual=False)  # noqa: E731
    assert law_error(unscaled, target, draft, 3, 3) > 1e-3
    monkeypatch.setattr(verify, "_block_thresholds", thresholds_equal_scales)
    assert law_error(block_rule, target, draft, 3, 3) > 1e-2


# ------------------------------------------------------------------ sampled laws


def positional_law(probs: torch.Tensor) -> Law:
    """probs [k+1, vocab]: the law at position j whatever the prefix (context-free rows)."""
    return lambda prefix: probs[len(prefix)].double()


def sampled_round(target, draft, g, rows=ROWS, verify_fn=block_verify, lengths=None):
    """rows copies of one context-free case [k+1, vocab] / [k, vocab], drafts drawn from the draft law."""
    draft_probs = draft.expand(rows, -1, -1)
    drafts = sample(draft_probs, g)
    return verify_fn(target.expand(rows, -1, -1), drafts, draft_probs, generator=g, draft_lengths=lengths)


@pytest.mark.parametrize("seed", [0, 1])
def test_block_token_and_accepted_laws(seed):
    g = torch.Generator().manual_seed(seed)
    target, draft = random_law(4, 8, generator=g).float(), random_law(3, 8, generator=g).float()
    result = sampled_round(target, draft, g)
    assert token_law_violations(result.tokens, target) == []
    law = exact_law(block_rule, positional_law(target), positional_law(draft), 8, 3)[2]
    assert bin_violations(torch.bincount(result.num_accepted, minlength=4), law, ROWS) == []


def test_law_check_catches_unscaled_residual(monkeypatch):
    g = torch.Generator().manual_seed(2)
    target, draft = torch.tensor([SKEWED_TARGET] * 4), torch.tensor([SKEWED_DRAFT] * 3)
    assert token_law_violations(sampled_round(target, draft, g).tokens, target) == []
    monkeypatch.setattr(verify, "_residual_scale", lambda scales, num_accepted: torch.ones(len(scales)))
    assert token_law_violations(sampled_round(target, draft, g).tokens, target) != []


def test_law_check_catches_thresholds_equal_scales(monkeypatch):
    g = torch.Generator().manual_seed(3)
    target, draft = torch.tensor([SKEWED_TARGET] * 4), torch.tensor([SKEWED_DRAFT] * 3)
    monkeypatch.setattr(verify, "_block_thresholds", thresholds_equal_scales)
    assert token_law_violations(sampled_round(target, draft, g).tokens, target) != []


def test_block_accepts_more_than_token_on_sampled_rounds():
    g = torch.Generator().manual_seed(4)
    target, draft = torch.tensor([SKEWED_TARGET] * 4), torch.tensor([SKEWED_DRAFT] * 3)
    block = sampled_round(target, draft, g).num_accepted.double()
    token = sampled_round(target, draft, g, verify_fn=speculative_verify).num_accepted.double()
    margin = 6 * ((block.var() + token.var()) / ROWS).sqrt()
    assert block.mean() - token.mean() > margin
    exact = expected_accepted(block_rule, fixed_law(SKEWED_TARGET), fixed_law(SKEWED_DRAFT), 3, 3)
    assert abs(block.mean().item() - exact) < 6 * block.std().item() / ROWS**0.5


# ------------------------------------------------------------------ ragged batches


def one_hot(index: int, vocab: int = 10) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[index] = 1.0
    return row


def test_ragged_rows_hand_built():
    target_probs = torch.stack([one_hot(1), one_hot(2), one_hot(3)])[None].repeat(3, 1, 1)
    drafts = torch.tensor([[1, 2], [1, 2], [1, 2]])
    result = block_verify(target_probs, drafts, target_probs[:, :2].clone(), draft_lengths=torch.tensor([0, 1, 2]))
    assert result.tokens.tolist() == [[1, -1, -1], [1, 2, -1], [1, 2, 3]]
    assert result.num_accepted.tolist() == [0, 1, 2] and result.bonus.tolist() == [True, True, True]


def test_ragged_rows_equal_their_truncated_selves_and_are_exact():
    target, draft, vocab, k = context_law(5, 3), context_law(105, 3), 3, 3
    _, tokens, target_probs, draft_probs, _ = enumerate_blocks(target, draft, vocab, k)
    lengths = torch.arange(len(tokens)) % (k + 1)  # every length in one batch
    _, thresholds = block_acceptance(target_probs, tokens, draft_probs, lengths)
    for length in range(1, k + 1):
        rows = lengths == length
        _, alone = block_acceptance(
            target_probs[rows, : length + 1], tokens[rows, :length], draft_probs[rows, :length], lengths[rows]
        )
        assert torch.allclose(thresholds[rows, :length], alone, atol=1e-12)
        assert (thresholds[rows, length:] == 0).all()
    for length in range(k + 1):
        assert law_error(block_rule, target, draft, vocab, k, length) < 1e-6


def test_ragged_batch_follows_target_law():
    g = torch.Generator().manual_seed(6)
    target, draft = random_law(4, 6, generator=g).float(), random_law(3, 6, generator=g).float()
    lengths = torch.arange(ROWS) % 4
    result = sampled_round(target, draft, g, lengths=lengths)
    assert (result.num_accepted <= lengths).all()
    for length in range(4):
        rows = lengths == length
        assert (result.tokens[rows, length + 1 :] == -1).all()
        assert token_law_violations(result.tokens[rows], target) == []
        law = exact_law(block_rule, positional_law(target), positional_law(draft), 6, 3, length)[2]
        assert bin_violations(torch.bincount(result.num_accepted[rows], minlength=4), law, int(rows.sum())) == []


# ------------------------------------------------------------------ point-mass drafts


def test_point_mass_block_equals_token_verification_in_law():
    vocab, k = 4, 3
    _, tokens, target_probs, _, _ = enumerate_blocks(context_law(7, vocab), context_law(8, vocab), vocab, k)
    draft_probs = torch.nn.functional.one_hot(tokens, vocab).double()  # every block, drafted deterministically
    lengths = torch.arange(len(tokens)) % (k + 1)
    block_stop, block_emit = block_rule(target_probs, tokens, draft_probs, lengths)
    token_stop, token_emit = token_rule(target_probs, tokens, draft_probs, lengths)
    assert torch.allclose(block_stop, token_stop, atol=1e-6)
    reached = token_stop > 0
    assert torch.allclose(block_emit[reached], token_emit[reached], atol=1e-6)


def test_point_mass_drafts_sampled():
    g = torch.Generator().manual_seed(8)
    target = random_law(4, 8, generator=g).float()
    drafts = torch.tensor([[2, 5, 1]]).expand(ROWS, -1)
    explicit = torch.stack([one_hot(2, 8), one_hot(5, 8), one_hot(1, 8)]).expand(ROWS, -1, -1)
    by_block = block_verify(target.expand(ROWS, -1, -1), drafts, explicit, generator=g)
    assert token_law_violations(by_block.tokens, target) == []
    law = exact_law(token_rule, positional_law(target), positional_law(explicit[0].double()), 8, 3)[2]
    assert bin_violations(torch.bincount(by_block.num_accepted, minlength=4), law, ROWS) == []
    # draft_probs=None is the point-mass contract: the same tokens as token verification.
    a = block_verify(target.expand(100, -1, -1), drafts[:100], generator=torch.Generator().manual_seed(1))
    b = speculative_verify(target.expand(100, -1, -1), drafts[:100], generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens)


# ------------------------------------------------------------------ edges, determinism, bad input


def test_zero_drafts_and_zero_draft_probability():
    target_probs = one_hot(6)[None, None]
    result = block_verify(target_probs, torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 10))
    assert result.tokens.tolist() == [[6]] and result.num_accepted.tolist() == [0]
    target_probs = torch.stack([one_hot(3), one_hot(4), one_hot(5)])[None]
    draft_probs = torch.stack([one_hot(0), one_hot(4)])[None]  # the drafted token 3 has draft probability 0
    result = block_verify(target_probs, torch.tensor([[3, 4]]), draft_probs)
    assert result.tokens.tolist() == [[3, -1, -1]] and result.num_accepted.tolist() == [0]


def test_equal_laws_accept_everything():
    g = torch.Generator().manual_seed(9)
    law = random_law(500, 4, 10, generator=g).float()
    result = block_verify(law, sample(law[:, :3], g), law[:, :3].clone(), generator=g)
    assert (result.num_accepted == 3).all() and result.bonus.all()


def test_same_seed_same_tokens_and_global_rng_untouched():
    g = torch.Generator().manual_seed(10)
    target, draft = random_law(4, 8, generator=g).float(), random_law(3, 8, generator=g).float()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = sampled_round(target, draft, torch.Generator().manual_seed(42), rows=1000)
    b = sampled_round(target, draft, torch.Generator().manual_seed(42), rows=1000)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t, d, q: (t[0], d, q), "target_probs must have shape"),
        (lambda t, d, q: (t, d[:, :2], q), "draft_tokens must have shape"),
        (lambda t, d, q: (t, d + 100, q), "token ids"),
        (lambda t, d, q: (t * 2, d, q), "sum to 1"),
        (lambda t, d, q: (t, d, q[:, :, :5]), "draft_probs must have shape"),
        (lambda t, d, q: (t, d, q - 0.5), "negative"),
    ],
)
def test_block_invalid_input_raises_value_error(mutate, message):
    g = torch.Generator().manual_seed(11)
    target, draft = random_law(1, 4, 8, generator=g).float(), random_law(1, 3, 8, generator=g).float()
    with pytest.raises(ValueError, match=message):
        block_verify(*mutate(target, sample(draft, g), draft))
    with pytest.raises(ValueError, match="draft_lengths"):
        block_verify(target, sample(draft, g), draft, draft_lengths=torch.tensor([4]))


# ------------------------------------------------------------------ race sampling

MASK_64 = (1 << 64) - 1


def reference_word(seed: int, row: int, position: int, token: int) -> int:
    """The race hash in plain Python integers: splitmix64 streams keyed on (seed, row, position)."""

    def mix(z: int) -> int:
        z &= MASK_64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    return mix(mix(mix(mix(seed) + row * golden) + position * golden) + (token + 1) * golden)


def test_race_bits_are_plain_integer_hashes():
    for seed in (0, 7, -3, 2**70 + 5):
        keys, positions = torch.tensor([0, 9, -4]), torch.tensor([[0, 1], [5, 123456789], [2, 3]])
        words = race_bits(seed, keys, positions, 6)
        for b, n, t in itertools.product(range(3), range(2), range(6)):
            expected = reference_word(seed, int(keys[b]), int(positions[b, n]), t)
            assert int(words[b, n, t]) & MASK_64 == expected
    word = reference_word(7, 9, 5, 4)
    uniform = ((word & ((1 << 52) - 1)) + 0.5) / 2**52
    noise = race_noise(7, torch.tensor([9]), torch.tensor([[5]]), 6)
    assert noise[0, 0, 4].item() == pytest.approx(-math.log(-math.log(uniform)), rel=1e-6)


def test_race_noise_ignores_batch_composition():
    wide = race_noise(3, torch.tensor([1, 5, 7, 9]), torch.tensor([[0, 0], [3, 4], [2, 2], [10, 11]]), 50)
    narrow = race_noise(3, torch.tensor([9, 5]), torch.tensor([[10, 11], [3, 4]]), 50)
    assert torch.equal(narrow, wide[[3, 1]])
    single = race_noise(3, torch.tensor([5]), torch.tensor([[4]]), 50)
    assert torch.equal(single[0, 0], wide[1, 1])
    assert not torch.equal(race_noise(4, torch.tensor([5]), torch.tensor([[4]]), 50), single)  # the seed matters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_race_noise_same_on_gpu():
    keys, positions = torch.arange(4), torch.arange(12).reshape(4, 3) * 1000
    cpu = race_bits(11, keys, positions, 151936)
    assert torch.equal(race_bits(11, keys.cuda(), positions.cuda(), 151936).cpu(), cpu)
    noise = race_noise(11, keys, positions, 151936)
    assert torch.allclose(race_noise(11, keys, positions, 151936, device="cuda").cpu(), noise, atol=1e-5)


def race_law_violations(noise_fn, probs: torch.Tensor, rows: int = 30_000) -> list[str]:
    """Race winners over many keys: each must follow probs, and pairs (two rows at one position,
    one row at two positions) must follow probs x probs: independent draws."""
    vocab = probs.shape[-1]
    keys, positions = torch.arange(rows), torch.tensor([[40, 41]]).expand(rows, -1)
    winners = race_sample(probs.expand(rows, 2, -1), noise_fn(5, keys, positions, vocab))  # [rows, 2]
    pair_law = (probs[:, None] * probs[None, :]).flatten()
    problems = bin_violations(torch.bincount(winners[:, 0], minlength=vocab), probs, rows)
    across_rows = winners[0::2, 0] * vocab + winners[1::2, 0]
    across_positions = winners[:, 0] * vocab + winners[:, 1]
    problems += bin_violations(torch.bincount(across_rows, minlength=vocab**2), pair_law, rows // 2)
    return problems + bin_violations(torch.bincount(across_positions, minlength=vocab**2), pair_law, rows)


def test_race_sample_follows_the_law_and_keys_are_independent():
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3])
    assert race_law_violations(race_noise, probs) == []


def test_race_check_catches_noise_shared_across_rows_or_positions():
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3])
    one_row = lambda seed, keys, positions, vocab: race_noise(seed, keys * 0, positions, vocab)  # noqa: E731
    one_position = lambda seed, keys, positions, vocab: race_noise(seed, keys, positions * 0, vocab)  # noqa: E731
    assert race_law_violations(one_row, probs) != []
    assert race_law_violations(one_position, probs) != []


def test_race_verify_emits_the_target_winners_whatever_the_drafts():
    g = torch.Generator().manual_seed(12)
    rows, k, vocab = 2000, 4, 6
    target = random_law(rows, k + 1, vocab, generator=g).float()
    noise = race_noise(0, torch.arange(rows), torch.arange(k + 1).expand(rows, -1) + 17, vocab)
    winners = race_sample(target, noise)  # [rows, k + 1]
    perfect = race_verify(target, winners[:, :k], noise=noise)
    assert torch.equal(perfect.tokens, winners) and (perfect.num_accepted == k).all() and perfect.bonus.all()
    lengths = torch.arange(rows) % (k + 1)
    for drafts in (torch.randint(0, vocab, (rows, k), generator=g), winners[:, :k]):
        result = race_verify(target, drafts, noise=noise, draft_lengths=lengths)
        emitted = torch.arange(k + 1) <= result.num_accepted[:, None]
        assert torch.equal(result.tokens[emitted], winners[emitted]) and (result.tokens[~emitted] == -1).all()
        assert (result.num_accepted <= lengths).all()


def toy_model(seed: int, vocab: int) -> Law:
    """A context-dependent law: a random one for each pair of last tokens."""
    tail_law = context_law(seed, vocab)
    return lambda prefix: tail_law(tuple(prefix[-2:]))


def race_generate(keys, steps, k_schedule, draft_token=None, vocab=5, absolute=True):
    """A race-sampling decode loop over toy_model(0): each round drafts k tokens per row with
    draft_token(prefix, noise [vocab]), verifies them, appends the emitted tokens.
    Returns the first `steps` tokens of each row and the number of drafts accepted."""
    target = toy_model(0, vocab)
    sequences, accepted = [[] for _ in keys], 0
    for k in itertools.cycle(k_schedule):
        if min(len(s) for s in sequences) >= steps:
            return [s[:steps] for s in sequences], accepted
        start = torch.tensor([len(s) if absolute else 0 for s in sequences])
        noise = race_noise(9, keys, start[:, None] + torch.arange(k + 1), vocab)  # [rows, k+1, vocab]
        drafts = [[] for _ in keys]
        for s, d, row_noise in zip(sequences, drafts, noise):
            for j in range(k):
                d.append(draft_token(tuple(s + d), row_noise[j]))
        target_probs = [
            torch.stack([target(tuple(s + d[:j])) for j in range(k + 1)]) for s, d in zip(sequences, drafts)
        ]
        draft_tokens = torch.tensor(drafts, dtype=torch.long).reshape(len(keys), k)
        result = race_verify(torch.stack(target_probs).float(), draft_tokens, noise=noise)
        for s, row in zip(sequences, result.tokens.tolist()):
            s.extend(t for t in row if t >= 0)
        accepted += int(result.num_accepted.sum())


def racer(model: Law):
    """A drafter that proposes its own race winner under the round's noise."""
    return lambda prefix, noise: int(race_sample(model(prefix).float(), noise))


def test_race_decoding_is_path_independent():
    keys, g = torch.tensor([3, 1, 4, 1_000_003]), torch.Generator().manual_seed(13)
    plain, _ = race_generate(keys, 24, [0])  # no drafts: the target's own race, token by token
    random_drafts = lambda prefix, noise: int(torch.randint(0, 5, (1,), generator=g))  # noqa: E731
    for schedule, drafter in (([3], random_drafts), ([1, 4, 2], racer(toy_model(1, 5))), ([5], racer(toy_model(0, 5)))):
        assert race_generate(keys, 24, schedule, drafter)[0] == plain
    # A drafter racing the target's own law with the same noise is always right: 6 rounds of 3 + 1.
    assert race_generate(keys, 24, [3], racer(toy_model(0, 5)))[1] == 6 * 3 * len(keys)
    # Broken: noise keyed on the position within a round, not in the sequence: the tokens depend on k.
    within_round = race_generate(keys, 24, [3], random_drafts, absolute=False)[0]
    assert within_round != race_generate(keys, 24, [0], absolute=False)[0]


def test_race_invalid_input():
    with pytest.raises(ValueError, match="row_keys must have shape"):
        race_noise(0, torch.arange(3), torch.zeros(2, 4, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="integer"):
        race_noise(0, torch.arange(3), torch.zeros(3, 4), 10)
    with pytest.raises(ValueError, match="vocab"):
        race_noise(0, torch.arange(3), torch.zeros(3, 4, dtype=torch.long), 0)
    target = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="noise must have the shape"):
        race_verify(target, torch.zeros(2, 2, dtype=torch.long), noise=torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="sum to 1"):
        race_verify(target * 2, torch.zeros(2, 2, dtype=torch.long), noise=torch.zeros(2, 3, 4))


def test_race_noise_memo_gives_the_hashed_noise():
    """Race.noise reads recent (row, position) pairs from its memo; it must equal race_noise always,
    with repeated positions (a tree's siblings), across calls (draft then verify) and after eviction."""
    from specdec.verify.race import Race

    race = Race.for_prompts(7, [[1, 2, 3], [4, 5], [1, 2, 3]], vocab=50)
    object.__setattr__(race, "MEMO_ENTRIES", 4)  # force evictions (the class keeps 96)
    for positions in ([[3, 4, 4, 5], [2, 2, 3, 9], [3, 3, 3, 4]], [[5, 6, 6, 7], [9, 10, 10, 11], [4, 5, 6, 7]]):
        positions = torch.tensor(positions)
        expected = race_noise(race.seed, race.row_keys, positions, 50)
        assert torch.equal(race.noise(positions), expected)
        assert torch.equal(race.noise(positions[:, :2]), expected[:, :2])  # from the memo
