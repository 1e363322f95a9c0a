"""Verification methods in the engine: block and race are exact like token-level, and race sampling
is path-independent: with a seed, the same tokens with any drafter, any k, in any batch, or alone."""

import pytest

import specdec
from tests.tiny import build, hf_greedy, perturbed

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    target = build("qwen2", 30, root / "t", layers=2, hidden=32, sharpness=6.0)
    return target, perturbed(target, 0.3, seed=31)


def sampled(prompt, pair, draft, **kwargs):
    target, near = pair
    drafter = {"model": near, "ngram": "ngram", "none": None, "target": target}[draft]
    settings = dict(max_new_tokens=20, temperature=0.8, top_k=0, seed=11, verification="race") | kwargs
    return specdec.generate(prompt, target=target, draft=drafter, **settings)


def test_race_tokens_do_not_depend_on_the_draft_or_k(pair):
    alone = [sampled(p, pair, "none").token_ids for p in PROMPTS]
    for draft, k in [("model", 1), ("model", 3), ("model", "auto"), ("ngram", 4), ("target", 5)]:
        assert [sampled(p, pair, draft, num_draft_tokens=k).token_ids for p in PROMPTS] == alone, (draft, k)
    for width, k in [(2, 3), (4, 2), ("auto", "auto")]:  # draft trees
        runs = [sampled(p, pair, "model", num_draft_tokens=k, draft_width=width) for p in PROMPTS]
        assert [r.token_ids for r in runs] == alone, (width, k)
        assert width == "auto" or sum(r.metrics.sibling_tokens for r in runs) > 0, "paths through siblings"
    together = sampled(PROMPTS, pair, "model", num_draft_tokens=3, draft_width=3)
    assert [r.token_ids for r in together] == alone


def test_race_tokens_do_not_depend_on_the_batch(pair):
    alone = [sampled(p, pair, "model").token_ids for p in PROMPTS]
    together = [r.token_ids for r in sampled(PROMPTS, pair, "model", num_draft_tokens=2)]
    reversed_batch = [r.token_ids for r in sampled(PROMPTS[::-1], pair, "none")][::-1]
    assert together == alone == reversed_batch


def test_race_drafts_are_accepted_when_the_draft_is_the_target(pair):
    out = sampled(PROMPTS[0], pair, "target", num_draft_tokens=4)
    assert out.metrics.draft_acceptance_rate == 1.0 and out.metrics.drafted_tokens > 0


def test_race_seed_changes_the_tokens_and_repeated_prompts_differ(pair):
    a, b = sampled(PROMPTS[0], pair, "model", seed=1), sampled(PROMPTS[0], pair, "model", seed=2)
    assert a.token_ids != b.token_ids
    rows = sampled([PROMPTS[0]] * 4, pair, "model")
    assert len({tuple(r.token_ids) for r in rows}) > 1  # equal prompts in a batch race independently
    assert rows[0].token_ids == sampled(PROMPTS[0], pair, "none").token_ids  # the first occurrence is the solo row


@pytest.mark.parametrize("verification", ["block", "race"])
def test_greedy_is_the_same_for_every_method(pair, verification):
    target, near = pair
    for prompt in PROMPTS:
        out = specdec.generate(
            prompt, target=target, draft=near, max_new_tokens=16, temperature=0, verification=verification
        )
        assert out.token_ids == hf_greedy(target, prompt, 16)


@pytest.mark.parametrize("width", [2, 3, "auto"])
@pytest.mark.parametrize("verification", ["token", "race"])
def test_greedy_trees_equal_transformers(pair, width, verification):
    target, near = pair
    siblings = 0
    for prompt in PROMPTS:
        out = specdec.generate(
            prompt,
            target=target,
            draft=near,
            max_new_tokens=24,
            temperature=0,
            num_draft_tokens=4,
            draft_width=width,
            verification=verification,
        )
        assert out.token_ids == hf_greedy(target, prompt, 24)
        siblings += out.metrics.sibling_tokens
    assert siblings > 0, "some rounds must end on an accepted sibling"
    batch = specdec.generate(PROMPTS, target=target, draft=near, max_new_tokens=24, temperature=0, draft_width=width)
    assert [r.token_ids for r in batch] == [hf_greedy(target, p, 24) for p in PROMPTS]


def test_trees_accept_more_per_round_than_chains(pair):
    """Greedy, same pair and k: siblings turn some rejections into accepted tokens (and a bonus)."""
    target, near = pair
    lengths = {}
    for width in (1, 3):
        out = specdec.generate(
            PROMPTS, target=target, draft=near, max_new_tokens=32, temperature=0, num_draft_tokens=4, draft_width=width
        )
        lengths[width] = out[0].batch_metrics.mean_acceptance_length
    assert lengths[3] > lengths[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(draft_width=0), "draft_width must be"),
        (dict(draft_width="wide"), "draft_width must be"),
        (dict(draft_width=2, draft="ngram"), "proposes chains only"),
        (dict(draft_width=2, verification="block", temperature=1.0), "block verification judges a chain"),
    ],
)
def test_tree_arguments_are_checked(pair, kwargs, message):
    settings = dict(target=pair[0], draft=pair[1], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        specdec.generate([1, 2, 3], **settings)


def test_auto_width_falls_back_to_chains_where_trees_cannot_run(pair):
    target, _ = pair
    out = specdec.generate([1, 2, 3], target=target, draft="ngram", max_new_tokens=8, temperature=0, draft_width="auto")
    assert out.token_ids == hf_greedy(target, [1, 2, 3], 8) and out.metrics.tree_nodes == 0


def test_unknown_verification_is_refused(pair):
    with pytest.raises(ValueError, match="verification"):
        specdec.generate([1, 2], target=pair[0], verification="tree")


def test_block_accepts_at_least_as_many_drafts_as_token_level(pair):
    """Same pair, same prompts, many rows: block's mean accepted length is >= token-level's (within noise)."""
    target, near = pair
    rates = {}
    for verification in ("token", "block"):
        out = specdec.generate(
            [PROMPTS[1]] * 400,
            target=target,
            draft=near,
            max_new_tokens=6,
            temperature=1.0,
            top_k=0,
            seed=5,
            num_draft_tokens=5,
            verification=verification,
        )
        rates[verification] = out[0].batch_metrics.accepted_tokens / out[0].batch_metrics.rounds
    assert rates["block"] >= rates["token"] - 0.1, rates
