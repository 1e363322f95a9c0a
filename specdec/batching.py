"""Continuous batching with speculation: requests join a running batch at a round boundary and leave
it the moment they finish, while every round drafts, verifies and commits for all of them at once.

Words:
- session: one loaded target and drafter shared by every request; `run` is its loop (one thread).
- row: one request in the batch: its prompt, its own options (a SpecConfig) and where its tokens go.
- admit: a queued request joins before the next round: its KV rows are added empty, and its prompt
  is fed with that round's forward beside the other rows' pending tokens and drafts.
- leave: a finished, stopped or cancelled row is dropped from both models before the next round.

Exact as `SpeculativeDecoder.generate` alone: a greedy row's tokens are its greedy tokens (float32),
and every row is verified by race sampling keyed on its own seed (a random one when none is given),
so a seeded request gets the same tokens whatever else is in the batch, with or without a draft.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.adapters import HFCausalLM
from specdec.adapters.static import StaticHFCausalLM
from specdec.costs import MeasuredCosts
from specdec.decoder import Batch, Decoder, draft_settings
from specdec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from specdec.inputs import SpecConfig
from specdec.metrics import SpeculativeMetrics, Stopwatch
from specdec.policy import DraftLengthPolicy
from specdec.race import Race
from specdec.rows import check_budget_fits, sampling_key
from specdec.sampling import row_warping
from specdec.text import StopStrings

MAX_DRAFT = 10  # the longest chain `auto` drafts


class QueueFull(RuntimeError):
    """The session's queue holds max_queue requests already."""


@dataclass(eq=False)
class Row:
    """One request: what it asked for, what it got so far, and how it ended."""

    prompt: list[int]
    config: SpecConfig
    seed: int
    on_tokens: Callable[[list[int]], None] | None = None  # called with each round's new tokens
    tokens: list[int] = field(default_factory=list)
    metrics: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled" or "error"
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0
    warping: object = None  # its Warping, shared with the batch's rows of the same settings (sampling_key)
    key: tuple = ()
    solo: bool = False  # its batch failed: it runs its next round alone, to tell whose failure it was
    resume: list[int] | None = None  # prompt and committed tokens, where a failed batch put it back in the queue

    def cancel(self) -> None:
        """Leave the batch before its next round (a client that went away)."""
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


class Session:
    """Rows of many requests decoded together by one SpeculativeDecoder's models; requests join and
    leave at round boundaries. `submit` from any thread; `run` (or `step`) in one thread."""

    def __init__(self, decoder, max_batch: int = 8, max_queue: int = 64, clock=time.perf_counter):
        target, drafter = decoder.target, decoder.drafter
        if type(target) is not HFCausalLM or isinstance(target, StaticHFCausalLM):
            raise ValueError("continuous batching needs the dynamic cache (cache='dynamic', no compile)")
        if not isinstance(drafter, (ModelDrafter, NgramDrafter, NoDrafter)):
            raise ValueError(f"continuous batching needs a draft model, 'ngram' or none; not {type(drafter).__name__}")
        if isinstance(drafter, ModelDrafter) and type(drafter.adapter) is not HFCausalLM:
            raise ValueError("continuous batching needs the draft on the dynamic cache (cache='dynamic', no compile)")
        self.decoder, self.max_batch, self.max_queue, self.clock = decoder, max_batch, max_queue, clock
        self.queue: deque[Row] = deque()
        self.wake = threading.Condition()
        self.rows: list[Row] = []
        self.batch = Batch([], [], [], [])
        self.metrics = SpeculativeMetrics()  # every row the session ran
        self.costs = {}  # batch bucket -> calibrated costs (measured when the session starts)
        self.clocks: dict[int, MeasuredCosts] = {}  # batch bucket -> those costs, corrected by the rounds' clocks
        self.policy = DraftLengthPolicy(k=0 if isinstance(drafter, NoDrafter) else None, max_k=MAX_DRAFT)
        self.alone = DraftLengthPolicy(k=0)  # a round that drafts nothing: the target alone, timed in this batch
        self.round_policy = self.policy  # the last round's
        self.steps = 0
        self.started = False
        self.eos = decoder._resolve_sampling(SpecConfig.of())[1]  # the model's: every row of a batch ends on it

    # ------------------------------------------------------------ requests

    def submit(self, prompt: list[int], config: SpecConfig, on_tokens=None) -> Row:
        """Queue a request (token ids and its options); it joins at the next round boundary."""
        check_budget_fits([prompt], config.max_new_tokens, [self.decoder.target, self.decoder.drafter])
        if config.stops and self.decoder.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        warping, eos, _ = self.decoder._resolve_sampling(config)  # against the target's generation config, now
        if eos != self.eos:
            raise ValueError(
                f"a request's EOS ids {sorted(eos)} differ from the model's {sorted(self.eos)}: the rows of a shared "
                "batch end on the same EOS (leave eos_token_id unset)"
            )
        seed = config.seed if config.seed is not None else secrets.randbits(62)
        row = Row(list(prompt), config, seed, on_tokens, warping=warping, key=sampling_key(config))
        with self.wake:
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} requests already; retry later")
            self.queue.append(row)
            self.wake.notify()
        return row

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Rounds until `stop` is set; waits for requests while none is queued or running. Holds the
        decoder for its whole life (generate() calls on it wait)."""
        with self.decoder._exclusive():
            while not stop.is_set():
                if not self.step():
                    with self.wake:
                        if not self.queue:
                            self.wake.wait(idle_wait)
            for row in [*self.rows, *self.queue]:  # what was left when asked to stop: cancelled
                self._finish(row, "cancelled")
            self.rows, self.queue = [], deque()

    def step(self) -> bool:
        """Drop the rows that ended, admit queued ones, run one round. False when there was nothing to do."""
        if not self.started:
            self._start()
        self._leave()
        joined = self._admit()
        if not self.rows:
            return False
        before, last_width = self._clocks(), self.round_policy.last_width
        try:
            self.steps = self._decoder().round(self.batch, self.steps)
        except Exception as error:  # noqa: BLE001 - the failing row gets the cause, the session goes on
            self._failed(error)
            return True
        for row in self.rows:
            row.solo = False
        if not joined:  # a round that fed prompts is not a decoding round's cost
            self._time_round(before, last_width)
        return True

    def _bucket(self, rows: int | None = None) -> int:
        """The batch size whose costs price a batch of `rows` rows (the running batch's by default)."""
        rows = len(self.rows) if rows is None else rows
        return min(1 << (rows - 1).bit_length(), self.max_batch)

    def _clocks(self) -> tuple[float, float, int]:
        m = self.metrics
        return m.draft_time_s, m.target_time_s, m.draft_forwards

    def _time_round(self, before: tuple[float, float, int], last_width: int) -> None:
        """The round's seconds into its bucket's measured costs: auto k then prices rounds by what this
        batch really costs (exact: race verification and greedy give the same tokens for any k).
        last_width: the round before's verify width (1: the draft drafted nothing, so this round also
        fed it the catch-up, and its draft time is not a draft step's)."""
        clock = self.clocks.get(self._bucket())
        if clock is None:
            return
        draft_s, target_s, draft_steps = (now - then for now, then in zip(self._clocks(), before))
        clock.observe(self.round_policy.last_width, target_s, 0 if last_width == 1 else draft_steps, draft_s)

    def _failed(self, error: Exception) -> None:
        """A round failed (non-finite logits, ...). Alone, the row gets the error; in a batch, every row
        goes back to the front of the queue with what it committed so far (the failed round committed
        nothing) and reruns one round alone, so only the row that fails alone gets the error."""
        rows, batch = self.rows, self.batch
        self.rows, self.batch = [], Batch([], [], [], [])
        self._reset_models()
        if len(rows) == 1:
            rows[0].error = error
            self._finish(rows[0], "error")
            return
        with self.wake:
            for i in reversed(range(len(rows))):
                rows[i].solo = True
                rows[i].resume = batch.sequences[i]
                self.queue.appendleft(rows[i])

    def _start(self) -> None:
        """Measure (or read) this host's costs at each batch size the session can reach, then empty caches."""
        if self.policy.k != 0:
            sizes = sorted({self._bucket(n) for n in range(1, self.max_batch + 1)})
            self.costs = {size: self.decoder.calibration(size) for size in sizes}
            self.clocks = {size: MeasuredCosts(costs) for size, costs in self.costs.items()}
        self._reset_models()
        self.started = True

    def _reset_models(self) -> None:
        self.decoder.target.reset(0)
        self.decoder.drafter.reset(0)

    def _admit(self) -> bool:
        """Queued rows into the batch, while it has room; True where any joined."""
        with self.wake:
            joining = []
            while self.queue and len(self.rows) + len(joining) < self.max_batch:
                if any(row.solo for row in [*self.rows, *joining]):
                    break  # a row on its round alone
                if self.queue[0].solo and (self.rows or joining):
                    break  # it waits for an empty batch
                joining.append(self.queue.popleft())
        if not joining:
            return False
        self.decoder.target.add_rows(len(joining))
        self.decoder.drafter.add_rows(len(joining))
        for row in joining:
            row.started = row.started or self.clock()
            self.rows.append(row)
            row.warping = next((other.warping for other in self.rows if other.key == row.key), row.warping)
            self.batch.sequences.append(list(row.resume or row.prompt))  # a rerun keeps its committed tokens
            self.batch.prompt_lengths.append(len(row.prompt))
            self.batch.max_new_tokens.append(row.config.max_new_tokens)
            self.batch.finished.append(False)
        return True

    def _leave(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if not (self.batch.finished[i] or row.cancelled)]
        if len(keep) == len(self.rows):
            return
        for i, row in enumerate(self.rows):
            if i not in keep:
                self._finish(row, "cancelled" if row.cancelled and not self.batch.finished[i] else self._reason(i))
        index = torch.tensor(keep, dtype=torch.long)
        self.decoder.target.select_rows(index)
        self.decoder.drafter.select_rows(index)
        self.rows = [self.rows[i] for i in keep]
        b = self.batch
        self.batch = Batch(
            [b.sequences[i] for i in keep],
            [b.prompt_lengths[i] for i in keep],
            [b.max_new_tokens[i] for i in keep],
            [False] * len(keep),
        )

    def _reason(self, i: int) -> str:
        new = self.batch.new_tokens(i)
        return "length" if len(new) >= self.batch.max_new_tokens[i] and new[-1] not in self.eos else "stop"

    def _finish(self, row: Row, reason: str) -> None:
        row.finish_reason = reason
        row.metrics.wall_time_s = self.clock() - row.started if row.started else 0.0
        row.done.set()

    def _decoder(self) -> Decoder:
        """This round's Decoder over the rows now in the batch."""
        rows = self.rows
        clock = self.clocks.get(self._bucket())  # auto k is batch-aware: dearer verifies draft less
        self.policy.costs = None if clock is None else clock.costs()
        self.round_policy = self.alone if clock is not None and clock.alone_due else self.policy
        # Chains (rows join and leave between rounds; a tree's siblings would not), and the drafter's own stop
        # priced by this batch's costs too: past k it drafts on while a draft pays at these verify widths.
        self.decoder.drafter.configure(draft_settings(self.policy, width=1))
        stops = [StopStrings(row.config.stops, self.decoder.tokenizer) if row.config.stops else None for row in rows]

        def stop(i, *rest):
            return None if stops[i] is None else stops[i](i, *rest)

        def on_commit(i: int, tokens: list[int]) -> None:
            rows[i].tokens.extend(tokens)
            if rows[i].on_tokens is not None:
                rows[i].on_tokens(tokens)

        prompts = [row.prompt for row in rows]
        race = Race.for_prompts(0, prompts, self.decoder.target.vocab_size, [row.seed for row in rows])
        return Decoder(
            target=self.decoder.target,
            drafter=self.decoder.drafter,
            warping=row_warping([row.warping for row in rows]).for_prompts(self.batch.prompt_lengths),
            policy=self.round_policy,
            watch=Stopwatch(self.metrics, self.clock),
            row_metrics=[row.metrics for row in rows],
            eos_ids=self.eos,
            stop=stop if any(stops) else None,
            on_commit=on_commit,
            verification="race",
            race=race,
        )
