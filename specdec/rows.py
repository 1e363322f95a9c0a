"""One call's rows, resolved once before decoding: each row's prompt ids, config, sampling, stop
strings and seed.

Words: a row is one prompt of a batch. Its config is the call's `SpecConfig` with the row's own
options (`rows=`) over it; its budget (max_new_tokens) must fit every model's context after its
prompt. Rows whose sampling settings agree share one warping. A row's own seed keys its race noise
(verification="race"); otherwise the batch shares the call's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel

from specdec.config import SpecConfig, encode
from specdec.text import StopStrings
from specdec.verify.grammar import CompiledConstraint
from specdec.verify.sampling import RowWarpings, SamplingConfig, Warping, resolve_generation_config, row_warping

PLAIN_SAMPLING = ("temperature", "top_k", "top_p", "do_sample")  # all a custom TargetModel's warping reads


def eos_ids(config) -> set[int]:
    """EOS as transformers' generate sees it: the resolved generation config's, and nothing else
    (generate() never reads the tokenizer; stop= or eos_token_id= ask for more)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos if isinstance(eos, list) else [eos])


def resolve_sampling(target, request: SpecConfig, tokenizer=None) -> tuple[Warping, set[int], dict]:
    """The target's generation config with a config's overrides -> warping, EOS ids, and the sampling
    settings it resolved to (for `result.config`). A constraint is compiled here, for this tokenizer."""
    model = target.model
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
        return Warping.from_sampling(config, _compiled(request, tokenizer, target, set())), set(), summary
    try:
        config = resolve_generation_config(model, max_new_tokens=request.max_new_tokens, **request.sampling)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid generation settings: {error}") from None
    summary = {"do_sample": bool(config.do_sample)}
    if config.do_sample:
        summary |= dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    changed = {key: value for key, value in request.sampling.items() if value is not None and key not in summary}
    if request.constraint is not None and (config.min_new_tokens or config.min_length):
        raise ValueError(
            "min_new_tokens and min_length are refused beside structured output: the grammar decides where the reply "
            "ends, and where it ends sooner they would leave no token allowed; bound the length in the grammar "
            "instead (a regex's {n,}, a schema's minLength)"
        )
    eos = eos_ids(config)
    warping = Warping.from_generation_config(model, config, _compiled(request, tokenizer, target, eos))
    return warping, eos, summary | changed


def _compiled(request: SpecConfig, tokenizer, target, eos: set[int]) -> CompiledConstraint | None:
    if request.constraint is None:
        return None
    if tokenizer is None:
        raise ValueError("structured output needs a tokenizer (the grammar reads text): pass tokenizer=")
    return CompiledConstraint(request.constraint, tokenizer, target.vocab_size, eos)


def check_budget_fits(prompts: list[list[int]], max_new_tokens: int, models: list) -> None:
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


@dataclass(frozen=True)
class Rows:
    """What each row of one call runs with, resolved before decoding."""

    prompts: list[list[int]]  # [rows] each row's prompt token ids
    configs: list[SpecConfig]  # [rows]
    warping: Warping | RowWarpings  # one warping, or one per row where settings differ
    eos_ids: set[int]
    sampling: list[dict]  # [rows] each row's resolved sampling summary (result.config["sampling"])
    stops: list[StopStrings | None]  # [rows] each row's stop-string check (None: it has none)
    seeds: list[int | None] | None  # [rows] the rows' own race seeds, None where all use the call's

    @property
    def max_new_tokens(self) -> list[int]:
        return [config.max_new_tokens for config in self.configs]


def resolve_rows(request: SpecConfig, row_options, texts: list, batched: bool, *, chat: bool, decoder) -> Rows:
    """One call's rows: the prompts encoded, and the call's config with each row's own options over it
    (row_options None: every row runs the call's). `decoder`: its target, drafter and tokenizer."""
    target, tokenizer = decoder.target, decoder.tokenizer
    configs = row_configs(request, row_options, len(texts), batched)
    warping, eos, sampling = _row_sampling(target, configs, tokenizer)
    prompts = [encode(p, tokenizer, chat, target.vocab_size) for p in texts]
    for ids, config in zip(prompts, configs):
        check_budget_fits([ids], config.max_new_tokens, [target, decoder.drafter])
    stops, seeds = _row_stops(configs, tokenizer), _row_seeds(request, configs)
    return Rows(prompts, configs, warping, eos, sampling, stops, seeds)


def row_configs(request: SpecConfig, row_options, count: int, batched: bool) -> list[SpecConfig]:
    """Each row's config: the call's, with the row's own options over it."""
    if row_options is None:
        return [request] * count
    if not batched or not isinstance(row_options, Sequence) or len(row_options) != count:
        raise ValueError(f"rows= takes one dict of options per prompt of a batch ({count} prompts)")
    return [request.for_row(options) for options in row_options]


def sampling_key(config: SpecConfig) -> tuple:
    """What a row's warping depends on: configs with equal keys can share one Warping."""
    return config.max_new_tokens, tuple(sorted((k, repr(v)) for k, v in config.sampling.items())), config.constraint


def _row_sampling(target, configs: list[SpecConfig], tokenizer) -> tuple[Warping | RowWarpings, set[int], list[dict]]:
    """One warping per distinct setting (rows sharing settings share it), the EOS ids, and each
    row's resolved sampling summary."""
    built: dict[tuple, tuple] = {}
    chosen = []
    for config in configs:
        key = sampling_key(config)
        if key not in built:
            built[key] = resolve_sampling(target, config, tokenizer)
        chosen.append(built[key])
    return row_warping([w for w, _, _ in chosen]), chosen[0][1], [summary for _, _, summary in chosen]


def _row_seeds(request: SpecConfig, configs: list[SpecConfig]) -> list[int | None] | None:
    """Rows' own race seeds, where a row's seed differs from the call's."""
    if all(config.seed == request.seed for config in configs):
        return None
    if request.verification != "race":
        raise ValueError(
            "rows with their own seed need verification='race' (its noise is keyed per row); under "
            f"{request.verification!r} verification the batch shares one generator: pass seed= to the call"
        )
    return [config.seed for config in configs]


def _row_stops(configs: list[SpecConfig], tokenizer) -> list[StopStrings | None]:
    """Each row's stop-string check (None: the row has no stop strings)."""
    if any(config.stops for config in configs) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    return [StopStrings(config.stops, tokenizer) if config.stops else None for config in configs]
