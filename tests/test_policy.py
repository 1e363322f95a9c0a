"""The auto draft-length policy: it speculates when it pays, stops (almost) when it does not,
never speculates where the costs say no k can pay, and learns from counts only."""

import torch

from specdec.tuning.costs import Costs
from specdec.tuning.policy import DraftLengthPolicy
from specdec.tuning.speedup import (
    best_draft_length,
    expected_tokens,
    expected_tokens_by_position,
    geometric_speedup,
    leviathan_cost,
)
from specdec.verify import VerifyResult


def rounds(policy: DraftLengthPolicy, accept_all: bool, count: int) -> list[int]:
    ks = []
    for _ in range(count):
        k = policy.next_k()
        ks.append(k)
        if k:
            accepted = torch.tensor([k if accept_all else 0])
            policy.observe(
                VerifyResult(torch.zeros(1, k + 1, dtype=torch.long), accepted, accepted == k), torch.tensor([k])
            )
    return ks


def flat_costs(draft_step: float, target_1: float = 1.0, per_token: float = 0.0) -> Costs:
    return Costs(draft_step, tuple((w, target_1 + per_token * (w - 1)) for w in (1, 2, 5, 11)))


def test_auto_grows_k_when_everything_is_accepted():
    ks = rounds(DraftLengthPolicy(k=None, costs=flat_costs(0.1)), accept_all=True, count=30)
    assert ks[-1] >= 8


def test_auto_stops_speculating_with_a_useless_draft():
    ks = rounds(DraftLengthPolicy(k=None, costs=flat_costs(0.35)), accept_all=False, count=400)
    assert ks[-300:].count(0) >= 295  # after learning, at most a handful of k=1 probes
    assert sum(ks) < 40


def test_probes_grow_while_everything_is_accepted_on_a_dear_draft():
    """A draft at 0.6 of the target with a verify that grows with width (the AVX2 int8 pair): the
    prior says k = 0, but on copy-like text every draft is accepted. Probes that keep all their drafts
    grow (k = 1, 2, 3, ...) until the continuation rate is learned and k > 0 is chosen outright."""
    ks = rounds(DraftLengthPolicy(k=None, costs=flat_costs(0.6, per_token=0.1)), accept_all=True, count=60)
    assert ks[0] == 0 and ks[-1] > 0
    assert sum(k > 0 for k in ks[-20:]) == 20  # once learned, it keeps speculating
    assert sorted(set(ks[:30]) - {0})[:2] == [1, 2]  # it got there through growing probes


def test_fixed_k_is_fixed():
    assert rounds(DraftLengthPolicy(k=3, costs=flat_costs(0.5)), accept_all=False, count=5) == [3] * 5


def test_no_k_from_the_first_round_where_none_can_pay():
    """A draft step as dear as the target (or a verify linear in width): even perfect acceptance loses."""
    for costs in (flat_costs(1.0), flat_costs(0.05, per_token=1.0)):
        policy = DraftLengthPolicy(k=None, costs=costs)
        assert policy.never_pays
        assert rounds(policy, accept_all=True, count=50) == [0] * 50


def test_costs_that_become_dear_stop_every_draft_probes_included():
    """A serving batch's costs are re-measured as it runs: where they come to say that no k could pay,
    no round drafts, not even a probe (a probe's catch-up feeds the draft every token it missed)."""
    policy = DraftLengthPolicy(k=None, costs=flat_costs(0.2))
    assert not policy.never_pays and any(k > 0 for k in rounds(policy, accept_all=True, count=30))
    policy.costs = flat_costs(1.0)
    assert policy.never_pays and rounds(policy, accept_all=True, count=300) == [0] * 300
    policy.costs = flat_costs(0.2)
    assert not policy.never_pays


def test_verify_cost_growth_shortens_k():
    """The AVX2 case: verify linear in width makes the best k shorter than with a free width."""
    free = DraftLengthPolicy(k=None, alpha=0.8, costs=flat_costs(0.2))
    linear = DraftLengthPolicy(k=None, alpha=0.8, costs=flat_costs(0.2, per_token=0.3))
    assert 0 < linear.next_k() < free.next_k()


def test_costs_interpolate_between_measured_widths():
    costs = Costs(0.02, ((1, 1.0), (3, 2.0), (5, 2.0)))
    assert costs.target(2) == 1.5 and costs.target(4) == 2.0 and costs.target(7) == 2.0
    assert costs.round_cost(2) == (2 * 0.02 + 2.0) / 1.0


def test_one_speedup_model():
    assert expected_tokens(0.5, 0.5, 2) == 1 + 0.5 * 1.5
    assert geometric_speedup(1.0, 3, 0.0) == 4.0
    assert abs(geometric_speedup(0.8, 4, 0.1) - (1 - 0.8**5) / (0.2 * 1.4)) < 1e-12
    assert best_draft_length(0.0, 0.0, leviathan_cost(0.1), 8) == 0
    assert abs(expected_tokens_by_position([0.9] + [0.7] * 4) - expected_tokens(0.9, 0.7, 5)) < 1e-12
    assert expected_tokens_by_position([]) == expected_tokens(0.3, 0.3, 0) == 1.0
    assert expected_tokens_by_position([0.5, 1.0, 0.0]) == 2.0  # a rate of 0 ends the chain


def test_a_fixed_k_past_max_k_is_costed_with_the_pooled_rate_for_the_extra_drafts():
    policy = DraftLengthPolicy(k=16, costs=flat_costs(0.1))
    rates = policy.rates(16)
    assert len(rates) == 16 and rates[10:] == (policy.continuation_rate,) * 6
    assert abs(policy.expected_speedup(16) - expected_tokens(0.7, 0.7, 16) / policy.round_cost(16)) < 1e-12


def test_acceptance_by_confidence_learns_from_judged_drafts_only():
    from specdec.drafters import AcceptanceByConfidence

    model = AcceptanceByConfidence(prior=0.5, weight=2.0)
    confidences = torch.tensor([[0.05, 0.95, 0.95, 0.95]] * 10)
    # each row: first draft (unsure) accepted, second (sure) rejected, the rest never judged
    model.observe(confidences, torch.tensor([4] * 10), torch.tensor([1] * 10))
    unsure, sure = model.predict(torch.tensor([0.05, 0.95]))
    assert unsure == (10 + 1) / 12 and sure == (0 + 1) / 12
    assert sum(model.counts.trials) == 20  # 2 judged drafts per row, not 4


def test_learned_stop_keeps_a_flat_agreeing_draft_and_stops_a_peaked_wrong_one():
    from specdec.drafters import ModelDrafter

    class Flat:  # stands in for the adapter: ModelDrafter only needs these attributes here
        name, max_positions, vocab_size, device = "flat", None, 8, torch.device("cpu")

    drafter = ModelDrafter(Flat(), stop_below="auto")
    drafter.stop_costs = [0.15] * 11
    low = torch.full((1,), 0.05)
    survive = torch.ones(1, dtype=torch.float64)
    # Unsure drafts that were always accepted: keep drafting.
    drafter.acceptance.observe(torch.full((50, 4), 0.05), torch.tensor([4] * 50), torch.tensor([4] * 50))
    assert not any(bool(drafter._stop(low, survive, i)) for i in range(4))
    # Unsure drafts that were always rejected: stop after the first.
    drafter.acceptance.reset()
    drafter.acceptance.observe(torch.full((50, 4), 0.05), torch.tensor([4] * 50), torch.tensor([0] * 50))
    survive = torch.ones(1, dtype=torch.float64)
    assert bool(drafter._stop(low, survive, 0))


def test_extension_past_k_only_for_auto_and_at_the_rounds_rate():
    fixed = DraftLengthPolicy(k=3, costs=flat_costs(0.1))
    assert fixed.extension(3) is None
    auto = DraftLengthPolicy(k=None, costs=flat_costs(0.1))
    rounds(auto, accept_all=True, count=5)
    assert auto.extension(0) is None  # no drafting this round: nothing to extend
    k, bar = auto.extension(4)
    assert k == 4
    continuation = auto.continuation.rate(prior=auto.first.rate())  # its prior: the first rate
    assert bar == auto.expected_speedup(4) / continuation
    assert bar > 1  # a draft past k must add tokens at the round's own rate or better


def test_learned_stop_drafts_past_k_while_sure_and_stops_at_k_when_not():
    from specdec.drafters import ModelDrafter

    class Flat:
        name, max_positions, vocab_size, device = "flat", None, 8, torch.device("cpu")

    drafter = ModelDrafter(Flat(), stop_below="auto")
    drafter.stop_costs = [0.1] * 11
    sure = torch.full((1,), 0.95)
    drafter.acceptance.observe(torch.full((50, 8), 0.95), torch.tensor([8] * 50), torch.tensor([8] * 50))

    def drafted(extension, limit=10) -> int:  # drafts made before the stop fires (limit: the row's cap)
        drafter.extension = extension
        survive = torch.ones(1, dtype=torch.float64)
        return next((i + 1 for i in range(limit) if bool(drafter._stop(sure, survive, i))), limit)

    # Sure drafts that are always accepted (learned rate ~0.998): past k = 2 while P(all survive) >= 2.5 x 0.1.
    assert drafted((2, 2.5)) == 10
    assert drafted((2, 20.0)) == 2  # a bar no draft can meet: stop at k
    assert drafted(None) == 10  # without an extension the stop itself never fires here: k caps the row
    # Sure drafts that are often rejected: the extension stops early, where survival falls below the bar.
    drafter.acceptance.reset()
    drafter.acceptance.observe(torch.full((50, 8), 0.95), torch.tensor([8] * 50), torch.tensor([3] * 50))
    rate = float(drafter.acceptance.predict(sure))
    expected = next(n for n in range(2, 11) if rate**n < 2.5 * 0.1)
    assert drafted((2, 2.5)) == expected < 10


def test_rejections_clustered_at_one_position_do_not_shorten_every_chain():
    """Code-like rounds: the second draft is rejected in 2 rounds of 5, and a chain that gets past it
    survives to its end. One pooled continuation rate (0.92 here) would spread those rejections over
    every position; per position, the later drafts are seen to hold, so k stays long."""
    policy = DraftLengthPolicy(k=None, costs=flat_costs(0.2))
    for round_index in range(40):
        k = policy.next_k()
        accepted = 1 if round_index % 5 in (1, 3) else k
        accepted = min(accepted, k)
        result = VerifyResult(torch.zeros(1, k + 1, dtype=torch.long), torch.tensor([accepted]), torch.tensor([False]))
        policy.observe(result, torch.tensor([k]))
    rates = policy.rates()
    assert rates[1] < 0.8 and min(rates[2:]) > 0.9
    pooled = max(
        range(policy.max_k + 1),
        key=lambda k: expected_tokens(rates[0], policy.continuation_rate, k) / policy.round_cost(k),
    )
    assert policy.next_k() == policy.max_k > pooled


def test_the_history_of_k_is_bounded_for_a_long_lived_session():
    from specdec.tuning.policy import HISTORY_ROUNDS, DraftLengthPolicy

    policy = DraftLengthPolicy(k=None)  # auto k: each round's choice is recorded
    for _ in range(HISTORY_ROUNDS + 10):
        policy.next_k()
    assert len(policy.history) == HISTORY_ROUNDS
