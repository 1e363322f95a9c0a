"""Diagnostics and the lossy lenient opt-in: its exact law matches its samples, and it is lossy."""

import math

import pytest
import torch

from specdec.verify.diagnostics import (
    expected_acceptance,
    js_divergence,
    kl_divergence,
    lenient_output_law,
    lenient_verify,
    total_variation,
)
from specdec.verify.sampling import sample
from tests.lawcheck import bin_violations


def laws(seed=0, vocab=6):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.softmax(2 * torch.randn(vocab, generator=g), -1),
        torch.softmax(2 * torch.randn(vocab, generator=g), -1),
        g,
    )


def test_divergences():
    p, q, _ = laws()
    assert kl_divergence(p, p).item() == pytest.approx(0, abs=1e-12)
    assert kl_divergence(p, q).item() > 0
    assert 0 < js_divergence(p, q).item() <= math.log(2)
    assert kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])).item() == math.inf
    assert expected_acceptance(p, q).item() == pytest.approx(1 - total_variation(p, q).item(), abs=1e-6)


def test_lenient_is_exact_at_one_and_lossy_above():
    p, q, _ = laws(1)
    assert torch.allclose(lenient_output_law(p, q, 1.0), p.double(), atol=1e-6)
    assert total_variation(lenient_output_law(p, q, 2.0), p).item() > 0.01


def test_lenient_samples_follow_its_stated_law():
    p, q, g = laws(2)
    rows, leniency = 40_000, 2.0
    target = torch.stack([p, p])[None].expand(rows, -1, -1)
    draft_probs = q[None, None].expand(rows, 1, -1)
    result = lenient_verify(target, sample(draft_probs, g), draft_probs, leniency=leniency, generator=g)
    counts = torch.bincount(result.tokens[:, 0], minlength=p.numel())
    assert bin_violations(counts, lenient_output_law(p, q, leniency), rows) == []
    assert bin_violations(counts, p, rows) != []  # and it is not the target's law
    with pytest.raises(ValueError, match="leniency"):
        lenient_verify(target, sample(draft_probs, g), draft_probs, leniency=0.5)
