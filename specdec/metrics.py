"""Metrics: counters plus derived properties, and a stopwatch with an injectable clock.

Words (docs/DESIGN.md):
- round: one draft-verify step; it emits accepted + 1 tokens.
- acceptance rate: accepted / drafted; None (JSON null) where nothing was drafted, since no rate was measured.
- mean acceptance length: 1 + accepted / rounds (includes the recovered or
  bonus token; vLLM's and SGLang's convention).
- accepted_per_position[i]: rounds whose (i+1)-th draft was accepted;
  drafted_per_position[i]: rounds that drafted an (i+1)-th token. With draft
  trees, position is depth: a round accepts at most one node per depth.
- tree_nodes: sibling nodes verified (draft trees; the chain's drafts are
  drafted_tokens); sibling_tokens: rounds whose path ended on a sibling.
- lookup_tokens: copy drafts appended after the drafter's chain (prompt lookup, specdec.drafters.lookup),
  counted in drafted_tokens too; lookup_accepted: those accepted (in accepted_tokens too).
- forced_tokens: chain drafts the output's grammar forced (the one token it allows there), proposed
  without a draft model forward (specdec.verify.grammar); counted in drafted_tokens too.
- compile_time_s: warm-up inside this run, capturing (or compiling) forward
  shapes used for the first time (compile=True); part of wall_time_s.

Rounds are counted per sequence: a batch of 3 rows doing one step counts 3.
Rendering lives elsewhere (cli/); this module only counts and serialises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

Clock = Callable[[], float]
DERIVED = (
    "acceptance_rate",
    "draft_acceptance_rate",
    "mean_acceptance_length",
    "acceptance_rate_per_position",
    "tokens_per_second",
    "other_time_s",
)


# Counted per row as its tokens commit (`record_round` and the draft kinds); a run's are the sum of its rows'.
# The other fields are the run's own: forwards and clocks, which the rows of a batch share.
ROW_COUNTS = (
    "rounds",
    "drafted_tokens",
    "accepted_tokens",
    "generated_tokens",
    "recovered_tokens",
    "bonus_tokens",
    "accepted_per_position",
    "drafted_per_position",
    "tree_nodes",
    "sibling_tokens",
    "lookup_tokens",
    "lookup_accepted",
    "forced_tokens",
)


def _add_into(mine: list[int], theirs: list[int]) -> None:
    """mine += theirs, position by position, in place (mine grows to theirs' length)."""
    mine.extend([0] * (len(theirs) - len(mine)))
    for i, count in enumerate(theirs):
        mine[i] += count


@dataclass
class SpeculativeMetrics:
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    draft_forwards: int = 0
    target_forwards: int = 0
    tree_nodes: int = 0
    sibling_tokens: int = 0
    compile_time_s: float = 0.0
    lookup_tokens: int = 0
    lookup_accepted: int = 0
    forced_tokens: int = 0

    # ------------------------------------------------------------ counting

    def record_round(self, drafted: int, accepted: int, emitted: int, bonus: bool) -> None:
        """One sequence's round: `drafted` proposals, `accepted` kept, `emitted` committed
        (emitted may be below accepted + 1 when EOS or the token budget cut the round)."""
        assert 0 <= accepted <= drafted and emitted >= 1
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.generated_tokens += emitted
        self.bonus_tokens += int(bonus)
        self.recovered_tokens += int(not bonus)
        _add_into(self.drafted_per_position, [1] * drafted)
        _add_into(self.accepted_per_position, [1] * accepted)

    def add_counts(self, rows: Iterable[SpeculativeMetrics]) -> None:
        """Add rows' token counts (ROW_COUNTS) to this run's: they are booked once, per row."""
        rows = list(rows)
        for name in ROW_COUNTS:
            mine = getattr(self, name)
            if not isinstance(mine, list):
                setattr(self, name, mine + sum(getattr(row, name) for row in rows))
                continue
            for row in rows:
                _add_into(mine, getattr(row, name))

    # ------------------------------------------------------------ derived

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Acceptance of the drafter's own drafts, copy drafts (prompt lookup) aside."""
        drafted = self.drafted_tokens - self.lookup_tokens
        return (self.accepted_tokens - self.lookup_accepted) / drafted if drafted else None

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def other_time_s(self) -> float:
        """Wall time outside draft and target forwards: the engine's own overhead."""
        return max(0.0, self.wall_time_s - self.draft_time_s - self.target_time_s)

    def speedup_over(self, baseline: SpeculativeMetrics) -> float:
        """tokens/s ratio against a baseline run (e.g. draft=None)."""
        return self.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else 0.0

    # ------------------------------------------------------------ combining and serialising

    def merge(self, other: SpeculativeMetrics) -> SpeculativeMetrics:
        """Sum of two runs' counters and clocks (wall times add: sequential runs)."""
        summed = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                summed[f.name] = list(mine)
                _add_into(summed[f.name], theirs)
            else:
                summed[f.name] = mine + theirs
        return SpeculativeMetrics(**summed)

    __add__ = merge

    def to_dict(self) -> dict:
        """Counters, clocks and derived rates: one JSON object with stable keys."""
        data = {f.name: list(v) if isinstance(v := getattr(self, f.name), list) else v for f in fields(self)}
        return data | {name: getattr(self, name) for name in DERIVED}

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeMetrics:
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


class Stopwatch:
    """Adds elapsed clock time to a metrics field. The clock is injectable for tests."""

    def __init__(self, metrics: SpeculativeMetrics, clock: Clock = time.perf_counter):
        self.metrics = metrics
        self.clock = clock

    @contextmanager
    def time(self, field_name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            setattr(self.metrics, field_name, getattr(self.metrics, field_name) + self.clock() - start)
