"""Structured output: a grammar as a processor of the target's law (llguidance's matcher).

Words:
- constraint: what a row's output must match: a JSON schema, any JSON object, a regex, or a grammar
  (Lark, or llama.cpp's GBNF). The output is the row's new tokens; the prompt is not read.
- mask: the tokens the grammar allows after a prefix of the output. EOS is in it only where the grammar
  may end; where the grammar allows nothing else (a dead end), EOS alone, so the row ends there.
- forced token: a position whose mask allows exactly one token.
- complete: the output so far is a whole sentence of the grammar.

`GrammarMask` is a transformers logits processor: it sits where `generate(logits_processor=[...])` puts a
user's, after the model's own processors and before the warpers, so the constrained law is the target's
processed law restricted to the mask and renormalised by the warpers after it. Its mask at a position
depends only on that position's own prefix (`Warping` hands each scored position its prefix, drafts
included), so drafts and verification see exactly the law of the target alone. It keeps one matcher per
recent output and moves it to each prefix asked for by rollback and replay, the only state it holds.

llguidance over xgrammar: one mask over Qwen2.5's 151,936 tokens took a median 163 µs against 621 µs
(scripts/mask_cost.py, docs/BENCHMARKS.md "Structured output"); both roll back.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

KINDS = ("json_schema", "json_object", "regex", "grammar")
# JSON as json.dumps writes it: one spelling of the whitespace, so keys a schema fixes are forced
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REFUSED_KEPT = 256  # distinct masks whose refused tokens a GrammarMask keeps (a bounded memo)
MATCHERS = 64  # recent outputs a mask keeps a matcher for (rows of one batch that share a prompt length)


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: kind (KINDS) and its source text (schema JSON, regex, grammar)."""

    kind: str
    source: str

    @property
    def grammar(self) -> str:
        """llguidance's grammar for this constraint, built once per kind and source (a request checks, then
        compiles, then joins the batch, each with its own Constraint)."""
        return _grammar(self.kind, self.source)

    def check(self) -> None:
        """Raise ValueError where the constraint does not compile (before any model runs)."""
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.grammar)
        except (ValueError, TypeError, RuntimeError) as caught:  # a malformed regex or schema, raised while built
            error = str(caught)
        if error:
            raise ValueError(f"the {self.kind.replace('_', ' ')} does not compile: {error.strip()}")


@functools.lru_cache(maxsize=64)
def _grammar(kind: str, source: str) -> str:
    """llguidance's grammar for a constraint's kind and source text."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "grammar":  # Lark as it is, GBNF (llama.cpp's) translated to Lark
        return LLMatcher.grammar_from_lark(any_to_lark(source))
    schema = json.loads(source) if kind == "json_schema" else {"type": "object"}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": COMPACT_JSON}
    return LLMatcher.grammar_from_json_schema(schema)


def constraint_of(response_format=None, json_schema=None, regex=None, grammar=None) -> Constraint | None:
    """The one constraint these options ask for (None: unconstrained), checked to compile.
    response_format: OpenAI's ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}}; "text" is none), or a JSON schema as a dict or a Pydantic model class.
    json_schema: a schema (dict, JSON text or Pydantic model class); regex, grammar: text."""
    given = {n: v for n, v in dict(response_format=response_format, json_schema=json_schema, regex=regex,
                                  grammar=grammar).items() if v is not None}  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"give one output constraint, not {' and '.join(given)}")
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "response_format":
        constraint = _response_format(value)
    elif name == "json_schema":
        constraint = Constraint("json_schema", _schema_text(value, "json_schema"))
    else:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be non-empty text, got {value!r}")
        constraint = Constraint(name, value)
    if constraint is not None:
        constraint.check()
    return constraint


def _response_format(value) -> Constraint | None:
    if hasattr(value, "model_json_schema"):  # a Pydantic model class, as openai's parse() takes
        return Constraint("json_schema", _schema_text(value, "response_format"))
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError(
            'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {value!r}'
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "")
    if kind != "json_schema":
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
    return Constraint("json_schema", _schema_text(spec["schema"], "response_format's schema"))


def _schema_text(schema, what: str) -> str:
    """A JSON schema (dict, JSON text or Pydantic model class) as canonical JSON text."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"{what} is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema)  # in its own order: the properties of an object come out in that order


_TOKENIZERS: dict[tuple, object] = {}  # (tokenizer id, vocab, eos ids) -> llguidance's view (~2 s for Qwen's)


def grammar_tokenizer(tokenizer, vocab: int, eos_ids) -> object:
    """llguidance's view of a tokenizer with these EOS ids: a fast tokenizer's own (byte-level BPE and the
    like); otherwise each id's decoded text (character- and word-level tokenizers)."""
    import llguidance
    import llguidance.hf

    key = (id(tokenizer), vocab, tuple(sorted(eos_ids)))
    if key in _TOKENIZERS:
        return _TOKENIZERS[key][1]
    try:
        view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos_ids))
    except (ValueError, TypeError, RuntimeError):
        view = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Decoded(tokenizer, vocab, eos_ids)))
    _TOKENIZERS[key] = (tokenizer, view)  # the tokenizer is held so its id is not reused
    return view


class _Decoded:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes (EOS ids special)."""

    bos_token_id = None

    def __init__(self, tokenizer, vocab: int, eos_ids):
        eos = sorted(eos_ids)
        self.eos_token_id, self.special_token_ids = eos[0], eos
        self.tokens = [b"\xff<eos>" if i in eos else tokenizer.decode([i]).encode() for i in range(vocab)]
        self._tokenizer = tokenizer

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        return list(self._tokenizer(text)["input_ids"])


class CompiledConstraint:
    """A constraint compiled for one tokenizer and EOS set: makes matchers, checks outputs."""

    def __init__(self, constraint: Constraint, tokenizer, vocab: int, eos_ids):
        if not eos_ids:
            raise ValueError("structured output needs an EOS token id (the grammar ends with it): pass eos_token_id=")
        self.constraint, self.vocab, self.eos_ids = constraint, vocab, sorted(eos_ids)
        self._view, self._grammar = grammar_tokenizer(tokenizer, vocab, eos_ids), constraint.grammar
        self.matcher()  # a grammar that names tokens this tokenizer lacks fails here, before decoding

    def matcher(self):
        from llguidance import LLMatcher

        matcher = LLMatcher(self._view, self._grammar)
        if matcher.is_error():
            raise ValueError(f"the {self.constraint.kind.replace('_', ' ')} does not compile: {matcher.get_error()}")
        return matcher

    def complete(self, tokens) -> bool:
        """Whether these output tokens (an EOS at the end is the grammar's end) are a whole sentence."""
        tokens = list(tokens)
        if tokens and tokens[-1] in self.eos_ids:
            tokens = tokens[:-1]
        matcher = self.matcher()
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    def mask(self, start: int) -> GrammarMask:
        return GrammarMask(self, start)


class GrammarMask(LogitsProcessor):
    """Masks the scores of each row to the tokens the grammar allows after its output, input_ids[start:].
    A prefix the grammar refused (a rejected draft's own continuation, never emitted) is left unmasked."""

    def __init__(self, compiled: CompiledConstraint, start: int):
        self.compiled, self.start = compiled, start
        self._matchers: list[list] = []  # [output tokens, matcher at them], most recently used last
        self._last: tuple[tuple, torch.Tensor | None] = ((), None)  # the last output asked for, and its mask
        self._refused: dict[bytes, torch.Tensor] = {}  # a mask's bytes -> its refused tokens (rows share states)

    def allowed(self, output: list[int]) -> torch.Tensor | None:
        """The bitmask [1, words] of tokens allowed after `output`; None where the grammar refused it."""
        import llguidance.torch

        key = tuple(output)
        if self._last[1] is not None and self._last[0] == key:  # a drafter's forced check, then its scores
            return self._last[1]
        matcher, legal = self._matcher(output)
        if not legal:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.compiled.vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        if not bool(bitmask.any()):  # a dead end: the row ends here (incomplete: finish reason "length")
            for eos in self.compiled.eos_ids:
                bitmask[0, eos // 32] |= 1 << (eos % 32)
        self._last = (key, bitmask)
        return bitmask

    def forced(self, prefix: list[int]) -> int | None:
        """The one token the grammar allows after this prefix (prompt and output), or None."""
        bitmask = self.allowed(list(prefix[self.start :]))
        if bitmask is None:
            return None
        words = bitmask[0].nonzero()
        if len(words) != 1:
            return None
        word = int(words[0])
        bits = int(bitmask[0, word]) & 0xFFFFFFFF
        return word * 32 + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None

    def legal(self, prefix: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, one after another after this prefix, the grammar accepts."""
        output = list(prefix[self.start :])
        self._matcher(output + list(tokens))
        return max(0, len(self._matchers[-1][0]) - len(output))  # the matcher just used holds the legal part

    def refused(self, prefix: list[int], vocab: int) -> torch.Tensor | None:
        """[vocab] bool: the tokens the grammar refuses after this prefix (None: it refused the prefix)."""
        output = list(prefix[self.start :])
        bitmask = self.allowed(output)
        if bitmask is None:
            return None
        key = bitmask.numpy().tobytes()
        refused = self._refused.get(key)
        if refused is None or len(refused) != vocab:
            bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # llguidance's apply compiles
            refused = bits.flatten()[:vocab] == 0
            if len(self._refused) >= REFUSED_KEPT:
                self._refused.clear()
            self._refused[key] = refused
        return refused

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row in range(input_ids.shape[0]):
            refused = self.refused(input_ids[row].tolist(), scores.shape[-1])
            if refused is not None:
                scores[row].masked_fill_(refused.to(scores.device), float("-inf"))
        return scores

    def _matcher(self, output: list[int]):
        """A matcher moved to `output` (rolled back to the longest prefix it shares, then fed the rest)
        -> (matcher, whether the grammar accepts every token of output)."""
        best, shared = None, -1
        for entry in self._matchers:
            held = entry[0]
            n = 0
            limit = min(len(held), len(output))
            while n < limit and held[n] == output[n]:
                n += 1
            if n > shared:
                best, shared = entry, n
        if best is None or (shared < len(best[0]) // 2 and len(self._matchers) < MATCHERS):
            best, shared = [[], self.compiled.matcher()], 0  # another row's output: leave its matcher be
            self._matchers.append(best)
        elif shared < len(best[0]):
            best[1].rollback(len(best[0]) - shared)
            del best[0][shared:]
        self._matchers.remove(best)
        self._matchers.append(best)
        del self._matchers[:-MATCHERS]
        rest = output[shared:]
        taken = best[1].try_consume_tokens(rest) if rest else 0
        best[0].extend(rest[:taken])
        return best[1], taken == len(rest)
