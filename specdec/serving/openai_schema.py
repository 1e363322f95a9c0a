"""OpenAI's wire format for `specdec serve`: request bodies checked field by field, replies and stream chunks.

Words:
- body: a request's JSON object, checked into `CompletionBody` or `ChatBody` (pydantic, strict types, no
  unknown fields). A field of OpenAI's schema that specdec does not honour (`UNSUPPORTED`) is accepted only
  when null or at the value that changes nothing; any other value is a 400 that names it, never ignored.
- reply: one request's answer (`Reply`): a whole object, or server-sent events (`data: {chunk}`, ending
  with `data: [DONE]`). Both carry `usage` and an extra field, `specdec`, with the request's speculation
  counters.
- stop: OpenAI's text leaves the stop string out; the decoder keeps it (it stops at the token that
  completes it), so `StopTrimmer` cuts it from the text, streamed or not.
Errors are `APIError`s, rendered as {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import difflib
import json
import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.config import MAX_LOGPROBS
from specdec.metrics import SpeculativeMetrics
from specdec.text import TokenSpans


class APIError(Exception):
    """An HTTP error in OpenAI's schema."""

    def __init__(self, status: int, message: str, *, param=None, code=None, kind=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------ requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class CommonBody(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: the target's generation config (as vLLM does)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id, for its own logs: no effect on output
    safety_identifier: str | None = None  # OpenAI's newer name for `user`: no effect on output
    prompt_cache_key: str | None = None  # a hint for OpenAI's prompt cache: no effect on output
    metadata: dict[str, str] | None = None  # the caller's tags for a stored response; nothing is stored
    specdec_tokens: bool = False  # opt-in: each choice also lists its tokens with what emitted each (and its round)
    specdec_draft: bool = True  # False: this request drafts nothing (the target alone, in the same batch)
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs: dict | None = None  # vLLM's: one of {"json"|"regex"|"grammar"|"choice": ...}

    def constraint(self) -> dict:
        """The structured output asked for, as generate()'s options ({} for none)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if self.structured_outputs is None:
            return {} if self.response_format is None else {"response_format": self.response_format}
        given = {k: v for k, v in self.structured_outputs.items() if v is not None}
        unknown = sorted(set(given) - {"json", "regex", "grammar", "choice"})
        if unknown or len(given) != 1:
            message = "structured_outputs takes one of json, regex, grammar or choice"
            raise APIError(
                400, message + (f", not {', '.join(unknown)}" if unknown else ""), param="structured_outputs"
            )
        ((name, value),) = given.items()
        if name == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise APIError(
                    400, "structured_outputs.choice must be a list of non-empty strings", param="structured_outputs"
                )
            return {"grammar": "start: " + " | ".join(json.dumps(c) for c in value)}  # Lark: each choice a literal
        return {"json_schema" if name == "json" else name: value}

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(CommonBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the chosen token's and this many alternatives
    echo: bool = False  # the reply starts with the prompt (with logprobs: each prompt token scored)

    def alternatives(self) -> int | None:
        """Log-probabilities asked for: alternatives per token (None: none)."""
        return self.logprobs

    def text_or_ids(self) -> str | list[int]:
        """The one prompt: a string or token ids (a list of one string is that string)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}; send one request each", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(CommonBody):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def alternatives(self) -> int | None:
        """Log-probabilities asked for: alternatives per token (None: none)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them: text content, "developer" as "system"."""
        if not self.messages:
            raise APIError(400, "messages is empty", param="messages")
        return [
            {
                "role": "system" if m.role == "developer" else m.role,  # OpenAI's newer name for the system role
                "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
                **({"name": m.name} if m.name is not None else {}),
            }
            for m in self.messages
        ]

    def token_budget(self) -> tuple[str, int | None]:
        """(the field that set it, the budget): max_completion_tokens, OpenAI's newer name, wins."""
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


UNION_TYPES = {
    "prompt": "a string, a list of token ids, or a list of one string or of one list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...})",
}
_ONE = "one choice per request: send the request again (another seed) for more"
_TOOLS = "tool and function calling are not supported"
UNSUPPORTED: dict[str, tuple[tuple, str]] = {  # name -> (the values that change nothing, what to do instead)
    "n": ((1,), _ONE),
    "best_of": ((1,), _ONE),
    "suffix": (("",), "insertion (a suffix) is not supported"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "presence_penalty": ((0, 0.0), "presence and frequency penalties are not supported"),
    "frequency_penalty": ((0, 0.0), "presence and frequency penalties are not supported"),
    "tools": (([],), _TOOLS),
    "tool_choice": (("none",), _TOOLS),
    "parallel_tool_calls": ((True, False), _TOOLS),  # either changes nothing: any tools are refused
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "modalities": ((["text"],), "the output is text only"),
    "audio": ((), "the output is text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "responses are not stored"),
    "service_tier": (("auto", "default"), "there is one service tier"),
}
_FIELD_NAMES = {name for m in (CompletionBody, ChatBody, Message, TextPart, StreamOptions) for name in m.model_fields}


def _neutral(value, allowed: tuple) -> bool:
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def json_type(value) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return names.get(type(value), "null")


def read_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # [[[[... thousands deep: no field of the schema nests past a few levels
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_type(body)}", code="invalid_json")
    return body


def parse_body(model: type[CommonBody], body: dict) -> CommonBody:
    """A JSON object -> the endpoint's checked body; an unsupported, unknown or mistyped field -> a 400 naming it."""
    for name in [n for n in body if n in UNSUPPORTED]:
        allowed, instead = UNSUPPORTED[name]
        value = body.pop(name)
        if not _neutral(value, allowed):
            shown = json.dumps(value)[:80]
            raise APIError(400, f"{name}={shown} is not supported: {instead}", param=name, code="unsupported_parameter")
    try:
        parsed = model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        loc = first["loc"]
        path = [p for i, p in enumerate(loc) if not (i and loc[i - 1] in UNION_TYPES and isinstance(p, str))]
        dotted = ".".join(str(p) for p in path)  # without pydantic's union member tags ("prompt.str")
        leaf = next((p for p in reversed(path) if isinstance(p, str)), "")
        if first["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(path[-1]), [*_FIELD_NAMES, *UNSUPPORTED], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            message = f"unknown field {dotted!r}{hint}: specdec serve takes the OpenAI fields in docs/SERVING.md"
        elif first["type"] == "missing":
            message = f"{dotted} is required"
        elif leaf in UNION_TYPES:
            message = f"{dotted} must be {UNION_TYPES[leaf]}, got {json_type(first['input'])}"
        else:
            message = f"{dotted}: {first['msg'].lower()}, got {json.dumps(first['input'])[:80]}"
        raise APIError(400, message, param=dotted) from None
    if parsed.stream_options is not None and not parsed.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    return parsed


# ------------------------------------------------------------------ replies


class StopTrimmer:
    """Holds back a tail of the text that could begin a stop string, and cuts the text where the first one
    begins. before: the text just before the reply (the prompt's end). A stop string that begins there and
    ends in the reply ends the reply where it begins, so the reply is empty: the decoder stops on such a
    match, and OpenAI's text never holds any part of a stop string."""

    def __init__(self, stops: list[str], before: str = ""):
        self.stops, self.hold, self.held, self.stopped = stops, max(map(len, stops), default=1) - 1, "", False
        self.before = self._tail(before)  # all a stop string can begin in

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.held += text
        seen, head = self.before + self.held, len(self.before)
        # only matches that end in the reply: one wholly before it did not stop the decoder
        cuts = [i for i in (seen.find(s, max(0, head - len(s) + 1)) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, out, self.held = True, self.held[: max(0, min(cuts) - head)], ""
            return out
        split = max(0, len(self.held) - self.hold)
        out, self.held = self.held[:split], self.held[split:]
        self.before = self._tail(self.before + out)
        return out

    def _tail(self, text: str) -> str:
        """The last `hold` characters of text, or all of it when shorter (a prompt shorter than a stop)."""
        return text[-self.hold :] if self.hold else ""

    def end(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def specdec_field(metrics: SpeculativeMetrics) -> dict:
    """The extra field: the request's speculation counters."""
    return {
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length,
        "rounds": metrics.rounds,
        "drafted_tokens": metrics.drafted_tokens,
        "accepted_tokens": metrics.accepted_tokens,
        "tokens_per_second": metrics.tokens_per_second,
        "accepted_per_position": metrics.accepted_per_position,
        "drafted_per_position": metrics.drafted_per_position,
        "draft_time_s": metrics.draft_time_s,  # under batching, the batch's while the request ran
        "target_time_s": metrics.target_time_s,
        "wall_time_s": metrics.wall_time_s,
    }


class ReplyTokens(TokenSpans):
    """A reply's committed tokens (specdec.text.TokenSpans) with their TokenLogprobs and kinds, handed out
    with the text they begin: their logprobs in OpenAI's shape for a chat (`logprobs.content`) or a
    completion (tokens, token_logprobs, top_logprobs, text_offset), where asked for, and `specdec_tokens`
    (text, kind, round, and the round's drafts), where asked for. A token string is the token decoded
    alone, special tokens included."""

    def __init__(self, tokenizer, chat: bool, logprobs: bool, kinds: bool):
        super().__init__(tokenizer)
        self.chat, self.logprobs, self.kinds = chat, logprobs, kinds

    def add(self, ids: list[int], entries: list | None, kinds: list[tuple[str, int, int]]) -> None:
        super().add(ids, [(None if entries is None else entries[j], kinds[j]) for j in range(len(ids))])

    def take(self, chars: int | None) -> dict:
        """{"logprobs": ... or None, "specdec_tokens": [...] or None} for the tokens handed out now."""
        span = super().take(chars)
        text = [self.tokenizer.decode([self.ids[i]], skip_special_tokens=False) for i in span]
        told = [dict(text=t, kind=kind, round=number, drafted=drafted)
                for t, (_, (kind, number, drafted)) in zip(text, (self.items[i] for i in span))]  # fmt: skip
        return {"logprobs": self._logprobs(span, text) if self.logprobs else None,
                "specdec_tokens": told if self.kinds else None}  # fmt: skip

    def _logprobs(self, span: range, text: list[str]) -> dict:
        entries = [self.items[i][0] for i in span]  # None: a first prompt token, which nothing precedes
        alternatives = [
            None if entry is None else
            [(self.tokenizer.decode([token], skip_special_tokens=False), value) for token, value in entry.top]
            for entry in entries
        ]  # fmt: skip
        chosen = [None if entry is None else entry.logprob for entry in entries]
        if self.chat:
            content = [_token(t, v) | {"top_logprobs": [_token(*a) for a in alts]}
                       for t, v, alts in zip(text, chosen, alternatives)]  # fmt: skip
            return {"content": content, "refusal": None}
        top = [None if alts is None else dict(alts) for alts in alternatives]
        return {"tokens": text, "token_logprobs": chosen, "top_logprobs": top,
                "text_offset": [self.offsets[i] for i in span]}  # fmt: skip


def _token(token: str, logprob: float) -> dict:
    """A chat logprob entry: the token's text, its log-probability and its UTF-8 bytes."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


DONE = "data: [DONE]\n\n"


class Reply:
    """The shapes of one request's answer: a completion (`text_completion`) or a chat completion."""

    def __init__(self, model: str, chat: bool, include_usage: bool = False):
        self.chat, self.include_usage = chat, include_usage
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "created": int(time.time())}
        self.head["model"] = model

    def _choice(self, text: str | None, finish: str | None, chunk: bool, tokens: dict | None = None) -> dict:
        """tokens: ReplyTokens.take's logprobs (null where not asked for) and specdec_tokens (only where asked)."""
        tokens = tokens or {"logprobs": None, "specdec_tokens": None}
        told = {} if tokens["specdec_tokens"] is None else {"specdec_tokens": tokens["specdec_tokens"]}
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": tokens["logprobs"], "finish_reason": finish} | told
        if chunk:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": tokens["logprobs"], "finish_reason": finish} | told
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": tokens["logprobs"], "finish_reason": finish} | told

    def whole(self, text: str, finish: str, usage: dict, extra: dict, tokens: dict | None = None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [self._choice(text, finish, chunk=False, tokens=tokens)]
        return {**self.head, "object": kind, "choices": choices, "usage": usage, "specdec": extra}

    def _event(self, data: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        usage = {"usage": None} if self.include_usage and "usage" not in data else {}  # OpenAI's null before the last
        return f"data: {json.dumps({**self.head, 'object': kind, **data, **usage})}\n\n"

    def opening(self) -> str:
        """A chat stream opens with the assistant's role; a completion stream has no opening."""
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event({"choices": [role]}) if self.chat else ""

    def chunk(self, text: str, tokens: dict | None = None) -> str:
        return self._event({"choices": [self._choice(text, None, chunk=True, tokens=tokens)]})

    def closing(self, finish: str, usage: dict, extra: dict) -> str:
        """The last chunk (its finish_reason and the specdec field), then usage where asked for."""
        events = self._event({"choices": [self._choice(None, finish, chunk=True)], "specdec": extra})
        if self.include_usage:
            events += self._event({"choices": [], "usage": usage, "specdec": extra})
        return events

    @staticmethod
    def error(error: APIError) -> str:
        """An error after the 200 went out rides in the stream, as vLLM sends it (the openai client raises it)."""
        return f"data: {json.dumps(error.body())}\n\n"
