"""`SpeculativeDecoder` (load once, generate many) and the one-shot `specdec.generate()`.

Words: a prompt is a string, a list of token ids (or a 1-D tensor / array), or a
chat (a list of {"role", "content"} messages); a batch is a list of prompts.
`draft=None` runs the target alone through the same loop (the timing baseline);
`draft="ngram"` uses prompt lookup; anything else is a draft LM.

Sampling arguments default to None, meaning the target's own `generation_config`
(then transformers' defaults), exactly as `model.generate()` resolves them;
explicit values override it. `temperature=0` is greedy.

This is the one place that turns names into models (through specdec.loading): the CLI,
the bench and the scripts all build a `SpeculativeDecoder`. A call's rows are resolved
by specdec.rows.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.config import (
    SpecConfig,
    check_chat,
    check_progress,
    check_removed,
    check_request,
    check_tokenizer_fits,
    split_prompts,
)
from specdec.drafters import DraftModel
from specdec.engine.decoder import TokenLogprob, decode, plan_for, rows_for, token_logprobs
from specdec.engine.trees import tree_width
from specdec.loading import (
    ModelSpec,
    adapter_for,
    check_tokenizer,
    drafter_for,
    load_pair,
    tokenizer_for,
)
from specdec.metrics import SpeculativeMetrics, Stopwatch
from specdec.models.adapters import TargetModel, cache_keyword
from specdec.models.resolution import Progress
from specdec.rows import Rows, resolve_rows, resolve_sampling, row_configs
from specdec.text import DeltaStreamer, TokenSpans, iterate_deltas
from specdec.tuning.calibration import calibrate
from specdec.tuning.costs import Costs
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.sampling import Warping

MAX_CALIBRATED_BATCH = 64  # larger batches use the costs measured at 64 rows


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens, when a tokenizer is known
    metrics: SpeculativeMetrics  # this row's counts (clocks are the batch's: rows share forwards)
    prompt_ids: list[int]
    batch_metrics: SpeculativeMetrics | None = None  # the whole batch (the same object for one prompt)
    calibration: dict | None = None  # the measured costs `auto` chose k from (None with a fixed k)
    config: dict | None = None  # this row's options as the run resolved them ("auto" made concrete)
    logprobs: list[TokenLogprob] | None = None  # per new token, with generate(logprobs=n) (None: not asked)
    kinds: list[tuple[str, int, int]] | None = None  # per new token: its KINDS, its round, that round's drafts


@dataclass(frozen=True)
class Call:
    """One generate() call's options, checked: the one signature of `SpeculativeDecoder.generate` and of
    `specdec.generate` (which adds the loading options). `Call.of` checks everything before a model loads."""

    config: SpecConfig
    texts: list  # the prompts (one for a single prompt)
    batched: bool  # a list of prompts was given
    chat: bool
    clock: Callable[[], float]
    metrics: SpeculativeMetrics | None
    rows: Sequence[dict] | None
    stream_tokens: bool = False  # each streamed delta a text.Delta with the tokens it begins

    @staticmethod
    def of(
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
        logprobs: int | None = None,
        chat: bool = False,
        stop: str | Sequence[str] | None = None,
        stream: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        metrics: SpeculativeMetrics | None = None,
        rows: Sequence[dict] | None = None,
        config: SpecConfig | None = None,
        stream_tokens: bool = False,
        **generation_config,
    ) -> Call:
        check_chat(chat)
        texts, batched = split_prompts(prompt)  # a malformed prompt fails before loading too
        options = dict(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, temperature=temperature)
        options |= dict(top_k=top_k, top_p=top_p, do_sample=do_sample, seed=seed, verification=verification)
        options |= dict(draft_width=draft_width, prompt_lookup=prompt_lookup, stop=stop, logprobs=logprobs)
        options |= generation_config
        if config is None:
            config = check_request(stream=stream, **options)
        else:
            config = _config_alone(config, options, stream)
        if batched and config.stream is not None:
            raise ValueError("stream works with a single prompt; call generate once per prompt to stream each")
        if rows is not None:  # each row's options, checked now (encoded and resolved with the models)
            row_configs(config, rows, len(texts), batched)
        if stream_tokens not in (True, False) or (stream_tokens and config.stream is None):
            raise ValueError(
                "stream_tokens=True needs stream= (a callable taking each Delta), or use stream(..., tokens=True)"
            )
        return Call(config, texts, batched, chat, clock, metrics, rows, stream_tokens)


# ------------------------------------------------------------------ the engine object


PROMPT_BLOCK = 256  # prompt positions scored per forward (echo): the logits held are [256, vocab], not [prompt, vocab]


class SpeculativeDecoder:
    """A target, its drafter and tokenizer, loaded once; `generate` and `stream` as often as needed.

    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    print(decoder.generate("def fib(n):", max_new_tokens=64).text)
    for delta in decoder.stream("Write a haiku."): print(delta, end="")
    """

    def __init__(self, target: TargetModel | PreTrainedModel, drafter=None, tokenizer=None, *, draft_name=None):
        """From loaded pieces: a target (HFCausalLM or transformers model), a drafter (a DraftModel,
        a loaded draft model, "ngram", or None for the target alone) and a tokenizer (or None)."""
        self.target = adapter_for(target, None, None, "target")
        self.tokenizer = check_tokenizer(tokenizer) if tokenizer is not None else tokenizer_for(self.target)
        if tokenizer is not None:  # one given for this target: refused now, not at the first prompt
            check_tokenizer_fits(self.tokenizer, self.target.vocab_size)
        self.drafter = drafter_for(drafter, self.target, None, None, None, self.tokenizer, None, None)
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
            adapter.progress = callback  # static-cache adapters announce their captures

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
        dtype "auto": float16 on CUDA; on CPU bfloat16 where bf16 is native, else float32, but bfloat16 for a
        target without a draft (its forwards are one token of one row; for batches of 4+ prompts without a
        draft on such a CPU, float32 is faster: pass it).
        draft_quantization: for a draft given by name, "auto" (on CPU, for an offline alias and dtype "auto", the
            faster of int8 and int4-rtn, timed once per host; int8 otherwise), or any weight form of
            specdec.models.forms: "int8", "int4" (a GGUF source's 4-bit weights), "int4-rtn" (its own weights
            rounded to 4 bits) or "none"; exact in each.
        target_quantization: "int8" (CPU, opt-in) makes the target an int8-dynamic model; "int4" (CPU, a
        GGUF source) keeps the GGUF's own 4-bit weights (specdec.models.int4). Output is then exact with respect
        to that quantised target, which is a different model from the original weights: token-exact in
        float32 (int4: dtype="float32" for its other layers), and in bfloat16 up to bf16 near-ties, as for
        every bfloat16 model.
        cache: "dynamic" (transformers' DynamicCache), "static" (preallocated, rollback moves a pointer) or
        "auto" (static on CUDA where the model allows it, dynamic elsewhere);
        compile=True (static cache only) captures the draft step and verify forwards (CUDA graphs on GPU);
        "auto": on CUDA with the static cache.
        A draft whose tokenizer differs from the target's continues the text, re-encoded into target tokens
        (specdec.drafters.crosstok). A removed option (docs/FEATURES.md) is refused in one line."""
        check_removed(removed, "from_pretrained")
        check_progress(progress)
        loading = dict(dtype=dtype, device=device, draft_quantization=draft_quantization, cache=cache, compile=compile)
        loading |= dict(target_quantization=target_quantization, tokenizer=tokenizer, progress=progress)
        target_adapter, drafter, tokenizer = load_pair(target, draft, **loading)
        name = draft if isinstance(draft, str) else None
        decoder = cls(target_adapter, drafter, tokenizer, draft_name=name)
        decoder.on_status = progress
        return decoder

    @property
    def device(self) -> torch.device:
        return self.target.device

    def calibration(self, batch: int) -> Costs | None:
        """This host's costs for the pair at this batch size (measured once, then cached)."""
        if not self.drafter.drafts:
            return None
        bucket = min(1 << (batch - 1).bit_length(), MAX_CALIBRATED_BATCH)  # powers of two up to 64
        draft = self.drafter.adapter if self.drafter.uses_model else None
        drafter = self.drafter if draft is not None else None
        return calibrate(self.target, draft, drafter=drafter, batch=bucket, progress=self.on_status)

    def _compile_seconds(self) -> float:
        """Warm-up spent so far capturing forward shapes (compile=True), target and draft together."""
        return sum(adapter.compile_seconds for adapter in self._adapters())

    def warping(self, request: SpecConfig) -> tuple[Warping, set[int]]:
        """The target's generation config with this call's overrides -> warping and EOS ids."""
        warping, eos, _ = self._resolve_sampling(request)
        return warping, eos

    def _resolve_sampling(self, request: SpecConfig) -> tuple[Warping, set[int], dict]:
        """-> warping, EOS ids, and the sampling settings it resolved to (for `result.config`)."""
        return resolve_sampling(self.target, request, self.tokenizer)

    def generate(self, prompt, **options) -> GenerationResult | list[GenerationResult]:
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
        calibration (specdec.drafters.lookup; exact). "auto" (the default): on with a draft model, `auto` k
        (calibrated costs) and the drafts on the CPU; True: on with any draft (draft=None: a
        cost-aware prompt lookup), False: off.

        Sampling: temperature (0 = greedy), top_k, top_p, do_sample and any other generation-config
        field (repetition_penalty, no_repeat_ngram_size, min_p, ...); None means the target's
        generation_config. `metrics`: its clocks and forwards filled in as rounds complete, its token
        counts (the sum of its rows') when the run ends, an interrupt included; with a batch it covers
        all rows, and each result also has its own row's metrics.

        rows: for a batch, one dict per prompt of that row's own options over the call's: max_new_tokens,
        seed, stop, temperature, top_k, top_p, do_sample and generation-config fields (a row's own seed
        needs verification="race": its tokens are then the same alone or in any batch).
        logprobs: n (0-20) gives each result's `logprobs`, one TokenLogprob per new token: its log-probability
        under the target's raw law at its position (log_softmax of the logits the verify forward already
        computed there, float32, before temperature and the other processors: vLLM's default) and the n
        most likely ids with theirs; what the target alone computes there (tested to 1e-5 in float32).
        config: a SpecConfig (`specdec.config.check_request(...)`) in place of the keyword options.
        Each result's `config` records the options its row ran with, "auto" resolved.
        """
        call = Call.of(prompt, **options)
        return self._run(call)

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob | None]:
        """Each prompt token's TokenLogprob under the target's raw law after the tokens before it (None for
        the first, which nothing precedes): prompt scoring, as evaluation harnesses ask with `echo`. One
        forward of the target over the prompt, beside any cache (a serving batch's is left alone)."""
        model = self.target.model
        if model is None:
            raise ValueError(f"{self.target.name} is not a transformers model: it scores no prompt")
        scored: list[TokenLogprob | None] = [None]
        cache, keyword = DynamicCache(config=model.config), cache_keyword(model)
        with torch.inference_mode():
            for start in range(0, len(prompt_ids) - 1, PROMPT_BLOCK):  # bounded logits: a block's, not the prompt's
                block = prompt_ids[start : start + PROMPT_BLOCK]
                ids = torch.tensor([block], device=self.target.device)
                logits = model(input_ids=ids, use_cache=True, **{keyword: cache}).logits[0]  # [block, vocab]
                after = prompt_ids[start + 1 : start + 1 + len(block)]  # each position's next prompt token
                scored += token_logprobs(logits, list(range(len(after))), after, top)
        return scored

    def stream(self, prompt, tokens: bool = False, **kwargs) -> Iterator[str]:
        """Text deltas as they are accepted (transformers' TextIteratorStreamer manner). tokens=True: each
        delta is a specdec.text.Delta (a str) whose `tokens` are the tokens it begins, each a dict of id,
        text, kind (what emitted it: KINDS), round and, with logprobs=n, logprob and top."""
        if "stream" in kwargs:
            raise ValueError("stream() yields the text itself; do not pass stream=")
        return iterate_deltas(lambda callback: self.generate(prompt, stream=callback, stream_tokens=tokens, **kwargs))

    def _run(self, call: Call) -> GenerationResult | list:
        with self._exclusive():
            return self._run_alone(call)

    def _run_alone(self, call: Call):
        request, batched, clock, metrics = call.config, call.batched, call.clock, call.metrics
        rows = resolve_rows(request, call.rows, call.texts, batched, chat=call.chat, decoder=self)
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(request.seed)
        width = tree_width(request.draft_width, self.target, self.drafter, request.verification, rows.warping.greedy)
        costs = self.calibration(len(rows.prompts)) if request.k is None or width == "auto" else None
        k = request.k if self.drafter.drafts else 0  # the target alone: nothing to choose
        spans = TokenSpans(self.tokenizer) if call.stream_tokens and self.tokenizer else None
        streamer = DeltaStreamer(self.tokenizer, request.stream, spans) if request.stream and self.tokenizer else None
        commits = _Commits(len(rows.prompts), streamer, spans)
        row_metrics = [SpeculativeMetrics() for _ in rows.prompts]
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        engine_rows = rows_for(rows.prompts, rows.max_new_tokens, rows.warping, self.target.vocab_size,
                               race_seed=seed, row_seeds=rows.seeds, stops=rows.stops, on_commit=commits,
                               metrics=row_metrics, logprobs=request.logprobs)  # fmt: skip
        commits.engine_rows = engine_rows
        policy = DraftLengthPolicy(k=k, max_k=10, costs=costs)
        plan = plan_for(self.target, self.drafter, policy, rows.warping.greedy, eos_ids=rows.eos_ids,
                        verification=request.verification, draft_width=width, generator=generator,
                        prompt_lookup=request.prompt_lookup)  # fmt: skip
        watch = Stopwatch(metrics if metrics is not None else SpeculativeMetrics(), clock)
        warm_up = self._compile_seconds()
        try:
            _, total = decode(self.target, self.drafter, engine_rows, plan, watch)
        except KeyboardInterrupt as interrupt:
            commits.end()  # the last word, held back until its end, of the tokens committed so far
            interrupt.token_ids = commits.rows if batched else commits.rows[0]  # what the caller got before it
            raise
        for counts in (total, *row_metrics):  # shapes captured for the first time in this run
            counts.compile_time_s = self._compile_seconds() - warm_up
        commits.end()  # flush the last word
        resolved = dict(num_draft_tokens="auto" if request.k is None else k, draft_width=width)
        resolved |= dict(verification=request.verification, prompt_lookup=plan.copies)
        results = _results(engine_rows, rows, total, row_metrics if batched else None, resolved, costs, self.tokenizer)
        for result, row in zip(results, engine_rows):
            result.kinds = list(row.token_kinds)
            if request.logprobs is not None:
                result.logprobs = list(row.token_logprobs)
        return results if batched else results[0]


def _config_alone(config, options: dict, stream) -> SpecConfig:
    """generate(config=...): the config, refused beside any other option (the stream may join it)."""
    defaults = dict(max_new_tokens=128, num_draft_tokens="auto", verification="token", draft_width="auto")
    defaults |= dict(prompt_lookup="auto", logprobs=None)
    clashing = sorted(k for k, v in options.items() if v != defaults.get(k))
    if not isinstance(config, SpecConfig):
        raise ValueError(f"config= takes a SpecConfig (SpecConfig.of(...)), got {type(config).__name__}")
    if clashing:
        raise ValueError(f"pass config= alone, with no options beside it (got {', '.join(clashing)})")
    if stream is not None:
        config = check_request(**config.arguments | {"stream": stream})
    return config


class _Commits:
    """decode's on_commit: each row's committed tokens so far (for an interrupt), fed on to the stream."""

    def __init__(self, count: int, streamer: DeltaStreamer | None, spans: TokenSpans | None = None):
        self.rows: list[list[int]] = [[] for _ in range(count)]  # [rows] the tokens committed so far
        self.streamer, self.spans = streamer, spans
        self.engine_rows: list = []  # the run's engine rows: each token's kind and logprob (stream_tokens)

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.rows[row].extend(tokens)
        if self.spans is not None:  # before the text: each delta then finds the tokens it begins
            engine_row, tokenizer = self.engine_rows[row], self.spans.tokenizer
            kinds, logprobs = engine_row.token_kinds[-len(tokens) :], engine_row.token_logprobs[-len(tokens) :]
            items = [dict(id=t, text=tokenizer.decode([t]), kind=kinds[j][0], round=kinds[j][1])
                     | ({} if engine_row.logprobs is None else dict(logprob=logprobs[j].logprob, top=logprobs[j].top))
                     for j, t in enumerate(tokens)]  # fmt: skip
            self.spans.add(tokens, items)
        if self.streamer is not None:
            self.streamer(row, tokens)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def _results(engine_rows, rows: Rows, total, row_metrics, resolved: dict, costs, tokenizer) -> list[GenerationResult]:
    """One GenerationResult per row; row_metrics None: one prompt, whose metrics are the batch's."""
    results = []
    for row, ids in enumerate(rows.prompts):
        new, config = engine_rows[row].new_tokens, rows.configs[row]
        text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
        ran = resolved | dict(max_new_tokens=config.max_new_tokens, seed=config.seed, stop=config.stops)
        own = row_metrics[row] if row_metrics is not None else total
        calibration = costs.to_dict() if costs else None
        results.append(
            GenerationResult(new, text, own, ids, total, calibration, ran | {"sampling": rows.sampling[row]})
        )
    return results


# ------------------------------------------------------------------ the one-shot call


def generate(
    prompt,
    *,
    target: ModelSpec,
    draft: ModelSpec | DraftModel | None = None,
    tokenizer=None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    draft_quantization: str | None = "auto",
    target_quantization: str | None = None,
    cache: str = "auto",
    compile: bool | str = "auto",
    progress: Progress | None = None,
    **options,
) -> GenerationResult | list[GenerationResult]:
    """One call: load (or wrap) the models, then `SpeculativeDecoder.generate(prompt, **options)`, whose
    options these are (`Call.of`: the one signature of both); the loading options go to
    `SpeculativeDecoder.from_pretrained`. Every argument is checked before anything loads. For many
    prompts, build a SpeculativeDecoder once instead."""
    check_progress(progress)
    call = Call.of(prompt, **options)
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
    return decoder._run(call)


def _signature_of_generate():
    """SpeculativeDecoder.generate's signature, as help() and IDEs show it: Call.of's, after `self`."""
    import inspect

    params = list(inspect.signature(Call.of).parameters.values())
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.signature(Call.of).replace(parameters=[self_param, *params], return_annotation="GenerationResult")


SpeculativeDecoder.generate.__signature__ = _signature_of_generate()
