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

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.adapters import HFCausalLM, TargetModel
from specdec.adapters.static import COMPILE_MODES, StaticHFCausalLM
from specdec.calibration import Costs, calibrate
from specdec.crosstok import CrossTokenizerDrafter, check_text_compatible
from specdec.decoder import decode, tree_width
from specdec.drafters import DraftModel, ModelDrafter, NgramDrafter, NoDrafter, as_drafter
from specdec.inputs import (
    Request,
    SpecConfig,
    check_chat,
    check_progress,
    check_removed,
    check_request,
    check_tokenizer_fits,
    encode,
    split_prompts,
)
from specdec.metrics import SpeculativeMetrics
from specdec.policy import DraftLengthPolicy
from specdec.resolution import Progress, load_model, load_tokenizer, parse_device
from specdec.sampling import RowWarpings, SamplingConfig, Warping, resolve_generation_config, row_warping
from specdec.text import DeltaStreamer, StopStrings, iterate_deltas

ModelSpec = str | PreTrainedModel | HFCausalLM
DRAFT_ALIASES = {"ngram": "ngram", "prompt-lookup": "ngram", "none": None}
MAX_CALIBRATED_BATCH = 64  # larger batches use the costs measured at 64 rows
PLAIN_SAMPLING = ("temperature", "top_k", "top_p", "do_sample")  # all a custom TargetModel's warping reads


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens, when a tokenizer is known
    metrics: SpeculativeMetrics  # this row's counts (clocks are the batch's: rows share forwards)
    prompt_ids: list[int]
    batch_metrics: SpeculativeMetrics | None = None  # the whole batch (the same object for one prompt)
    calibration: dict | None = None  # the measured costs `auto` chose k from (None with a fixed k)
    config: dict | None = None  # this row's options as the run resolved them ("auto" made concrete)


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


CACHES = ("auto", "dynamic", "static")


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


def _adapter(
    spec, dtype, device, role: str, quantization=None, progress=None, cache="auto", compile="auto"
) -> HFCausalLM:
    if isinstance(spec, HFCausalLM):
        return spec
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
        )
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
    then drafts through text (specdec.crosstok)."""
    if tokenizer is None:
        return None
    draft_tokenizer = _tokenizer_for(draft_spec)
    if draft_tokenizer is None or draft_tokenizer.get_vocab() == tokenizer.get_vocab():
        return None
    check_text_compatible(draft_tokenizer, tokenizer, len(tokenizer))
    return draft_tokenizer


def _drafter(
    draft,
    target: HFCausalLM,
    target_spec,
    dtype,
    device,
    tokenizer,
    quantization,
    progress,
    *extra,
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
        return as_drafter(draft)  # a user's object with propose() only: the protocol's defaults around it
    draft_tokenizer = check_tokenizers_agree(draft, target_spec, tokenizer)
    cache, compile = extra or ("auto", "auto")
    if cache == "auto" and draft_tokenizer is not None:
        cache, compile = "dynamic", False  # cross-tokenizer drafts: unless cache="static" is asked
    adapter = _adapter(draft, dtype, device, "draft", quantization, progress, cache, compile)
    if adapter is target:  # one model in both roles: each role needs its own KV cache
        adapter = HFCausalLM(target.model, name=f"{target.name} (as draft)")
    if draft_tokenizer is not None:  # another tokenizer: the draft continues the text
        return CrossTokenizerDrafter(adapter, draft_tokenizer, tokenizer, target.vocab_size)
    _check_vocabularies(target, adapter, tokenizer)
    return ModelDrafter(adapter, vocab_size=target.vocab_size)


def _eos_ids(config) -> set[int]:
    """EOS as transformers' generate sees it: the resolved generation config's, and nothing else
    (generate() never reads the tokenizer; stop= or eos_token_id= ask for more)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos if isinstance(eos, list) else [eos])


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
        if tokenizer is not None:  # one given for this target: refused now, not at the first prompt
            check_tokenizer_fits(self.tokenizer, self.target.vocab_size)
        self.drafter = _drafter(drafter, self.target, None, None, None, self.tokenizer, None, None)
        self.draft_name = draft_name or self.drafter.name
        self.on_status = None
        self._lock = threading.Lock()  # one run at a time: the runs share the models' KV caches
        self._owner: int | None = None  # the thread running now

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the decoder for one run. Calls from other threads wait their turn (a stream's run
        holds it until the run ends or its iterator is closed); a call from inside a running call
        (a stream callback) would wait for itself, so it is refused."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "this SpeculativeDecoder is already running a call in this thread (generate() from inside a "
                "stream callback?); finish or close that call first"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    @property
    def on_status(self) -> Progress | None:
        """A one-line callback for the waits inside `generate`: this host's costs being measured (once
        per pair, device and batch size) and forward shapes being captured (compile=True, once each).
        from_pretrained sets it to its `progress`; None says nothing."""
        return self._on_status

    @on_status.setter
    def on_status(self, callback: Progress | None) -> None:
        self._on_status = callback
        for adapter in self._adapters():
            if hasattr(adapter, "progress"):  # static-cache adapters announce their captures
                adapter.progress = callback

    def _adapters(self) -> list:
        """The target's adapter and the draft model's (when the drafter runs one)."""
        return [a for a in (self.target, self.drafter.adapter) if a is not None]

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
        cache: str = "auto",
        compile: bool | str = "auto",
        **removed,
    ) -> SpeculativeDecoder:
        """Load by name (local dir, .gguf, offline alias or Hub id) or wrap loaded models.
        draft_quantization: for a draft given by name, "auto" (int8 on CPU), "int8" or "none".
        target_quantization: "int8" (CPU, opt-in) makes the target an int8-dynamic model; output is then
        exact with respect to that quantised target, which is a different model from the original weights.
        cache: "dynamic" (transformers' DynamicCache), "static" (preallocated, rollback moves a pointer) or
        "auto" (static on CUDA where the model allows it, dynamic elsewhere);
        compile=True (static cache only) captures the draft step and verify forwards (CUDA graphs on GPU);
        "auto": on CUDA with the static cache.
        A draft whose tokenizer differs from the target's continues the text, re-encoded into target tokens
        (specdec.crosstok). A removed option (docs/FEATURES.md) is refused in one line."""
        check_removed(removed, "from_pretrained")
        check_progress(progress)
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
        if not (isinstance(compile, bool) or compile in ("auto", *COMPILE_MODES)):
            raise ValueError(
                f"compile must be True, False, 'auto' or one of {', '.join(COMPILE_MODES)}; got {compile!r}"
            )
        device = parse_device(device) if device is not None or isinstance(target, str) else None
        if compile not in (False, "auto") and _device_type(target, device) == "cpu":
            raise ValueError(
                f"compile={compile!r} needs CUDA (its captured forwards are CUDA graphs, and torch.compile cannot "
                "trace the CPU's packed oneDNN Linears); on the CPU, leave compile off"
            )
        if target_quantization not in (None, "none", "int8"):
            raise ValueError(f"target_quantization must be none or int8, got {target_quantization!r}")
        if target_quantization == "int8" and not isinstance(target, str):
            raise ValueError("target_quantization applies to a target given by name; quantise a loaded model yourself")
        tokenizer = _check_tokenizer(tokenizer) if tokenizer is not None else _tokenizer_for(target, progress)
        quantize_target = None if target_quantization == "none" else target_quantization
        target_adapter = _adapter(target, dtype, device, "target", quantize_target, progress, cache, compile)
        quantization = draft_quantization_for(draft_quantization, target_adapter.device.type)
        drafter = _drafter(
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
        )
        name = draft if isinstance(draft, str) else None
        decoder = cls(target_adapter, drafter, tokenizer, draft_name=name)
        decoder.on_status = progress
        return decoder

    @property
    def device(self) -> torch.device:
        return self.target.device

    def calibration(self, batch: int) -> Costs | None:
        """This host's costs for the pair at this batch size (measured once, then cached)."""
        if isinstance(self.drafter, NoDrafter):
            return None
        bucket = min(1 << (batch - 1).bit_length(), MAX_CALIBRATED_BATCH)  # powers of two up to 64
        draft = self.drafter.adapter if self.drafter.uses_model else None
        drafter = self.drafter if draft is not None else None
        return calibrate(self.target, draft, drafter=drafter, batch=bucket, progress=self.on_status)

    def _compile_seconds(self) -> float:
        """Warm-up spent so far capturing forward shapes (compile=True), target and draft together."""
        return sum(getattr(adapter, "compile_seconds", 0.0) for adapter in self._adapters())

    def warping(self, request: Request) -> tuple[Warping, set[int]]:
        """The target's generation config with this call's overrides -> warping and EOS ids."""
        warping, eos, _ = self._resolve_sampling(request)
        return warping, eos

    def _resolve_sampling(self, request: Request) -> tuple[Warping, set[int], dict]:
        """-> warping, EOS ids, and the sampling settings it resolved to (for `result.config`)."""
        model = getattr(self.target, "model", None)
        if not isinstance(model, PreTrainedModel):  # a custom TargetModel: the plain sampling arguments only
            s = request.sampling
            other = sorted(key for key, value in s.items() if value is not None and key not in PLAIN_SAMPLING)
            if other:
                raise ValueError(
                    f"{', '.join(other)} need a transformers target (its generation config); a custom "
                    "TargetModel takes temperature, top_k, top_p and do_sample only"
                )
            greedy = not s.get("do_sample")
            config = SamplingConfig(0 if greedy else s.get("temperature") or 1.0, s.get("top_k"), s.get("top_p"))
            summary = dict(do_sample=not greedy, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
            return Warping.from_sampling(config), set(), summary
        try:
            config = resolve_generation_config(model, max_new_tokens=request.max_new_tokens, **request.sampling)
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid generation settings: {error}") from None
        summary = {"do_sample": bool(config.do_sample)}
        if config.do_sample:
            summary |= dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
        changed = {key: value for key, value in request.sampling.items() if value is not None and key not in summary}
        return Warping.from_generation_config(model, config), _eos_ids(config), summary | changed

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int = 128,
        num_draft_tokens: int | str = "auto",
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool | None = None,
        seed: int | None = None,
        verification: str = "token",
        draft_width: int | str = "auto",
        prompt_lookup: bool | str = "auto",
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        stream: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        metrics: SpeculativeMetrics | None = None,
        rows: Sequence[dict] | None = None,
        config: SpecConfig | None = None,
        **generation_config,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate with the target's exact output law, faster.

        num_draft_tokens: "auto" (the default, as in the CLI) picks k each round from this host's costs
        (measured on the first call per pair, device and batch size, then cached on disk; on_status
        says so) and the acceptance counted so far, and drafts past k while the draft is sure; an
        integer fixes k.
        verification: "token" (Leviathan et al.), "block" (Sun et al. 2024: the drafted block judged
        jointly; never accepts less in expectation) or "race" (Kobus & Gunduz 2025: keyed Gumbel races;
        with a seed, the same tokens with any draft, any k, in any batch, or with draft=None).
        All three are exact; under greedy they coincide.
        draft_width: candidates per draft position. 1 is a chain; w > 1 a draft tree (the chain plus
        the draft's w - 1 next-best tokens beside each draft, scored in the same target forward with
        a tree mask; token and race verification); "auto" (the default) adds siblings only where the
        calibrated cost of a wider verify is paid by their learned acceptance, and is a chain where
        trees cannot run (n-gram or cross-tokenizer drafts, the static cache, block verification).
        prompt_lookup: after the draft's chain, append copy drafts (prompt lookup over the prompt, the
        output and the chain) while their learned acceptance pays for the wider verify, by this host's
        calibration (specdec.lookup; exact). "auto" (the default): on with a draft model, `auto` k
        (calibrated costs) and the drafts on the CPU; True: on with any draft (draft=None: a
        cost-aware prompt lookup), False: off.

        Sampling: temperature (0 = greedy), top_k, top_p, do_sample and any other generation-config
        field (repetition_penalty, no_repeat_ngram_size, min_p, ...); None means the target's
        generation_config. `metrics`: filled in as rounds complete (readable after an interrupt);
        with a batch it covers all rows, and each result also has its own row's metrics.

        rows: for a batch, one dict per prompt of that row's own options over the call's: max_new_tokens,
        seed, stop, temperature, top_k, top_p, do_sample and generation-config fields (a row's own seed
        needs verification="race": its tokens are then the same alone or in any batch).
        config: a SpecConfig (`specdec.inputs.check_request(...)`) in place of the keyword options.
        Each result's `config` records the options its row ran with, "auto" resolved.
        """
        check_chat(chat)
        if config is not None:
            given = dict(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, temperature=temperature)
            given |= dict(top_k=top_k, top_p=top_p, do_sample=do_sample, seed=seed, verification=verification)
            given |= dict(draft_width=draft_width, prompt_lookup=prompt_lookup, stop=stop, **generation_config)
            defaults = dict(max_new_tokens=128, num_draft_tokens="auto", verification="token", draft_width="auto")
            defaults["prompt_lookup"] = "auto"
            clashing = sorted(k for k, v in given.items() if v != defaults.get(k))
            if not isinstance(config, SpecConfig) or clashing:
                raise ValueError(f"pass a SpecConfig as config= and no options beside it (got {', '.join(clashing)})")
            if stream is not None:
                config = check_request(**config.arguments | {"stream": stream})
            return self._run(prompt, config, chat=chat, clock=clock, metrics=metrics, rows=rows)
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
            draft_width=draft_width,
            prompt_lookup=prompt_lookup,
            **generation_config,
        )
        return self._run(prompt, request, chat=chat, clock=clock, metrics=metrics, rows=rows)

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Text deltas as they are accepted (transformers' TextIteratorStreamer manner)."""
        if "stream" in kwargs:
            raise ValueError("stream() yields the text itself; do not pass stream=")
        return iterate_deltas(lambda callback: self.generate(prompt, stream=callback, **kwargs))

    def _prompt_lookup(self, setting: bool | str, costs: Costs | None) -> bool:
        """Whether copy drafts follow the draft's chain: "auto" with a draft model whose drafts are read
        on the CPU, and calibrated costs (auto k) to weigh each copy against its verify column."""
        if setting != "auto":
            return bool(setting)
        return self.drafter.uses_model and self.device.type == "cpu" and costs is not None

    def _run(self, prompt, request: Request, *, chat: bool, clock, metrics, rows=None) -> GenerationResult | list:
        with self._exclusive():
            return self._run_alone(prompt, request, chat=chat, clock=clock, metrics=metrics, row_options=rows)

    def _row_configs(self, request: SpecConfig, row_options, count: int, batched: bool) -> list[SpecConfig]:
        """Each row's config: the call's, with the row's own options over it."""
        if row_options is None:
            return [request] * count
        if not batched or not isinstance(row_options, Sequence) or len(row_options) != count:
            raise ValueError(f"rows= takes one dict of options per prompt of a batch ({count} prompts)")
        return [request.for_row(options) for options in row_options]

    def _row_sampling(self, configs: list[SpecConfig]) -> tuple[Warping | RowWarpings, set[int], list[dict]]:
        """One warping per distinct setting (rows sharing settings share it), the EOS ids, and each
        row's resolved sampling summary."""
        built: dict[tuple, tuple] = {}
        chosen = []
        for config in configs:
            key = (config.max_new_tokens, tuple(sorted((k, repr(v)) for k, v in config.sampling.items())))
            if key not in built:
                built[key] = self._resolve_sampling(config)
            chosen.append(built[key])
        return row_warping([w for w, _, _ in chosen]), chosen[0][1], [summary for _, _, summary in chosen]

    def _row_seeds(self, request: SpecConfig, configs: list[SpecConfig]) -> list[int | None] | None:
        """Rows' own race seeds, where a row's seed differs from the call's."""
        if all(config.seed == request.seed for config in configs):
            return None
        if request.verification != "race":
            raise ValueError(
                "rows with their own seed need verification='race' (its noise is keyed per row); under "
                f"{request.verification!r} verification the batch shares one generator: pass seed= to the call"
            )
        return [config.seed for config in configs]

    def _row_stops(self, configs: list[SpecConfig]):
        """The stop check of a batch whose rows may have their own stop strings (None: none has any)."""
        if not any(config.stops for config in configs):
            return None
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        checks = [StopStrings(config.stops, self.tokenizer) if config.stops else None for config in configs]
        return lambda row, *rest: None if checks[row] is None else checks[row](row, *rest)

    def _run_alone(self, prompt, request: SpecConfig, *, chat: bool, clock, metrics, row_options=None):
        texts, batched = split_prompts(prompt)
        if batched and request.stream is not None:
            raise ValueError("stream works with a single prompt; call generate once per prompt to stream each")
        configs = self._row_configs(request, row_options, len(texts), batched)
        warping, eos_ids, sampling = self._row_sampling(configs)
        prompts = [encode(p, self.tokenizer, chat, self.target.vocab_size) for p in texts]
        for ids, config in zip(prompts, configs):
            _check_context([ids], config.max_new_tokens, [self.target, self.drafter])
        stop, row_seeds = self._row_stops(configs), self._row_seeds(request, configs)
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        width = tree_width(request.draft_width, self.target, self.drafter, request.verification, warping.greedy)
        costs = self.calibration(len(prompts)) if request.k is None or width == "auto" else None
        k = 0 if isinstance(self.drafter, NoDrafter) else request.k  # the target alone: nothing to choose
        lookup = self._prompt_lookup(request.prompt_lookup, costs)
        streamer = DeltaStreamer(self.tokenizer, request.stream) if request.stream and self.tokenizer else None
        row_metrics = [SpeculativeMetrics() for _ in prompts]
        committed: list[list[int]] = [[] for _ in prompts]  # per row: the tokens committed so far

        def on_commit(row: int, tokens: list[int]) -> None:
            committed[row].extend(tokens)
            if streamer is not None:
                streamer(row, tokens)

        warm_up = self._compile_seconds()
        try:
            batch, total = decode(
                self.target,
                self.drafter,
                prompts,
                max_new_tokens=[config.max_new_tokens for config in configs],
                warping=warping,
                policy=DraftLengthPolicy(k=k, max_k=10, costs=costs),
                eos_ids=eos_ids,
                stop=stop,
                on_commit=on_commit,
                generator=generator,
                clock=clock,
                metrics=metrics,
                row_metrics=row_metrics,
                verification=request.verification,
                draft_width=width,
                prompt_lookup=lookup,
                race_seed=request.seed if request.seed is not None else secrets.randbits(62),
                row_seeds=row_seeds,
            )
        except KeyboardInterrupt as interrupt:
            if streamer is not None:
                streamer.end()  # the last word, held back until its end, of the tokens committed so far
            interrupt.token_ids = committed if batched else committed[0]  # what the caller got before it
            raise
        for counts in (total, *row_metrics):  # shapes captured for the first time in this run
            counts.compile_time_s = self._compile_seconds() - warm_up
        if streamer is not None:
            streamer.end()  # flush the last word
        resolved = dict(num_draft_tokens="auto" if request.k is None else k, draft_width=width)
        resolved |= dict(verification=request.verification, prompt_lookup=lookup)
        results = []
        for row, ids in enumerate(prompts):
            new, config = batch.new_tokens(row), configs[row]
            text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
            ran = resolved | dict(max_new_tokens=config.max_new_tokens, seed=config.seed, stop=config.stops)
            results.append(
                GenerationResult(
                    new,
                    text,
                    row_metrics[row] if batched else total,
                    ids,
                    total,
                    costs.to_dict() if costs else None,
                    ran | {"sampling": sampling[row]},
                )
            )
        return results if batched else results[0]


# ------------------------------------------------------------------ the one-shot call


def generate(
    prompt,
    *,
    target: ModelSpec,
    draft: ModelSpec | DraftModel | None = None,
    max_new_tokens: int = 128,
    num_draft_tokens: int | str = "auto",
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool | None = None,
    seed: int | None = None,
    verification: str = "token",
    draft_width: int | str = "auto",
    prompt_lookup: bool | str = "auto",
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
    cache: str = "auto",
    compile: bool | str = "auto",
    progress: Progress | None = None,
    **generation_config,
) -> GenerationResult | list[GenerationResult]:
    """One call: load (or wrap) the models, then `SpeculativeDecoder.generate`; loading options go to
    `SpeculativeDecoder.from_pretrained`. Arguments are checked before anything loads. For many
    prompts, build a SpeculativeDecoder once instead."""
    check_chat(chat)
    check_progress(progress)
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
        draft_width=draft_width,
        prompt_lookup=prompt_lookup,
        **generation_config,
    )
    split_prompts(prompt)  # a malformed prompt fails before loading too
    decoder = SpeculativeDecoder.from_pretrained(
        target,
        draft,
        dtype=dtype,
        device=device,
        draft_quantization=draft_quantization,
        target_quantization=target_quantization,
        tokenizer=tokenizer,
        cache=cache,
        compile=compile,
        progress=progress,
    )
    return decoder._run(prompt, request, chat=chat, clock=clock, metrics=metrics)  # checked above, once
