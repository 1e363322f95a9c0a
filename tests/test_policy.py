"""The auto draft-length policy: it speculates when it pays and stops (almost) when it does not."""

import torch

from specdec.policy import DraftLengthPolicy
from specdec.verify import VerifyResult


def rounds(policy: DraftLengthPolicy, accept_all: bool, count: int, cost_ratio: float) -> list[int]:
    ks = []
    for _ in range(count):
        k = policy.next_k()
        ks.append(k)
        if k:
            accepted = torch.tensor([k if accept_all else 0])
            policy.observe(
                VerifyResult(torch.zeros(1, k + 1, dtype=torch.long), accepted, accepted == k), torch.tensor([k])
            )
        policy.observe_costs(0.01 * k, k, 0.01 / cost_ratio)
    return ks


def test_auto_grows_k_when_everything_is_accepted():
    ks = rounds(DraftLengthPolicy(k=None), accept_all=True, count=30, cost_ratio=0.1)
    assert ks[-1] >= 8


def test_auto_stops_speculating_with_a_useless_draft():
    ks = rounds(DraftLengthPolicy(k=None), accept_all=False, count=400, cost_ratio=0.35)
    assert ks[-300:].count(0) >= 295  # after learning, at most a handful of k=1 probes
    assert sum(ks) < 40


def test_fixed_k_is_fixed():
    assert rounds(DraftLengthPolicy(k=3), accept_all=False, count=5, cost_ratio=0.5) == [3] * 5
