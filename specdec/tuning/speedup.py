"""The speedup model: tokens a round emits, what it costs, and the draft length that pays best.

Words (docs/DESIGN.md):
- first-token acceptance a1: P(the round's first draft is accepted).
- continuation acceptance a: P(draft i+1 accepted | draft i accepted). With a1 = a
  this is Leviathan et al.'s geometric model; keeping them apart fits n-gram drafts
  (a copy is either wrong at once or right for a while) as well as model drafts.
- round cost: the time of a round in target forwards of one token:
  (k draft steps + one target forward over k + 1 positions) / target forward over 1.
  Leviathan et al.'s 1 + k c is the case where the verify width costs nothing.

One module, used by the auto draft-length policy and by the bench's bound.
"""

from __future__ import annotations

from collections.abc import Callable


def expected_tokens(first: float, continuation: float, k: int) -> float:
    """E[N] = 1 + a1 (1 - a^k) / (1 - a): tokens emitted per round with k drafts."""
    if not (0 <= first <= 1 and 0 <= continuation <= 1):
        raise ValueError(f"acceptance rates must lie in [0, 1], got {first}, {continuation}")
    if k == 0:
        return 1.0
    if continuation >= 1:
        return 1 + first * k
    return 1 + first * (1 - continuation**k) / (1 - continuation)


def expected_tokens_by_position(rates: list[float]) -> float:
    """E[N] = 1 + r1 + r1 r2 + ... + r1 ... rk: tokens per round with k = len(rates) drafts, where rates[i]
    is P(draft i + 1 accepted | the drafts before it accepted). Constant later rates give expected_tokens."""
    total, survive = 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
    return total


def leviathan_cost(cost_ratio: float) -> Callable[[int], float]:
    """Round cost 1 + k c (verify width free), c = draft step / target forward."""
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return lambda k: 1 + k * cost_ratio


def expected_speedup(first: float, continuation: float, k: int, round_cost: Callable[[int], float]) -> float:
    """S = E[N] / round cost, over the target alone (cost 1 per token)."""
    return expected_tokens(first, continuation, k) / round_cost(k)


def best_draft_length(first: float, continuation: float, round_cost: Callable[[int], float], max_k: int) -> int:
    """The k in [0, max_k] with the highest expected speedup (k = 0: the target alone)."""
    return max(range(max_k + 1), key=lambda k: expected_speedup(first, continuation, k, round_cost))


def geometric_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.'s S = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))."""
    return expected_speedup(alpha, alpha, k, leviathan_cost(cost_ratio))
