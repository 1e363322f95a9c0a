"""Verification core: hand-built cases, the analytic identity, statistical laws with
broken variants that the same checks must catch, edge cases and bad input."""

import pytest
import torch

import specdec.verify as verify
from specdec.verify import (
    acceptance_probs,
    greedy_verify,
    residual_distribution,
    speculative_verify,
    tree_verify,
)
from specdec.verify.sampling import SamplingConfig, sample
from tests.lawcheck import bin_violations, logits_to_probs, token_law_violations

ROWS = 60_000


def one_hot(index: int, vocab: int = 10) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[index] = 1.0
    return row


def random_law(*shape: int, generator: torch.Generator, zeros: float = 0.3) -> torch.Tensor:
    """Random distributions over the last dim, with some zero-probability entries."""
    weights = torch.rand(*shape, generator=generator, dtype=torch.float64) ** 3
    weights = weights * (torch.rand(*shape, generator=generator, dtype=torch.float64) > zeros)
    weights[..., 0] += 1e-3  # never an all-zero row
    return (weights / weights.sum(-1, keepdim=True)).float()


# ------------------------------------------------------------------ hand-built


def test_hand_built_two_accepted_then_recovered_8():
    drafts = torch.tensor([[1, 4, 5]])
    draft_probs = torch.stack([one_hot(1), one_hot(4), one_hot(5)])[None]
    target_probs = torch.stack([one_hot(1), one_hot(4), one_hot(8), torch.full((10,), 0.1)])[None]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        result = speculative_verify(target_probs, drafts, draft_probs, generator=g)
        assert result.num_accepted.tolist() == [2]
        assert result.tokens.tolist() == [[1, 4, 8, -1]]
        assert result.bonus.tolist() == [False]


def test_all_accepted_emits_bonus_from_row_k():
    drafts = torch.tensor([[2, 3]])
    target_probs = torch.stack([one_hot(2), one_hot(3), one_hot(7)])[None]
    result = speculative_verify(target_probs, drafts, target_probs[:, :2].clone())
    assert result.tokens.tolist() == [[2, 3, 7]]
    assert result.bonus.tolist() == [True]


def test_zero_drafts_emits_one_target_token():
    target_probs = one_hot(6)[None, None]  # [1, 1, 10]
    result = speculative_verify(target_probs, torch.zeros(1, 0, dtype=torch.long))
    assert result.tokens.tolist() == [[6]] and result.num_accepted.tolist() == [0]


def test_ragged_rows_respect_draft_lengths():
    target_probs = torch.stack([one_hot(1), one_hot(2), one_hot(3)])[None].repeat(3, 1, 1)
    drafts = torch.tensor([[1, 2], [1, 2], [1, 2]])
    result = speculative_verify(target_probs, drafts, draft_lengths=torch.tensor([0, 1, 2]))
    assert result.tokens.tolist() == [[1, -1, -1], [1, 2, -1], [1, 2, 3]]
    assert result.num_accepted.tolist() == [0, 1, 2]
    assert result.bonus.tolist() == [True, True, True]


def test_draft_probability_zero_rejects_without_nan():
    target_probs = torch.stack([one_hot(3), one_hot(4)])[None]
    draft_probs = one_hot(0)[None, None]  # the drafted token 3 has draft probability 0
    result = speculative_verify(target_probs, torch.tensor([[3]]), draft_probs)
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[3, -1]]  # recovered from the residual = target


def test_equal_laws_accept_everything_and_no_nan():
    g = torch.Generator().manual_seed(0)
    law = random_law(500, 4, 10, generator=g)
    drafts = sample(law[:, :3], g)
    result = speculative_verify(law, drafts, law[:, :3].clone(), generator=g)
    assert (result.num_accepted == 3).all()
    assert acceptance_probs(law[..., 0], law[..., 0]).isfinite().all()
    assert residual_distribution(law, law).isfinite().all()


def test_disjoint_supports_always_reject_and_recover_from_target():
    target_probs = torch.tensor([[[0.5, 0.5, 0, 0], [0.25] * 4]])
    draft_probs = torch.tensor([[[0, 0, 0.5, 0.5]]])
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        result = speculative_verify(target_probs, sample(draft_probs, g), draft_probs, generator=g)
        assert result.num_accepted.item() == 0 and result.tokens[0, 0].item() in (0, 1)


def masked_emissions(result, target_probs: torch.Tensor) -> int:
    """Emitted tokens where the target law is 0."""
    emitted = result.tokens.clamp_min(0)
    law_at = target_probs.gather(-1, emitted[..., None]).squeeze(-1)
    return int(((law_at == 0) & (result.tokens >= 0)).sum())


def test_masked_tokens_are_never_emitted(monkeypatch):
    g = torch.Generator().manual_seed(2)
    rows = ROWS // 6
    target_probs = logits_to_probs(torch.randn(rows, 3, 12, generator=g), SamplingConfig(temperature=0.8, top_k=4))
    # Drafts from an unmasked law: many land where the target law is 0, and must all be rejected.
    draft_probs = logits_to_probs(torch.randn(rows, 2, 12, generator=g), SamplingConfig(temperature=1.0))
    drafts = sample(draft_probs, g)
    assert int((target_probs[:, :2].gather(-1, drafts[..., None]) == 0).sum()) > rows // 2
    result = speculative_verify(target_probs, drafts, draft_probs, generator=g)
    assert int((result.tokens >= 0).sum()) >= rows  # every row emitted at least one token
    assert masked_emissions(result, target_probs) == 0
    # Broken variant: accepting every draft emits masked tokens, and the same count sees them.
    monkeypatch.setattr(verify, "acceptance_probs", lambda t, d: torch.ones_like(t, dtype=torch.float64))
    assert masked_emissions(speculative_verify(target_probs, drafts, draft_probs, generator=g), target_probs) > 0


# ------------------------------------------------------------------ the analytic identity


def emitted_law(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """q * a + (1 - sum(q * a)) * residual: the law of the emitted token at one position."""
    kept = draft_row.double() * acceptance_probs(target_row, draft_row)
    return kept + (1 - kept.sum(-1, keepdim=True)) * residual_distribution(target_row, draft_row).double()


def test_analytic_identity_on_random_and_edge_pairs():
    g = torch.Generator().manual_seed(3)
    p, q = random_law(2000, 17, generator=g), random_law(2000, 17, generator=g)
    edge_p = torch.stack([one_hot(1, 17), one_hot(1, 17), p[0], p[1], torch.full((17,), 1 / 17)])
    edge_q = torch.stack([one_hot(1, 17), one_hot(2, 17), p[0], one_hot(5, 17), one_hot(0, 17)])
    for target_row, draft_row in ((p, q), (edge_p, edge_q)):
        assert torch.allclose(emitted_law(target_row, draft_row), target_row.double(), atol=1e-6)


def test_identity_fails_for_residual_equal_to_target():
    g = torch.Generator().manual_seed(4)
    p, q = random_law(200, 9, generator=g), random_law(200, 9, generator=g)
    kept = q.double() * acceptance_probs(p, q)
    broken = kept + (1 - kept.sum(-1, keepdim=True)) * p.double()
    assert not torch.allclose(broken, p.double(), atol=1e-3)


# ------------------------------------------------------------------ statistical laws


def make_case(seed: int, k: int = 3, vocab: int = 8):
    g = torch.Generator().manual_seed(seed)
    target = random_law(k + 1, vocab, generator=g, zeros=0.25)
    draft = random_law(k, vocab, generator=g, zeros=0.25)
    return g, target, draft


def run_rows(target, draft, g, rows=ROWS, verify_fn=speculative_verify):
    draft_probs = draft.expand(rows, -1, -1)
    drafts = sample(draft_probs, g)
    return verify_fn(target.expand(rows, -1, -1), drafts, draft_probs, generator=g)


def accepted_count_violations(num_accepted, target, draft) -> list[str]:
    """P(n) = a1 ... an (1 - a(n+1)), with a_k+1 := 0."""
    alphas = torch.minimum(target[:-1], draft).sum(-1).double().tolist() + [0.0]
    law, prefix = [], 1.0
    for a in alphas:
        law.append(prefix * (1 - a))
        prefix *= a
    counts = torch.bincount(num_accepted, minlength=len(law))
    return bin_violations(counts, torch.tensor(law), num_accepted.numel())


@pytest.mark.parametrize("seed", [0, 1])
def test_accepted_count_and_token_laws(seed):
    g, target, draft = make_case(seed)
    result = run_rows(target, draft, g)
    assert accepted_count_violations(result.num_accepted, target, draft) == []
    assert token_law_violations(result.tokens, target) == []


def test_point_mass_drafts_follow_target_law():
    g, target, _ = make_case(5)
    drafts = torch.tensor([[2, 5, 1]]).expand(ROWS, -1)  # deterministic proposals
    result = speculative_verify(target.expand(ROWS, -1, -1), drafts, generator=g)
    assert token_law_violations(result.tokens, target) == []


@pytest.mark.parametrize("verify_fn", ["speculative", "block"])
def test_branch_free_path_of_the_gpu_follows_the_same_laws(monkeypatch, verify_fn):
    # On a GPU the residual is built for every row, masked (asking which rows need it is a host sync):
    # forced here on the CPU, point-mass and sampled drafts alike, rows with and without a bonus.
    from specdec.verify import block_verify

    monkeypatch.setattr(verify, "_may_hold", lambda flags: True)
    fn = speculative_verify if verify_fn == "speculative" else block_verify
    g, target, draft = make_case(3)
    result = run_rows(target, draft, g, verify_fn=fn)
    assert token_law_violations(result.tokens, target) == []
    if verify_fn == "speculative":
        assert accepted_count_violations(result.num_accepted, target, draft) == []
        drafts = torch.tensor([[2, 5, 1]]).expand(ROWS, -1)  # point masses: the draft token zeroed, masked
        point = speculative_verify(target.expand(ROWS, -1, -1), drafts, generator=g)
        assert token_law_violations(point.tokens, target) == []
    assert bool(result.bonus.any()) and not bool(result.bonus.all())


def test_warped_laws_follow_target():
    g = torch.Generator().manual_seed(6)
    config = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    target = logits_to_probs(torch.randn(4, 10, generator=g), config)
    draft = logits_to_probs(torch.randn(3, 10, generator=g), config)
    result = run_rows(target, draft, g)
    assert token_law_violations(result.tokens, target) == []


# Broken variants: the same checks must catch each.


def test_check_catches_always_accept(monkeypatch):
    g, target, draft = make_case(0)
    monkeypatch.setattr(verify, "acceptance_probs", lambda t, d: torch.ones_like(t, dtype=torch.float64))
    result = run_rows(target, draft, g)
    assert token_law_violations(result.tokens, target) != []


def test_check_catches_residual_equal_to_target(monkeypatch):
    g, target, draft = make_case(0)
    monkeypatch.setattr(verify, "_subtract_draft", lambda weights, draft_rows: None)  # residual = target
    result = run_rows(target, draft, g)
    assert token_law_violations(result.tokens, target) != []


def test_check_catches_draft_probs_from_unwarped_logits():
    g = torch.Generator().manual_seed(7)
    config = SamplingConfig(temperature=0.5, top_k=3)
    target = logits_to_probs(torch.randn(4, 10, generator=g), config)
    draft_logits = torch.randn(ROWS, 3, 10, generator=g) * 0 + torch.randn(3, 10, generator=g)
    drafts = sample(logits_to_probs(draft_logits, config), g)  # drawn from the warped law...
    unwarped = logits_to_probs(draft_logits, SamplingConfig(temperature=1.0))  # ...scored with the raw one
    result = speculative_verify(target.expand(ROWS, -1, -1), drafts, unwarped, generator=g)
    assert token_law_violations(result.tokens, target) != []


# ------------------------------------------------------------------ determinism


def test_same_seed_same_tokens_and_global_rng_untouched():
    _, target, draft = make_case(8)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = run_rows(target, draft, torch.Generator().manual_seed(42), rows=1000)
    b = run_rows(target, draft, torch.Generator().manual_seed(42), rows=1000)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(torch.random.get_rng_state(), before)


# ------------------------------------------------------------------ greedy


def test_greedy_verify_accepts_prefix_matching_argmax():
    logits = torch.stack([one_hot(1), one_hot(4), one_hot(8), one_hot(2)])[None] * 5
    result = greedy_verify(logits, torch.tensor([[1, 4, 5]]))
    assert result.tokens.tolist() == [[1, 4, 8, -1]]
    result = greedy_verify(logits, torch.tensor([[1, 4, 8]]))
    assert result.tokens.tolist() == [[1, 4, 8, 2]] and result.bonus.item()
    result = greedy_verify(
        logits.repeat(2, 1, 1), torch.tensor([[1, 4, 8], [1, 4, 8]]), draft_lengths=torch.tensor([1, 0])
    )
    assert result.tokens.tolist() == [[1, 4, -1, -1], [1, -1, -1, -1]]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t, d, q: (t[0], d, q), "target_probs must have shape"),
        (lambda t, d, q: (t, d[:, :2], q), "draft_tokens must have shape"),
        (lambda t, d, q: (t, d + 100, q), "token ids"),
        (lambda t, d, q: (t * 2, d, q), "sum to 1"),
        (lambda t, d, q: (t.index_fill(2, torch.tensor([0]), float("nan")), d, q), "NaN"),
        (lambda t, d, q: (t, d, q[:, :, :5]), "draft_probs must have shape"),
        (lambda t, d, q: (t, d, q - 0.5), "negative"),
    ],
)
def test_invalid_input_raises_value_error(mutate, message):
    g, target, draft = make_case(9)
    t, d, q = target[None].clone(), sample(draft, g)[None], draft[None].clone()
    with pytest.raises(ValueError, match=message):
        speculative_verify(*mutate(t, d, q))


def test_invalid_draft_lengths():
    _, target, draft = make_case(9)
    with pytest.raises(ValueError, match="draft_lengths"):
        speculative_verify(target[None], torch.zeros(1, 3, dtype=torch.long), draft_lengths=torch.tensor([4]))


# ---------------------------------------------------------------- draft trees


def test_tree_greedy_walk_follows_the_winners():
    # root -> 0 (chain) -> 1 (chain); 2 and 3 are siblings of node 0; 4 a sibling of node 1
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    parents = torch.tensor([[-1, 0, -1, -1, 0]])
    # columns: root, node 0..4; the root's winner is 8 (sibling node 3), whose winner ends the round
    winners = torch.tensor([[8, 1, 1, 1, 2, 1]])
    result = tree_verify(None, tokens, parents, winners=winners)
    assert result.tokens.tolist() == [[8, 2]] and result.num_accepted.tolist() == [1]
    assert result.path.tolist() == [[3]] and result.bonus.tolist() == [True]  # node 3 is a leaf
    winners = torch.tensor([[5, 9, 0, 0, 0, 3]])  # chain node 0, then its sibling-of-node-1 node 4
    result = tree_verify(None, tokens, parents, winners=winners)
    assert result.tokens.tolist() == [[5, 9, 3]] and result.path.tolist() == [[0, 4]]
    winners = torch.tensor([[1, 9, 0, 0, 0, 3]])  # no child holds 1: recovered at the root
    valid = torch.tensor([[True, True, True, True, False]])
    result = tree_verify(None, tokens, parents, node_valid=valid, winners=winners)
    assert result.tokens.tolist() == [[1]] and result.bonus.tolist() == [False]


def _tree_rounds(rows: int, p: torch.Tensor, q: torch.Tensor, seed: int, wrong_q: bool = False):
    """Rows of a depth-2 tree: chain x0 ~ q[0], x1 ~ q[1], two siblings beside x0 and one beside x1
    (the draft's best other tokens). Every node of depth d is scored by p[d] (context-free)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.stack([torch.multinomial(q[d], rows, replacement=True, generator=g) for d in range(2)], 1)
    siblings = []
    for d, count in ((0, 2), (1, 1)):
        ranked = q[d].expand(rows, -1).clone().scatter_(1, x[:, d : d + 1], -1.0)
        siblings.append(ranked.topk(count, dim=1).indices)
    tokens = torch.cat([x, siblings[0], siblings[1]], 1)  # nodes: x0, x1, s0a, s0b, s1
    parents = torch.tensor([-1, 0, -1, -1, 0]).expand(rows, -1)
    depth_of_column = [0, 1, 2, 1, 1, 2]  # root, then each node's children's depth
    target = torch.stack([p[d] for d in depth_of_column]).expand(rows, -1, -1)
    draft = q.expand(rows, -1, -1).clone()
    if wrong_q:
        draft = torch.full_like(draft, 1 / q.shape[-1])
    return tree_verify(target, tokens, parents, draft_probs=draft, generator=g)


def test_tree_sampled_tokens_follow_the_target_law_at_every_depth():
    # The target puts more mass than the draft on the draft's runners-up: the residual after a
    # rejected chain draft lands on the siblings, so paths through them run often.
    q = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05], [0.1, 0.5, 0.25, 0.1, 0.05]], dtype=torch.float64)
    p = torch.tensor([[0.2, 0.35, 0.3, 0.1, 0.05], [0.05, 0.3, 0.4, 0.2, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3]])
    p = p.double()
    result = _tree_rounds(10000, p, q, seed=4)
    assert token_law_violations(result.tokens, p) == []
    assert (result.num_accepted == 2).any() and (result.path >= 2).any()  # chain and sibling paths both ran
    broken = _tree_rounds(10000, p, q, seed=4, wrong_q=True)
    assert token_law_violations(broken.tokens, p) != []


@pytest.mark.parametrize("vocab", [8, 6000], ids=["one-level", "two-level"])  # about ONE_LEVEL_VOCAB (4096)
def test_sample_draws_the_given_law_over_a_small_and_a_large_vocabulary(vocab):
    from specdec.verify.sampling import ONE_LEVEL_VOCAB

    assert (vocab <= ONE_LEVEL_VOCAB) == (vocab == 8)
    g = torch.Generator().manual_seed(vocab)
    weights = torch.zeros(vocab)
    support = torch.randperm(vocab, generator=g)[:8]  # spread over the blocks of the two-level draw
    weights[support] = torch.rand(8, generator=g) + 0.05
    weights[support[0]] = 1e-6  # tiny but positive: still drawn at its rate
    draws = torch.cat([sample(weights.expand(4000, vocab), g) for _ in range(5)])
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[weights == 0].sum() == 0
    assert not bin_violations(counts, weights.double() / weights.sum(), len(draws))
