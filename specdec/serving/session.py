"""Continuous batching: a queue of requests around the engine (specdec.engine.decoder). Requests join its rows
at a round boundary and leave them the moment they finish; every round drafts, verifies and commits for
all of them at once, through the same rounds as `generate()` (draft trees and copy drafts included where
the drafter, the target and this host's costs allow them).

Words:
- session: one loaded target and drafter shared by every request; `run` is its loop (one thread).
- request: what a client asked for: its prompt, its own options (a SpecConfig) and where its tokens go.
  While it decodes it is one of the engine's rows.
- admit: a queued request joins before the next round: its KV rows are added empty, and its prompt
  is fed with the rounds' forwards beside the other rows' pending tokens and drafts, PREFILL_CHUNK tokens
  a round (chunked prefill: a long prompt never stalls the running streams for its whole prefill).
- leave: a finished, stopped or cancelled request's row is dropped from both models before the next round.

Exact as `SpeculativeDecoder.generate` alone: a greedy request's tokens are its greedy tokens (float32),
and every request is verified by race sampling keyed on its own seed (a random one when none is given),
so a seeded request gets the same tokens whatever else is in the batch, with or without a draft.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.config import SpecConfig, check_request
from specdec.engine.decoder import Decoder, Row, draft_settings, plan_for
from specdec.metrics import SpeculativeMetrics, Stopwatch
from specdec.rows import check_budget_fits, sampling_key
from specdec.text import StopStrings
from specdec.tuning.costs import MeasuredCosts
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.race import Race

MAX_DRAFT = 10  # the longest chain `auto` drafts
PREFILL_CHUNK = 128  # a joining prompt's tokens per round: running rows wait one such forward, not the whole prefill


@dataclass(frozen=True)
class DraftChoices:
    """What a serving batch drafts (`specdec serve -k / --draft-width / --prompt-lookup`): each as
    generate() takes it, "auto" or a fixed value, the same for every request of the batch."""

    num_draft_tokens: int | str = "auto"
    draft_width: int | str = "auto"
    prompt_lookup: bool | str = "auto"

    def __post_init__(self):  # refused at start, as generate() refuses them, not at each request
        check_request(max_new_tokens=1, num_draft_tokens=self.num_draft_tokens, stop=None, stream=None, seed=None,
                      temperature=None, top_k=None, top_p=None, do_sample=None, draft_width=self.draft_width,
                      prompt_lookup=self.prompt_lookup)  # fmt: skip


class QueueFull(RuntimeError):
    """The session's queue holds max_queue requests already."""


@dataclass(eq=False)
class Request:
    """One request: what it asked for, what it got so far, and how it ended."""

    prompt: list[int]
    config: SpecConfig
    seed: int
    on_tokens: Callable[[list[int], list | None, list], None] | None = None  # each round's tokens, logprobs, kinds
    tokens: list[int] = field(default_factory=list)
    metrics: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled" or "error"
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0
    warping: object = None  # its Warping, shared with the batch's requests of the same settings (sampling_key)
    key: tuple = ()
    solo: bool = False  # its batch failed: it runs its next round alone, to tell whose failure it was
    resume: list[int] | None = None  # prompt and committed tokens, where a failed batch put it back in the queue
    row: Row | None = None  # its row of the engine while it decodes
    drafts: bool = True  # False: its row drafts nothing
    clocks: tuple = ()  # the session's draft and target seconds when it joined: its time split is the batch's since

    def cancel(self) -> None:
        """Leave the batch before its next round (a client that went away)."""
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def committed(self, number: int, tokens: list[int]) -> None:
        """Its row's on_commit: keep the tokens and hand them on, with their TokenLogprobs (where asked for)
        and their kinds."""
        self.tokens.extend(tokens)
        if self.on_tokens is not None:
            entries = self.row.token_logprobs[-len(tokens) :] if self.row.logprobs is not None else None
            self.on_tokens(tokens, entries, self.row.token_kinds[-len(tokens) :])


class Session:
    """Requests decoded together by one SpeculativeDecoder's models, as rows of one engine; requests
    join and leave at round boundaries. `submit` from any thread; `run` (or `step`) in one thread."""

    def __init__(
        self,
        decoder,
        max_batch: int = 8,
        max_queue: int = 64,
        clock=time.perf_counter,
        drafting: DraftChoices | None = None,
    ):
        """drafting: the batch's draft length, width and copy drafts, as generate() takes them (all "auto":
        chosen each round from this host's measured costs and the acceptance so far)."""
        target, drafter = decoder.target, decoder.drafter
        drafting = drafting or DraftChoices()
        if not (target.can_select_rows and drafter.can_select_rows):
            raise ValueError(
                "continuous batching needs rows that can join and leave: the dynamic cache (cache='dynamic', "
                f"no compile) and a drafter that can drop rows (not {drafter.name})"
            )
        self.decoder, self.max_batch, self.max_queue, self.clock = decoder, max_batch, max_queue, clock
        self.queue: deque[Request] = deque()
        self.wake = threading.Condition()
        self.requests: list[Request] = []  # the engine's rows, in its order
        self.metrics = SpeculativeMetrics()  # every request the session ran
        self.costs = {}  # batch bucket -> calibrated costs (measured when the session starts)
        self.clocks: dict[int, MeasuredCosts] = {}  # batch bucket -> those costs, corrected by the rounds' clocks
        k = drafting.num_draft_tokens if drafter.drafts else 0
        self.policy = DraftLengthPolicy(k=None if k == "auto" else k, max_k=MAX_DRAFT if k == "auto" else max(k, 1))
        self.eos = decoder._resolve_sampling(SpecConfig.of())[1]  # the model's: every row of a batch ends on it
        # Race verification (a request's tokens are the same in any batch); the rounds are priced by the
        # batch's measured costs wherever it drafts (calibrated when the session starts).
        plan = plan_for(target, drafter, self.policy, greedy=False, eos_ids=self.eos, verification="race",
                        draft_width=drafting.draft_width, read_ahead=False, prompt_lookup=drafting.prompt_lookup,
                        priced=k != 0, prefill_chunk=PREFILL_CHUNK)  # fmt: skip
        self.engine = Decoder(target, drafter, plan, Stopwatch(self.metrics, clock))
        self.started, self.drafted_last = False, False

    # ------------------------------------------------------------ requests

    def submit(self, prompt: list[int], config: SpecConfig, on_tokens=None, drafts: bool = True) -> Request:
        """Queue a request (token ids and its options); it joins at the next round boundary. drafts: False,
        its row drafts nothing (the target alone, in the same rounds)."""
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
        request = Request(list(prompt), config, seed, on_tokens, warping=warping, key=sampling_key(config))
        request.drafts = drafts
        with self.wake:
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} requests already; retry later")
            self.queue.append(request)
            self.wake.notify()
        return request

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Rounds until `stop` is set; waits for requests while none is queued or running. Holds the
        decoder for its whole life (generate() calls on it wait)."""
        with self.decoder._exclusive():
            self.restart()
            while not stop.is_set():
                if not self.step():
                    with self.wake:
                        if not self.queue:
                            self.wake.wait(idle_wait)
            for request in [*self.requests, *self.queue]:  # what was left when asked to stop: cancelled
                self._finish(request, "cancelled")
            self.requests, self.queue = [], deque()

    def restart(self) -> None:
        """Empty models (after the decoder served other calls, or a failed round); no request may be running."""
        assert not self.requests, "restart drops the rows of running requests"
        self.engine.start([])

    def step(self) -> bool:
        """Drop the rows that ended, admit queued requests, run one round. False when there was nothing to do."""
        if not self.started:
            self._start()
        self._leave()
        joined = self._admit()
        if not self.requests:
            return False
        self._price()
        before = self._clocks()
        try:
            self.engine.round()
        except Exception as error:  # noqa: BLE001 - the failing request gets the cause, the session goes on
            self._failed(error)
            return True
        for request in self.requests:
            request.solo = False
        if not (joined or self.engine.prefilled):  # a round that fed prompts is not a decoding round's cost
            self._time_round(before, self.drafted_last)
        self.drafted_last = self.metrics.draft_forwards > before[2]
        return True

    def _bucket(self, rows: int | None = None) -> int:
        """The batch size whose costs price a batch of `rows` rows (the running batch's by default)."""
        rows = len(self.requests) if rows is None else rows
        return min(1 << (rows - 1).bit_length(), self.max_batch)

    def _price(self) -> None:
        """This round's policy, priced by this batch size's clocks (auto k is batch-aware: dearer verifies
        draft less); the drafter's own stop and siblings read the same costs. One round in `alone_every`
        drafts nothing, to time the target alone."""
        clock = self.clocks.get(self._bucket())
        self.policy.costs = None if clock is None else clock.costs()
        self.policy.alone = clock is not None and clock.alone_due and self.policy.k is None  # a fixed k every round
        self.engine.drafter.configure(draft_settings(self.policy, self.engine.plan.width))

    def _clocks(self) -> tuple[float, float, int]:
        m = self.metrics
        return m.draft_time_s, m.target_time_s, m.draft_forwards

    def _time_round(self, before: tuple[float, float, int], drafted_last: bool) -> None:
        """The round's seconds into its bucket's measured costs: auto k then prices rounds by what this
        batch really costs (exact: race verification and greedy give the same tokens for any k).
        drafted_last: the round before ran the draft (else this round also fed it the catch-up, and its
        draft time is not a draft step's)."""
        clock = self.clocks.get(self._bucket())
        if clock is None:
            return
        draft_s, target_s, draft_steps = (now - then for now, then in zip(self._clocks(), before))
        clock.observe(self.engine.scored_width, target_s, draft_steps if drafted_last else 0, draft_s)

    def _failed(self, error: Exception) -> None:
        """A round failed (non-finite logits, ...). Alone, the request gets the error; in a batch, every one
        goes back to the front of the queue with what it committed so far (the failed round committed
        nothing) and reruns one round alone, so only the request that fails alone gets the error."""
        requests = self.requests
        self.requests = []
        self.restart()
        if len(requests) == 1:
            requests[0].error = error
            self._finish(requests[0], "error")
            return
        with self.wake:
            for request in reversed(requests):
                request.solo, request.resume = True, request.row.sequence
                self.queue.appendleft(request)

    def _start(self) -> None:
        """Measure (or read) this host's costs at each batch size the session can reach."""
        if self.policy.k != 0:
            sizes = sorted({self._bucket(n) for n in range(1, self.max_batch + 1)})
            self.costs = {size: self.decoder.calibration(size) for size in sizes}
            self.clocks = {size: MeasuredCosts(costs) for size, costs in self.costs.items()}
        self.restart()  # calibration ran forwards through the models
        self.started = True

    def _admit(self) -> bool:
        """Queued requests into the engine's rows, while it has room; True where any joined."""
        with self.wake:
            joining = []
            while self.queue and len(self.requests) + len(joining) < self.max_batch:
                if any(request.solo for request in [*self.requests, *joining]):
                    break  # a request on its round alone
                if self.queue[0].solo and (self.requests or joining):
                    break  # it waits for an empty batch
                joining.append(self.queue.popleft())
        if not joining:
            return False
        for request in joining:
            request.started = request.started or self.clock()
            request.clocks = request.clocks or self._clocks()
            # one Warping per setting: requests of equal settings share it
            known = (r.warping for r in self.requests if r.key == request.key)
            request.warping = next(known, request.warping)
            request.row = self._row(request)
            self.requests.append(request)
        self.engine.add_rows([request.row for request in joining])
        return True

    def _row(self, request: Request) -> Row:
        """A request's row: its prompt (and what it committed before a failed round), its race keyed as alone."""
        race = Race.for_prompts(0, [request.prompt], self.decoder.target.vocab_size, [request.seed])
        config = request.config
        stop = StopStrings(config.stops, self.decoder.tokenizer) if config.stops else None
        row = Row(request.prompt, config.max_new_tokens, request.warping, int(race.row_keys[0]),
                  int(race.row_seeds[0]) if race.row_seeds is not None else race.seed, stop, request.committed,
                  metrics=request.metrics, logprobs=config.logprobs, drafts=request.drafts)  # fmt: skip
        if request.resume is not None:  # a rerun keeps its committed tokens (and their logprobs)
            row.sequence = list(request.resume)
            row.token_logprobs, row.token_kinds = list(request.row.token_logprobs), list(request.row.token_kinds)
        return row

    def _leave(self) -> None:
        keep = [i for i, r in enumerate(self.requests) if not (r.row.finished or r.cancelled)]
        if len(keep) == len(self.requests):
            return
        for i, request in enumerate(self.requests):
            if i not in keep:
                cancelled = request.cancelled and not request.row.finished
                self._finish(request, "cancelled" if cancelled else self._reason(request.row))
        self.requests = [self.requests[i] for i in keep]
        self.engine.drop_rows(keep)

    def _reason(self, row: Row) -> str:
        new = row.new_tokens
        return "length" if len(new) >= row.max_new_tokens and new[-1] not in self.eos else "stop"

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.metrics.wall_time_s = self.clock() - request.started if request.started else 0.0
        if request.clocks:  # the batch's draft and target seconds while it ran (shared with the other rows)
            (draft_s, target_s, _), (draft_then, target_then, _) = self._clocks(), request.clocks
            request.metrics.draft_time_s, request.metrics.target_time_s = draft_s - draft_then, target_s - target_then
        self.metrics.add_counts([request.metrics])  # the session's token counts: the sum of its requests'
        request.done.set()
