"""`specdec serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one loaded SpeculativeDecoder.

Words:
- job: one admitted completion request: its prompt's token ids and its checked settings (`Completion`).
- worker: the one thread that runs jobs through the decoder (specdec.serving.runners). With continuous
  batching (BatchRunner, the default where the pair allows it) every admitted job decodes in one
  speculative batch (specdec.serving.session.Session), joining at a round boundary and leaving when it ends;
  otherwise (Runner, max_batch=1 or a pair the session cannot hold) jobs run one at a time, in arrival
  order. Generation never runs on the event loop, so /health and /metrics answer while a job decodes.
- queue depth: jobs admitted and waiting for the worker (the running job is not counted); past
  `max_queue` a request gets 429. Running batch size: jobs decoding now.
- event: what a job's run hands its request, in order: "started" (the first tokens committed), "delta"
  (newly final text), then one of "done" (the GenerationResult), "error" (the exception) or "cancelled".
- cancel: a request whose client disconnected closes its job's stream; the run stops at its next
  commit (within one round), or the job leaves the queue if it has not started.

Errors use OpenAI's schema, {"error": {"message", "type", "param", "code"}}: a request the server cannot
honour is a 400 that names the field; an exception inside a run is that request's 500, and the worker
goes on with the next job. Every request is counted once in /metrics, with the status it was answered.

Browser safety (`Guard`): a web page the user visits can send "simple" cross-origin POSTs to a loopback
server, and a DNS-rebinding page can also read the replies. So the server answers only requests whose
Host names it (loopback, or the address it binds, or `allowed_hosts`), refuses any cross-origin request
whose Origin is not in `allowed_origins` (403; the allowed ones get CORS headers and their preflights
answered), and takes POST bodies only as application/json (415), which no simple request can send.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.config import SpecConfig, encode
from specdec.engine.trees import tree_width
from specdec.serving.openai_schema import (
    DONE,
    APIError,
    ChatBody,
    CommonBody,
    CompletionBody,
    Reply,
    ReplyTokens,
    StopTrimmer,
    parse_body,
    read_body,
    specdec_field,
)
from specdec.serving.runners import (
    BatchRunner,
    Completion,
    Job,
    Runner,
)
from specdec.serving.session import DraftChoices
from specdec.verify.reads import NonFiniteLogitsError

logger = logging.getLogger("specdec.serving.server")
FALLBACK_CONTEXT = 4096  # the chat default budget where a model states no context length
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def check_api_key(key: str | None) -> str | None:
    """The key as the server compares it: surrounding blanks dropped, as they are from the client's token."""
    if key is not None and not key.strip():
        raise ValueError("the API key is empty: give one, or none to serve without")
    return None if key is None else key.strip()


def check_address(host: str, port: int) -> None:
    """Fail before the models load if the address cannot be bound (a taken port, an unknown host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        raise OSError(f"cannot serve on {host}:{port}: {error.strerror or error}") from None


@dataclass(frozen=True)
class ServeSettings:
    model: str  # the name clients send as "model" (GET /v1/models lists it)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_queue: int = 32  # requests that may wait behind the running one; past it, 429
    max_body_bytes: int = 2 * 1024 * 1024  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # None: the model's context
    max_batch: int = 8  # requests decoded together (continuous batching); 1: one at a time
    host: str = "127.0.0.1"  # the address bound: a Host header may name it
    allowed_hosts: tuple[str, ...] | None = None  # Host names served (None: loopback and `host`; "*": any)
    allowed_origins: tuple[str, ...] = ()  # cross-origin callers allowed, as "scheme://host[:port]" ("*": any)
    read_timeout: float = 30.0  # seconds a client gets to send its headers, and then its body (408)
    drafting: DraftChoices = DraftChoices()  # the batch's draft length, width and copy drafts (all auto)

    def __post_init__(self):
        if not self.model:
            raise ValueError("the served model name is empty")
        if self.max_queue < 1 or self.max_body_bytes < 1 or self.max_batch < 1:
            raise ValueError("max_queue, max_body_bytes and max_batch must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if self.read_timeout <= 0:
            raise ValueError("read_timeout must be > 0 seconds")
        object.__setattr__(self, "api_key", check_api_key(self.api_key))  # frozen: normalised once, here
        if any("://" not in origin and origin != "*" for origin in self.allowed_origins):
            raise ValueError(f"allowed origins are scheme://host[:port], got {list(self.allowed_origins)}")

    def host_allowed(self, name: str) -> bool:
        allowed = (*LOOPBACK, self.host) if self.allowed_hosts is None else self.allowed_hosts
        return "*" in allowed or name.lower() in {a.lower().strip("[]") for a in allowed}

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in {o.rstrip("/") for o in self.allowed_origins}


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
    if ended and not trimmer.stopped and completion.grammar is not None and not completion.grammar.complete(ids):
        return "length"  # a structured reply the grammar has not finished (a dead end) is never called complete
    return "stop" if trimmer.stopped or ended else "length"


def _usage(completion: Completion, result) -> dict:
    prompt, generated = len(completion.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _runner(decoder, settings: ServeSettings, clock: Callable[[], float]) -> Runner:
    """Continuous batching where the pair allows it (the dynamic cache; a draft model, n-gram or none),
    else one request at a time."""
    if settings.max_batch > 1:
        try:
            return BatchRunner(decoder, settings.max_queue, settings.max_batch, clock, settings.drafting)
        except ValueError as why:
            logger.warning("serving one request at a time: %s", why)
    return Runner(decoder, settings.max_queue, clock, settings.drafting)


class Guard:
    """The app's outermost layer (plain ASGI, so streams pass through it untouched): browser safety (the
    module's docstring), OpenAI's error body for any failure, and one count per request with the status it
    was answered (499 where the client left first)."""

    def __init__(self, app, settings: ServeSettings, count: Callable[[str, int], None]):
        self.app, self.settings, self.count = app, settings, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                return await _respond(refusal, scope, receive, sending)
            await self.app(scope, receive, sending)
        except Exception as error:  # a bug, not the client's fault: its own 500, and the server goes on
            logger.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
            if status is None:  # once a reply has begun (a stream) it cannot become a 500
                failure = APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error")
                await _respond(failure, scope, receive, sending)
        finally:
            self.count(scope["path"], 499 if status is None else status)

    def refusal(self, scope) -> APIError | None:
        """Why a request is refused before it reaches an endpoint, or None."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get("host", "")
        name = urlsplit("//" + host).hostname or ""
        if not self.settings.host_allowed(name):
            message = f"Host {host!r} is not served here (a DNS-rebinding guard); start the server with --allowed-hosts"
            return APIError(403, message, code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != host and not self.settings.origin_allowed(origin):
            message = f"cross-origin requests from {origin!r} are refused; start the server with --allowed-origins"
            return APIError(403, message, code="origin_not_allowed")
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            message = f"the request body must be application/json, got {media or 'no Content-Type'}"
            return APIError(415, message, code="unsupported_media_type")
        return None


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _respond(error: APIError, scope, receive, send) -> None:
    await _error_response(error)(scope, receive, send)


class Routes:
    """The endpoints of one app: each request is authorised, read, resolved into a job and answered."""

    def __init__(self, decoder, settings: ServeSettings, runner: Runner):
        self.decoder, self.settings, self.runner = decoder, settings, runner
        self.started_at = int(time.time())
        contexts = [m.max_positions for m in (decoder.target, decoder.drafter)]
        self.context = min((c for c in contexts if c), default=None)

    async def api_error(self, request: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    async def http_error(self, request: Request, error: StarletteHTTPException) -> JSONResponse:
        return await self.api_error(request, APIError(error.status_code, str(error.detail)))

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401,
                "a missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read(self, request: Request, model: type[CommonBody]) -> CommonBody:
        """The checked body: authorised, within the size limit, of the served model."""
        self.authorize(request)
        limit, served = self.settings.max_body_bytes, self.settings.model
        too_big = APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0

        async def receive() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:  # a client trickling its body is dropped, as one trickling its headers is (TimedH11)
            await asyncio.wait_for(receive(), self.settings.read_timeout)
        except TimeoutError:
            message = f"the request body did not arrive within {self.settings.read_timeout:g} s"
            raise APIError(408, message, code="request_timeout") from None
        body = parse_body(model, read_body(b"".join(chunks)))
        if body.model != served:
            message = f"model {body.model!r} is not served here; this server serves {served!r}"
            raise APIError(400, message, param="model", code="model_not_found")
        return body

    async def resolve(self, body: CommonBody, prompt, chat: bool, budget: tuple[str, int | None]) -> Completion:
        """Tokenise, then check the limits and sampling values before queueing: a 400 comes at once."""
        decoder, context, field_name = self.decoder, self.context, "messages" if chat else "prompt"
        try:  # off the loop: a long prompt's tokenisation
            ids = await asyncio.to_thread(encode, prompt, decoder.tokenizer, chat, decoder.target.vocab_size)
        except ValueError as error:
            raise APIError(400, str(error), param=field_name) from None
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            message = f"the prompt has {len(ids)} tokens, over this server's limit of {limit}"
            raise APIError(400, message, param=field_name, code="context_length_exceeded")
        name, max_tokens = budget
        room = (context or FALLBACK_CONTEXT) - len(ids)
        if context is not None and room < 1:  # the prompt's fault, whatever the budget
            message = f"the prompt has {len(ids)} tokens, leaving no room in the model's context ({context}); "
            raise APIError(400, message + "shorten the prompt", param=field_name, code="context_length_exceeded")
        if max_tokens is None:  # OpenAI's defaults: 16 for completions; for chat, what the context leaves
            max_tokens = room if chat else 16
        if max_tokens < 1:
            raise APIError(400, f"{name} must be >= 1, got {max_tokens}", param=name)
        if context is not None and len(ids) + max_tokens > context:
            message = f"prompt of {len(ids)} tokens + {name} {max_tokens} exceeds the model's context ({context})"
            raise APIError(400, f"{message}; lower {name} to {room}", param=name, code="context_length_exceeded")
        fields = dict(stop=body.stops or None, seed=body.seed, temperature=body.temperature, top_p=body.top_p)
        structured = body.constraint()
        fields |= structured
        logprobs = body.alternatives()
        batched = isinstance(self.runner, BatchRunner)
        if not body.specdec_draft and not batched:
            message = "specdec_draft: false needs the batch (--max-batch > 1 and a pair it can hold)"
            raise APIError(400, message, param="specdec_draft")
        asked = "logprobs" if logprobs is not None else "specdec_tokens" if body.specdec_tokens else None
        if asked and body.stream and not batched:
            message = f"streamed {asked} need the batch (--max-batch > 1 and a pair it can hold); send stream: false"
            raise APIError(400, message, param=asked)
        try:
            request = SpecConfig.of(max_new_tokens=max_tokens, **fields)
            # the values against the target's generation config; off the loop: a grammar's first tokenizer view
            warping, eos_ids = await asyncio.to_thread(decoder.warping, request)
        except ValueError as error:
            culprit = _culprit(fields)
            if culprit is None and structured and "does not compile" in str(error):  # only with this tokenizer
                culprit = next(iter(structured))
            if culprit in structured and body.structured_outputs is not None:  # named as the request named it
                culprit = "structured_outputs"
            raise APIError(400, str(error), param=culprit) from None
        sampling = (body.temperature, body.top_p, body.seed, body.stops, frozenset(eos_ids))
        echo = bool(getattr(body, "echo", False))
        if echo and body.stream:
            raise APIError(400, "echo is answered whole: send stream: false", param="echo")
        return Completion(ids, max_tokens, *sampling, logprobs, body.specdec_tokens, body.specdec_draft, echo,
                          structured, warping.constraint)  # fmt: skip

    async def answer(self, request: Request, body: CommonBody, completion: Completion, chat: bool):
        """Queue the job, then answer: one JSON object, or server-sent events once the run has begun."""
        runner, job = self.runner, Job(completion, asyncio.get_running_loop())
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
        reply = Reply(self.settings.model, chat, body.include_usage)
        trimmer = StopTrimmer(completion.stops, before=self.prompt_tail(completion))
        tokens = None
        if completion.logprobs is not None or completion.kinds:
            tokens = ReplyTokens(self.decoder.tokenizer, chat, completion.logprobs is not None, completion.kinds)
        if not body.stream:
            generated, echoed = value.text, ""
            if completion.echo:  # the prompt first: its text, and its tokens scored where logprobs were asked
                tokenizer = self.decoder.tokenizer
                echoed = tokenizer.decode(completion.prompt_ids, skip_special_tokens=True)
                # the reply as it reads after the prompt (a tokenizer may drop a reply's leading space alone)
                whole = tokenizer.decode(completion.prompt_ids + value.token_ids, skip_special_tokens=True)
                generated = whole[len(echoed) :] if whole.startswith(echoed) else generated
            text = trimmer.feed(generated) + trimmer.end()
            finish = _finish_reason(completion, value, trimmer)
            told = None
            if tokens is not None:  # a stop string's cut drops the tokens that begin past it
                if completion.echo:
                    ids = completion.prompt_ids
                    tokens.add(ids, job.prompt_logprobs or [None] * len(ids), [("prompt", 0, 0)] * len(ids))
                tokens.add(value.token_ids, value.logprobs, value.kinds)
                told = tokens.take(len(echoed) + len(text) if trimmer.stopped else None)
            reply_text = echoed + text
            return reply.whole(reply_text, finish, _usage(completion, value), specdec_field(value.metrics), told)
        events = self._events(job, completion, reply, trimmer, kind, value, tokens)
        return StreamingResponse(events, media_type="text/event-stream")

    def prompt_tail(self, completion: Completion) -> str:
        """The prompt's end, where a stop string that ends in the reply may begin: its last tokens decoded as
        the decoder's stop check decodes them (a token holds at least one byte, a character at most four)."""
        if not completion.stops:
            return ""
        window = completion.prompt_ids[-4 * max(map(len, completion.stops)) :]
        return self.decoder.tokenizer.decode(window, skip_special_tokens=True)

    async def _events(self, job: Job, completion: Completion, reply: Reply, trimmer: StopTrimmer, kind, value,
                      tokens: ReplyTokens | None = None):  # fmt: skip
        """A streamed answer's server-sent events, from the job's first wanted event to its end. tokens: where
        logprobs or specdec_tokens were asked for, each chunk carries the tokens whose text begins in it."""
        sent = 0
        try:
            yield reply.opening()
            while kind not in ("done", "error", "cancelled"):
                if kind == "tokens" and tokens is not None:
                    tokens.add(*value)
                if kind == "delta" and (text := trimmer.feed(value)):
                    sent += len(text)
                    yield reply.chunk(text, None if tokens is None else tokens.take(sent))
                kind, value = await job.events.get()
            if kind == "done":
                given_before = 0 if tokens is None else tokens.given
                tail = trimmer.end()
                sent += len(tail)
                rest = None if tokens is None else tokens.take(sent if trimmer.stopped else None)
                if tail or (rest is not None and tokens.given > given_before):
                    yield reply.chunk(tail, rest)
                finish = _finish_reason(completion, value, trimmer)
                yield reply.closing(finish, _usage(completion, value), specdec_field(value.metrics))
            elif kind == "error":
                yield reply.error(_failure(value, started=True))
            yield DONE
        finally:  # the stream ended, or the client left (Starlette cancels the response)
            self.runner.cancel(job)

    async def completions(self, request: Request):
        body = await self.read(request, CompletionBody)
        completion = await self.resolve(body, body.text_or_ids(), False, ("max_tokens", body.max_tokens))
        return await self.answer(request, body, completion, chat=False)

    async def chat_completions(self, request: Request):
        body = await self.read(request, ChatBody)
        messages = body.chat()
        if not getattr(self.decoder.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        completion = await self.resolve(body, messages, True, body.token_budget())
        return await self.answer(request, body, completion, chat=True)

    def card(self) -> dict:
        """The served model, as OpenAI describes a model."""
        return {"id": self.settings.model, "object": "model", "created": self.started_at, "owned_by": "specdec"}

    async def models(self, request: Request):
        self.authorize(request)
        return {"object": "list", "data": [self.card()]}

    async def model(self, request: Request, model_id: str):
        """One model's card by its id (a served name may hold slashes, as a Hub id does)."""
        self.authorize(request)
        served = self.settings.model
        if model_id != served:
            message = f"model {model_id!r} is not served here; this server serves {served!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        return self.card()

    async def health(self):
        if not self.runner.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        waiting, running = self.runner.depth()
        return {"status": "ok", "queue_depth": waiting, "running": running}

    async def metrics(self):
        return PlainTextResponse(self.runner.prometheus(), media_type="text/plain; version=0.0.4")

    async def page(self):
        """The live page: one static file, no CDN and no build step; it asks for the API key itself."""
        return HTMLResponse((Path(__file__).parent / "page.html").read_text())


def _culprit(fields: dict) -> str | None:
    """The one field whose value alone is refused (a 400's param), or None where only their mix is."""
    for name, value in fields.items():
        try:
            SpecConfig.of(**{name: value})
        except ValueError:
            return name
    return None


def create_app(decoder, settings: ServeSettings, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The FastAPI app serving `decoder` (a SpeculativeDecoder with a tokenizer) under `settings.model`.
    clock: the busy time's clock in /metrics (a test's fake one)."""
    if decoder.tokenizer is None:
        raise ValueError("serving needs a target with a tokenizer (text in, text out)")
    tree_width(settings.drafting.draft_width, decoder.target, decoder.drafter, "race", greedy=False)  # refused now
    runner = _runner(decoder, settings, clock)
    routes = Routes(decoder, settings, runner)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start(asyncio.get_running_loop())
        yield
        runner.close(timeout=5.0)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner, app.state.settings = runner, settings
    origins = list(settings.allowed_origins)  # the Guard has refused every other cross-origin caller
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(Guard, settings=settings, count=runner.count)  # added last: the outermost
    app.add_exception_handler(APIError, routes.api_error)
    app.add_exception_handler(StarletteHTTPException, routes.http_error)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/", routes.page, methods=["GET"])
    return app


# ------------------------------------------------------------------ running it


BACKSTOP_S = 5.0  # uvicorn's own cancel, this long after the app has ended its streams


class Server(uvicorn.Server):
    """uvicorn's server, ending the app's own work at shutdown: a signal stops admission (new requests get
    503); the accepted ones, running or queued, may finish within the graceful timeout, and at its end each
    left gets a 503 (a stream: an error event, then [DONE]) before its socket closes. uvicorn would cancel
    them mid-chunk instead, so its own timeout is moved BACKSTOP_S later, as a backstop."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.deadline = config.timeout_graceful_shutdown  # None: wait for the running requests however long
        if self.deadline is not None:
            config.timeout_graceful_shutdown = self.deadline + BACKSTOP_S

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        runner = getattr(self.config.app.state, "runner", None)
        if runner is not None and runner.loop is not None:  # on the loop: a signal handler must not take locks
            runner.loop.call_soon_threadsafe(runner.drain)

    async def shutdown(self, sockets=None) -> None:
        runner = getattr(self.config.app.state, "runner", None)
        if runner is not None:
            runner.drain()
            if self.deadline is not None:
                asyncio.get_running_loop().call_later(self.deadline, runner.end_streams)
        await super().shutdown(sockets)


class TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: a client that opens a connection
    and trickles its headers (or sends none) is dropped after `header_timeout` seconds."""

    header_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(self.header_timeout, self._expire, self.cycle)

    def _expire(self, cycle) -> None:
        if self.cycle is cycle and not self.transport.is_closing():  # no request's headers came since
            self.transport.close()


def server_config(app: FastAPI, *, host: str, port: int, shutdown_timeout: float | None, log_level: str):
    """uvicorn's config for the app: its h11 protocol with the header deadline of the app's read_timeout."""
    protocol = type("TimedH11", (TimedH11,), {"header_timeout": app.state.settings.read_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        lifespan="on",
        http=protocol,
    )


@contextmanager
def serving_in_thread(app: FastAPI, log_level: str = "warning") -> Iterator[str]:
    """The app on uvicorn in a background thread, on a free loopback port (a bench's own server): yields
    its base URL; stops it on leaving."""
    server = Server(server_config(app, host="127.0.0.1", port=0, shutdown_timeout=5, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the server did not start (its log says why)")
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def run(app: FastAPI, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (in-flight work finishes, or is answered
    503 at `shutdown_timeout` seconds) and return: the process exits 0."""
    server = Server(server_config(app, host=host, port=port, shutdown_timeout=shutdown_timeout, log_level=log_level))
    # uvicorn re-raises the signal that stopped it once it has shut down; with these the re-raise is a no-op
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except SystemExit:  # uvicorn could not start (the port is taken, ...): it has logged why
        raise OSError(f"could not serve on {host}:{port}; the reason is in the log above") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
