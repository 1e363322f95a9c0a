"""Request checks: a generate() call's arguments and prompts, checked before any model is touched.

Words: a prompt is a string, token ids (a list, a 1-D tensor or array), or a chat (a list of
{"role", "content"} messages); a batch is a list of prompts. A `SpecConfig` holds one call's checked
arguments; sampling values of None defer to the target's generation config.
"""

from __future__ import annotations

import difflib
import functools
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from specdec.text import check_stop_strings
from specdec.verify import VERIFICATIONS, check_draft_width
from specdec.verify.grammar import Constraint, constraint_of
from specdec.verify.sampling import SamplingConfig, check_generation_values, check_temperature

MAX_SEED = 2**64 - 1
# Every stop string is searched for in each round's window (4x its length): bounded, as OpenAI's 4 are.
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
# generate()'s own arguments (beside generation-config fields), for "did you mean" hints.
ARGUMENTS = ("max_new_tokens", "num_draft_tokens", "seed", "verification", "draft_width", "chat", "stop", "stream")
LOAD_OPTIONS = (
    *("cache", "compile", "progress", "dtype", "device", "tokenizer"),
    *("draft_quantization", "target_quantization"),
)
# Keywords (and their CLI flags) removed because their measured gain was at noise level or below
# (docs/FEATURES.md): each is refused in one line that says what to do instead, never ignored.
REMOVED: dict[str, str] = {
    "draft_vocab": "draft_vocab was removed (it measured at noise level, docs/FEATURES.md); drop it: the draft "
    "computes its full head",
    "draft_mode": "draft_mode was removed (intersection mode measured slower than text mode, docs/FEATURES.md); "
    "drop it: a draft with another tokenizer drafts its text, re-encoded",
}

_BEAMS = "specdec decodes one sequence per prompt, greedy or sampled (no beam search)"
_DRAFTING = "specdec drafts itself: choose the drafter with draft= and its length with num_draft_tokens="
_LOADING = "choose the cache and compilation when loading: from_pretrained(..., cache='static', compile=True)"
_OUTPUTS = "results hold token ids, text and metrics; use the model itself for scores or hidden states"
# Generation-config fields that change generate() in ways specdec does not reproduce, with what to do
# instead; each is accepted only at None or at the value that changes nothing.
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "max_length": (None, "use max_new_tokens (the number of new tokens)"),
    "stop_strings": (None, "use stop=[...]"),
    "num_beams": (1, _BEAMS),
    "num_beam_groups": (1, _BEAMS),
    "diversity_penalty": (0.0, _BEAMS),
    "length_penalty": (1.0, _BEAMS),
    "early_stopping": (False, _BEAMS),
    "constraints": (None, _BEAMS),
    "force_words_ids": (None, _BEAMS),
    "low_memory": (None, _BEAMS),
    "num_return_sequences": (1, "pass the prompt several times, as a batch, to get several samples"),
    "penalty_alpha": (None, "contrastive search is not supported; use greedy or sampling"),
    "dola_layers": (None, "DoLa decoding is not supported; use greedy or sampling"),
    "guidance_scale": (1.0, "classifier-free guidance is not supported"),
    "token_healing": (None, "token healing is not supported"),
    "max_time": (None, "bound the run with max_new_tokens, or stop iterating stream()"),
    "use_cache": (True, "specdec always decodes with a KV cache"),
    "cache_implementation": (None, _LOADING),
    "cache_config": (None, _LOADING),
    "max_cache_len": (None, _LOADING),
    "compile_config": (None, _LOADING),
    "disable_compile": (None, _LOADING),
    "prefill_chunk_size": (None, "chunked prefill is not supported"),
    "continuous_batching_config": (None, "continuous batching is not supported; pass a list of prompts"),
    "output_scores": (False, _OUTPUTS),
    "output_logits": (False, _OUTPUTS),
    "output_attentions": (False, _OUTPUTS),
    "output_hidden_states": (False, _OUTPUTS),
    "return_dict_in_generate": (False, _OUTPUTS),
    "num_assistant_tokens": (None, _DRAFTING),
    "num_assistant_tokens_schedule": (None, _DRAFTING),
    "assistant_confidence_threshold": (None, _DRAFTING),
    "assistant_early_exit": (None, _DRAFTING),
    "assistant_lookbehind": (None, _DRAFTING),
    "target_lookbehind": (None, _DRAFTING),
    "assistant_ensemble_weight": (None, _DRAFTING),
    "is_assistant": (None, _DRAFTING),
    "prompt_lookup_num_tokens": (None, "use draft='ngram' (prompt lookup)"),
    "max_matching_ngram_size": (None, "use draft='ngram' (prompt lookup)"),
    "speculation_type": (None, _DRAFTING),
    "use_mtp": (None, _DRAFTING),
}
_PROCESSOR = "transformers' processor, built by generate()'s own builder, at each position's own prefix"
_WARPER = "transformers' warper, built by generate()'s own builder (sampling only, as in generate())"
# The audit of every other generation-config field: how specdec gives generate()'s output with it.
# tests/test_hostile_api.py checks that HONOURED and UNSUPPORTED cover GenerationConfig().to_dict() and
# compares each field here with generate() (greedy, and the sampled law along generate()'s own path).
HONOURED: dict[str, str] = {
    "max_new_tokens": "generate()'s argument: the budget of new tokens per row",
    "do_sample": "generate()'s argument; temperature=0 is specdec's spelling of do_sample=False",
    "temperature": _WARPER + "; an explicit temperature > 0 samples (specdec's convention)",
    "top_k": _WARPER,
    "top_p": _WARPER,
    "min_p": _WARPER,
    "top_h": _WARPER,
    "typical_p": _WARPER,
    "epsilon_cutoff": _WARPER,
    "eta_cutoff": _WARPER,
    "repetition_penalty": _PROCESSOR,
    "no_repeat_ngram_size": _PROCESSOR,
    "bad_words_ids": _PROCESSOR,
    "sequence_bias": _PROCESSOR,
    "suppress_tokens": _PROCESSOR,
    "begin_suppress_tokens": _PROCESSOR + " (from each row's prompt length)",
    "min_length": _PROCESSOR + " (counts the prompt, as generate() does; needs an EOS; not beside a grammar)",
    "min_new_tokens": _PROCESSOR + " (needs an EOS, as in generate(); not beside a grammar)",
    "forced_bos_token_id": _PROCESSOR + " (a prompt of one token)",
    "forced_eos_token_id": _PROCESSOR + " (at prompt length + max_new_tokens, per row)",
    "exponential_decay_length_penalty": _PROCESSOR + " (refused without an EOS, where generate() fails)",
    "encoder_repetition_penalty": _PROCESSOR + "; the prompt is its encoder_input_ids, as in generate()",
    "encoder_no_repeat_ngram_size": _PROCESSOR + "; the prompt is its encoder_input_ids, as in generate()",
    "renormalize_logits": _PROCESSOR + " (last, as in generate())",
    "remove_invalid_values": _PROCESSOR + "; non-finite model logits are an error in specdec, not replaced",
    "watermarking_config": _PROCESSOR + " (WatermarkingConfig; stateful SynthID is refused)",
    "eos_token_id": "ends a row at its first EOS (and feeds min_length, bad words, ...); [] is refused",
    "pad_token_id": "metadata: generate() pads finished rows of a batch and, without an attention mask, masks "
    "the prompt's pad tokens; specdec neither pads nor masks (each row keeps its own length)",
    "bos_token_id": "metadata: generate() reads it only when called without a prompt; specdec always has one",
    "decoder_start_token_id": "metadata: encoder-decoder models only; specdec's targets are decoder-only",
}


@functools.cache
def generation_config_fields() -> frozenset[str]:
    return frozenset(name for name in GenerationConfig().to_dict() if not name.startswith("_")) - {
        "transformers_version"
    }


def check_generation_settings(settings: dict) -> None:
    """Refuse a keyword that is not a generation-config field (a misspelling), that specdec does not
    honour, or whose value is outside its range, rather than ignore it."""
    for name, value in settings.items():
        if name in REMOVED:
            raise ValueError(REMOVED[name])
        if name in UNSUPPORTED:
            neutral, instead = UNSUPPORTED[name]
            if value is not None and value != neutral:
                raise ValueError(f"{name}={value!r} is not supported: {instead}")
        elif name in LOAD_OPTIONS:
            raise ValueError(
                f"{name} is a loading option, not a generate() argument: pass it to "
                f"SpeculativeDecoder.from_pretrained(..., {name}=...) (or to specdec.generate)"
            )
        elif name not in generation_config_fields():
            close = difflib.get_close_matches(name, [*ARGUMENTS, *generation_config_fields()], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(
                f"unknown generate() argument {name!r}{hint} (arguments are specdec's own and generation-config fields)"
            )
    check_generation_values(settings)


def check_removed(options: dict, caller: str) -> None:
    """A removed keyword (REMOVED) as one ValueError saying what to do instead; any other unknown keyword
    as Python reports one."""
    for name in options:
        if name in REMOVED:
            raise ValueError(REMOVED[name])
    if options:
        raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(options))!r}")


def _plain(value):
    """A numpy scalar (np.int64, np.float32, ...) as the Python int or float it holds; anything else as is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value) in (int, float):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_draft_length(num_draft_tokens) -> int | None:
    if num_draft_tokens == "auto":
        return None
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral):
        raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
    return int(num_draft_tokens)


def _check_stop_sizes(stops: list[str]) -> None:
    if len(stops) > MAX_STOPS:
        raise ValueError(f"give at most {MAX_STOPS} stop strings, got {len(stops)}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string holds at most {MAX_STOP_CHARS} characters, got one of {longest}")


def _check_seed(seed) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Every decoding option of one generate() call, checked before any model is loaded (build it with
    `check_request`, or `SpeculativeDecoder.generate(prompt, config=...)`). "auto" values are resolved
    once per run, against the loaded pair and this host, and recorded in each result's `config`. A
    batch's rows may carry their own options over it (`for_row`: ROW_OPTIONS)."""

    max_new_tokens: int
    k: int | None  # num_draft_tokens; None: auto
    stops: list[str]
    stream: Callable[[str], None] | None
    seed: int | None
    sampling: dict  # generation-config overrides; None values defer to the model's config
    verification: str = "token"
    draft_width: int | str = "auto"
    prompt_lookup: bool | str = "auto"
    logprobs: int | None = None  # each new token's log-probability and this many alternatives (None: none)
    constraint: Constraint | None = None  # what the output must match (specdec.verify.grammar; None: anything)
    arguments: dict = field(default_factory=dict, compare=False, repr=False)  # the keywords it was built from

    @classmethod
    def of(cls, **options) -> SpecConfig:
        """A checked config from generate()'s keyword options (the same defaults)."""
        defaults = dict(max_new_tokens=128, num_draft_tokens="auto", stop=None, stream=None, seed=None)
        defaults |= dict(temperature=None, top_k=None, top_p=None, do_sample=None)
        return check_request(**defaults | options)

    def for_row(self, options: dict) -> SpecConfig:
        """This config with one row's own options over it."""
        if not isinstance(options, dict):
            raise ValueError(f"each row's options must be a dict, got {type(options).__name__}")
        # A name that is neither an argument nor a generation-config field falls through to check_request,
        # which calls it unknown (with the closest name); only known, call-wide options are refused here.
        known = set(ARGUMENTS) | {"temperature", "top_k", "top_p", "do_sample"} | set(LOAD_OPTIONS)
        call_wide = (set(options) & known) - ROW_OPTIONS
        batch_only = sorted(call_wide | set(options) & BATCH_ONLY)
        if batch_only:
            raise ValueError(
                f"{', '.join(batch_only)} cannot differ between rows (the rows share the round): pass it to the call; "
                f"a row may set {', '.join(sorted(ROW_OPTIONS))} and generation-config fields"
            )
        arguments = dict(self.arguments)
        if set(options) & set(CONSTRAINTS):  # a row's own constraint replaces the call's
            arguments = {name: value for name, value in arguments.items() if name not in CONSTRAINTS}
        return check_request(**{**arguments, **options})


CONSTRAINTS = ("response_format", "json_schema", "regex", "grammar")  # structured output (one at most)
ROW_OPTIONS = frozenset({"max_new_tokens", "seed", "stop", "temperature", "top_k", "top_p", "do_sample", *CONSTRAINTS})
BATCH_ONLY = frozenset({"eos_token_id"})  # a row's end must be the batch's (one EOS set per run)


def check_prompt_lookup(setting) -> None:
    if setting not in (True, False, "auto"):
        raise ValueError(f"prompt_lookup must be True, False or 'auto', got {setting!r}")


def check_chat(chat) -> None:
    if not isinstance(chat, bool):
        raise ValueError(f"chat must be True or False, got {chat!r}")


def check_progress(progress) -> None:
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable taking one status line, or None; got {progress!r}")


def check_request(
    *,
    max_new_tokens,
    num_draft_tokens,
    stop,
    stream,
    seed,
    temperature,
    top_k,
    top_p,
    do_sample,
    verification="token",
    draft_width="auto",
    prompt_lookup="auto",
    logprobs=None,
    response_format=None,
    json_schema=None,
    regex=None,
    grammar=None,
    **sampling,
) -> SpecConfig:
    # numpy scalars as the Python numbers they hold: an np.int64 seed would reach torch's manual_seed
    max_new_tokens, num_draft_tokens, seed, temperature, top_k, top_p, draft_width, logprobs = map(
        _plain, (max_new_tokens, num_draft_tokens, seed, temperature, top_k, top_p, draft_width, logprobs)
    )
    sampling = {name: _plain(value) for name, value in sampling.items()}
    # The keywords as given (before greedy's spelling is normalised), so a row's options override them.
    arguments = {name: value for name, value in locals().items() if name != "sampling"} | sampling
    _check_count("max_new_tokens", max_new_tokens, 1)
    check_generation_settings(sampling)
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    k = _check_draft_length(num_draft_tokens)
    check_draft_width(draft_width)
    check_prompt_lookup(prompt_lookup)
    if logprobs is not None:
        _check_count("logprobs", logprobs, 0)
        if logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS} (alternatives per token), got {logprobs}")
    constraint = constraint_of(response_format, json_schema, regex, grammar)
    stops = check_stop_strings(stop)
    _check_stop_sizes(stops)
    if stream is not None and not callable(stream):
        raise ValueError(f"stream must be a callable taking each text delta, got {stream!r}")
    _check_seed(seed)
    if temperature is not None:
        check_temperature(temperature)
    SamplingConfig(1.0, top_k, top_p)  # range checks for top_k and top_p
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True, False or None, got {do_sample!r}")
    if temperature == 0:  # specdec's spelling of greedy
        if do_sample:
            raise ValueError("temperature=0 means greedy decoding; it cannot be combined with do_sample=True")
        temperature, do_sample = None, False
    elif temperature is not None and do_sample is None:
        do_sample = True
    overrides = dict(temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample, **sampling)
    return SpecConfig(
        int(max_new_tokens), k, stops, stream, seed, overrides, verification, draft_width, prompt_lookup, logprobs,
        constraint, arguments,
    )  # fmt: skip


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_list(ids, what: str) -> list[int]:
    if isinstance(ids, torch.Tensor) or hasattr(ids, "dtype"):  # a tensor or a numpy array
        tensor = torch.as_tensor(ids)
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer token ids, got a {tensor.dtype} array")
        if tensor.dim() != 1:
            raise ValueError(f"{what} must be 1-D token ids, got shape {tuple(tensor.shape)}")
        return tensor.tolist()
    bad = [value for value in ids if not _is_token_id(value)]
    if bad:
        raise ValueError(f"{what} must hold integer token ids; got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(value) for value in ids]


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def _refuse_bytes(prompt) -> None:
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"prompt is bytes ({bytes(prompt)[:20]!r}), not text or token ids: decode it first, e.g. prompt.decode()"
        )


def split_prompts(prompt) -> tuple[list, bool]:
    """A prompt or a batch -> (rows, batched). Rows are strings, chats or token-id lists."""
    _refuse_bytes(prompt)
    if isinstance(prompt, str) or _is_chat(prompt):
        return [prompt], False
    if isinstance(prompt, torch.Tensor) or hasattr(prompt, "dtype"):
        tensor = torch.as_tensor(prompt)
        if tensor.dim() == 2:
            return [_token_list(row, "prompt") for row in tensor], True
        return [_token_list(tensor, "prompt")], False
    if not isinstance(prompt, Sequence):
        raise ValueError(f"prompt must be a string, token ids, a chat or a list of those; got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: give a non-empty string, a list of token ids, or a list of those")
    if all(_is_token_id(value) for value in prompt):
        return [list(prompt)], False
    for row in prompt:
        _refuse_bytes(row)
    if all(isinstance(p, (str, list, tuple, torch.Tensor)) or hasattr(p, "dtype") for p in prompt):
        return list(prompt), True
    bad = next(p for p in prompt if not _is_token_id(p))
    raise ValueError(
        f"prompt must hold integer token ids (or be a list of prompts); got {bad!r} ({type(bad).__name__})"
    )


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"prompt is not valid UTF-8 text (an undecodable character at position {error.start}); "
            "check the input's encoding"
        ) from None


def _check_messages(messages: list) -> None:
    """Each message has a role and text content (an assistant's tool calls may stand for the content)."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ValueError(f"chat message {i} has no 'role' (a string such as 'user'): {message!r}")
        if "content" not in message:
            if "tool_calls" in message:
                continue
            raise ValueError(f"chat message {i} has no 'content': give each message its text, {{'role', 'content'}}")
        content = message["content"]
        if not isinstance(content, (str, list)):
            raise ValueError(f"chat message {i}'s content must be text, got {type(content).__name__}: {content!r}")
        _check_text(str(content))


def _apply_chat_template(tokenizer, messages: list) -> list[int]:
    """The chat template's token ids; its errors (invalid Jinja, or the template refusing these
    messages) as one line naming the template."""
    from jinja2 import TemplateError, TemplateSyntaxError  # transformers renders chat templates with jinja2

    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    except TemplateSyntaxError as error:
        raise ValueError(
            f"the chat template of tokenizer {name!r} is not valid Jinja (line {error.lineno}: {error.message}); "
            "fix its chat_template (chat_template.jinja or tokenizer_config.json), or pass chat=False"
        ) from None
    except TemplateError as error:
        text = " ".join(str(error).split())
        raise ValueError(f"the chat template of tokenizer {name!r} refused these messages: {text}") from None
    return list(encoded["input_ids"])


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """A tokenizer of the target's vocabulary: no ordinary token past the target's head (added special
    tokens may be: Gemma 3's image token is), and not clearly another vocabulary (under half of it;
    padded heads, as Qwen's, are a few percent larger than their tokenizers)."""
    size = len(tokenizer) if callable(getattr(tokenizer, "__len__", None)) else None
    if size is None or vocab_size // 2 <= size <= vocab_size:
        return
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if size > vocab_size and all(token in added for token in range(vocab_size, size)):
        return
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    relation = "more tokens than" if size > vocab_size else "another vocabulary than"
    raise ValueError(
        f"tokenizer {name!r} has {size} tokens, {relation} the target's {vocab_size}: "
        "pass the target's own tokenizer (or none, to use the one saved with the target)"
    )


def encode(prompt, tokenizer, chat: bool, vocab_size: int) -> list[int]:
    """One prompt row -> token ids (chat template for text when chat=True, or for a chat)."""
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    if isinstance(prompt, str) or _is_chat(prompt):
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty: give a non-empty string or list of token ids")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer=..., or a model name that has one")
        if isinstance(prompt, str) and not chat:
            _check_text(prompt)
            ids = tokenizer(prompt)["input_ids"]
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            _check_messages(messages)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat needs a tokenizer with a chat template; this one has none (use chat=False)")
            ids = _apply_chat_template(tokenizer, messages)
    else:
        ids = _token_list(prompt, "prompt")
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the target's vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids
