"""Names -> models: the target's adapter, the drafter and the tokenizer of a `SpeculativeDecoder`.

Words: a spec is what a caller names a model with: a name (local dir, .gguf, offline alias or Hub
id), a loaded transformers `PreTrainedModel`, or an adapter (`HFCausalLM`). An adapter is a model
with its KV cache (dynamic, or static with captured forwards); a drafter is what the decoder asks
for drafts (`specdec.drafters`). Every loading option is checked before anything loads.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.drafters import DraftModel, ModelDrafter, NgramDrafter, NoDrafter, as_drafter
from specdec.drafters.crosstok import CrossTokenizerDrafter, check_text_compatible
from specdec.models.adapters import HFCausalLM, TargetModel
from specdec.models.adapters.capture import COMPILE_MODES
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.models.forms import WEIGHT_FORMS, parse_dtype, weight_form
from specdec.models.packing import TIMED_WIDTHS
from specdec.models.resolution import (
    ALIASES,
    DRAFT_FORMS,
    fastest_form,
    load_model,
    load_tokenizer,
    parse_device,
    same_tokenizer_files,
)

ModelSpec = str | PreTrainedModel | HFCausalLM
DRAFT_ALIASES = {"ngram": "ngram", "prompt-lookup": "ngram", "none": None}
DRAFT_WIDTHS = (1,)  # the rows of a draft's steps (a chain's), for its weights' form (load_model)
CACHES = ("auto", "dynamic", "static")


def draft_quantization_for(
    setting: str | None, device: str | None, draft=None, dtype=None, progress=None
) -> str | None:
    """ "auto": on CPU, for a draft given as an offline alias in the default dtype, the fastest of DRAFT_FORMS on
    this host (timed once: resolution.fastest_form); int8 for any other (2.3x cheaper draft steps than bf16 on an
    AVX-512 host, the same exactness); none on CUDA. Otherwise any weight form (specdec.models.forms.WEIGHT_FORMS):
    a draft stays exact in every form."""
    if setting == "auto":
        if (device or "cpu") != "cpu":
            return None
        if isinstance(draft, str) and draft in ALIASES and dtype in (None, "auto"):
            return fastest_form(draft, DRAFT_FORMS, progress, widths=DRAFT_WIDTHS)
        return DRAFT_FORMS[0]
    if setting not in (None, *WEIGHT_FORMS):
        raise ValueError(f"draft_quantization must be auto or one of {', '.join(WEIGHT_FORMS)}; got {setting!r}")
    return None if setting in (None, "none") else setting


def _on_cuda(model: PreTrainedModel) -> bool:
    return model.get_input_embeddings().weight.device.type == "cuda"


def _wrap(model: PreTrainedModel, name: str, cache: str, compile: bool | str) -> HFCausalLM:
    """The adapter for a cache kind: a DynamicCache (grows by concatenation) or a preallocated static
    cache (writes in place, rollback moves a pointer; compile captures its narrow forwards).
    "auto" (both defaults): on CUDA the static cache with captured forwards (CUDA graphs), where the model
    allows them (full attention, sdpa or eager attention, one device), else the dynamic cache; on the CPU
    the dynamic cache, uncompiled. On an H100 the compiled static cache ran the target alone at 3.9-4.2x
    the eager dynamic one (docs/BENCHMARKS.md, "GPU: one host read per round")."""
    explicit = compile if compile != "auto" else None
    compile = ("graphs" if _on_cuda(model) else False) if compile == "auto" else compile
    if cache == "dynamic" or (cache == "auto" and not compile):
        if explicit:
            raise ValueError("compile=True needs cache='static': captured forwards need a fixed-size cache")
        return HFCausalLM(model, name=name)
    try:
        adapter = StaticHFCausalLM(model, name=name, compile=compile)
    except ValueError:
        if explicit:  # asked for by the caller: say why it cannot be
            raise
        if cache == "auto":
            return HFCausalLM(model, name=name)
        adapter = StaticHFCausalLM(model, name=name)  # cache="static" asked for, uncompiled
    adapter.eager_on_failure = not explicit  # compile="auto": a forward that cannot be captured runs eagerly
    return adapter


def _device_type(target, device: str | None) -> str:
    """The device type the target will run on: the one asked for, else where a loaded target lives."""
    if device is not None:
        return torch.device(device).type
    if isinstance(target, PreTrainedModel):
        return target.get_input_embeddings().weight.device.type
    return getattr(getattr(target, "device", None), "type", "cpu")


def adapter_for(
    spec, dtype, device, role: str, quantization=None, progress=None, cache="auto", compile="auto", widths=TIMED_WIDTHS
) -> HFCausalLM:
    """The adapter of a target or draft spec: a name loaded, a loaded model wrapped, any TargetModel (an
    HFCausalLM, or one written from scratch) as it is. `widths`: the rows a loaded model's forwards run at,
    for its Linears' forms (load_model)."""
    if isinstance(spec, PreTrainedModel):
        if device is not None and getattr(spec, "hf_device_map", None) is None:
            spec = spec.to(device)
        return _wrap(spec, f"{role} {spec.config.model_type}", cache, compile)
    if isinstance(spec, str):
        model = load_model(
            spec,
            dtype=dtype,
            device=device,
            quantization=quantization,
            progress=progress,
            keep_outliers=role == "target",  # a quantised target is the output's model: keep it faithful
            widths=widths,
        )
        return _wrap(model, spec, cache, compile)
    if isinstance(spec, TargetModel):
        return spec
    raise ValueError(
        f"{role} must be a model name, a transformers PreTrainedModel or a TargetModel (an HFCausalLM); got "
        f"{type(spec).__name__}"
    )


def tokenizer_for(spec, progress=None):
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


def check_tokenizer(tokenizer):
    """A tokenizer given by the caller: a transformers tokenizer, or a name to load one by."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if not (callable(getattr(tokenizer, "decode", None)) and callable(tokenizer)):
        raise ValueError(f"tokenizer must be a transformers tokenizer or a model name, got {type(tokenizer).__name__}")
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
    then drafts through text (specdec.drafters.crosstok)."""
    if tokenizer is None:
        return None
    draft_tokenizer = tokenizer_for(draft_spec)
    if draft_tokenizer is None or draft_tokenizer.get_vocab() == tokenizer.get_vocab():
        return None
    check_text_compatible(draft_tokenizer, tokenizer, len(tokenizer))
    return draft_tokenizer


def drafter_for(
    draft,
    target: HFCausalLM,
    target_spec,
    dtype,
    device,
    tokenizer,
    quantization,
    progress,
    *extra,
    tokenizer_from=None,
) -> DraftModel:
    """The drafter for a draft spec; `extra`: the cache kind and compile flag of a draft LM's adapter;
    tokenizer_from: the name the tokenizer was loaded from, as it is (None: the caller's own tokenizer)."""
    if isinstance(draft, str) and draft in DRAFT_ALIASES:
        draft = DRAFT_ALIASES[draft]
    if draft is None:
        return NoDrafter()
    if draft == "ngram":
        return NgramDrafter()
    if not isinstance(draft, (str, PreTrainedModel, TargetModel)):  # a drafter object: a new drafter is a class
        drafter = as_drafter(draft)  # a user's object with propose() only: the protocol's defaults around it
        if drafter.adapter is target:
            raise ValueError(f"the drafter runs the target's own adapter ({target.name}): each role needs its own "
                             "KV cache; give the drafter its own, e.g. ModelDrafter(HFCausalLM(model))")  # fmt: skip
        return drafter
    if tokenizer_from is not None and same_tokenizer_files(draft, tokenizer_from):
        draft_tokenizer = None  # the same files: one vocabulary, without loading the draft's tokenizer
    else:
        draft_tokenizer = check_tokenizers_agree(draft, target_spec, tokenizer)
    cache, compile = extra or ("auto", "auto")
    if cache == "auto" and draft_tokenizer is not None:
        cache, compile = "dynamic", False  # cross-tokenizer drafts: unless cache="static" is asked
    adapter = adapter_for(draft, dtype, device, "draft", quantization, progress, cache, compile, DRAFT_WIDTHS)
    if adapter is target:  # one model in both roles: each role needs its own KV cache
        adapter = HFCausalLM(target.model, name=f"{target.name} (as draft)")
    if draft_tokenizer is not None:  # another tokenizer: the draft continues the text
        return CrossTokenizerDrafter(adapter, draft_tokenizer, tokenizer, target.vocab_size)
    _check_vocabularies(target, adapter, tokenizer)
    return ModelDrafter(adapter, vocab_size=target.vocab_size)


def _check_loading(target, device, cache: str, compile, target_quantization) -> str | None:
    """The loading options checked before anything loads -> the parsed device (None: leave models where they are)."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    if not (isinstance(compile, bool) or compile in ("auto", *COMPILE_MODES)):
        raise ValueError(f"compile must be True, False, 'auto' or one of {', '.join(COMPILE_MODES)}; got {compile!r}")
    device = parse_device(device) if device is not None or isinstance(target, str) else None
    if compile not in (False, "auto") and _device_type(target, device) == "cpu":
        raise ValueError(
            f"compile={compile!r} needs CUDA (its captured forwards are CUDA graphs, and torch.compile cannot "
            "trace the CPU's packed oneDNN Linears); on the CPU, leave compile off"
        )
    if not weight_form(target_quantization, role="target").own_weights and not isinstance(target, str):
        raise ValueError("target_quantization applies to a target given by name; quantise a loaded model yourself")
    return device


def load_pair(
    target: ModelSpec,
    draft,
    *,
    dtype,
    device,
    draft_quantization,
    target_quantization,
    tokenizer,
    progress,
    cache: str,
    compile: bool | str,
) -> tuple[HFCausalLM, DraftModel, object]:
    """`SpeculativeDecoder.from_pretrained`'s loading: -> the target's adapter, the drafter, the tokenizer."""
    device = _check_loading(target, device, cache, compile, target_quantization)
    given_tokenizer = tokenizer
    tokenizer = check_tokenizer(tokenizer) if tokenizer is not None else tokenizer_for(target, progress)
    quantize_target = None if target_quantization == "none" else target_quantization
    target_dtype = dtype
    alone = (DRAFT_ALIASES.get(draft, draft) if isinstance(draft, str) else draft) is None
    if isinstance(target, str) and quantize_target is None and dtype in (None, "auto"):
        target_dtype = parse_dtype(dtype, device, alone=alone)  # without a draft: one-token forwards
    widths = (1,) if alone else TIMED_WIDTHS  # ... and its Linears in their fastest form for one token
    target_adapter = adapter_for(
        target, target_dtype, device, "target", quantize_target, progress, cache, compile, widths
    )
    quantization = draft_quantization_for(draft_quantization, target_adapter.device.type, draft, dtype, progress)
    tokenizer_from = target if given_tokenizer is None and isinstance(target, str) else None
    drafter = drafter_for(
        draft,
        target_adapter,
        target,
        dtype,
        device,
        tokenizer,
        quantization,
        progress,
        cache,
        compile,
        tokenizer_from=tokenizer_from,
    )
    return target_adapter, drafter, tokenizer
