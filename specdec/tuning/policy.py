"""Draft-length policy: k fixed, or chosen each round to maximise the expected speedup ("auto").

Words: first-token and continuation acceptance, and the round cost, as in
specdec.tuning.speedup (the one speedup model). Costs are specdec.tuning.costs.Costs, from a
calibration (specdec.tuning.calibration: measured once per host, pair and batch size),
or, without one, from a prior (draft step / target forward = cost_ratio, verify cost per
drafted token = verify_cost_per_token). During a run the policy learns only
acceptance, from counts, never from clocks: with a seed, `auto` gives the same
tokens on every run.

Estimates are specdec.tuning.costs.RateCounter's, with exponential forgetting and
priors worth `prior_weight` trials, so one bad round cannot pin k at 0. The
continuation rate's prior is the current first-token estimate. Each later draft position also keeps its own
rate, P(draft j accepted | draft j - 1 accepted), whose prior is that pooled
rate: on code the rejections cluster (a hard token, then a long run the draft
gets right), and one rate for every position would underrate long chains there.
Positions past the chosen k are reached only by sure drafts (the learned stop's
extension), so their rates may start high; once k reaches them every round
drafts them, and the counts correct it. With k = 0 chosen, a probe keeps the
estimates alive; the wait between probes doubles after each probe that found
speculation still unprofitable, so a useless draft costs almost nothing. A
probe drafts one token; after a probe whose drafts were all accepted the next
one drafts one more and comes after the shortest wait (k = 1 probes alone
never inform the continuation rate, so a dear draft on copy-like text stayed
at k = 0 however good it was); a rejection takes the probe back to one. Where
even perfect acceptance could not pay for one draft (the costs say so), k is 0
from the first round and there are no probes.

k is the best length for an average round. A drafter that can stop on its own
(ModelDrafter's learned stop) drafts past it while its drafts stay sure
(`extension`): the bar is the round's expected tokens per cost, so a draft past k
must pay at least as well as the round does (specdec.tuning.costs's one pays rule).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specdec.tuning.costs import PERFECT, Costs, RateCounter
from specdec.tuning.speedup import expected_speedup, expected_tokens_by_position, leviathan_cost
from specdec.verify import VerifyResult

DECAY = 0.9  # each round's counts forget a tenth of the earlier ones
HISTORY_ROUNDS = 4096  # the k of this many last rounds is kept for inspection


@dataclass
class DraftLengthPolicy:
    k: int | None  # None: auto
    max_k: int = 10
    alpha: float = 0.7  # prior acceptance (first and continuation)
    costs: Costs | None = None  # calibrated; None: the prior cost model below
    cost_ratio: float = 0.2  # prior draft-step / target-forward cost (0 for model-free drafters)
    verify_cost_per_token: float = 0.02  # prior extra target cost per drafted token
    prior_weight: float = 2.0
    probe_every: int = 8
    max_probe_every: int = 128
    # The k of the last rounds, for inspection; bounded, as a serving session runs round after round for days.
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_ROUNDS))
    # This round drafts nothing, copies neither: the target alone, which a serving batch times now and then
    # (its measured costs); rounds alone learn nothing.
    alone: bool = False

    def __post_init__(self) -> None:
        self.first = RateCounter(self.alpha, self.prior_weight, decay=DECAY, cap=PERFECT)
        self.continuation = RateCounter(self.alpha, self.prior_weight, decay=DECAY, cap=PERFECT)
        # P(draft j accepted | draft j - 1 accepted) for j = 2 .. max_k (bin j - 2), shrunk towards the pooled rate
        self.by_position = RateCounter(self.alpha, self.prior_weight, max(self.max_k - 1, 0), DECAY, PERFECT)
        self._rates: tuple[float, ...] | None = None
        self._best: int | None = None  # best_k, until observe
        self._wait, self._since_probe = self.probe_every, 0
        self._probe_k, self._probing = 1, False
        self._never_pays: tuple[Costs | None, bool] | None = None  # (the costs it was computed for, the answer)

    @property
    def never_pays(self) -> bool:
        """Auto k only: no k pays even if every draft were accepted, at the costs as they are now (a serving
        batch's costs change as its rounds are timed). Then no round drafts, not even a probe: a probe
        only learns acceptance, and no acceptance could make drafting pay."""
        if self.k is not None:
            return False
        if self._never_pays is None or self._never_pays[0] is not self.costs:
            never = all(expected_speedup(PERFECT, PERFECT, k, self.round_cost) <= 1 for k in range(1, self.max_k + 1))
            self._never_pays = (self.costs, never)
        return self._never_pays[1]

    def round_cost(self, k: int) -> float:
        if self.costs is not None:
            return self.costs.round_cost(k)
        return leviathan_cost(self.cost_ratio + self.verify_cost_per_token)(k)

    @property
    def max_width(self) -> int:
        """The widest verify the calibration measured (11 without one): costs past it are extrapolated."""
        return self.costs.max_width if self.costs is not None else 11

    def verify_cost(self, width: int) -> float:
        """A target forward over `width` tokens, in forwards of one token."""
        if self.costs is not None:
            return self.costs.verify_cost(width)
        return 1 + self.verify_cost_per_token * (width - 1)

    @property
    def continuation_rate(self) -> float:
        # Without evidence of its own, a later draft is taken to survive as often as a first one
        # (k = 1 rounds never inform the continuation rate; a fixed prior pinned such runs at k = 1).
        return self.continuation.rate(prior=self.first.rate())

    def rates(self, k: int | None = None) -> tuple[float, ...]:
        """Per draft position up to k (max_k without one): the first-token rate, then each later draft's
        rate given the one before; past max_k (a user's fixed k may be longer) the pooled rate. Computed
        once per round: they change only in observe."""
        if self._rates is None:
            pooled = self.continuation_rate
            self._rates = (self.first.rate(), *(self.by_position.rate(j, pooled) for j in range(self.max_k - 1)))
        if k is None or k <= len(self._rates):
            return self._rates[:k]
        return self._rates + (self.continuation_rate,) * (k - len(self._rates))

    def expected_speedup(self, k: int) -> float:
        return expected_tokens_by_position(self.rates(k)) / self.round_cost(k)

    def extension(self, k: int) -> tuple[int, float] | None:
        """Auto k only: (k, bar) for a drafter that can stop on its own. Past k drafts, a row drafts
        on while P(every draft so far survives) >= bar x the next draft's marginal cost (in target
        forwards): the next draft survives with about the continuation rate, and it must add tokens at
        no less than the round's expected rate, tokens per cost at k. So a run of confident drafts is
        not cut at a k chosen for the average round."""
        if self.k is not None or k == 0:
            return None
        return k, self.expected_speedup(k) / self.continuation_rate

    def next_k(self) -> int:
        if self.alone:
            return 0
        if self.k is not None:
            return self.k
        if self.never_pays:
            self.history.append(0)
            return 0
        k = self.best_k()
        if k > 0:
            self._since_probe, self._wait = 0, self.probe_every
        else:
            self._since_probe += 1
            if self._since_probe >= self._wait:  # probe, and wait longer before the next one
                self._since_probe, self._wait, k = 0, min(2 * self._wait, self.max_probe_every), self._probe_k
                self._probing = True
        self.history.append(k)
        return k

    def best_k(self) -> int:
        """The k with the most expected tokens per cost by the rates learned so far (auto k, probes aside)."""
        if self._best is None:
            self._best = max(range(self.max_k + 1), key=self.expected_speedup)
        return self._best

    def observe(self, result: VerifyResult, lengths: torch.Tensor) -> None:
        drafted = lengths > 0
        probing, self._probing = self._probing, False
        if not bool(drafted.any()):
            return
        accepted = torch.minimum(result.num_accepted, lengths)[drafted].double()  # copies past a chain aside
        length = lengths[drafted].double()
        if probing:  # a probe that kept every draft: the next one sooner and one longer; else back to one
            full = bool((accepted >= length).all())
            self._probe_k = min(self._probe_k + 1, self.max_k) if full else 1
            if full:
                self._wait = self.probe_every
        self.first.observe(float((accepted >= 1).sum()), float(drafted.sum()))
        later = (accepted - 1).clamp(min=0)  # accepted drafts after the first
        stopped = ((accepted >= 1) & (accepted < length)).double()  # a rejection after an acceptance
        self.continuation.observe(float(later.sum()), float((later + stopped).sum()))
        # Draft j (>= 2) of a row is judged when the row drafted it and kept draft j - 1; kept when accepted.
        # A row judges drafts 2 .. min(length, accepted + 1) and keeps 2 .. accepted.
        rows = list(zip(accepted.tolist(), length.tolist()))
        positions = range(2, self.max_k + 1)  # draft j's rate is bin j - 2
        judged = [float(sum(1 for a, n in rows if min(n, a + 1) >= j)) for j in positions]
        kept = [float(sum(1 for a, _ in rows if a >= j)) for j in positions]
        self.by_position.observe(kept, judged)
        self._rates = self._best = None

    @property
    def acceptance(self) -> float:
        """The first-token acceptance estimate (for reports)."""
        return self.first.rate()
