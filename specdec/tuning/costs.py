"""The one cost model: what a round costs on this host, what learned rates say a draft is worth, and
whether one more verify column pays.

Words (docs/DESIGN.md):
- costs (`Costs`): the measured seconds of one draft step and of the target forward at each verify
  width w (batch x w tokens after a context), for one pair, host and batch size. Read in target
  forwards of one token: `round_cost(k)` for a round with k drafts, `verify_cost(w)` for a verify
  over w columns. Calibration (specdec.tuning.calibration) and the bench (specdec.bench.main) both measure it
  with the one forward timer, `forward_seconds`.
- rate (`RateCounter`): P(success) learned from counts, per bin, shrunk towards a prior worth
  `weight` trials. The policy's acceptance per draft position, a drafter's acceptance by confidence
  or by sibling rank and copy acceptance by match length are all rate counters.
- pays: one more verify column (a sibling, a copy, a draft past k) pays when it raises the round's
  expected tokens per cost: (tokens + value) / (cost + extra) > tokens / cost, i.e. `surplus` =
  value x cost - tokens x extra > 0, with extra the column's cost in target forwards.
  `columns_that_pay` counts such columns, best first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

PERFECT = 0.99  # the cap of learned acceptance rates: "perfect" for deciding whether any k can pay


@dataclass(frozen=True)
class DraftSettings:
    """A run's settings for a drafter, from the draft-length policy's costs (in target forwards): what
    `DraftModel.configure` is given, once per run (and per round in a serving batch)."""

    width: int | str = 1  # candidates per chain draft: 1 (a chain), w (w - 1 siblings), or "auto"
    stop_costs: tuple[float, ...] = (0.2,) * 16  # the marginal round cost of the (i + 1)-th draft
    verify_cost: Callable[[int], float] = lambda width: 1 + 0.02 * (width - 1)  # a verify over `width` tokens
    max_width: int = 11  # the widest verify the calibration measured
    stops: bool = True  # may a row stop drafting early on its own (False: the calibration times full chains)


@dataclass(frozen=True)
class RoundPrice:
    """What the draft-length policy tells the drafter before each round's proposal (`plan_round`)."""

    extension: tuple[int, float] | None = None  # auto k: (k, bar) for a drafter that stops on its own past k
    rate: float | None = None  # the round's expected tokens per cost, all rows: what a copy column must beat
    rates: tuple[float, ...] = ()  # the policy's acceptance per chain position (first, then each given the last)
    room: torch.Tensor | None = None  # [batch] drafts each row may still add (its budget but one)


@dataclass(frozen=True)
class Costs:
    draft_step_s: float  # one draft step over batch x 1 token (0 for model-free drafters)
    target_s: tuple[tuple[int, float], ...]  # (width, seconds) for the target forward over batch x width
    batch: int = 1

    def target(self, width: int) -> float:
        """Seconds of a target forward over `width` tokens (linear between measured widths)."""
        points = sorted(self.target_s)
        if len(points) == 1:
            return points[0][1]
        for (w0, t0), (w1, t1) in zip(points, points[1:]):
            if w0 <= width <= w1:
                return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
        (w0, t0), (w1, t1) = points[-2], points[-1]  # beyond the last width: extend the last slope
        return t1 + (t1 - t0) * (width - w1) / (w1 - w0)

    def verify_cost(self, width: int) -> float:
        """A target forward over `width` tokens, in forwards of one token."""
        return self.target(width) / self.target(1)

    def round_cost(self, k: int) -> float:
        """A round with k drafts, in target forwards of one token."""
        return (k * self.draft_step_s + self.target(k + 1)) / self.target(1)

    @property
    def max_width(self) -> int:
        """The widest verify measured: costs past it are extrapolated."""
        return max(width for width, _ in self.target_s)

    @property
    def cost_ratio(self) -> float:
        """c = draft step / target forward over one token."""
        return self.draft_step_s / self.target(1)

    def to_dict(self) -> dict:
        return asdict(self) | {"cost_ratio": self.cost_ratio}


class MeasuredCosts:
    """Costs corrected by a running batch's own clocks (specdec.serving.session): a serving batch is dearer
    than the calibration's clean rows (rows join and leave, reject at different places, contexts
    differ), so each round's measured seconds, per verify width and per draft step, replace the
    calibrated ones, with exponential forgetting. A width never measured keeps the calibrated shape,
    scaled by the measured/calibrated ratio of the nearest measured width. Exact only where the tokens
    do not depend on k (greedy, race verification): these decisions read clocks."""

    SPIKE = 4.0  # a later reading counts for at most this many times the average so far

    def __init__(self, calibrated: Costs, decay: float = 0.7, alone_every: int = 32):
        self.calibrated, self.decay, self.alone_every = calibrated, decay, alone_every
        self.target_s: dict[int, float] = {}  # verify width -> seconds (moving average)
        self.draft_step_s: float | None = None
        self.since_alone = 0  # rounds since width 1 (the target alone) was timed

    @property
    def alone_due(self) -> bool:
        """A round of the target alone is due: rounds that draft never time width 1, the price every
        round is compared with, so one in `alone_every` drafts nothing (the first one at once)."""
        return 1 not in self.target_s or self.since_alone >= self.alone_every

    def _average(self, old: float | None, new: float) -> float:
        """The first reading replaces the calibration's price; a later one counts for at most SPIKE times
        the average so far: one stall (a page fault, a neighbour's burst) must not price drafting out for
        good, since rounds that do not draft never time the draft again. A lasting change still moves
        the price, by up to 1 + (1 - decay) x (SPIKE - 1) times a round."""
        return new if old is None else self.decay * old + (1 - self.decay) * min(new, self.SPIKE * old)

    def observe(self, width: int, target_s: float, draft_steps: int = 0, draft_s: float = 0.0) -> None:
        """One round: a target forward over `width` columns took target_s; draft_steps steps took draft_s
        (0 steps: the draft's time is not counted, e.g. a round that also caught the draft up)."""
        self.target_s[width] = self._average(self.target_s.get(width), target_s)
        self.since_alone = 0 if width == 1 else self.since_alone + 1
        if draft_steps > 0:
            self.draft_step_s = self._average(self.draft_step_s, draft_s / draft_steps)

    def costs(self) -> Costs:
        """The calibrated costs with every measurement in place."""
        base = self.calibrated
        if not self.target_s:
            return base
        widths = sorted({w for w, _ in base.target_s} | set(self.target_s))

        def at(width: int) -> float:
            if width in self.target_s:
                return self.target_s[width]
            nearest = min(self.target_s, key=lambda w: (abs(w - width), w))
            return base.target(width) * self.target_s[nearest] / base.target(nearest)

        draft = self.draft_step_s if self.draft_step_s is not None else base.draft_step_s * at(1) / base.target(1)
        return Costs(draft, tuple(zip(widths, monotone([at(w) for w in widths]))), base.batch)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one fn() call, synchronised on CUDA (events)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def monotone(times: list[float]) -> list[float]:
    """A wider forward never costs less than a narrower one: each width takes the least time
    measured at it or at any wider width (a load spike on one width cannot make it look dear)."""
    out, least = [], float("inf")
    for value in reversed(times):
        least = min(least, value)
        out.append(least)
    return out[::-1]


def forward_seconds(model, batch: int, widths: Sequence[int], context: int, repeats: int) -> list[float]:
    """The forward timer: seconds of a forward over batch x w tokens after `context` cached tokens, for
    each width w, through the adapter: one prefill, then each timed forward is rolled back to the context."""
    ids = torch.randint(0, min(1000, model.vocab_size), (batch, context + max(widths)), device=model.device)
    valid = torch.ones(ids.shape, dtype=torch.bool)  # host bookkeeping: masks and lengths from the CPU
    keep = torch.full((batch,), context, dtype=torch.long)

    def step(width: int):
        model.rollback(keep)
        model.forward(ids[:, context : context + width], valid[:, context : context + width], keep_logits=width)

    model.reset(batch)
    model.forward(ids[:, :context], valid[:, :context])
    for width in widths:  # warm-up: first calls of a shape allocate
        step(width)
    # Interleaved sweeps, the least time per width: another process's burst hits one sample of
    # one width, not a whole width, and the minimum is what the host can do.
    samples = [[seconds(lambda w=w: step(w), model.device) for w in widths] for _ in range(repeats)]
    model.reset(batch)
    return monotone([min(column) for column in zip(*samples)])


class RateCounter:
    """Success rates learned from counts, one per bin: (successes + weight x prior) / (trials + weight),
    at most `cap`. With `decay` < 1 the counts forget: each observe first scales the old ones by it.
    Counts are Python floats (the policy and the copies read one rate at a time); `predict` reads many
    bins at once as a tensor."""

    def __init__(
        self,
        prior: float | Sequence[float],
        weight: float = 2.0,
        bins: int | None = None,
        decay: float = 1.0,
        cap: float | None = None,
    ):
        if isinstance(prior, (int, float)):
            prior = [float(prior)] * (1 if bins is None else bins)
        assert bins in (None, len(prior)), "one prior per bin"
        self.prior = [float(p) for p in prior]  # [bins]
        self.weight, self.decay, self.cap = weight, decay, cap
        self.reset()

    def reset(self) -> None:
        self.successes = [0.0] * len(self.prior)  # [bins]
        self.trials = [0.0] * len(self.prior)  # [bins]
        self._table: tuple[torch.Tensor, ...] | None = None  # predict's tensors, until the counts change

    def observe(self, successes, trials, bins=None) -> None:
        """Add successes[i] of trials[i] to bin bins[i]: numbers, lists or tensors (a number of trials
        counts for every entry); without bins, one entry per bin in order."""
        if self.decay != 1.0:
            self.successes = [self.decay * count for count in self.successes]
            self.trials = [self.decay * count for count in self.trials]
        listed = lambda x: x.tolist() if isinstance(x, torch.Tensor) else x  # noqa: E731
        successes, trials, bins = listed(successes), listed(trials), listed(bins)
        if isinstance(successes, (int, float)):
            successes = [successes]
        bins = range(len(self.prior)) if bins is None else [bins] if isinstance(bins, int) else bins
        trials = [trials] * len(successes) if isinstance(trials, (int, float)) else trials
        assert len(bins) == len(successes) == len(trials), "one count per bin"
        for bin_, success, trial in zip(bins, successes, trials):
            self.successes[bin_] += success
            self.trials[bin_] += trial
        self._table = None

    def rate(self, bin: int = 0, prior: float | None = None) -> float:
        """A bin's rate, shrunk towards `prior` in place of its own where given (e.g. a pooled rate for
        a bin without evidence of its own)."""
        prior = self.prior[bin] if prior is None else prior
        rate = (self.successes[bin] + self.weight * prior) / (self.trials[bin] + self.weight)
        return rate if self.cap is None else min(rate, self.cap)

    def predict(self, bins: torch.Tensor) -> torch.Tensor:
        """The rates of `bins` (a long tensor of any shape), as float64 of that shape."""
        if self._table is None:
            self._table = tuple(torch.tensor(x, dtype=torch.float64) for x in (self.successes, self.trials, self.prior))
        successes, trials, prior = self._table
        rates = (successes[bins] + self.weight * prior[bins]) / (trials[bins] + self.weight)
        return rates if self.cap is None else rates.clamp(max=self.cap)


def surplus(value, tokens, cost, extra):
    """value x cost - tokens x extra: > 0 where a column worth `value` expected tokens for `extra` target
    forwards raises the tokens per cost of a round expecting `tokens` for `cost` (it pays), 0 where it
    breaks even. Numbers or tensors; its sign is exactly that of the comparison of the two products."""
    return value * cost - tokens * extra


def columns_that_pay(
    values: Sequence[float],
    width: int,
    tokens: float,
    cost: float,
    verify_cost: Callable[[int], float],
    max_width: float = math.inf,
    raise_bar: bool = True,
) -> int:
    """How many of `values` (expected tokens, best first) to verify in more columns after a round of
    `width` columns expecting `tokens` for `cost` target forwards: each while it pays for one more
    column, verify_cost(w + 1) - verify_cost(w), and never past `max_width` columns. `raise_bar`: each
    column kept joins the round, so the next must beat the round's new tokens per cost; else each
    must beat the round's own."""
    count = 0
    for value in values:
        if width >= max_width:
            break
        extra = verify_cost(width + 1) - verify_cost(width)
        if surplus(value, tokens, cost, extra) <= 0:
            break
        count, width = count + 1, width + 1
        if raise_bar:
            tokens, cost = tokens + value, cost + extra
    return count
