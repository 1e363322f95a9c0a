"""Text around the token loop: streaming deltas and stop strings, both incremental.

Words:
- delta: a piece of newly final text. Streaming follows transformers'
  `TextStreamer`: text is flushed at word ends (or per CJK character), so a
  delta never changes later, and decoding cost grows with the line, not the output.
- stop string: generation of a row ends with the first token that completes
  one; a stop string may begin in the prompt (as in transformers' StopStringCriteria).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import TextStreamer


class StreamClosed(Exception):
    """Raised inside a streamed run once its consumer has stopped iterating: the run ends there."""


class DeltaQueue:
    """A streamed run's callback: deltas go to the consumer's queue. Once the consumer has gone
    (`closed`), the next delta, or the next commit (`check`), raises StreamClosed in the run."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()
        self.closed = threading.Event()

    def check(self) -> None:
        if self.closed.is_set():
            raise StreamClosed

    def __call__(self, text: str) -> None:
        self.check()
        self.items.put(text)


class DeltaStreamer(TextStreamer):
    """transformers' incremental detokeniser, handing each final piece of text to a callback. spans: where
    given (a TokenSpans the caller fills before each commit's text), each piece goes out as a Delta with the
    tokens it begins."""

    def __init__(self, tokenizer, callback: Callable[[str], None], spans: TokenSpans | None = None):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.callback, self.spans, self.sent = callback, spans, 0

    def __call__(self, row: int, tokens: list[int]) -> None:  # the decoder's on_commit hook
        if isinstance(self.callback, DeltaQueue):  # every round: a word may take many tokens to end
            self.callback.check()
        self.put(torch.tensor(tokens))

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self.spans is not None:
            self.sent += len(text)
            delta = Delta(text)
            delta.tokens = tuple(self.spans.items[i] for i in self.spans.take(None if stream_end else self.sent))
            text = delta
        if text or getattr(text, "tokens", ()):  # an empty Delta may still carry the last tokens (EOS)
            self.callback(text)


class TokenSpans:
    """Tokens placed where their text begins in a reply (the decoded text of the tokens before it), each
    with what the caller keeps about it; `take(chars)` hands out, once, those not yet handed out that begin
    before `chars` characters of reply (None: all left). So each piece of streamed text goes out with the
    tokens it begins, however the text was cut into pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.items: list = []
        self.offsets: list[int] = []
        self.length = 0  # characters of reply the tokens so far make (a character missing bytes: not yet)
        self.given = 0

    WINDOW = 8  # tokens decoded before each new one: a character spans at most 4 tokens, a word's space 1

    def add(self, ids: Sequence[int], items: Sequence) -> None:
        """Append tokens: each one's offset is the last one's plus what the last one added to the text, read
        from a short window decoded with and without it (linear in the reply, not quadratic), a character
        still missing bytes (U+FFFD) counted once it is whole."""
        for token, item in zip(ids, items):
            window = self.ids[max(0, len(self.ids) - self.WINDOW) :]  # the same start: its artefacts cancel
            self.offsets.append(self.length)
            self.length += self._chars(window + [token]) - self._chars(window)
            self.ids.append(token)
            self.items.append(item)

    def _chars(self, ids: list[int]) -> int:
        return len(self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")) if ids else 0

    def take(self, chars: int | None) -> range:
        """The positions handed out now."""
        end = self.given
        while end < len(self.ids) and (chars is None or self.offsets[end] < chars):
            end += 1
        span, self.given = range(self.given, end), end
        return span


class Delta(str):
    """A streamed delta that also says which tokens it begins (stream(..., tokens=True)): `tokens`, one
    dict per token: its id, its text (the token decoded alone), kind (specdec.engine.decoder.KINDS), round,
    and logprob where asked for (generate(logprobs=n))."""

    tokens: tuple = ()


def iterate_deltas(run: Callable[[Callable[[str], None]], object]) -> Iterator[str]:
    """Run `run(callback)` in a thread and yield the deltas it passes to the callback, as
    transformers' TextIteratorStreamer does; an error in the run is raised here. Closing the
    iterator (close(), an interrupt, or a `break` once nothing else holds the iterator) stops the
    run at its next commit and waits for it."""
    deltas = DeltaQueue()
    done = object()
    failure: list[BaseException] = []

    def work() -> None:
        try:
            run(deltas)
        except StreamClosed:
            pass
        except BaseException as error:  # handed to the consumer below
            failure.append(error)
        finally:
            deltas.items.put(done)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (item := deltas.items.get()) is not done:
            yield item
    finally:
        deltas.closed.set()
        thread.join()  # the run must not outlive its stream: it uses the decoder's caches
    if failure:
        raise failure[0]


def check_stop_strings(stop) -> list[str]:
    """stop=None, a string, or a sequence of non-empty strings -> a list (empty: none)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty (an empty string would match before any text)")
    return list(stops)


class StopStrings:
    """Finds the first token that completes a stop string, decoding only a short window:
    the tokens just committed and enough before them for a stop string to start there."""

    def __init__(self, stops: Sequence[str], tokenizer):
        self.stops, self.tokenizer = list(stops), tokenizer
        # Tokens: every real token holds >= 1 byte and a character <= 4, so a stop string's part before
        # the new tokens (its characters but the last, and the started bytes of that one) fits in 4 x len.
        self.lookback = 4 * max(len(s) for s in self.stops)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _hit(self, text: str, head: int) -> bool:
        """A stop string in text that ends after its first `head` characters."""
        return any(text.find(s, max(0, head - len(s) + 1)) >= 0 for s in self.stops)

    def __call__(self, sequence: list[int], prompt_length: int, added: int) -> int | None:
        """-> how many new tokens to keep (through the completing token), or None."""
        first_new = len(sequence) - added
        begin = max(0, first_new - self.lookback)
        # A character still missing bytes decodes as U+FFFD; the new tokens may complete it into a stop string's end.
        head = len(self._decode(sequence[begin:first_new]).rstrip("\ufffd"))
        if not self._hit(self._decode(sequence[begin:]), head):
            return None
        for keep in range(1, added + 1):
            if self._hit(self._decode(sequence[begin : first_new + keep]), head):
                return first_new + keep - prompt_length
        return len(sequence) - prompt_length
