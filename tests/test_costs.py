"""The one cost model: measured costs, the prior-weighted rate counter and the "does one more verify
column pay?" rule. The decisions built on them (the policy's k, the copies appended, a tree's siblings,
the draft's stop) are pinned for scripted counts, so a refactor of the model cannot move them."""

import pytest
import torch

from specdec.drafters import (
    AcceptanceByConfidence,
    AcceptanceByRank,
    ModelDrafter,
    NoDrafter,
)
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.proposal import Proposal, Siblings
from specdec.tuning.costs import Costs, DraftSettings, RateCounter, columns_that_pay, surplus
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify import VerifyResult

FREE = lambda width: 1 + 0.001 * (width - 1)  # noqa: E731  (a wider verify nearly free: AVX-512 bf16)
SOME = lambda width: 1 + 0.02 * (width - 1)  # noqa: E731  (the prior's verify cost)
DEAR = lambda width: 1 + 0.3 * (width - 1)  # noqa: E731  (a wider verify dear: AVX2 float32)


def scripted(count: int, seed: int = 1) -> list[int]:
    """A fixed sequence of small numbers (a linear congruential generator: no torch RNG, no platform)."""
    out, x = [], seed
    for _ in range(count):
        x = (1103515245 * x + 12345) % 2**31
        out.append(x >> 16)
    return out


def policy_run(policy: DraftLengthPolicy, rounds: int = 80) -> list[int]:
    """Rounds over three ragged rows whose acceptances follow a scripted pattern; the k of each round."""
    ks, draws = [], iter(scripted(3 * rounds))
    for _ in range(rounds):
        k = policy.next_k()
        ks.append(k)
        lengths = torch.tensor([k, max(k - 1, 0), min(k, 2)])
        accepted = torch.tensor([min(int(n), next(draws) % (n + 3)) for n in lengths.tolist()])
        policy.observe(VerifyResult(torch.zeros(3, k + 1, dtype=torch.long), accepted, accepted == lengths), lengths)
    return ks


def policy_scenarios() -> dict:
    calibrated = DraftLengthPolicy(k=None, costs=Costs(0.12, ((1, 1.0), (2, 1.02), (5, 1.1), (11, 1.5))))
    prior = DraftLengthPolicy(k=None, cost_ratio=0.3, verify_cost_per_token=0.05)
    return {"calibrated": calibrated, "prior": prior}


def digits(values) -> str:
    return "".join(str(int(v)) for v in values)


def test_policy_decisions_are_pinned():
    """The k of each round and the learned rates, for scripted counts, calibrated costs and the prior."""
    policies = policy_scenarios()
    calibrated, prior = policies["calibrated"], policies["prior"]
    assert digits(policy_run(calibrated)) == (
        "34233343344444445554444444444444444444444444444443433333333333333433333333334444"
    )
    assert (
        digits(policy_run(prior)) == "26333333333222222222322332222222222222222222221211121222111111111111223223222222"
    )
    assert calibrated.rates()[:5] == (
        0.8603320356932563,
        0.8152683736958876,
        0.68819453741471,
        0.8691700536998653,
        0.7884662245424394,
    )
    assert prior.rates()[:5] == (
        0.8176348430365332,
        0.7621084530727745,
        0.5903598298346875,
        0.7470918163710641,
        0.7471925697731818,
    )
    assert calibrated.extension(3) == (3, 2.693867924059528) and prior.extension(3) == (3, 1.833614932148321)
    assert calibrated.verify_cost(4) == 1.0733333333333335 and prior.verify_cost(4) == 1.15


def lookup_scenario() -> PromptLookup:
    lookup = PromptLookup(NoDrafter())
    draws = iter(scripted(200, seed=5))
    for _ in range(12):
        base_lengths = torch.tensor([next(draws) % 3 for _ in range(4)])
        copied = torch.tensor([1 + next(draws) % 4 for _ in range(4)])
        match = torch.tensor([next(draws) % 4 for _ in range(4)])
        lengths = base_lengths + copied
        k = int(lengths.max())
        base = Proposal(torch.zeros(4, int(base_lengths.max()), dtype=torch.long), base_lengths, None)
        extended = Proposal(torch.zeros(4, k, dtype=torch.long), lengths, None, copied=copied)
        accepted = torch.tensor([next(draws) % (n + 1) for n in lengths.tolist()])
        result = VerifyResult(torch.zeros(4, k + 1, dtype=torch.long), accepted, accepted == lengths)
        lookup.chain, lookup.match = base, match  # what its propose kept of the round
        lookup.observe(extended, result)
    return lookup


def copies(lookup: PromptLookup, verify_cost, *args) -> int:
    lookup.configure(DraftSettings(verify_cost=verify_cost))
    return lookup.copies(*args)


def test_copy_decisions_are_pinned():
    lookup = lookup_scenario()
    counts = [
        copies(lookup, cost, survival, match, width, rate, 8)
        for survival in (1.0, 0.8, 0.4)
        for match in range(4)
        for width in (1, 4)
        for rate in (1.0, 2.5)
        for cost in (FREE, DEAR)
    ]
    assert (
        digits(counts)
        == "615061508280828082808280838183816150615082808280828082808280828050405040808080808080808081808180"
    )
    assert [lookup.rates(match) for match in range(4)] == [
        (0.7153846153846154, 0.29230769230769227),
        (0.6214285714285713, 0.6666666666666666),
        (0.7142857142857143, 0.62),
        (0.7533333333333334, 0.6461538461538462),
    ]


def drafter_scenario() -> tuple[AcceptanceByConfidence, AcceptanceByRank]:
    confidence, rank = AcceptanceByConfidence(), AcceptanceByRank()
    draws = iter(scripted(500, seed=9))
    for _ in range(6):
        confidences = torch.tensor([[next(draws) % 100 / 100 for _ in range(5)] for _ in range(3)])
        lengths = torch.tensor([1 + next(draws) % 5 for _ in range(3)])
        accepted = torch.tensor([next(draws) % (n + 1) for n in lengths.tolist()])
        confidence.observe(confidences, lengths, accepted)
        depth = torch.tensor([[next(draws) % 5 for _ in range(4)] for _ in range(3)])
        ranks = torch.tensor([[1 + next(draws) % 5 for _ in range(4)] for _ in range(3)])
        valid = torch.tensor([[next(draws) % 4 > 0 for _ in range(4)] for _ in range(3)])
        won = torch.tensor([[next(draws) % 3 == 0 for _ in range(4)] for _ in range(3)])
        rank.observe(Siblings(torch.zeros(3, 4, dtype=torch.long), depth, ranks, valid), accepted, lengths, won)
    return confidence, rank


def test_learned_acceptance_is_pinned():
    confidence, rank = drafter_scenario()
    assert confidence.predict(torch.linspace(0, 1, 12)).tolist() == [
        0.7,
        0.6,
        0.7333333333333334,
        0.7333333333333334,
        0.85,
        0.6799999999999999,
        0.8545454545454546,
        0.8545454545454546,
        0.5692307692307692,
        0.5692307692307692,
        0.7111111111111111,
        0.7111111111111111,
    ]
    assert rank.predict(torch.arange(1, 7)).tolist() == [0.4, 0.075, 0.3] + [0.22800000000000004] * 3


def test_sibling_and_stop_decisions_are_pinned():
    values = [0.5, 0.3, 0.2, 0.12, 0.08, 0.05, 0.03, 0.01]
    counts = [
        columns_that_pay(values[start:], width, tokens, cost, verify_cost, max_width)
        for start in (0, 2, 5)
        for width in (1, 3, 6)
        for tokens, cost in ((1.0, 1.0), (2.5, 1.4), (4.0, 1.2))
        for verify_cost in (FREE, DEAR)
        for max_width in (4, 11)
    ]
    assert digits(counts) == (
        "381138003800181118001800050105000500360036003600160016001600050005000500330033003300130013001300030003000300"
    )

    class Flat:  # stands in for the adapter: the stop needs only these attributes
        name, max_positions, vocab_size, device = "flat", None, 8, torch.device("cpu")

    drafter = ModelDrafter(Flat(), stop_below="auto")
    drafter.acceptance, _ = drafter_scenario()
    drafter.stop_costs = [0.3, 0.12, 0.11, 0.105, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    confidences = torch.tensor([[c / 100 for c in scripted(10, seed=row)] for row in range(6)]) % 1
    pinned = {  # per draft i: which of the 6 rows stop after it
        None: "000000 000000 000000 000000 000000 000000 101100 101111 111111 111111",
        (2, 1.5): "000000 000000 000000 000000 000000 100110 101111 111111 111111 111111",
        (3, 4.0): "000000 000000 101100 111111 111111 111111 111111 111111 111111 111111",
    }
    for extension, stops in pinned.items():
        drafter.extension = extension
        survive = torch.ones(6, dtype=torch.float64)
        assert " ".join(digits(drafter._stop(confidences[:, i], survive, i).tolist()) for i in range(10)) == stops


# ------------------------------------------------------------------ the one model


def test_calibration_and_the_bench_share_one_costs_class_and_one_timer(tmp_path):
    from specdec.bench import main as bench
    from specdec.models.adapters import HFCausalLM
    from specdec.tuning import calibration, costs
    from tests.tiny import build

    assert bench.Costs is calibration.Costs is costs.Costs
    assert calibration.forward_seconds is costs.forward_seconds  # the timer calibrate looks up
    target = HFCausalLM(build("qwen2", 0, tmp_path / "t", layers=2), name="bench-target")
    draft = HFCausalLM(build("qwen2", 1, tmp_path / "d", layers=1), name="bench-draft")
    measured = bench.measure_costs(target, draft, ks=(1, 2, 4), context_len=16, repeats=2)
    assert [width for width, _ in measured.target_s] == [1, 2, 3, 5] and measured.draft_step_s > 0
    seconds = [s for _, s in measured.target_s]
    assert seconds == sorted(seconds)  # monotone: a wider forward never costs less
    data = bench.costs_json(measured, (1, 2, 4))
    assert data["target_step_s"] == measured.target(1) and data["ratio"] == measured.cost_ratio
    assert data["target_k_plus_1_s"] == {k: measured.target(k + 1) / measured.target(1) for k in (1, 2, 4)}


def test_costs_read_in_target_forwards():
    measured = Costs(0.1, ((1, 2.0), (3, 3.0), (11, 5.0)))
    assert measured.verify_cost(2) == 1.25 and measured.round_cost(2) == (0.2 + 3.0) / 2.0
    assert measured.max_width == 11 and measured.cost_ratio == 0.05
    assert Costs(0.0, ((1, 2.0),)).verify_cost(4) == 1.0  # one width measured: flat


def test_a_rate_is_its_prior_until_counts_move_it():
    rates = RateCounter((0.3, 0.6), weight=2.0)
    assert rates.rate(0) == 0.3 and rates.rate(1) == 0.6 and rates.rate(1, prior=0.2) == 0.2
    rates.observe([1.0, 0.0], 2.0, bins=[0, 0])  # two entries in bin 0: one success in four trials
    assert rates.rate(0) == (1 + 0.6) / (4 + 2) and rates.trials == [4.0, 0.0]
    assert rates.predict(torch.tensor([[1, 0]])).tolist() == [[0.6, (1 + 0.6) / 6]]
    capped = RateCounter(0.7, bins=3, decay=0.5, cap=0.99)
    capped.observe([8.0, 200.0, 0.0], [8.0, 200.0, 8.0])
    capped.observe([0.0, 2.0, 0.0], [0.0, 2.0, 0.0])  # forgets half of the first counts
    assert capped.successes == [4.0, 102.0, 0.0] and capped.trials == [4.0, 102.0, 4.0]
    assert capped.rate(1) == 0.99 > capped.rate(2) == 1.4 / 6  # capped: no draft is sure


def test_one_more_column_pays_when_it_raises_tokens_per_cost():
    assert surplus(0.5, 2.0, 1.0, 0.2) > 0 > surplus(0.3, 2.0, 1.0, 0.2) and surplus(0.4, 2.0, 1.0, 0.2) == 0
    quarter = lambda width: 1 + 0.25 * (width - 1)  # noqa: E731  (a column costs a quarter forward)
    # At the round's own rate, 2 tokens per forward, a column must bring more than 0.5 tokens.
    assert columns_that_pay([1.0, 0.75, 0.5, 0.25], 1, 2.0, 1.0, quarter, raise_bar=False) == 2  # 0.5: even
    assert columns_that_pay([1.0, 0.75, 0.5], 1, 2.0, 1.0, quarter, max_width=2) == 1  # never past max_width
    # Raising the bar: after a column of 2 tokens the round makes 4 / 1.25, and 0.75 no longer pays.
    assert columns_that_pay([2.0, 0.75], 1, 2.0, 1.0, quarter, raise_bar=False) == 2
    assert columns_that_pay([2.0, 0.75], 1, 2.0, 1.0, quarter) == 1


def test_tree_siblings_chosen_are_pinned():
    class Flat:  # stands in for the adapter: choosing siblings needs only these attributes
        name, max_positions, vocab_size, device = "flat", None, 8, torch.device("cpu")

    drafter = ModelDrafter(Flat(), stop_below="auto", width="auto")
    drafter.acceptance, drafter.rank_acceptance = drafter_scenario()
    drafter.stop_costs = [0.3, 0.12, 0.11, 0.105, 0.1, 0.1]
    confidences = torch.tensor([[c / 100 for c in scripted(4, seed=row)] for row in range(3)]) % 1
    rank = torch.arange(1, 4)[None, None, :].expand(3, 4, 3)
    valid = torch.tensor([[c % 5 > 0 for c in scripted(12, seed=row)] for row in range(3)]).reshape(3, 4, 3)
    pinned = {  # (verify cost, widest verify): the siblings kept, per row, depth and rank
        (FREE, 6): "001000000000100000001100101000000000",
        (FREE, 11): "011101001001111001011101111100100101",
        (SOME, 6): "001000000000100000001100101000000000",
        (SOME, 11): "001100001000101000001101101100000100",
        (DEAR, 11): "0" * 36,
    }
    for (verify_cost, max_width), kept in pinned.items():
        drafter.verify_cost, drafter.max_width = verify_cost, max_width
        assert digits(drafter._worth_verifying(confidences, rank, valid, torch.tensor([4, 2, 3])).flatten()) == kept


def test_measured_costs_replace_the_calibrated_ones_where_measured_and_scale_the_rest():
    from specdec.tuning.costs import MeasuredCosts

    calibrated = Costs(0.1, ((1, 1.0), (5, 1.2), (11, 2.0)), batch=8)  # a clean batch: width 5 near free
    clock = MeasuredCosts(calibrated, decay=0.5, alone_every=3)
    assert clock.costs() == calibrated and clock.alone_due  # nothing timed: the calibration; width 1 first
    clock.observe(1, 2.0)  # the serving batch's forward over one token: twice the calibration's
    assert not clock.alone_due
    costs = clock.costs()
    assert costs.target(1) == 2.0 and costs.target(5) == pytest.approx(2.4)  # width 5 scaled as width 1
    assert costs.draft_step_s == pytest.approx(0.2)  # the draft untimed: scaled as the target
    clock.observe(5, 5.0, draft_steps=4, draft_s=1.2)
    clock.observe(5, 7.0, draft_steps=4, draft_s=2.0)  # a moving average: half the old, half the new
    costs = clock.costs()
    assert costs.target(5) == 6.0 and costs.draft_step_s == pytest.approx(0.4)
    assert costs.verify_cost(5) == 3.0  # what auto k reads: a verify over 5 tokens is 3 forwards here, not 1.2
    assert costs.target(11) == pytest.approx(6.0 * 2.0 / 1.2)  # past the last timed width, that width's ratio
    clock.observe(5, 6.0, draft_steps=0, draft_s=9.0)  # no steps counted: the draft's time is left out
    assert clock.costs().draft_step_s == pytest.approx(0.4)
    assert clock.alone_due  # three rounds since width 1 was timed
    clock.observe(3, 1.0)  # a wider forward timed cheaper than a narrower one: never priced below it
    assert clock.costs().target(1) <= clock.costs().target(3) <= clock.costs().target(5)


def test_one_stall_cannot_price_drafting_out_but_a_lasting_change_moves_the_price():
    """A serving batch's draft step is timed only in rounds that draft: if one stall priced drafting out
    (k = 0), no later round would time the draft again. A later reading counts for at most SPIKE times the
    average so far; readings that stay high still move it."""
    from specdec.tuning.costs import MeasuredCosts
    from specdec.tuning.policy import DraftLengthPolicy

    calibrated = Costs(0.1, tuple((w, 1.0 + 0.1 * (w - 1)) for w in (1, 2, 5, 11)))
    clock = MeasuredCosts(calibrated)
    clock.observe(1, 1.0)
    clock.observe(2, 1.1, draft_steps=1, draft_s=0.1)
    clock.observe(2, 1.1, draft_steps=1, draft_s=3.0)  # one draft step stalled for 30 steps' time
    assert clock.costs().draft_step_s == pytest.approx(0.7 * 0.1 + 0.3 * 0.4)
    assert DraftLengthPolicy(k=None, costs=clock.costs()).next_k() > 0  # unclipped (0.97): k = 0 for good
    unclipped = Costs(0.7 * 0.1 + 0.3 * 3.0, calibrated.target_s)
    assert DraftLengthPolicy(k=None, costs=unclipped).next_k() == 0
    for _ in range(8):  # the draft really became three times dearer: the price follows
        clock.observe(2, 1.1, draft_steps=1, draft_s=0.3)
    assert clock.costs().draft_step_s == pytest.approx(0.3, rel=0.05)
    clock.observe(11, 50.0)  # a width's first reading replaces the calibration's (which may be far off)
    assert clock.costs().target(11) == 50.0
