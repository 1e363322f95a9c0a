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
    """transformers' incremental detokeniser, handing each final piece of text to a callback."""

    def __init__(self, tokenizer, callback: Callable[[str], None]):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.callback = callback

    def __call__(self, row: int, tokens: list[int]) -> None:  # the decoder's on_commit hook
        if isinstance(self.callback, DeltaQueue):  # every round: a word may take many tokens to end
            self.callback.check()
        self.put(torch.tensor(tokens))

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.callback(text)


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
