"""`specdec.generate()`: names -> models, prompt handling, batching, text.

Words: a prompt is a string or a list of token ids; a batch is a list of
either. `draft=None` runs the target alone through the same loop (the timing
baseline); `draft="ngram"` uses prompt lookup; anything else is a draft LM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.adapters import HFCausalLM
from specdec.decoder import decode
from specdec.drafters import DraftModel, ModelDrafter, NgramDrafter, NoDrafter
from specdec.metrics import SpeculativeMetrics
from specdec.policy import DraftLengthPolicy
from specdec.resolution import load_model, load_tokenizer, parse_device
from specdec.sampling import SamplingConfig

ModelSpec = str | PreTrainedModel | HFCausalLM


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens, when a tokenizer is known
    metrics: SpeculativeMetrics
    prompt_ids: list[int]


# ------------------------------------------------------------------ argument checks


def _check_arguments(max_new_tokens: int, num_draft_tokens: int | str) -> int | None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if num_draft_tokens == "auto":
        return None
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
    return num_draft_tokens


def _is_batch(prompt) -> bool:
    if isinstance(prompt, str):
        return False
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError("prompt is empty: give a non-empty string, a list of token ids, or a list of those")
    return not isinstance(prompt[0], int)


def _encode(prompt, tokenizer, chat: bool, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give a non-empty string or list of token ids")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer=..., or a model name that has one")
        if chat:
            encoded = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
            )
            ids = list(encoded["input_ids"])
        else:
            ids = tokenizer(prompt)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the target's vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


# ------------------------------------------------------------------ models


def draft_quantization_for(setting: str | None, device: str | None) -> str | None:
    """ "auto": int8 on CPU (2.3x cheaper draft steps here, same exactness), none on CUDA."""
    if setting in (None, "none"):
        return None
    if setting == "auto":
        return "int8" if (device or "cpu") == "cpu" else None
    if setting != "int8":
        raise ValueError(f"draft_quantization must be auto, int8 or none; got {setting!r}")
    return setting


def _adapter(spec: ModelSpec, dtype, device, role: str, quantization: str | None = None) -> HFCausalLM:
    if isinstance(spec, HFCausalLM):
        return spec
    if isinstance(spec, PreTrainedModel):
        if device is not None and getattr(spec, "hf_device_map", None) is None:
            spec = spec.to(device)
        return HFCausalLM(spec, name=f"{role} {spec.config.model_type}")
    if isinstance(spec, str):
        return HFCausalLM(load_model(spec, dtype=dtype, device=device, quantization=quantization), name=spec)
    raise ValueError(
        f"{role} must be a model name, a transformers PreTrainedModel or an HFCausalLM; got {type(spec).__name__}"
    )


def _tokenizer_for(spec: ModelSpec):
    """The tokenizer that belongs to a model given by name (or its save_pretrained dir)."""
    if isinstance(spec, str):
        name = spec
    else:
        model = spec.model if isinstance(spec, HFCausalLM) else spec
        name = getattr(model.config, "_name_or_path", None)
    if not name:
        return None
    try:
        return load_tokenizer(name)
    except Exception:  # a model without tokenizer files still generates token ids
        return None


def _check_vocabularies(target: HFCausalLM, draft: HFCausalLM, tokenizer) -> None:
    if draft.vocab_size == target.vocab_size:
        return
    real = len(tokenizer) if tokenizer is not None else None
    if real is not None and real <= min(draft.vocab_size, target.vocab_size):
        return  # padded heads (Qwen2.5 family): the real tokens agree
    raise ValueError(
        f"draft and target vocabularies disagree: draft {draft.name!r} has {draft.vocab_size} tokens, "
        f"target {target.name!r} has {target.vocab_size}; use a draft from the target's family"
    )


def check_tokenizers_agree(draft_spec, target_spec, tokenizer) -> None:
    if not (isinstance(draft_spec, str) and isinstance(target_spec, str)) or tokenizer is None:
        return
    draft_tokenizer = _tokenizer_for(draft_spec)
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"the tokenizers of draft {draft_spec!r} ({len(draft_tokenizer)} tokens) and target {target_spec!r} "
            f"({len(tokenizer)} tokens) disagree; speculative decoding needs a shared vocabulary "
            "(or use --draft ngram)"
        )


def _drafter(draft, target: HFCausalLM, target_spec, dtype, device, tokenizer, quantization) -> DraftModel:
    if draft is None:
        return NoDrafter()
    if isinstance(draft, str) and draft in ("ngram", "prompt-lookup"):
        return NgramDrafter()
    if hasattr(draft, "propose"):  # any DraftModel: a new drafter is a new class
        return draft
    check_tokenizers_agree(draft, target_spec, tokenizer)
    adapter = _adapter(draft, dtype, device, "draft", quantization)
    _check_vocabularies(target, adapter, tokenizer)
    return ModelDrafter(adapter, vocab_size=target.vocab_size)


# ------------------------------------------------------------------ text


def _eos_ids(model: HFCausalLM, tokenizer) -> set[int]:
    """EOS as transformers' generate sees it: the generation config first, then the model config."""
    for source in (model.model.generation_config, model.model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return set(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {tokenizer.eos_token_id}
    return set()


def _check_context(prompts: list[list[int]], max_new_tokens: int, models: list[HFCausalLM]) -> None:
    """Fail before generating anything if a prompt plus its budget overflows a model's context."""
    longest = max(len(p) for p in prompts)
    for model in models:
        if model.max_positions and longest + max_new_tokens > model.max_positions:
            room = model.max_positions - longest
            hint = f"lower max_new_tokens to {room}" if room > 0 else "shorten the prompt"
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context of "
                f"{model.name} ({model.max_positions} tokens); {hint}"
            )


def _stop_check(stop: Sequence[str] | None, tokenizer):
    """(row, new tokens) -> how many tokens to keep so the text ends with its first stop string."""
    if not stop:
        return None
    if tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    stops = [stop] if isinstance(stop, str) else list(stop)

    def check(row: int, tokens: list[int]) -> int | None:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return None
        for keep in range(1, len(tokens) + 1):  # shortest prefix whose text holds a stop string
            if any(s in tokenizer.decode(tokens[:keep], skip_special_tokens=True) for s in stops):
                return keep
        return len(tokens)

    return check


class TextStreamer:
    """Turns committed token ids into text deltas; holds back incomplete characters."""

    def __init__(self, tokenizer, callback: Callable[[str], None]):
        self.tokenizer, self.callback = tokenizer, callback
        self.tokens: list[int] = []
        self.sent = ""

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character still being completed
            return
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.callback(text[len(self.sent) :])
            self.sent = text


# ------------------------------------------------------------------ the public call


def generate(
    prompt,
    *,
    target: ModelSpec,
    draft: ModelSpec | DraftModel | None = None,
    max_new_tokens: int = 128,
    num_draft_tokens: int | str = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    tokenizer=None,
    chat: bool = False,
    stop: str | Sequence[str] | None = None,
    stream: Callable[[str], None] | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    clock: Callable[[], float] = time.perf_counter,
    metrics: SpeculativeMetrics | None = None,
    draft_quantization: str | None = "auto",
) -> GenerationResult | list[GenerationResult]:
    """Generate with the target's exact output law, faster. See README for examples.

    `metrics`: an object to fill in as rounds complete (readable after an interrupt);
    with a batch, the metrics cover all rows together.
    `draft_quantization`: for a draft given by name, "auto" (int8 on CPU), "int8" or "none".
    A draft passed as a loaded model is used as it is.
    """
    k = _check_arguments(max_new_tokens, num_draft_tokens)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    batched = _is_batch(prompt)
    if batched and stream is not None:
        raise ValueError("stream= works with a single prompt; call generate once per prompt to stream each")
    device = parse_device(device) if device is not None or isinstance(target, str) else None
    target_adapter = _adapter(target, dtype, device, "target")
    tokenizer = tokenizer if tokenizer is not None else _tokenizer_for(target)
    quantization = draft_quantization_for(draft_quantization, target_adapter.device.type)
    drafter = _drafter(draft, target_adapter, target, dtype, device, tokenizer, quantization)
    prompts = [_encode(p, tokenizer, chat, target_adapter.vocab_size) for p in (prompt if batched else [prompt])]
    _check_context(
        prompts, max_new_tokens, [target_adapter] + ([drafter.adapter] if isinstance(drafter, ModelDrafter) else [])
    )

    generator = None
    if seed is not None:
        generator = torch.Generator(device=target_adapter.device).manual_seed(seed)
    policy = DraftLengthPolicy(k=k, max_k=10, cost_ratio=0.2 if drafter.uses_model else 0.0)
    streamer = TextStreamer(tokenizer, stream) if stream is not None and tokenizer is not None else None
    batch, metrics = decode(
        target_adapter,
        drafter,
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        policy=policy,
        eos_ids=_eos_ids(target_adapter, tokenizer),
        stop=_stop_check(stop, tokenizer),
        on_commit=streamer,
        generator=generator,
        clock=clock,
        metrics=metrics,
    )
    results = []
    for row, ids in enumerate(prompts):
        new = batch.new_tokens(row)
        text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
        results.append(GenerationResult(new, text, metrics, ids))
    return results if batched else results[0]
