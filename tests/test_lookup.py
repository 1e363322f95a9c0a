"""Prompt lookup after the draft (specdec.drafters.lookup): copy drafts appended to proposals.

Greedy output equals transformers' with copies after every kind of chain (none, a useless
draft, the target itself, a tree, the static cache, a ragged batch); copies are proposed
and both accepted and rejected; the decision follows the verify costs; the drafter and the
policy learn from their own drafts only. Sampled laws are in tests/test_laws.py (the
"lookup-" cases and a broken variant).
"""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.drafters import ModelDrafter, NoDrafter
from specdec.drafters.lookup import PromptLookup, chain_round
from specdec.drafters.proposal import Proposal, Siblings, copies_accepted
from specdec.metrics import SpeculativeMetrics
from specdec.models.adapters import HFCausalLM
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.tuning.costs import DraftSettings, RoundPrice
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify import VerifyResult
from specdec.verify.sampling import SamplingConfig
from tests.tiny import build, decode, hf_greedy

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
PROMPTS = [REPEATING, [1, 2, 3], [4, 4, 4, 4, 4, 4, 4]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup-models")
    return {
        "target": build("qwen2", 0, root / "target"),
        "useless": build("qwen2", 2, root / "useless", layers=1, hidden=16),
    }


def run(target, drafter, prompts, k, width=1, max_new_tokens=40, lookup=True):
    metrics = SpeculativeMetrics()
    batch, _ = decode(
        target,
        drafter,
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=0),
        policy=DraftLengthPolicy(k=k),
        prompt_lookup=lookup,
        metrics=metrics,
        draft_width=width,
    )
    return [batch[row].new_tokens for row in range(len(prompts))], metrics


@pytest.mark.parametrize(
    "draft,k,width",
    [("none", 0, 1), ("useless", 2, 1), ("useless", None, 1), ("target", 2, 1), ("target", 3, 2)],
)
def test_greedy_with_copies_equals_transformers(models, draft, k, width):
    target = models["target"]
    drafter = NoDrafter() if draft == "none" else ModelDrafter(HFCausalLM(models[draft]))
    rows, metrics = run(HFCausalLM(target), drafter, PROMPTS, k, width)
    for prompt, row in zip(PROMPTS, rows):
        assert row == hf_greedy(target, prompt, 40)
    assert metrics.lookup_tokens > 0 and 0 < metrics.lookup_accepted < metrics.lookup_tokens, "both paths ran"
    if width > 1:
        assert metrics.tree_nodes > 0, "copies after a tree's chain"


def test_no_copies_where_a_sure_chain_already_fills_the_widest_verify(models):
    """The target drafting for itself with auto k: its chain grows to max_k (10), which with the bonus
    column is the widest verify measured (11); copies past it would be priced by a guess."""
    target = models["target"]
    rows, metrics = run(HFCausalLM(target), ModelDrafter(HFCausalLM(target)), PROMPTS, None)
    for prompt, row in zip(PROMPTS, rows):
        assert row == hf_greedy(target, prompt, 40)
    assert metrics.draft_acceptance_rate == 1.0 and metrics.lookup_tokens < metrics.rounds


def test_greedy_with_copies_on_the_static_cache(models):
    target = models["target"]
    drafter = ModelDrafter(StaticHFCausalLM(models["useless"]))
    rows, metrics = run(StaticHFCausalLM(target), drafter, PROMPTS, None)
    for prompt, row in zip(PROMPTS, rows):
        assert row == hf_greedy(target, prompt, 40)
    assert metrics.lookup_accepted > 0


def test_copies_raise_tokens_per_round_on_repeating_text(models):
    target = HFCausalLM(models["target"])
    _, alone = run(target, NoDrafter(), [REPEATING], 0, lookup=False)
    _, copied = run(target, NoDrafter(), [REPEATING], 0)
    assert alone.rounds == 40 and alone.drafted_tokens == 0
    assert copied.rounds < alone.rounds
    assert copied.drafted_tokens == copied.lookup_tokens and copied.accepted_tokens == copied.lookup_accepted


def test_api_turns_copies_on_with_a_draft_model_and_calibrated_costs(models):
    target, draft = models["target"], models["useless"]
    decoder = specdec.SpeculativeDecoder.from_pretrained(target, draft, device="cpu")
    auto = decoder.generate(REPEATING, max_new_tokens=30, num_draft_tokens="auto")
    off = decoder.generate(REPEATING, max_new_tokens=30, num_draft_tokens="auto", prompt_lookup=False)
    assert auto.token_ids == off.token_ids == hf_greedy(target, REPEATING, 30)
    assert auto.metrics.lookup_tokens > 0 and off.metrics.lookup_tokens == 0
    alone = specdec.SpeculativeDecoder(decoder.target, None, None)
    assert alone.generate(REPEATING, max_new_tokens=10).metrics.lookup_tokens == 0, "draft=None: the target alone"
    forced = alone.generate(REPEATING, max_new_tokens=30, prompt_lookup=True)
    assert forced.token_ids == off.token_ids and forced.metrics.lookup_tokens > 0
    with pytest.raises(ValueError, match="prompt_lookup"):
        decoder.generate(REPEATING, max_new_tokens=3, prompt_lookup="yes")


# ------------------------------------------------------------------ the decision


def priced(verify_cost, max_width: int = 11) -> PromptLookup:
    lookup = PromptLookup(NoDrafter(), max_tokens=8)
    lookup.configure(DraftSettings(verify_cost=verify_cost, max_width=max_width))
    return lookup


def test_copies_stop_where_a_verify_column_costs_more_than_they_bring():
    free = priced(lambda width: 1 + 0.001 * (width - 1))  # AVX-512 bf16: a wider verify is nearly free
    dear = priced(lambda width: 1 + 0.5 * (width - 1))  # AVX2 float32
    four, one = free.rates(3), free.rates(0)  # priors of 4+ and 1-token matches: (first, later)
    assert four[0] > 0.5 > four[0] * four[1] and one[0] < 0.5
    assert free.copies(1.0, 3, 1, 1.0, 8) == 8
    assert dear.copies(1.0, 3, 1, 1.0, 8) == 1  # the first pays for its column, the second does not
    assert dear.copies(1.0, 0, 1, 1.0, 8) == 0  # a one-token match never pays there
    assert free.copies(0.0, 3, 5, 1.0, 8) == 0  # a chain that will not survive: copies never judged
    assert free.copies(1.0, 3, 1, 1.0, 3) == 3  # room
    assert free.copies(0.5, 3, 5, 3.0, 8) == 8 and dear.copies(0.5, 3, 5, 3.0, 8) == 0


def test_copy_acceptance_is_learned_per_match_length():
    lookup = PromptLookup(NoDrafter())
    base = Proposal(torch.tensor([[7, 0], [1, 2]]), torch.tensor([1, 2]), None)
    copied = torch.tensor([3, 2])
    extended = Proposal(torch.tensor([[7, 3, 4, 5], [1, 2, 9, 9]]), torch.tensor([4, 4]), None, copied=copied)
    lookup.chain, lookup.match = base, torch.tensor([2, 1])  # what its propose kept of the round
    result = VerifyResult(torch.zeros(2, 5, dtype=torch.long), torch.tensor([3, 1]), torch.tensor([False, False]))
    lookup.observe(extended, result)
    assert copies_accepted(extended, result).tolist() == [2, 0]  # row 1's chain failed at its 2nd draft
    counts = lambda rates, match: (rates.successes[match], rates.trials[match])  # noqa: E731
    assert counts(lookup.first, 2) == (1.0, 1.0) and counts(lookup.continuation, 2) == (1.0, 2.0)
    assert counts(lookup.first, 1) == (0.0, 0.0)
    first, later = lookup.rates(2)
    prior_first, prior_later = PromptLookup(NoDrafter()).rates(2)
    assert first > prior_first and later < prior_later  # one success lifts the first rate; one stop lowers the later


def test_drafter_and_policy_see_their_own_chain():
    base = Proposal(torch.tensor([[7, 8]]), torch.tensor([2]), None)
    extended = Proposal(torch.tensor([[7, 8, 3, 4]]), torch.tensor([4]), None, copied=torch.tensor([2]))
    chain = VerifyResult(torch.zeros(1, 5, dtype=torch.long), torch.tensor([3]), torch.tensor([False]))
    assert chain_round(extended, base, chain).num_accepted.tolist() == [2]
    assert extended.chain_lengths.tolist() == [2]  # what the policy learns from (num_accepted capped by it)
    # a tree: chain 7 8 (+ copies 3 4), one sibling beside depth 1; the path takes 7, then the sibling
    siblings = Siblings(torch.tensor([[5]]), torch.tensor([[1]]), torch.tensor([[1]]), torch.tensor([[True]]))
    base = Proposal(torch.tensor([[7, 8]]), torch.tensor([2]), None, siblings=siblings)
    extended = Proposal(torch.tensor([[7, 8, 3, 4]]), torch.tensor([4]), None, siblings=siblings,
                        copied=torch.tensor([2]))  # fmt: skip
    tree = VerifyResult(torch.zeros(1, 5, dtype=torch.long), torch.tensor([2]), torch.tensor([False]))
    tree.path = torch.tensor([[0, 4, -1, -1, -1]])  # node 4: the sibling, after the 4 chain columns
    seen = chain_round(extended, base, tree)
    assert seen.path.tolist() == [[0, 2, -1, -1, -1]] and seen.num_accepted.tolist() == [2]
    # the whole chain, then two copies
    tree.path, tree.num_accepted = torch.tensor([[0, 1, 2, 3, -1]]), torch.tensor([4])
    seen = chain_round(extended, base, tree)
    assert seen.path.tolist() == [[0, 1, -1, -1, -1]] and seen.num_accepted.tolist() == [2]


def test_copies_never_widen_the_verify_past_the_calibrated_widths():
    lookup = priced(lambda width: 1.0)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 3  # every suffix recurs, with 12 tokens after it
    chain = Proposal(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]]), torch.tensor([9]), None)
    args = (torch.tensor([30]), torch.tensor([1.0], dtype=torch.float64), 1.0)
    extended, _ = lookup.extend(chain, [text[:-9]], *args)
    assert extended.copied.tolist() == [1] and extended.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    none = Proposal(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), None)
    extended, _ = lookup.extend(none, [text], *args)
    assert extended.copied.tolist() == [lookup.max_tokens] and extended.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    narrow = priced(lambda width: 1.0, max_width=10)
    assert narrow.extend(chain, [text[:-9]], *args)[0] is chain


def test_the_lookup_drafter_is_its_inner_drafter_plus_copies(models):
    """What the decoder sees of a wrapped drafter is the inner one's, and a round's price reaches both."""
    inner = ModelDrafter(HFCausalLM(models["useless"]))
    lookup = PromptLookup(inner)
    assert (lookup.name, lookup.uses_model, lookup.supports_trees, lookup.can_extend, lookup.trusted) == (
        inner.name, True, True, True, True)  # fmt: skip
    lookup.plan_round(RoundPrice((2, 1.5), 1.0, (0.5,), torch.tensor([4])))
    assert inner.extension == (2, 1.5)


def test_in_a_batch_a_copy_must_pay_for_every_rows_column(models):
    # A copy widens the verify of every row of the batch. With measured costs whose columns are dear, one
    # row alone copies, while 32 rows of the same prompt copy nothing: one row's copy cannot pay for 32.
    from specdec.tuning.costs import Costs

    target = HFCausalLM(models["target"])

    def copies(rows: int) -> int:
        metrics = SpeculativeMetrics()
        policy = DraftLengthPolicy(k=0, costs=Costs(0.1, ((1, 1.0), (11, 1.5))))  # a column: 0.05 forwards
        decode(target, NoDrafter(), [REPEATING] * rows, max_new_tokens=24, sampling=SamplingConfig(temperature=0),
               policy=policy, prompt_lookup=True, metrics=metrics)  # fmt: skip
        return metrics.lookup_tokens

    assert copies(1) > 0 and copies(32) == 0


def test_the_policy_learns_from_chains_not_copies(models):
    """Copies are the lookup's to learn: the draft-length policy never counts them as its drafts."""
    policy, metrics = DraftLengthPolicy(k=0), SpeculativeMetrics()
    decode(HFCausalLM(models["target"]), NoDrafter(), [REPEATING], max_new_tokens=24,
           sampling=SamplingConfig(temperature=0), policy=policy, prompt_lookup=True, metrics=metrics)  # fmt: skip
    assert metrics.lookup_accepted > 0 and sum(policy.first.trials) == 0
