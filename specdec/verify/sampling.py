"""Sampling: logits -> the law a token is drawn from.

Words:
- processors: transformers' logits processors that read the prefix
  (repetition_penalty, no_repeat_ngram_size, bad words, min_new_tokens, ...).
- warpers: the prefix-free ones applied only when sampling (temperature,
  top-k, top-p, min-p, typical, epsilon, eta), in transformers' order.
- warping: processors then warpers, exactly as `generate()` builds them from a
  generation config; `Warping` applies them at every scored position with that
  position's own prefix (drafts included), as transformers' assisted
  generation does. A decoder-only `generate()` also hands the prompt to the
  processors as `encoder_input_ids` (encoder_repetition_penalty,
  encoder_no_repeat_ngram_size read it): each row's list is then built from
  its own prompt.
- greedy: `do_sample=False` or temperature 0. It is its own exact path
  (argmax of the processed logits), never "temperature 1e-5".

Draft and target go through the same `Warping`, so the draft probabilities
handed to verification are exactly the law each draft token was drawn from
(docs/DESIGN.md, contract 1). Probabilities are float32 whatever the model dtype.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.generation import SynthIDTextWatermarkingConfig
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from specdec.verify.grammar import GrammarMask

MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows float32 for ordinary logits: use greedy (0)
# generate()'s warpers: they read only the scores, never input_ids or token ids of a vocabulary.
WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
# Processors that never read input_ids: applied to all rows and positions in one call.
PREFIX_FREE = (*WARPERS, SuppressTokensLogitsProcessor)


def check_temperature(t) -> None:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or t < 0 or t == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {t!r} is too small to sample with (logits / temperature overflows); "
            f"use temperature=0 for greedy decoding or a value >= {MIN_TEMPERATURE}"
        )


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(_count(token) for token in value)


def _biases(value) -> list | None:
    """sequence_bias's biases ({(ids...): bias} or [[ids, bias], ...]); None when malformed."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    pair = lambda p: isinstance(p, (list, tuple)) and len(p) == 2 and _ids(p[0]) and len(p[0]) > 0  # noqa: E731
    if not isinstance(pairs, (list, tuple)) or not all(pair(p) for p in pairs):
        return None
    return [bias for _, bias in pairs]


# Generation-config fields with a range: (accepts, what the value must be). transformers lets some of these
# through (an infinite penalty, a NaN cutoff, a typical_p of 2) into scores that are NaN or ignored.
FIELD_RANGES: dict[str, tuple[Callable[[object], bool], str]] = {
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "a finite number > 0 (1 disables it)"),
    "encoder_repetition_penalty": (lambda v: _finite(v) and v > 0, "a finite number > 0 (1 disables it)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_h": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    "typical_p": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1] (1 disables it)"),
    "epsilon_cutoff": (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1) (0 disables it)"),
    "eta_cutoff": (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1) (0 disables it)"),
    "no_repeat_ngram_size": (_count, "an integer >= 0 (0 disables it)"),
    "encoder_no_repeat_ngram_size": (_count, "an integer >= 0 (0 disables it)"),
    "min_length": (_count, "an integer >= 0"),
    "min_new_tokens": (_count, "an integer >= 0"),
    "renormalize_logits": (lambda v: isinstance(v, bool), "True or False"),
    "remove_invalid_values": (lambda v: isinstance(v, bool), "True or False"),
    "exponential_decay_length_penalty": (
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and _count(v[0]) and _finite(v[1]) and v[1] > 0,
        "a pair (start index >= 0, finite decay factor > 0)",
    ),
    "sequence_bias": (
        lambda v: (biases := _biases(v)) is not None and all(_number(b) and not math.isnan(b) for b in biases),
        "{(token ids...): bias} or [[token ids, bias], ...] with number biases (not NaN)",
    ),
    "bad_words_ids": (
        lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(_ids(w) and len(w) for w in v),
        "a non-empty list of non-empty token-id lists",
    ),
    "suppress_tokens": (_ids, "a list of token ids (integers >= 0)"),
    "begin_suppress_tokens": (_ids, "a list of token ids (integers >= 0)"),
    "forced_bos_token_id": (_count, "a token id (an integer >= 0)"),
    "forced_eos_token_id": (lambda v: _count(v) or (_ids(v) and len(v)), "a token id or a non-empty list of them"),
    "eos_token_id": (lambda v: _count(v) or (_ids(v) and len(v)), "a token id or a non-empty list of them"),
    "pad_token_id": (_count, "a token id (an integer >= 0)"),
    "bos_token_id": (_count, "a token id (an integer >= 0)"),
    "decoder_start_token_id": (lambda v: _count(v) or (_ids(v) and len(v)), "a token id or a non-empty list of them"),
}
# Read only when sampling: generate() ignores them under greedy, so a model's config may hold any value there.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
# Checked in a model's own generation config as well: values generate() fails on mid-run or turns into NaN scores
# (metadata ids such as a pad_token_id of -1 are left alone there: generate() never reads them).
MODEL_CHECKED = (
    *("repetition_penalty", "encoder_repetition_penalty", "exponential_decay_length_penalty", "sequence_bias"),
    *("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "watermarking_config"),
)


def check_generation_values(settings: dict) -> None:
    """Refuse a generation-config value outside its field's range (None: unset, left to the config)."""
    for name, value in settings.items():
        if value is None:
            continue
        if name == "temperature":
            check_temperature(value)
        elif name == "watermarking_config" and isinstance(value, SynthIDTextWatermarkingConfig):
            raise ValueError(
                f"watermarking_config={type(value).__name__}(...) is not supported: SynthID keeps state from one "
                "generate() step to the next, which speculative rounds do not follow; use WatermarkingConfig"
            )
        elif name in FIELD_RANGES and not FIELD_RANGES[name][0](value):
            raise ValueError(f"{name} must be {FIELD_RANGES[name][1]}, got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature, top-k and top-p alone (no generation config): the warpers of `generate()`."""

    temperature: float = 1.0
    top_k: int | None = None  # None or 0: no top-k
    top_p: float | None = None  # None or 1.0: no top-p

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None disables it), got {self.top_k!r}")
        if self.top_p is not None and not (
            isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1] (1 or None disables it), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        """transformers' warpers for this config, in generate()'s order (empty for greedy)."""
        warpers = LogitsProcessorList()
        if self.greedy:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(self.top_p)))
        return warpers


class Warping:
    """Processors and warpers applied at every scored position with its own prefix.

    `build(prompt)` returns the processor list for a row with that prompt (min_new_tokens and
    begin-suppression count from its length); lists are built once per prompt length, or once
    per prompt where `reads_prompt` (the encoder_* processors read its ids). When every
    processor is prefix-free, all rows and positions go through one batched call.
    """

    def __init__(
        self, greedy: bool, build: Callable[[Sequence[int]], LogitsProcessorList], reads_prompt=False, constraint=None
    ):
        self.greedy = greedy
        self._build, self._lists, self.reads_prompt = build, {}, reads_prompt
        self.constraint = constraint  # a CompiledConstraint (specdec.verify.grammar) its lists mask with, or None
        self.constrained = constraint is not None
        self.prompt_lengths: Sequence[int] | None = None  # per row, set by for_prompts
        self.prefix_free = all(isinstance(p, PREFIX_FREE) for p in self.processors(1))
        # Prefix-free processors around one grammar mask (structured output, no penalties): the masks are read
        # per position, everything else runs batched, in the list's order.
        kinds = [isinstance(p, (*PREFIX_FREE, GrammarMask)) for p in self.processors(1)]
        self.masked = constraint is not None and all(kinds)

    @classmethod
    def from_sampling(cls, config: SamplingConfig, constraint=None) -> Warping:
        warpers = config.warpers()
        if constraint is None:
            return cls(config.greedy, lambda prompt: warpers)
        return cls(config.greedy, lambda prompt: LogitsProcessorList([constraint.mask(len(prompt)), *warpers]),
                   constraint=constraint)  # fmt: skip

    @classmethod
    def from_generation_config(cls, model, generation_config, constraint=None) -> Warping:
        """The processors `model.generate(generation_config=...)` would build, in its order, for each
        prompt length. generation_config must be resolved (see `resolve_generation_config`), with the
        run's max_new_tokens. A constraint's mask goes where generate(logits_processor=[mask]) puts it."""

        def build(prompt: Sequence[int]) -> LogitsProcessorList:
            # max_length and min_length count the prompt (forced EOS reads max_length): set as generate() does.
            config = copy.copy(generation_config)
            model._prepare_generated_length(
                config,
                has_default_max_length=True,
                has_default_min_length=True,
                model_input_name="input_ids",
                input_ids_length=len(prompt),
                inputs_tensor=None,
            )
            # transformers' own builder keeps the order and the set of processors identical to generate(),
            # which gives a decoder-only model's prompt as encoder_input_ids.
            return model._get_logits_processor(
                generation_config=config,
                input_ids_seq_length=len(prompt),
                encoder_input_ids=torch.tensor([list(prompt)], dtype=torch.long, device=model.device),
                logits_processor=LogitsProcessorList([constraint.mask(len(prompt))] if constraint else []),
                device=model.device,
            )

        config = generation_config
        reads_prompt = config.encoder_repetition_penalty not in (None, 1.0) or bool(config.encoder_no_repeat_ngram_size)
        return cls(not config.do_sample, build, reads_prompt, constraint)

    def for_prompts(self, prompt_lengths: Sequence[int]) -> Warping:
        """This warping for a batch whose rows have these prompt lengths (shares the built lists)."""
        bound = copy.copy(self)
        bound.prompt_lengths = list(prompt_lengths)
        return bound

    def processors(self, prompt_length: int, prompt: Sequence[int] | None = None) -> LogitsProcessorList:
        """The list for a row whose prompt has this length; where the list reads the prompt's ids, for
        this prompt (without one, a stand-in of that length: enough to ask which processors there are)."""
        key = tuple(prompt) if self.reads_prompt and prompt is not None else prompt_length
        if key not in self._lists:
            self._lists[key] = self._build(prompt if prompt is not None else [0] * prompt_length)
        return self._lists[key]

    def scores(
        self,
        logits: torch.Tensor,  # [batch, n, vocab]
        prefixes: Sequence[Sequence[int]] | None = None,  # per row: the tokens before position 0
        drafts: torch.Tensor | None = None,  # [batch, >= n - 1]: position j's prefix adds drafts[:, :j]
        paths: Sequence[Sequence[Sequence[int]]] | None = None,  # or paths[b][j]: position j's own additions
    ) -> torch.Tensor:
        """Processed float32 scores [batch, n, vocab], as generate() computes them before sampling."""
        batch, n, vocab = logits.shape
        flat = logits.reshape(batch * n, vocab).float()
        if self.prefix_free:
            processors = self.processors(1)
            if len(processors):
                # Prefix-free processors ignore input_ids; an empty [rows, 0] tensor satisfies their signature.
                flat = processors(flat.new_empty((flat.shape[0], 0), dtype=torch.long), flat)
            return flat.reshape(batch, n, vocab)
        prompt_lengths = self.prompt_lengths
        assert prefixes is not None and prompt_lengths is not None, "prefix-reading processors need the prefixes"
        if self.masked:
            return self._masked(flat, prefixes, drafts, paths, n).reshape(batch, n, vocab)
        out = torch.empty_like(flat)
        for row, j, prefix in positions(prefixes, drafts, paths, n):
            prompt = prefixes[row][: prompt_lengths[row]] if self.reads_prompt else None
            ids = torch.tensor([prefix], dtype=torch.long, device=flat.device)
            scores = flat[row * n + j : row * n + j + 1].clone()
            for processor in self.processors(prompt_lengths[row], prompt):  # LogitsProcessorList's loop, without
                scores = processor(ids, scores)  # its signature check per call
            out[row * n + j] = scores[0]
        return out.reshape(batch, n, vocab)

    def forced(self, prefixes: Sequence[Sequence[int]], rows: Sequence[int]) -> list[int | None]:
        """For each of `rows`: the one token its constraint allows after prefixes[row], or None (no
        constraint, or more than one token allowed). Its processed law there is that token's point mass."""
        if self.constraint is None:
            return [None] * len(rows)
        return [self._mask(row).forced(prefixes[row]) for row in rows]

    def grammatical(self, prefix: Sequence[int], row: int, drafts: list[int], room: int) -> tuple[list[int], int]:
        """A point-mass chain for this row cut before the first token its constraint refuses, then followed
        by the tokens it forces, up to `room` in all (no constraint: the chain as it is) -> (chain, forced)."""
        if self.constraint is None:
            return drafts, 0
        mask = self._mask(row)
        chain = drafts[: mask.legal(list(prefix), drafts)][:room]
        kept = len(chain)
        while len(chain) < room and (token := mask.forced(list(prefix) + chain)) is not None:
            chain.append(token)
        return chain, len(chain) - kept

    def _masked(self, flat, prefixes, drafts, paths, n: int) -> torch.Tensor:
        """`scores` where the one prefix-reading processor is the grammar's mask: the processors before it
        batched, each position's mask, the processors after it batched (the same list, the same order)."""
        processors = self.processors(1)
        at = next(i for i, p in enumerate(processors) if isinstance(p, GrammarMask))
        empty = flat.new_empty((flat.shape[0], 0), dtype=torch.long)
        for processor in processors[:at]:
            flat = processor(empty, flat)
        refused = torch.zeros(flat.shape, dtype=torch.bool)
        for row, j, prefix in positions(prefixes, drafts, paths, n):
            cut = self._mask(row).refused(prefix, flat.shape[-1])
            if cut is not None:
                refused[row * n + j] = cut
        flat = flat.masked_fill(refused.to(flat.device), float("-inf"))
        for processor in processors[at + 1 :]:
            flat = processor(empty, flat)
        return flat

    def _mask(self, row: int):
        """The grammar's mask in this row's processor list (a constrained warping)."""
        return next(p for p in self.processors(self.prompt_lengths[row]) if isinstance(p, GrammarMask))

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores -> the float32 law sampled from (one-hot argmax when greedy)."""
        if self.greedy:
            return torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
        return torch.softmax(scores, dim=-1)


def positions(prefixes, drafts, paths, n: int):
    """Each scored position -> (row, j, its own prefix): the row's prefix, then drafts[row, :j] (a chain) or
    paths[row][j] (a tree node's ancestors)."""
    tail = drafts.tolist() if drafts is not None else [[] for _ in prefixes]
    for row, prefix in enumerate(prefixes):
        for j in range(n):
            yield row, j, list(prefix) + (list(paths[row][j]) if paths is not None else tail[row][:j])


class RowWarpings:
    """Rows with their own sampling settings: one Warping per row, behind Warping's interface. A
    greedy row's law is the one-hot argmax (`Warping.probs`), so in a batch that also samples, the
    sampling verification gives a greedy row exactly its argmax tokens: accepted iff the draft is the
    argmax, else recovered as the argmax (the residual of a one-hot law is itself)."""

    def __init__(self, warpings: Sequence[Warping]):
        self.warpings = list(warpings)
        self.greedy = all(w.greedy for w in self.warpings)  # the all-greedy fast path
        self.prefix_free = all(w.prefix_free for w in self.warpings)
        self.reads_prompt = any(w.reads_prompt for w in self.warpings)
        self.prompt_lengths: Sequence[int] | None = None
        self.constraint = None  # rows' constraints are their own warpings'
        self.constrained = any(w.constrained for w in self.warpings)

    def for_prompts(self, prompt_lengths: Sequence[int]) -> RowWarpings:
        bound = RowWarpings([w.for_prompts([n]) for w, n in zip(self.warpings, prompt_lengths)])
        bound.prompt_lengths = list(prompt_lengths)
        return bound

    def processors(self, prompt_length: int, prompt: Sequence[int] | None = None) -> LogitsProcessorList:
        """Every row's processors (callers ask which kinds there are, never apply this list)."""
        return LogitsProcessorList(p for w in self.warpings for p in w.processors(prompt_length, prompt))

    def scores(self, logits, prefixes=None, drafts=None, paths=None) -> torch.Tensor:
        """Each row through its own warping: [batch, n, vocab] float32."""
        return torch.cat(
            [
                w.scores(
                    logits[b : b + 1],
                    None if prefixes is None else prefixes[b : b + 1],
                    None if drafts is None else drafts[b : b + 1],
                    None if paths is None else paths[b : b + 1],
                )
                for b, w in enumerate(self.warpings)
            ]
        )

    def forced(self, prefixes: Sequence[Sequence[int]], rows: Sequence[int]) -> list[int | None]:
        return [self.warpings[row].forced([prefixes[row]], [0])[0] for row in rows]

    def grammatical(self, prefix: Sequence[int], row: int, drafts: list[int], room: int) -> tuple[list[int], int]:
        return self.warpings[row].grammatical(prefix, 0, drafts, room)

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.cat([w.probs(scores[b : b + 1]) for b, w in enumerate(self.warpings)])


def row_warping(warpings: Sequence[Warping]) -> Warping | RowWarpings:
    """One Warping where every row shares it, else RowWarpings."""
    return warpings[0] if all(w is warpings[0] for w in warpings) else RowWarpings(warpings)


# Fields a model's own generation_config may set that switch generate() to another decoding mode, with
# the value that leaves it greedy or sampling (explicit arguments are checked in specdec.config).
MODEL_MODES = {"num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "dola_layers": None, "guidance_scale": 1.0}


def resolve_generation_config(model, **overrides):
    """The generation config `model.generate(**overrides)` would use: explicit values over
    model.generation_config over transformers' defaults, with special tokens prepared.
    `overrides` with value None are left to the model's config."""
    given = {key: value for key, value in overrides.items() if value is not None}
    config, _ = model._prepare_generation_config(None, **given)  # as generate(**given) does
    # The model's own config too, where generate() would fail mid-run or compute NaN scores from it.
    check_generation_values({name: getattr(config, name, None) for name in MODEL_CHECKED})
    if config.eos_token_id == []:
        raise ValueError("eos_token_id must be a token id or a non-empty list of them, got []")
    for name, neutral in MODEL_MODES.items():  # a decoding mode the model's own config turns on: refused by name
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            fix = f"pass {name}={neutral!r}" if neutral is not None else f"set model.generation_config.{name} = None"
            raise ValueError(
                f"the target's generation_config sets {name}={value!r}, a decoding mode specdec does not reproduce "
                f"(generate() would not decode greedily or by sampling); {fix} to decode with specdec"
            )
    if config.do_sample:
        check_generation_values({name: getattr(config, name, None) for name in SAMPLING_FIELDS})
        SamplingConfig(1.0, config.top_k, config.top_p)  # range checks for top_k and top_p
    model._prepare_special_tokens(config, device=model.device)
    if config.exponential_decay_length_penalty is not None and config._eos_token_tensor is None:
        raise ValueError("exponential_decay_length_penalty needs an EOS token id: set eos_token_id")
    return config


ONE_LEVEL_VOCAB = 4096  # sample() draws over vocabularies up to this size in one level


def _block_size(vocab: int) -> int:
    """The divisor of vocab nearest sqrt(vocab) from below (1 for a prime vocab)."""
    for size in range(int(vocab**0.5), 0, -1):
        if vocab % size == 0:
            return size
    return 1


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [rows, n] >= 0 with positive row sums, uniforms [rows] in [0, 1) -> index [rows].
    Never returns a zero-weight index."""
    cumulative = weights.double().cumsum(-1)  # [rows, n]
    index = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True).squeeze(-1)
    # u * total can round up to total; fall back to the last index with positive weight.
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).long().argmax(-1)
    return torch.minimum(index, last_positive)


def sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from unnormalised non-negative weights [..., vocab] -> [...] long.

    Two-level inverse CDF with float64 uniforms: pick a block of the vocabulary by
    its mass, then a token inside it. It reads the weights once and allocates only
    [rows, sqrt(vocab)] temporaries (torch.multinomial was 10x slower at vocab 151936).
    Block masses are float32 sums (float64 ones were 30x slower): the law sampled equals
    the given one to ~1e-7 relative, the precision of the float32 probabilities themselves. A vocabulary
    of at most ONE_LEVEL_VOCAB tokens is drawn in one level (one float64 inverse CDF over it).
    """
    vocab = weights.shape[-1]
    flat = weights.reshape(-1, vocab)
    if vocab <= ONE_LEVEL_VOCAB:  # one float64 cumsum over a small vocabulary: half the kernels
        uniforms = torch.rand(flat.shape[0], dtype=torch.float64, generator=generator, device=flat.device)
        return _inverse_cdf(flat, uniforms).reshape(weights.shape[:-1])
    rows, size = flat.shape[0], _block_size(vocab)
    uniforms = torch.rand(2, rows, dtype=torch.float64, generator=generator, device=flat.device)
    blocks = flat.reshape(rows, vocab // size, size)
    block = _inverse_cdf(blocks.sum(-1).double(), uniforms[0])  # [rows]; float32 sums: float64 ones are 30x slower
    inside = blocks[torch.arange(rows, device=flat.device), block]  # [rows, size]
    token = block * size + _inverse_cdf(inside, uniforms[1])
    return token.reshape(weights.shape[:-1])
