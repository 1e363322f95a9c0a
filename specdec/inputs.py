"""Request checks: a generate() call's arguments and prompts, checked before any model is touched.

Words: a prompt is a string, token ids (a list, a 1-D tensor or array), or a chat (a list of
{"role", "content"} messages); a batch is a list of prompts. A `Request` holds one call's checked
arguments; sampling values of None defer to the target's generation config.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.decoder import VERIFICATIONS, check_draft_width
from specdec.sampling import SamplingConfig, check_temperature
from specdec.text import check_stop_strings

MAX_SEED = 2**64 - 1


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


def _check_seed(seed) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")


@dataclass(frozen=True)
class Request:
    """One generate() call's checked arguments (checked before any model is loaded)."""

    max_new_tokens: int
    k: int | None
    stops: list[str]
    stream: Callable[[str], None] | None
    seed: int | None
    sampling: dict  # generation-config overrides; None values defer to the model's config
    verification: str = "token"
    draft_width: int | str = "auto"


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
    **sampling,
) -> Request:
    _check_count("max_new_tokens", max_new_tokens, 1)
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    k = _check_draft_length(num_draft_tokens)
    check_draft_width(draft_width)
    stops = check_stop_strings(stop)
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
    return Request(int(max_new_tokens), k, stops, stream, seed, overrides, verification, draft_width)


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


def split_prompts(prompt) -> tuple[list, bool]:
    """A prompt or a batch -> (rows, batched). Rows are strings, chats or token-id lists."""
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


def encode(prompt, tokenizer, chat: bool, vocab_size: int) -> list[int]:
    """One prompt row -> token ids (chat template for text when chat=True, or for a chat)."""
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
            for message in messages:
                _check_text(str(message.get("content", "")))
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat needs a tokenizer with a chat template; this one has none (use chat=False)")
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            ids = list(encoded["input_ids"])
    else:
        ids = _token_list(prompt, "prompt")
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the target's vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids
