"""Draft-length policy: k fixed, or chosen each round to maximise the expected speedup ("auto").

Words:
- first-token acceptance a1: P(the round's first draft is accepted).
- continuation acceptance a: P(draft i+1 accepted | draft i accepted).
  With a1 = a this is Leviathan et al.'s geometric model; keeping them apart
  fits n-gram drafts (a copy is either wrong at once or right for a while)
  as well as model drafts.
- expected tokens per round with k drafts: E[N] = 1 + a1 (1 - a^k) / (1 - a).
- cost of a round, in target forwards: 1 + k (c + v), with c the draft step /
  target forward cost ratio (measured; 0 for model-free drafters) and v the
  target's extra cost per verified token (the Leviathan formula ignores it;
  fitted online from the target's time against the drafts it scored, once k
  has varied enough, since it is ~0.02 in bfloat16 but ~0.25 in float32 here).

Estimates use exponential forgetting and priors worth `prior_weight` trials,
so one bad round cannot pin k at 0. With k = 0 chosen, a k = 1 probe keeps the
estimates alive; the wait between probes doubles after each probe that found
speculation still unprofitable, so a useless draft costs almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.verify import VerifyResult


def expected_tokens(first: float, continuation: float, k: int) -> float:
    """E[N] = 1 + a1 (1 - a^k) / (1 - a)."""
    if k == 0:
        return 1.0
    if continuation >= 1:
        return 1 + first * k
    return 1 + first * (1 - continuation**k) / (1 - continuation)


@dataclass
class _Rate:
    """A success rate with forgetting and a prior."""

    prior: float
    weight: float
    decay: float = 0.9
    successes: float = 0.0
    trials: float = 0.0

    def update(self, successes: float, trials: float) -> None:
        self.successes = self.decay * self.successes + successes
        self.trials = self.decay * self.trials + trials

    @property
    def value(self) -> float:
        return min((self.successes + self.weight * self.prior) / (self.trials + self.weight), 0.99)


@dataclass
class DraftLengthPolicy:
    k: int | None  # None: auto
    max_k: int = 10
    alpha: float = 0.7  # prior acceptance (first and continuation)
    cost_ratio: float = 0.2  # prior draft-step / target-forward cost (0 for model-free drafters)
    # Measured ~0.02 for the 1.5B target on CPU (0.194 s for 1 token, 0.235 s for 9).
    verify_cost_per_token: float = 0.02
    prior_weight: float = 2.0
    probe_every: int = 8
    max_probe_every: int = 128
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first = _Rate(self.alpha, self.prior_weight)
        self.continuation = _Rate(self.alpha, self.prior_weight)
        self._wait, self._since_probe, self._cost_rounds = self.probe_every, 0, 0
        self._fit = [0.0] * 5  # decayed sums of 1, x, y, xx, xy for target time y against drafts scored x

    def expected_speedup(self, k: int) -> float:
        cost = 1 + k * (self.cost_ratio + self.verify_cost_per_token)
        return expected_tokens(self.first.value, self.continuation.value, k) / cost

    def next_k(self) -> int:
        if self.k is not None:
            return self.k
        k = max(range(self.max_k + 1), key=self.expected_speedup)
        if k > 0:
            self._since_probe, self._wait = 0, self.probe_every
        else:
            self._since_probe += 1
            if self._since_probe >= self._wait:  # probe, and wait longer before the next one
                self._since_probe, self._wait, k = 0, min(2 * self._wait, self.max_probe_every), 1
        self.history.append(k)
        return k

    def observe(self, result: VerifyResult, lengths: torch.Tensor) -> None:
        drafted = lengths > 0
        if not bool(drafted.any()):
            return
        accepted = result.num_accepted[drafted].double()
        length = lengths[drafted].double()
        self.first.update(float((accepted >= 1).sum()), float(drafted.sum()))
        later = (accepted - 1).clamp(min=0)  # accepted drafts after the first
        stopped = ((accepted >= 1) & (accepted < length)).double()  # a rejection after an acceptance
        self.continuation.update(float(later.sum()), float((later + stopped).sum()))

    @property
    def acceptance(self) -> float:
        """The first-token acceptance estimate (for reports)."""
        return self.first.value

    def observe_verify_cost(self, drafts_scored: int, target_time: float) -> None:
        """Fit target_time = t1 (1 + v * drafts_scored) by decayed least squares; keep the prior
        until the number of scored drafts has varied enough to tell the slope."""
        n, sx, sy, sxx, sxy = (0.95 * value for value in self._fit)
        x, y = float(drafts_scored), target_time
        self._fit = [n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]
        n, sx, sy, sxx, sxy = self._fit
        variance = sxx / n - (sx / n) ** 2
        if n >= 4 and variance >= 1.0:
            slope = (sxy / n - sx / n * sy / n) / variance
            intercept = sy / n - slope * sx / n
            if intercept > 0:
                self.verify_cost_per_token = min(max(slope / intercept, 0.0), 1.0)

    def observe_costs(self, draft_time: float, draft_steps: int, target_time: float) -> None:
        """One round's clocks; rounds without draft steps say nothing about the ratio."""
        if draft_steps == 0 or target_time <= 0:
            return
        self._cost_rounds += 1
        if self._cost_rounds == 1:
            return  # the first drafted round includes prefill: not a per-step cost
        ratio = (draft_time / draft_steps) / target_time
        self.cost_ratio = ratio if self._cost_rounds == 2 else 0.8 * self.cost_ratio + 0.2 * ratio
