"""Sampling config and warping; metrics counters, derived values and clock."""

import itertools

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from specdec.metrics import SpeculativeMetrics, Stopwatch
from specdec.verify.sampling import SamplingConfig
from tests.lawcheck import generate_law, generate_warpers, logits_to_probs


def test_float32_probabilities_from_bfloat16_logits():
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 50)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.5, 5, 0.8), (1.0, 10, 0.6), (0.7, 3, None), (1.3, None, 0.9), (0.8, 0, 1.0), (1.0, 30, 0.95)],
)
def test_warping_matches_transformers_order_and_masks(temperature, top_k, top_p):
    """The law equals the one generate() builds from transformers' warpers in its order
    (temperature, top-k, top-p), entry by entry, zeros included."""
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(0)) * 2
    probs = logits_to_probs(logits, SamplingConfig(temperature, top_k, top_p))
    reference = generate_law(logits, temperature, top_k, top_p)
    assert torch.equal(probs > 0, reference > 0)
    assert torch.allclose(probs.double(), reference, atol=1e-6)


def test_warping_check_sees_top_p_before_top_k():
    """The comparison above can fail: top-p before top-k is a different law for these logits."""
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(0)) * 2
    right = generate_warpers(0.5, 5, 0.8)
    swapped = generate_law(logits, 0.5, 5, 0.8, warpers=LogitsProcessorList([right[0], right[2], right[1]]))
    assert not torch.allclose(swapped, generate_law(logits, 0.5, 5, 0.8), atol=1e-2)
    assert not torch.equal(swapped > 0, logits_to_probs(logits, SamplingConfig(0.5, 5, 0.8)) > 0)


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.randn(3, 20)
    probs = logits_to_probs(logits, SamplingConfig(temperature=0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))
    assert SamplingConfig(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_metrics_counters_derived_values_and_clock():
    ticks = itertools.count(0.0, 0.5)  # each clock read advances 0.5 s
    metrics = SpeculativeMetrics()
    watch = Stopwatch(metrics, clock=lambda: next(ticks))
    with watch.time("draft_time_s"):
        pass
    with watch.time("target_time_s"):
        pass
    metrics.wall_time_s = 2.0
    metrics.record_round(drafted=4, accepted=2, emitted=3, bonus=False)
    metrics.record_round(drafted=4, accepted=4, emitted=5, bonus=True)
    assert metrics.draft_time_s == 0.5 and metrics.target_time_s == 0.5 and metrics.other_time_s == 1.0
    data = metrics.to_dict()
    for key in (
        "rounds",
        "drafted_tokens",
        "accepted_tokens",
        "generated_tokens",
        "acceptance_rate",
        "mean_acceptance_length",
        "accepted_per_position",
        "tokens_per_second",
        "wall_time_s",
    ):
        assert key in data
    assert data["rounds"] == 2 and data["accepted_tokens"] == 6 and data["generated_tokens"] == 8
    assert data["acceptance_rate"] == 0.75 and data["mean_acceptance_length"] == 4.0
    assert data["accepted_per_position"] == [2, 2, 1, 1]
    assert data["tokens_per_second"] == 4.0
    assert metrics.recovered_tokens == 1 and metrics.bonus_tokens == 1


def test_metrics_merge_and_round_trip():
    a, b = SpeculativeMetrics(), SpeculativeMetrics()
    a.record_round(2, 1, 2, False)
    b.record_round(5, 5, 6, True)
    a.wall_time_s, b.wall_time_s = 1.0, 3.0
    merged = a + b
    assert merged.rounds == 2 and merged.accepted_per_position == [2, 1, 1, 1, 1]
    assert merged.tokens_per_second == 2.0
    assert SpeculativeMetrics.from_dict(merged.to_dict()) == merged
    baseline = SpeculativeMetrics(generated_tokens=4, wall_time_s=4.0)
    assert merged.speedup_over(baseline) == 2.0
