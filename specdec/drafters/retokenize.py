"""Committed text between two tokenizers: the target's committed tokens decoded to text, and that
text encoded in the draft's own tokens, a short tail at a time.

Words:
- committed text: the text of a row's committed target tokens (prompt and output), decoded with
  special tokens kept, so a chat prompt reads the same to a draft that shares its chat markers.
- mark: (draft tokens, characters) such that the draft ids before it encode the committed text
  before it. A mark sits where the penultimate pre-token (word) of the last window starts: text
  appended later can re-split only the last words, so each round re-encodes a short tail from there.
- held back: the last target tokens whose text ends inside a character (a UTF-8 sequence split
  across tokens); their text joins once the character is whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

CONTEXT = 4  # tokens of left context when decoding a tail: alone it may lose a leading space or split a character
HOLD_BACK = 4  # target tokens a split character may span (UTF-8: up to 4 bytes)
_WORDS = re.compile(r"\s*\S+|\s+")  # a stand-in pre-tokenizer for tokenizers without one


def decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def text_after(tokenizer, context: Sequence[int], ids: Sequence[int]) -> str | None:
    """The text `ids` add after `context` (a few tokens before them); None where that is not clean
    (a character split at the end, or a decoder that rewrites the context)."""
    before = decode(tokenizer, context)
    after = decode(tokenizer, list(context) + list(ids))
    if not after.startswith(before) or after.endswith("\ufffd"):
        return None
    return after[len(before) :]


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def check_text_compatible(draft_tokenizer, target_tokenizer, target_vocab_size: int) -> None:
    """ValueError unless the target's tokens decode to text that the draft's tokenizer encodes and
    decodes back unchanged, whole and in pieces (the round trip every round relies on)."""
    for role, tokenizer in (("draft", draft_tokenizer), ("target", target_tokenizer)):
        if not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(
                f"the {role} tokenizer {_name(tokenizer)!r} cannot encode and decode text; "
                "a draft with another tokenizer needs two transformers tokenizers"
            )
    size = min(target_vocab_size, len(target_tokenizer))
    sample_ids = list(range(0, size, max(1, size // 400)))
    try:
        pieces = [decode(target_tokenizer, [i]) for i in sample_ids]
        probe = "".join(p for p in pieces if p.isascii() and p.isprintable())[:400]
        whole = decode(draft_tokenizer, encode(draft_tokenizer, probe))
        halves = [probe[: len(probe) // 2], probe[len(probe) // 2 :]]
        joined = decode(draft_tokenizer, [i for half in halves for i in encode(draft_tokenizer, half)])
    except Exception as error:  # a tokenizer that cannot decode or encode at all
        raise ValueError(
            f"the draft tokenizer {_name(draft_tokenizer)!r} and the target tokenizer "
            f"{_name(target_tokenizer)!r} disagree, and text cannot pass between them: {error}"
        ) from None
    if whole != probe or joined != probe:
        got = whole if whole != probe else joined
        raise ValueError(
            f"the tokenizers of draft {_name(draft_tokenizer)!r} ({len(draft_tokenizer)} tokens) and target "
            f"{_name(target_tokenizer)!r} ({len(target_tokenizer)} tokens) disagree, and the draft's does not "
            f"return the target's text unchanged ({probe[:40]!r} came back as {got[:40]!r}); "
            "use a draft that reads the target's text, or draft='ngram'"
        )


@dataclass
class _Row:
    """One row's committed text and the draft's tokens for it."""

    text: str = ""  # the committed text of the target tokens before `consumed`
    consumed: int = 0  # target tokens whose text is in `text`
    ids: list[int] = field(default_factory=list)  # draft ids that encode text[: marks[-1][1]]
    marks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # (draft ids, characters)
    cached: list[int] = field(default_factory=list)  # draft ids in the draft's KV cache, in order


class CommittedText:
    """Per row: committed target tokens -> committed text -> the draft's ids for that text.
    Only a short tail is decoded and re-encoded each round (see `marks`)."""

    def __init__(self, draft_tokenizer, target_tokenizer):
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        backend = getattr(draft_tokenizer, "backend_tokenizer", None)
        self._pre_tokenizer = getattr(backend, "pre_tokenizer", None)
        self.rows: list[_Row] = []

    def reset(self, batch: int) -> None:
        self.rows = [_Row() for _ in range(batch)]

    def sync(self, b: int, sequence: Sequence[int]) -> bool:
        """Bring row b's text and draft ids up to its committed target tokens. False while the text
        is held back (a character split across the last target tokens): no drafts this round."""
        row = self.rows[b]
        if len(sequence) < row.consumed:  # a stop string cut committed tokens: start the row over
            self.rows[b] = row = _Row(cached=row.cached)
        if len(sequence) > row.consumed:
            left = max(0, row.consumed - CONTEXT)
            before = decode(self.target_tokenizer, sequence[left : row.consumed])
            for end in range(len(sequence), max(row.consumed, len(sequence) - HOLD_BACK), -1):
                after = decode(self.target_tokenizer, sequence[left:end])
                if after.startswith(before) and not after.endswith("\ufffd"):
                    row.text += after[len(before) :]
                    row.consumed = end
                    break
        if len(row.text) > row.marks[-1][1]:
            self._reencode(row)
        return row.consumed == len(sequence)

    def _reencode(self, row: _Row) -> None:
        """Re-encode the text after the mark before the edge; set a new mark before its last word."""
        if len(row.marks) > 1:
            row.marks.pop()  # the old edge: text appended there may merge with the word before it
        n, c = row.marks[-1]
        window = row.text[c:]
        encoded = encode(self.draft_tokenizer, window)
        row.ids[n:] = encoded
        split = self._stable_split(window)
        if split > 0:
            head = encode(self.draft_tokenizer, window[:split])
            if encoded[: len(head)] == head:
                row.marks.append((n + len(head), c + split))
        row.marks.append((len(row.ids), len(row.text)))
        del row.marks[1:-3]  # only the last marks are ever restarted from

    def _stable_split(self, window: str) -> int:
        """Where the penultimate pre-token of the window starts: text appended later re-splits at most
        the last two pre-tokens (a word, or a whitespace run that gives its last space to the next word)."""
        if self._pre_tokenizer is not None:
            try:
                starts = [start for _, (start, _) in self._pre_tokenizer.pre_tokenize_str(window)]
            except Exception:  # a normaliser-dependent pre-tokenizer: fall back to words
                starts = [m.start() for m in _WORDS.finditer(window)]
        else:
            starts = [m.start() for m in _WORDS.finditer(window)]
        return starts[-2] if len(starts) >= 3 else 0
