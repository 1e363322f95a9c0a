"""`SpeculativeDecoder` (load once, generate many) and the one-shot `specdec.generate()`.

Words: a prompt is a string, a list of token ids (or a 1-D tensor / array), or a
chat (a list of {"role", "content"} messages); a batch is a list of prompts.
`draft=None` runs the target alone through the same loop (the timing baseline);
`draft="ngram"` uses prompt lookup; anything else is a draft LM.

Sampling arguments default to None, meaning the target's own `generation_config`
(then transformers' defaults), exactly as `model.generate()` resolves them;
explicit values override it. `temperature=0` is greedy.

This is the one place that turns names into models: the CLI, the bench and the
scripts all build a `SpeculativeDecoder`.
"""

from __future__ import annotations

import numbers
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.adapters import HFCausalLM, TargetModel
from specdec.adapters.static import StaticHFCausalLM
from specdec.calibration import Costs, calibrate
from specdec.crosstok import CrossTokenizerDrafter, check_text_compatible
from specdec.decoder import VERIFICATIONS, decode
from specdec.drafters import DraftModel, ModelDrafter, NgramDrafter, NoDrafter
from specdec.metrics import SpeculativeMetrics
from specdec.policy import DraftLengthPolicy
from specdec.resolution import Progress, load_model, load_tokenizer, parse_device
from specdec.sampling import SamplingConfig, Warping, check_temperature, resolve_generation_config
from specdec.text import DeltaStreamer, StopStrings, check_stop_strings, iterate_deltas

ModelSpec = str | PreTrainedModel | HFCausalLM
DRAFT_ALIASES = {"ngram": "ngram", "prompt-lookup": "ngram", "none": None}
MAX_SEED = 2**64 - 1
MAX_CALIBRATED_BATCH = 64  # larger batches use the costs measured at 64 rows


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens, when a tokenizer is known
    metrics: SpeculativeMetrics  # this row's counts (clocks are the batch's: rows share forwards)
    prompt_ids: list[int]
    batch_metrics: SpeculativeMetrics | None = None  # the whole batch (the same object for one prompt)
    calibration: dict | None = None  # the measured costs `auto` chose k from (None with a fixed k)


# ------------------------------------------------------------------ argument checks


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
    **sampling,
) -> Request:
    _check_count("max_new_tokens", max_new_tokens, 1)
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    k = _check_draft_length(num_draft_tokens)
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
    return Request(int(max_new_tokens), k, stops, stream, seed, overrides, verification)


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


CACHES = ("dynamic", "static")


def _wrap(model: PreTrainedModel, name: str, cache: str, compile: bool) -> HFCausalLM:
    """The adapter for a cache kind: a DynamicCache (grows by concatenation) or a preallocated static
    cache (writes in place, rollback moves a pointer; compile=True captures its narrow forwards)."""
    if cache == "static":
        return StaticHFCausalLM(model, name=name, compile=compile)
    if compile:
        raise ValueError("compile=True needs cache='static': captured forwards need a fixed-size cache")
    return HFCausalLM(model, name=name)


def _adapter(
    spec, dtype, device, role: str, quantization=None, progress=None, cache="dynamic", compile=False
) -> HFCausalLM:
    if isinstance(spec, HFCausalLM):
        return spec
    if isinstance(spec, PreTrainedModel):
        if device is not None and getattr(spec, "hf_device_map", None) is None:
            spec = spec.to(device)
        return _wrap(spec, f"{role} {spec.config.model_type}", cache, compile)
    if isinstance(spec, str):
        model = load_model(spec, dtype=dtype, device=device, quantization=quantization, progress=progress)
        return _wrap(model, spec, cache, compile)
    raise ValueError(
        f"{role} must be a model name, a transformers PreTrainedModel or an HFCausalLM; got {type(spec).__name__}"
    )


def _tokenizer_for(spec, progress=None):
    """The tokenizer that belongs to a model given by name (or its save_pretrained dir)."""
    if isinstance(spec, str):
        name = spec
    else:
        model = getattr(spec, "model", spec)
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    try:
        return load_tokenizer(name, progress=progress)
    except Exception:  # a model without tokenizer files still generates token ids
        return None


def _check_tokenizer(tokenizer):
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if not (callable(getattr(tokenizer, "decode", None)) and callable(tokenizer)):
        raise ValueError(
            f"tokenizer must be a transformers tokenizer or a model name, got {type(tokenizer).__name__}"
        )
    return tokenizer


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


def check_tokenizers_agree(draft_spec, target_spec, tokenizer):
    """None where the draft shares the target's vocabulary (or no tokenizers are known); else the
    draft's own tokenizer, once text passes between the two (ValueError where it cannot): the draft
    then drafts through text (specdec.crosstok)."""
    if tokenizer is None:
        return None
    draft_tokenizer = _tokenizer_for(draft_spec)
    if draft_tokenizer is None or draft_tokenizer.get_vocab() == tokenizer.get_vocab():
        return None
    check_text_compatible(draft_tokenizer, tokenizer, len(tokenizer))
    return draft_tokenizer


def _drafter(
    draft, target: HFCausalLM, target_spec, dtype, device, tokenizer, quantization, progress, *extra
) -> DraftModel:
    """The drafter for a draft spec; `extra`: the cache kind and compile flag of a draft LM's adapter."""
    if isinstance(draft, str) and draft in DRAFT_ALIASES:
        draft = DRAFT_ALIASES[draft]
    if draft is None:
        return NoDrafter()
    if draft == "ngram":
        return NgramDrafter()
    if hasattr(draft, "propose"):  # any DraftModel: a new drafter is a new class
        if isinstance(draft, ModelDrafter) and draft.adapter is target:
            return ModelDrafter(HFCausalLM(target.model, name=f"{target.name} (as draft)"), target.vocab_size)
        return draft
    draft_tokenizer = check_tokenizers_agree(draft, target_spec, tokenizer)
    adapter = _adapter(draft, dtype, device, "draft", quantization, progress, *extra)
    if adapter is target:  # one model in both roles: each role needs its own KV cache
        adapter = HFCausalLM(target.model, name=f"{target.name} (as draft)")
    if draft_tokenizer is not None:  # another tokenizer: the draft continues the text
        return CrossTokenizerDrafter(adapter, draft_tokenizer, tokenizer, target.vocab_size)
    _check_vocabularies(target, adapter, tokenizer)
    return ModelDrafter(adapter, vocab_size=target.vocab_size)


def _eos_ids(config, tokenizer) -> set[int]:
    """EOS as transformers' generate sees it: the resolved generation config, else the tokenizer's."""
    eos = getattr(config, "eos_token_id", None)
    if eos is not None:
        return set(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {tokenizer.eos_token_id}
    return set()


def _check_context(prompts: list[list[int]], max_new_tokens: int, models: list) -> None:
    """Fail before generating anything if a prompt plus its budget overflows a model's context."""
    longest = max(len(p) for p in prompts)
    for model in models:
        if model.max_positions and longest + max_new_tokens > model.max_positions:
            room = model.max_positions - longest
            hint = f"lower max_new_tokens to {room}" if room > 0 else "shorten the prompt"
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context of "
                f"{getattr(model, 'name', 'the draft')} ({model.max_positions} tokens); {hint}"
            )


# ------------------------------------------------------------------ the engine object


class SpeculativeDecoder:
    """A target, its drafter and tokenizer, loaded once; `generate` and `stream` as often as needed.

    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    print(decoder.generate("def fib(n):", max_new_tokens=64).text)
    for delta in decoder.stream("Write a haiku."): print(delta, end="")
    """

    def __init__(self, target: TargetModel | PreTrainedModel, drafter=None, tokenizer=None, *, draft_name=None):
        """From loaded pieces: a target (HFCausalLM or transformers model), a drafter (a DraftModel,
        a loaded draft model, "ngram", or None for the target alone) and a tokenizer (or None)."""
        self.target = _adapter(target, None, None, "target")
        self.tokenizer = _check_tokenizer(tokenizer) if tokenizer is not None else _tokenizer_for(self.target)
        self.drafter = _drafter(drafter, self.target, None, None, None, self.tokenizer, None, None)
        self.draft_name = draft_name or getattr(self.drafter, "name", None) or type(self.drafter).__name__

    @classmethod
    def from_pretrained(
        cls,
        target: ModelSpec,
        draft: ModelSpec | DraftModel | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        draft_quantization: str | None = "auto",
        target_quantization: str | None = None,
        tokenizer=None,
        progress: Progress | None = None,
        cache: str = "dynamic",
        compile: bool = False,
    ) -> SpeculativeDecoder:
        """Load by name (local dir, .gguf, offline alias or Hub id) or wrap loaded models.
        draft_quantization: for a draft given by name, "auto" (int8 on CPU), "int8" or "none".
        target_quantization: "int8" (CPU, opt-in) makes the target an int8-dynamic model; output is then
        exact with respect to that quantised target, which is a different model from the original weights.
        cache: "dynamic" (transformers' DynamicCache) or "static" (preallocated, rollback moves a pointer);
        compile=True (static cache only) captures the draft step and verify forwards (CUDA graphs on GPU)."""
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
        device = parse_device(device) if device is not None or isinstance(target, str) else None
        if target_quantization not in (None, "none", "int8"):
            raise ValueError(f"target_quantization must be none or int8, got {target_quantization!r}")
        if target_quantization == "int8" and not isinstance(target, str):
            raise ValueError("target_quantization applies to a target given by name; quantise a loaded model yourself")
        tokenizer = _check_tokenizer(tokenizer) if tokenizer is not None else _tokenizer_for(target, progress)
        quantize_target = None if target_quantization == "none" else target_quantization
        target_adapter = _adapter(target, dtype, device, "target", quantize_target, progress, cache, compile)
        quantization = draft_quantization_for(draft_quantization, target_adapter.device.type)
        drafter = _drafter(
            draft, target_adapter, target, dtype, device, tokenizer, quantization, progress, cache, compile
        )
        name = draft if isinstance(draft, str) else None
        return cls(target_adapter, drafter, tokenizer, draft_name=name)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def calibration(self, batch: int) -> Costs | None:
        """This host's costs for the pair at this batch size (measured once, then cached)."""
        if isinstance(self.drafter, NoDrafter):
            return None
        bucket = min(1 << (batch - 1).bit_length(), MAX_CALIBRATED_BATCH)  # powers of two up to 64
        draft = getattr(self.drafter, "adapter", None) if self.drafter.uses_model else None
        return calibrate(self.target, draft, batch=bucket)

    def warping(self, request: Request) -> tuple[Warping, set[int]]:
        """The target's generation config with this call's overrides -> warping and EOS ids."""
        model = getattr(self.target, "model", None)
        if not isinstance(model, PreTrainedModel):  # a custom TargetModel: the plain sampling arguments only
            s = request.sampling
            greedy = not s.get("do_sample")
            config = SamplingConfig(0 if greedy else s.get("temperature") or 1.0, s.get("top_k"), s.get("top_p"))
            return Warping.from_sampling(config), set()
        try:
            config = resolve_generation_config(model, **request.sampling)
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid generation settings: {error}") from None
        return Warping.from_generation_config(model, config), _eos_ids(config, self.tokenizer)

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int = 128,
        num_draft_tokens: int | str = 4,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool | None = None,
        seed: int | None = None,
        verification: str = "token",
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        stream: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        metrics: SpeculativeMetrics | None = None,
        **generation_config,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate with the target's exact output law, faster.

        verification: "token" (Leviathan et al.), "block" (Sun et al. 2024: the drafted block judged
        jointly; never accepts less in expectation) or "race" (Kobus & Gunduz 2025: keyed Gumbel races;
        with a seed, the same tokens with any draft, any k, in any batch, or with draft=None).
        All three are exact; under greedy they coincide.

        Sampling: temperature (0 = greedy), top_k, top_p, do_sample and any other generation-config
        field (repetition_penalty, no_repeat_ngram_size, min_p, ...); None means the target's
        generation_config. `metrics`: filled in as rounds complete (readable after an interrupt);
        with a batch it covers all rows, and each result also has its own row's metrics.
        """
        request = check_request(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            stop=stop,
            stream=stream,
            seed=seed,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            do_sample=do_sample,
            verification=verification,
            **generation_config,
        )
        return self._run(prompt, request, chat=chat, clock=clock, metrics=metrics)

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Text deltas as they are accepted (transformers' TextIteratorStreamer manner)."""
        if "stream" in kwargs:
            raise ValueError("stream() yields the text itself; do not pass stream=")
        return iterate_deltas(lambda callback: self.generate(prompt, stream=callback, **kwargs))

    def _run(self, prompt, request: Request, *, chat: bool, clock, metrics) -> GenerationResult | list:
        rows, batched = split_prompts(prompt)
        if batched and request.stream is not None:
            raise ValueError("stream works with a single prompt; call generate once per prompt to stream each")
        warping, eos_ids = self.warping(request)
        prompts = [encode(p, self.tokenizer, chat, self.target.vocab_size) for p in rows]
        _check_context(prompts, request.max_new_tokens, [self.target, self.drafter])
        if request.stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        costs = self.calibration(len(prompts)) if request.k is None else None
        policy = DraftLengthPolicy(k=request.k, max_k=10, costs=costs)
        streamer = None
        if request.stream is not None and self.tokenizer is not None:
            streamer = DeltaStreamer(self.tokenizer, request.stream)
        row_metrics = [SpeculativeMetrics() for _ in prompts]
        batch, total = decode(
            self.target,
            self.drafter,
            prompts,
            max_new_tokens=request.max_new_tokens,
            warping=warping,
            policy=policy,
            eos_ids=eos_ids,
            stop=StopStrings(request.stops, self.tokenizer) if request.stops else None,
            on_commit=streamer,
            generator=generator,
            clock=clock,
            metrics=metrics,
            row_metrics=row_metrics,
            verification=request.verification,
            race_seed=request.seed if request.seed is not None else secrets.randbits(62),
        )
        if streamer is not None:
            streamer.end()  # flush the last word
        results = []
        for row, ids in enumerate(prompts):
            new = batch.new_tokens(row)
            text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
            metrics = row_metrics[row] if batched else total
            results.append(GenerationResult(new, text, metrics, ids, total, costs.to_dict() if costs else None))
        return results if batched else results[0]


# ------------------------------------------------------------------ the one-shot call


def generate(
    prompt,
    *,
    target: ModelSpec,
    draft: ModelSpec | DraftModel | None = None,
    max_new_tokens: int = 128,
    num_draft_tokens: int | str = 4,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool | None = None,
    seed: int | None = None,
    verification: str = "token",
    tokenizer=None,
    chat: bool = False,
    stop: str | Sequence[str] | None = None,
    stream: Callable[[str], None] | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    clock: Callable[[], float] = time.perf_counter,
    metrics: SpeculativeMetrics | None = None,
    draft_quantization: str | None = "auto",
    target_quantization: str | None = None,
    **generation_config,
) -> GenerationResult | list[GenerationResult]:
    """One call: load (or wrap) the models, then `SpeculativeDecoder.generate`. Arguments are
    checked before anything loads. For many prompts, build a SpeculativeDecoder once instead."""
    arguments = dict(
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        stop=stop,
        stream=stream,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        do_sample=do_sample,
        verification=verification,
    )
    check_request(**arguments, **generation_config)
    split_prompts(prompt)  # a malformed prompt fails before loading too
    decoder = SpeculativeDecoder.from_pretrained(
        target,
        draft,
        dtype=dtype,
        device=device,
        draft_quantization=draft_quantization,
        target_quantization=target_quantization,
        tokenizer=tokenizer,
    )
    return decoder.generate(prompt, chat=chat, clock=clock, metrics=metrics, **arguments, **generation_config)
