"""`specdec serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one loaded SpeculativeDecoder.

Words:
- job: one admitted completion request: its prompt's token ids and its checked settings (`Completion`).
- worker: the one thread that runs jobs through the decoder. With continuous batching (BatchRunner, the
  default where the pair allows it) every admitted job decodes in one speculative batch
  (specdec.batching.Session), joining at a round boundary and leaving when it ends; otherwise (Runner,
  max_batch=1 or a pair the session cannot hold) jobs run one at a time, in arrival order. Generation
  never runs on the event loop, so /health and
  /metrics answer while a job decodes.
- queue depth: jobs admitted and waiting for the worker (the running job is not counted); past
  `max_queue` a request gets 429. Running batch size: jobs decoding now.
- event: what a job's run hands its request, in order: "started" (the first tokens committed), "delta"
  (newly final text), then one of "done" (the GenerationResult), "error" (the exception) or "cancelled".
- cancel: a request whose client disconnected closes its job's stream; the run stops at its next
  commit (within one round), or the job leaves the queue if it has not started.

Errors use OpenAI's schema, {"error": {"message", "type", "param", "code"}}: a request the server cannot
honour is a 400 that names the field; an exception inside a run is that request's 500, and the worker
goes on with the next job.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.adapters import NonFiniteLogitsError
from specdec.api import GenerationResult
from specdec.inputs import check_request, encode
from specdec.metrics import SpeculativeMetrics
from specdec.openai_schema import (
    DONE,
    APIError,
    ChatBody,
    CommonBody,
    CompletionBody,
    Reply,
    StopTrimmer,
    parse_body,
    read_body,
    specdec_field,
)
from specdec.text import DeltaQueue, StreamClosed

logger = logging.getLogger("specdec.serve")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
FALLBACK_CONTEXT = 4096  # the chat default budget where a model states no context length


@dataclass(frozen=True)
class ServeSettings:
    model: str  # the name clients send as "model" (GET /v1/models lists it)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_queue: int = 32  # requests that may wait behind the running one; past it, 429
    max_body_bytes: int = 2 * 1024 * 1024  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # None: the model's context
    max_batch: int = 8  # requests decoded together (continuous batching); 1: one at a time

    def __post_init__(self):
        if not self.model:
            raise ValueError("the served model name is empty")
        if self.max_queue < 1 or self.max_body_bytes < 1 or self.max_batch < 1:
            raise ValueError("max_queue, max_body_bytes and max_batch must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give one, or none to serve without")


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

    def __post_init__(self):
        self.stream = JobStream(self.post)

    def post(self, kind: str, value) -> None:
        """From any thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (shutdown): nobody is waiting
            pass


# ------------------------------------------------------------------ counters


@dataclass
class ServerMetrics:
    """Counters since start; rates are derived (specdec.metrics' rule). `decoding` sums every run's
    counters and clocks: runs are sequential, so its tokens/s is the server's busy-time rate."""

    responses: Counter = field(default_factory=Counter)  # (path, status) -> count
    prompt_tokens: int = 0
    runs: int = 0  # jobs the worker ran (to their end, cancelled or failed)
    cancelled: int = 0  # jobs whose client left (queued or running) or that shutdown dropped
    failed: int = 0  # runs that raised
    decoding: SpeculativeMetrics = field(default_factory=SpeculativeMetrics)

    @property
    def seconds_per_run(self) -> float:
        return self.decoding.wall_time_s / self.runs if self.runs else 1.0


def prometheus_text(m: ServerMetrics, waiting: int, running: int) -> str:
    """The counters in Prometheus' text format (version 0.0.4)."""
    d = m.decoding
    rows = [
        ("requests_total", "counter", "HTTP responses by path and status", None),
        ("requests_cancelled_total", "counter", "Requests whose client left, or dropped at shutdown", m.cancelled),
        ("requests_failed_total", "counter", "Runs that raised (answered 500)", m.failed),
        ("prompt_tokens_total", "counter", "Prompt tokens of the runs", m.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated", d.generated_tokens),
        ("drafted_tokens_total", "counter", "Draft tokens proposed", d.drafted_tokens),
        ("accepted_tokens_total", "counter", "Draft tokens accepted", d.accepted_tokens),
        ("rounds_total", "counter", "Speculative rounds (draft, verify, commit)", d.rounds),
        ("generation_seconds_total", "counter", "Wall time spent generating", d.wall_time_s),
        ("acceptance_rate", "gauge", "Accepted / drafted tokens, all runs", d.acceptance_rate),
        ("mean_acceptance_length", "gauge", "Tokens committed per round, all runs", d.mean_acceptance_length),
        ("tokens_per_second", "gauge", "Generated tokens per second of generation", d.tokens_per_second),
        ("queue_depth", "gauge", "Requests waiting for the worker", waiting),
        ("running_batch_size", "gauge", "Requests decoding now", running),
    ]
    lines = []
    for name, kind, text, value in rows:
        lines += [f"# HELP specdec_{name} {text}", f"# TYPE specdec_{name} {kind}"]
        if value is not None:
            lines.append(f"specdec_{name} {value}")
            continue
        for (path, status), count in sorted(m.responses.items()):
            lines.append(f'specdec_{name}{{path="{path}",code="{status}"}} {count}')
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the worker


class Runner:
    """The queue and the worker thread: jobs run through the decoder one at a time, in arrival order."""

    def __init__(self, decoder, max_queue: int):
        self.decoder, self.max_queue = decoder, max_queue
        self.metrics = ServerMetrics()
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
            return len(self._waiting), int(self._running is not None)

    def prometheus(self) -> str:
        with self._cond:  # one consistent snapshot
            return prometheus_text(self.metrics, len(self._waiting), int(self._running is not None))

    def count(self, path: str, status: int) -> None:
        if path in ENDPOINTS:  # not every path a client tries: the label set stays bounded
            with self._cond:
                self.metrics.responses[path, status] += 1

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self._accepting:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) >= self.max_queue:
                retry = max(1, round(self.metrics.seconds_per_run * (len(self._waiting) + 1)))
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
        """Stop admitting; the waiting jobs get 503 at once. The running job goes on."""
        with self._cond:
            self._accepting = False
            dropped = list(self._waiting)
            self._waiting.clear()
            self.metrics.cancelled += len(dropped)
        for job in dropped:
            job.post("error", APIError(503, "the server is shutting down", code="shutting_down"))

    def close(self, timeout: float) -> None:
        """Drain, stop the running job at its next commit, and wait (bounded) for the worker."""
        self.drain()
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._running.stream.closed.set()
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
            kind, value = self._run(job)
            with self._cond:
                self._running = None
                m = self.metrics
                m.runs += 1
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
            result = self.decoder.generate(
                c.prompt_ids,
                max_new_tokens=c.max_tokens,
                temperature=c.temperature,
                top_p=c.top_p,
                seed=c.seed,
                stop=c.stops or None,
                stream=job.stream,
                metrics=job.metrics,
            )
        except StreamClosed:
            return "cancelled", None
        except Exception as error:  # this request's failure, not the server's: answered 500, the worker goes on
            logger.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
            return "error", error
        return "done", result


class BatchRunner(Runner):
    """The queue and a worker thread that runs every admitted job in one speculative batch
    (specdec.batching.Session): a job joins at the next round boundary while others decode, and leaves
    the moment it ends. Each job is exact as generate() alone: greedy token for token, sampled by race
    verification keyed on its seed. The decoder is held while any job decodes, released when idle."""

    def __init__(self, decoder, max_queue: int, max_batch: int):
        super().__init__(decoder, max_queue)
        from specdec.batching import Session

        self.session = Session(decoder, max_batch=max_batch, max_queue=max_batch)
        self._rows: dict = {}  # Job -> (its row, its streamer)

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._waiting) + self.session.queued, self.session.running

    def prometheus(self) -> str:
        waiting, running = self.depth()
        with self._cond:
            return prometheus_text(self.metrics, waiting, running)

    def close(self, timeout: float) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            for job in self._rows:
                job.stream.closed.set()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._rows and not self._closed:
                    self._cond.wait()
                if self._closed and not self._rows:
                    return
            with self.decoder._exclusive():  # held while jobs decode; other callers wait until idle
                self.session._reset_models()
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
        from specdec.text import DeltaStreamer

        while True:
            with self._cond:
                room = self.session.max_batch - self.session.running - self.session.queued
                if room <= 0 or not self._waiting:
                    return
                job = self._waiting.popleft()
            c = job.completion
            if job.stream.closed.is_set():  # its client left between the queue and the batch
                self._end(job, "cancelled", None)
                continue
            streamer = DeltaStreamer(self.decoder.tokenizer, job.stream)
            try:
                config = check_request(
                    max_new_tokens=c.max_tokens,
                    num_draft_tokens="auto",
                    stop=c.stops or None,
                    stream=None,
                    seed=c.seed,
                    temperature=c.temperature,
                    top_k=None,
                    top_p=c.top_p,
                    do_sample=None,
                )
                row = self.session.submit(c.prompt_ids, config, on_tokens=self._forward_to(job, streamer))
            except Exception as error:  # noqa: BLE001 - this request's failure: answered, the others go on
                self._end(job, "error", error)
                continue
            self._rows[job] = (row, streamer)

    @staticmethod
    def _forward_to(job: Job, streamer):
        def on_tokens(tokens: list[int]) -> None:
            try:
                streamer(0, tokens)
            except StreamClosed:  # the client has gone: the row leaves before the next round
                job.stream.closed.set()

        return on_tokens

    def _collect(self) -> None:
        """Answer the jobs whose rows ended this round."""
        for job, (row, streamer) in list(self._rows.items()):
            if not row.done.is_set():
                continue
            del self._rows[job]
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
                self._end(job, "done", result)

    def _end(self, job: Job, kind: str, value) -> None:
        with self._cond:
            m = self.metrics
            m.runs += 1
            m.prompt_tokens += len(job.completion.prompt_ids)
            m.decoding = m.decoding + job.metrics
            m.cancelled += kind == "cancelled"
            m.failed += kind == "error"
        if kind == "error":
            logger.error("a request failed: %s: %s", type(value).__name__, value)
        job.post(kind, value)


# ------------------------------------------------------------------ the app


def _failure(error: BaseException, started: bool) -> APIError:
    """A run's exception as an HTTP error: a ValueError before anything was committed is the request's fault
    (400); non-finite logits, and anything else, are a 500 naming the cause."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError) and not isinstance(error, NonFiniteLogitsError) and not started:
        return APIError(400, str(error))
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", code="generation_failed")


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body has been read: what remains to receive is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(request: Request, job: Job, wanted: set[str]) -> tuple[str, object]:
    """The job's next event of a wanted kind (or its end), or ("cancelled", None) once the client has gone."""
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            getter = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({watcher, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                return "cancelled", None
            event = getter.result()
            if event[0] in wanted | {"error", "cancelled"}:
                return event
    finally:
        watcher.cancel()


def _finish_reason(completion: Completion, result, trimmer: StopTrimmer) -> str:
    ids = result.token_ids
    ended = len(ids) < completion.max_tokens or (ids and ids[-1] in completion.eos_ids)  # EOS or a stop string
    return "stop" if trimmer.stopped or ended else "length"


def _usage(completion: Completion, result) -> dict:
    prompt, generated = len(completion.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _runner(decoder, settings: ServeSettings) -> Runner:
    """Continuous batching where the pair allows it (the dynamic cache; a draft model, n-gram or none),
    else one request at a time."""
    if settings.max_batch > 1:
        try:
            return BatchRunner(decoder, settings.max_queue, settings.max_batch)
        except ValueError as why:
            logger.warning("serving one request at a time: %s", why)
    return Runner(decoder, settings.max_queue)


def create_app(decoder, settings: ServeSettings) -> FastAPI:
    """The FastAPI app serving `decoder` (a SpeculativeDecoder with a tokenizer) under `settings.model`."""
    if decoder.tokenizer is None:
        raise ValueError("serving needs a target with a tokenizer (text in, text out)")
    runner = _runner(decoder, settings)
    started_at = int(time.time())
    contexts = [getattr(m, "max_positions", None) for m in (decoder.target, decoder.drafter)]
    context = min((c for c in contexts if c), default=None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start(asyncio.get_running_loop())
        yield
        runner.close(timeout=5.0)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner = runner

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        runner.count(request.url.path, error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, APIError(error.status_code, str(error.detail)))

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(
                401,
                "a missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read(request: Request, model: type[CommonBody]) -> CommonBody:
        """The checked body: authorised, within the size limit, of the served model."""
        authorize(request)
        too_big = APIError(413, f"the request body is over {settings.max_body_bytes} bytes", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        body = parse_body(model, read_body(b"".join(chunks)))
        if body.model != settings.model:
            message = f"model {body.model!r} is not served here; this server serves {settings.model!r}"
            raise APIError(400, message, param="model", code="model_not_found")
        return body

    async def resolve(body: CommonBody, prompt, chat: bool, budget: tuple[str, int | None]) -> Completion:
        """Tokenise, then check the limits and sampling values before queueing: a 400 comes at once."""
        field_name = "messages" if chat else "prompt"
        try:  # off the loop: a long prompt's tokenisation
            ids = await asyncio.to_thread(encode, prompt, decoder.tokenizer, chat, decoder.target.vocab_size)
        except ValueError as error:
            raise APIError(400, str(error), param=field_name) from None
        limit = settings.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            message = f"the prompt has {len(ids)} tokens, over this server's limit of {limit}"
            raise APIError(400, message, param=field_name, code="context_length_exceeded")
        name, max_tokens = budget
        room = (context or FALLBACK_CONTEXT) - len(ids)
        if max_tokens is None:  # OpenAI's defaults: 16 for completions; for chat, what the context leaves
            max_tokens = room if chat else 16
        if max_tokens < 1:
            raise APIError(400, f"{name} must be >= 1, got {max_tokens}", param=name)
        if context is not None and len(ids) + max_tokens > context:
            hint = f"lower {name} to {room}" if room > 0 else "shorten the prompt"
            message = (
                f"prompt of {len(ids)} tokens + {name} {max_tokens} exceeds the model's context ({context}); {hint}"
            )
            raise APIError(400, message, param=name, code="context_length_exceeded")
        try:
            request = check_request(
                max_new_tokens=max_tokens,
                num_draft_tokens="auto",
                stop=body.stops or None,
                stream=None,
                seed=body.seed,
                temperature=body.temperature,
                top_k=None,
                top_p=body.top_p,
                do_sample=None,
            )
            _, eos_ids = decoder.warping(request)  # the values against the target's generation config
        except ValueError as error:
            raise APIError(400, str(error)) from None
        return Completion(ids, max_tokens, body.temperature, body.top_p, body.seed, body.stops, frozenset(eos_ids))

    async def answer(request: Request, body: CommonBody, completion: Completion, chat: bool):
        """Queue the job, then answer: one JSON object, or server-sent events once the run has begun."""
        job = Job(completion, asyncio.get_running_loop())
        runner.submit(job)
        try:
            kind, value = await _next_event(request, job, {"started", "done"} if body.stream else {"done"})
        except BaseException:  # cancelled (shutdown timeout): stop the run too
            runner.cancel(job)
            raise
        if kind == "cancelled":  # the client has gone: nobody reads this
            runner.cancel(job)
            return JSONResponse({}, status_code=499)
        if kind == "error":
            raise _failure(value, job.stream.started)
        reply, trimmer = Reply(settings.model, chat, body.include_usage), StopTrimmer(completion.stops)
        runner.count(request.url.path, 200)
        if not body.stream:
            text = trimmer.feed(value.text) + trimmer.end()
            finish = _finish_reason(completion, value, trimmer)
            return reply.whole(text, finish, _usage(completion, value), specdec_field(value.metrics))

        async def events(kind: str, value) -> AsyncIterator[str]:
            try:
                yield reply.opening()
                while kind not in ("done", "error", "cancelled"):
                    if kind == "delta" and (text := trimmer.feed(value)):
                        yield reply.chunk(text)
                    kind, value = await job.events.get()
                if kind == "done":
                    if tail := trimmer.end():
                        yield reply.chunk(tail)
                    finish = _finish_reason(completion, value, trimmer)
                    yield reply.closing(finish, _usage(completion, value), specdec_field(value.metrics))
                elif kind == "error":
                    yield reply.error(_failure(value, started=True))
                yield DONE
            finally:  # the stream ended, or the client left (Starlette cancels the response)
                runner.cancel(job)

        return StreamingResponse(events(kind, value), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read(request, CompletionBody)
        completion = await resolve(body, body.text_or_ids(), False, ("max_tokens", body.max_tokens))
        return await answer(request, body, completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read(request, ChatBody)
        messages = body.chat()
        if not getattr(decoder.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        completion = await resolve(body, messages, True, body.token_budget())
        return await answer(request, body, completion, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": settings.model, "object": "model", "created": started_at, "owned_by": "specdec"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not runner.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        waiting, running = runner.depth()
        return {"status": "ok", "queue_depth": waiting, "running": running}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(runner.prometheus(), media_type="text/plain; version=0.0.4")

    return app


# ------------------------------------------------------------------ running it


class Server(uvicorn.Server):
    """uvicorn's server, which also drains the queue at once when a signal asks it to stop: the waiting
    requests get 503, the running one may finish within uvicorn's graceful-shutdown timeout."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        runner = getattr(self.config.app.state, "runner", None)
        if runner is not None and runner.loop is not None:  # on the loop: a signal handler must not take locks
            runner.loop.call_soon_threadsafe(runner.drain)


def run(app: FastAPI, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (in-flight work finishes or is cancelled
    within `shutdown_timeout` seconds) and return: the process exits 0."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, lifespan="on"
    )
    server = Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these the re-raise is a no-op
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except SystemExit:  # uvicorn could not start (the port is taken, ...): it has logged why
        raise OSError(f"could not serve on {host}:{port}; the reason is in the log above") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
