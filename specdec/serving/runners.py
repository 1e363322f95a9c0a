"""The worker side of `specdec serve` (specdec.serving.server): jobs, their events, the queue and the worker thread.

Words (as in specdec.serving.server):
- job: one admitted completion request: its prompt's token ids and its checked settings (`Completion`).
- worker: the one thread that runs jobs through the decoder. With continuous batching (BatchRunner, the
  default where the pair allows it) every admitted job decodes in one speculative batch
  (specdec.serving.session.Session), joining at a round boundary and leaving when it ends; otherwise (Runner,
  max_batch=1 or a pair the session cannot hold) jobs run one at a time, in arrival order.
- queue depth: jobs admitted and waiting for the worker (the running job is not counted); past
  `max_queue` a request gets 429. Running batch size: jobs decoding now.
- event: what a job's run hands its request, in order: "started" (the first tokens committed), "delta"
  (newly final text), then one of "done" (the GenerationResult), "error" (the exception) or "cancelled".
- cancel: a closed job stream; the run stops at its next commit (within one round), or the job leaves
  the queue if it has not started.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.api import GenerationResult
from specdec.config import SpecConfig
from specdec.metrics import SpeculativeMetrics
from specdec.serving.openai_schema import APIError
from specdec.text import DeltaQueue, StreamClosed

logger = logging.getLogger("specdec.serving.server")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/health", "/metrics", "/")


# ------------------------------------------------------------------ a job and its text


@dataclass(frozen=True)
class Completion:
    """One request, checked and resolved once: what the worker passes to `decoder.generate`."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    stops: list[str]
    eos_ids: frozenset[int]
    logprobs: int | None = None  # each token's TokenLogprob with this many alternatives (None: none)
    kinds: bool = False  # each token's kind and round in the reply (the request's opt-in `specdec_tokens`)
    drafts: bool = True  # False: the request drafts nothing (`specdec_draft: false`; the batch only)
    echo: bool = False  # the reply starts with the prompt; with logprobs, the worker scores its tokens first
    structured: dict = field(default_factory=dict)  # structured output as generate()'s options ({}: none)
    grammar: object = None  # its CompiledConstraint (specdec.verify.grammar), which says whether a reply is whole


class JobStream(DeltaQueue):
    """The run's stream callback: posts the first commit ("started") and each delta to the request.
    Inherits the closing: once `closed` is set, the run raises StreamClosed at its next commit."""

    def __init__(self, post: Callable[[str, object], None]):
        super().__init__()
        self.post, self.started = post, False

    def check(self) -> None:  # called at every commit
        super().check()
        if not self.started:
            self.started = True
            self.post("started", None)

    def __call__(self, text: str) -> None:
        self.check()
        self.post("delta", text)


@dataclass(eq=False)  # a job is itself, not its fields: the queue finds and removes it by identity
class Job:
    completion: Completion
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    metrics: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)  # filled as rounds complete
    prompt_logprobs: list | None = None  # echo with logprobs: each prompt token's TokenLogprob (None first)

    def __post_init__(self):
        self.stream = JobStream(self.post)

    def post(self, kind: str, value) -> None:
        """From any thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (shutdown): nobody is waiting
            pass


# ------------------------------------------------------------------ counters


RECENT_RUNS = 16  # the job ends whose spacing prices Retry-After


@dataclass
class BusyTime:
    """Wall time while at least one job decodes: the jobs of a batch share their rounds, so their own
    wall times overlap and their sum is not the server's time (8 rows over 4.7 s are 4.7 busy seconds)."""

    clock: Callable[[], float] = time.monotonic
    total: float = 0.0
    since: float | None = None  # when the current busy stretch began; None while idle

    def set(self, busy: bool) -> None:
        if busy and self.since is None:
            self.since = self.clock()
        elif not busy and self.since is not None:
            self.total += self.clock() - self.since
            self.since = None

    @property
    def seconds(self) -> float:
        return self.total + (0.0 if self.since is None else self.clock() - self.since)


@dataclass
class ServerMetrics:
    """Counters since start; rates are derived (specdec.metrics' rule). `decoding` sums every run's
    counters (its clocks overlap under batching and are not read); `busy` is the server's time."""

    responses: Counter = field(default_factory=Counter)  # (path, status) -> count, once per request
    prompt_tokens: int = 0
    runs: int = 0  # jobs the worker ran (to their end, cancelled or failed)
    cancelled: int = 0  # jobs whose client left (queued or running) or that shutdown dropped
    failed: int = 0  # runs that raised
    decoding: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)
    busy: BusyTime = field(default_factory=BusyTime)
    ends: deque = field(default_factory=lambda: deque(maxlen=RECENT_RUNS))  # busy seconds at the last jobs' ends

    @property
    def seconds_per_run(self) -> float:
        """Busy seconds between two jobs' ends, over the last RECENT_RUNS: the pace now (a full batch ends
        jobs 8x as often as one client did), not the average since start. Before two ends: busy / runs."""
        later = sum(end > self.ends[0] for end in self.ends)  # jobs that end together share one interval
        if later:
            return (self.ends[-1] - self.ends[0]) / later
        return self.busy.seconds / self.runs if self.runs else 1.0

    @property
    def tokens_per_second(self) -> float:
        seconds = self.busy.seconds
        return self.decoding.generated_tokens / seconds if seconds > 0 else 0.0


def prometheus_text(m: ServerMetrics, waiting: int, running: int) -> str:
    """The counters in Prometheus' text format, written by prometheus-client from one snapshot."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    d = m.decoding
    counters = [
        ("requests_cancelled", "Requests whose client left, or dropped at shutdown", m.cancelled),
        ("requests_failed", "Runs that raised (answered 500)", m.failed),
        ("prompt_tokens", "Prompt tokens of the runs", m.prompt_tokens),
        ("generation_tokens", "Tokens generated", d.generated_tokens),
        ("drafted_tokens", "Draft tokens proposed", d.drafted_tokens),
        ("accepted_tokens", "Draft tokens accepted", d.accepted_tokens),
        ("forced_tokens", "Draft tokens a structured output's grammar forced, drafted free", d.forced_tokens),
        ("rounds", "Speculative rounds (draft, verify, commit)", d.rounds),
        ("generation_seconds", "Wall time while at least one request decodes", m.busy.seconds),
    ]
    gauges = [
        ("acceptance_rate", "Accepted / drafted tokens, all runs", d.acceptance_rate),
        ("mean_acceptance_length", "Tokens committed per round, all runs", d.mean_acceptance_length),
        ("tokens_per_second", "Generated tokens per busy second (all requests)", m.tokens_per_second),
        ("queue_depth", "Requests waiting for the worker", waiting),
        ("running_batch_size", "Requests decoding now", running),
    ]

    positions = [  # by draft position (1: a round's first draft), all runs
        ("drafted_per_position", "Rounds that drafted at this position", list(d.drafted_per_position)),
        ("accepted_per_position", "Rounds whose draft at this position was accepted", list(d.accepted_per_position)),
    ]

    class Snapshot:  # a collector over the values read above, under the runner's lock
        def collect(self):
            responses = CounterMetricFamily(
                "specdec_requests", "HTTP responses by path and status", labels=("path", "code")
            )
            for (path, status), count in sorted(m.responses.items()):
                responses.add_metric((path, str(status)), count)
            yield responses
            for name, text, value in counters:
                yield CounterMetricFamily(f"specdec_{name}", text, value=value)
            for name, text, value in gauges:
                yield GaugeMetricFamily(f"specdec_{name}", text, value=value)
            for name, text, values in positions:
                family = CounterMetricFamily(f"specdec_{name}", text, labels=("position",))
                for position, count in enumerate(values, 1):
                    family.add_metric((str(position),), count)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry).decode()


# ------------------------------------------------------------------ the worker


class Runner:
    """The queue and the worker thread: jobs run through the decoder one at a time, in arrival order."""

    def __init__(self, decoder, max_queue: int, clock: Callable[[], float] = time.monotonic, drafting=None):
        """drafting: a specdec.serving.session.DraftChoices, what every run drafts (None: all auto)."""
        self.decoder, self.max_queue = decoder, max_queue
        self.drafting = drafting
        self.metrics = ServerMetrics(busy=BusyTime(clock))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._accepting, self._closed = True, False
        self._thread = threading.Thread(target=self._work, name="specdec-serve-worker", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return self._depth()

    def prometheus(self) -> str:
        with self._cond:  # one consistent snapshot
            return prometheus_text(self.metrics, *self._depth())

    def _depth(self) -> tuple[int, int]:
        """(waiting, running) jobs; call with the lock held."""
        return len(self._waiting), len(self._running_jobs())

    def _running_jobs(self) -> list[Job]:
        """The jobs decoding now; call with the lock held."""
        return [] if self._running is None else [self._running]

    def count(self, path: str, status: int) -> None:
        path = "/v1/models/{id}" if path.startswith("/v1/models/") else path  # one label for every model id
        if path in ENDPOINTS:  # not every path a client tries: the label set stays bounded
            with self._cond:
                self.metrics.responses[path, status] += 1

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self._accepting:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) >= self.max_queue:  # retry once the jobs ahead should have ended
                retry = max(1, math.ceil(self.metrics.seconds_per_run * (self._depth()[0] + 1)))
                raise APIError(
                    429,
                    f"the queue is full ({self.max_queue} requests waiting); retry in {retry} s",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                )
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client has gone: a running job stops at its next commit, a waiting one leaves the queue."""
        job.stream.closed.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.cancelled += 1

    def drain(self) -> None:
        """Stop admitting (new requests get 503). Every accepted job, running or waiting for room, goes on:
        behind a process manager a SIGTERM is a restart, and an accepted request is owed its answer."""
        with self._cond:
            self._accepting = False

    def end_streams(self) -> None:
        """Shutdown's deadline: every job still waiting or running is answered with a 503 (a stream gets it
        as its last event, then [DONE]); the running ones stop at their next commit."""
        with self._cond:
            dropped = list(self._waiting)
            self._waiting.clear()
            self.metrics.cancelled += len(dropped)
            running = self._running_jobs()
        for job in dropped:
            job.post("error", APIError(503, "the server shut down before this request ran", code="shutting_down"))
        for job in running:
            job.post("error", APIError(503, "the server shut down before this request finished", code="shutting_down"))
            job.stream.closed.set()

    def close(self, timeout: float) -> None:
        """Stop admitting, answer every job left with a 503, and wait (bounded) for the worker."""
        self.drain()
        self.end_streams()
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
                self.metrics.busy.set(True)
            kind, value = self._run(job)
            with self._cond:
                self._running = None
                self.metrics.busy.set(False)
            self._end(job, kind, value)

    def _end(self, job: Job, kind: str, value) -> None:
        """Count a job's end and answer its request."""
        with self._cond:
            m = self.metrics
            m.runs += 1
            m.ends.append(m.busy.seconds)
            m.prompt_tokens += len(job.completion.prompt_ids)
            m.decoding = m.decoding + job.metrics
            m.cancelled += kind == "cancelled"
            m.failed += kind == "error"
        job.post(kind, value)

    def _run(self, job: Job) -> tuple[str, object]:
        c = job.completion
        if job.stream.closed.is_set():  # cancelled between leaving the queue and starting
            return "cancelled", None
        try:
            score_prompt(self.decoder, job)
            result = self.decoder.generate(
                c.prompt_ids,
                max_new_tokens=c.max_tokens,
                temperature=c.temperature,
                top_p=c.top_p,
                seed=c.seed,
                stop=c.stops or None,
                stream=job.stream,
                metrics=job.metrics,
                logprobs=c.logprobs,
                **c.structured,
                **({} if self.drafting is None else vars(self.drafting)),
            )
        except StreamClosed:
            return "cancelled", None
        except Exception as error:  # this request's failure, not the server's: answered 500, the worker goes on
            logger.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
            return "error", error
        return "done", result


def score_prompt(decoder, job: Job) -> None:
    """echo with logprobs: the prompt's tokens scored by the target, before the job decodes."""
    c = job.completion
    if c.echo and c.logprobs is not None:
        job.prompt_logprobs = decoder.prompt_logprobs(c.prompt_ids, c.logprobs)


class BatchRunner(Runner):
    """The queue and a worker thread that runs every admitted job in one speculative batch
    (specdec.serving.session.Session): a job joins at the next round boundary while others decode, and leaves
    the moment it ends. Each job is exact as generate() alone: greedy token for token, sampled by race
    verification keyed on its seed. The decoder is held while any job decodes, released when idle."""

    def __init__(
        self, decoder, max_queue: int, max_batch: int, clock: Callable[[], float] = time.monotonic, drafting=None
    ):
        super().__init__(decoder, max_queue, clock, drafting)
        from specdec.serving.session import Session

        self.session = Session(decoder, max_batch=max_batch, max_queue=max_batch, drafting=drafting)
        self._rows: dict = {}  # Job -> (its row, its streamer)
        self._joining: Job | None = None  # the job between the queue and the batch

    def _depth(self) -> tuple[int, int]:
        return len(self._waiting) + self.session.queued, self.session.running

    def _running_jobs(self) -> list[Job]:
        return list(self._rows) + ([] if self._joining is None else [self._joining])

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._rows and not self._closed:
                    self._cond.wait()
                if self._closed and not self._rows:
                    return
            with self.decoder._exclusive():  # held while jobs decode; other callers wait until idle
                self.session.restart()
                while self._rows or self._waiting:
                    self._admit()
                    for job, (row, _) in list(self._rows.items()):
                        if job.stream.closed.is_set():
                            row.cancel()
                    self.session.step()
                    self._collect()
                    if self._closed and not self._rows:
                        return

    def _admit(self) -> None:
        """Waiting jobs into the session, while it has room."""
        while True:
            with self._cond:
                room = self.session.max_batch - self.session.running - self.session.queued
                if room <= 0 or not self._waiting:
                    return
                job = self._waiting.popleft()
                self._joining = job  # neither waiting nor in the batch yet: shutdown's deadline still answers it
            try:
                self._join(job)
            finally:
                with self._cond:
                    self._joining = None

    def _join(self, job: Job) -> None:
        """One job into the session: its prompt scored where echo asks, its row submitted."""
        from specdec.text import DeltaStreamer

        c, streamer = job.completion, DeltaStreamer(self.decoder.tokenizer, job.stream)
        if job.stream.closed.is_set():  # its client left between the queue and the batch
            self._end(job, "cancelled", None)
            return
        try:
            score_prompt(self.decoder, job)
            config = SpecConfig.of(
                max_new_tokens=c.max_tokens,
                stop=c.stops or None,
                seed=c.seed,
                temperature=c.temperature,
                top_p=c.top_p,
                logprobs=c.logprobs,
                **c.structured,
            )
            row = self.session.submit(c.prompt_ids, config, self._forward_to(job, streamer), c.drafts)
        except Exception as error:  # noqa: BLE001 - this request's failure: answered, the others go on
            self._end(job, "error", error)
            return
        with self._cond:
            self._rows[job] = (row, streamer)
            self.metrics.busy.set(True)

    @staticmethod
    def _forward_to(job: Job, streamer):
        def on_tokens(tokens: list[int], entries: list | None, kinds: list) -> None:
            try:
                if entries is not None or job.completion.kinds:  # before their text: a delta then finds them
                    job.stream.check()  # (after "started")
                    job.post("tokens", (tokens, entries, kinds))
                streamer(0, tokens)
            except StreamClosed:  # the client has gone: the row leaves before the next round
                job.stream.closed.set()

        return on_tokens

    def _collect(self) -> None:
        """Answer the jobs whose rows ended this round."""
        for job, (row, streamer) in list(self._rows.items()):
            if not row.done.is_set():
                continue
            with self._cond:
                del self._rows[job]
                self.metrics.busy.set(bool(self._rows))
            job.metrics = row.metrics
            if row.finish_reason == "error":
                self._end(job, "error", row.error)
            elif row.finish_reason == "cancelled" or job.stream.closed.is_set():
                self._end(job, "cancelled", None)
            else:
                try:
                    streamer.end()  # the last word
                except StreamClosed:
                    pass
                text = self.decoder.tokenizer.decode(row.tokens, skip_special_tokens=True)
                result = GenerationResult(row.tokens, text, row.metrics, row.prompt, self.session.metrics)
                result.logprobs = list(row.row.token_logprobs) if row.row.logprobs is not None else None
                result.kinds = list(row.row.token_kinds)
                self._end(job, "done", result)

    def _end(self, job: Job, kind: str, value) -> None:
        if kind == "error":
            logger.error("a request failed: %s: %s", type(value).__name__, value)
        super()._end(job, kind, value)
