"""Side-by-side benchmarks: specdec against transformers, in one process, interleaved.

Words:
- method: one way to generate (`hf_target`, `hf_assisted`, `hf_assisted_pinned`,
  `hf_prompt_lookup`, `specdec_k{k}`, `specdec_auto`, `specdec_ngram`,
  `specdec_target`).
- run: one method on one prompt; a repeat is every method on every prompt,
  in the order A B C A B C ... so machine noise spreads over all methods.
- cost ratio c: draft step / target forward (1 token), measured directly; the
  target's cost for k + 1 positions relative to 1 is measured too.
- bound: Leviathan et al.'s S = E[N] / (k c + 1) for the measured acceptance.

Everything serialises to one JSON object (`run_benchmark` returns it);
scripts/report.py renders markdown and plots from that JSON.
"""

from __future__ import annotations

import collections
import datetime
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.host import host_info
from specdec.config import encode as _encode
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.loading import draft_quantization_for
from specdec.metrics import SpeculativeMetrics
from specdec.models.adapters import HFCausalLM, TargetModel
from specdec.tuning.costs import Costs, forward_seconds
from specdec.tuning.speedup import best_draft_length, geometric_speedup, leviathan_cost


def count_host_syncs(fn: Callable):
    """(fn(), Counter of host syncs by the specdec file:line that made them). Counted: what torch reports
    (torch.cuda.set_sync_debug_mode: device-to-host copies, item(), blocking copies) and every wait on a
    CUDA event (PendingRead's reads, which torch does not report). Off CUDA: (fn(), None)."""
    if not torch.cuda.is_available():
        return fn(), None
    sites = collections.Counter()

    own = ("record", "counted_wait")  # this function's frames

    def record(message, *args, **kwargs):
        if "synchroniz" in str(message):
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack if "/specdec/" in f.filename and f.name not in own]
            sites[f"{frames[-1].filename.split('/specdec/')[-1]}:{frames[-1].lineno}" if frames else "outside"] += 1

    event_wait = torch.cuda.Event.synchronize

    def counted_wait(event):
        record("synchronizing on an event")
        return event_wait(event)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted_wait
        try:
            result = fn()
        finally:
            torch.cuda.Event.synchronize = event_wait
            torch.cuda.set_sync_debug_mode(0)
    return result, sites


PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    ],
    "editing": [
        "Add type hints to this function and return the code:\n\n"
        "def merge_counts(first, second):\n    result = dict(first)\n    for key, value in second.items():\n"
        "        result[key] = result.get(key, 0) + value\n    return result\n",
        "Rename the variable `data` to `records` everywhere in this code and return it:\n\n"
        "def summarize(data):\n    total = sum(item['amount'] for item in data)\n"
        "    largest = max(data, key=lambda item: item['amount'])\n"
        "    return {'count': len(data), 'total': total, 'largest': largest}\n",
    ],
    "chat": [
        "Explain in a few sentences why the sky is blue.",
        "Give three tips for writing clear emails at work.",
    ],
    # Held out (written 2026-11-28, never tuned on): the n-gram guard's new editing prompts (bench ngram --held-out).
    "editing-new": [
        "Convert the string concatenations to f-strings and return the code:\n\n"
        "def describe(name, age, city):\n    return 'Name: ' + name + ', age: ' + str(age) + ', city: ' + city\n\n"
        "def greet(name):\n    return 'Hello, ' + name + '!'\n",
        "Make this function raise ValueError for an empty list, and return the code:\n\n"
        "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n",
        "Replace the loop with a dictionary comprehension and return the code:\n\n"
        "def index_by_id(users):\n    index = {}\n    for user in users:\n        index[user['id']] = user\n"
        "    return index\n",
    ],
}


# Two more per class, for policy comparisons (scripts/policy_eval.py --prompt-set all): with two prompts
# a class's best fixed k is the luckiest of a few, and a draft-length rule is judged against that pick.
EXTRA_PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
        "Write a Python function that merges two sorted lists into one sorted list.",
    ],
    "editing": [
        "Rewrite this function with a list comprehension and return the code:\n\n"
        "def squares_of_evens(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
        "            result.append(n * n)\n    return result\n",
        "Add a docstring to this function and return the code:\n\n"
        "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
        "        return high\n    return value\n",
    ],
    "chat": [
        "What should I think about before adopting a dog?",
        "Describe in a few sentences how a bill becomes a law.",
    ],
}


@dataclass(frozen=True)
class BenchSettings:
    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    max_new_tokens: int = 128
    repeats: int = 1
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    temperature: float = 0.0
    classes: tuple[str, ...] = ("code", "editing", "chat")
    prompts_per_class: int = 2
    pinned_gamma: int = 4
    hf_methods: bool = True
    draft_quantization: str | None = "int8"
    ngram: bool = False
    # Fairness: transformers' assisted generation with specdec's (int8) draft, and specdec with
    # transformers' (unquantised) draft, to separate the engine from the draft lever.
    swap_drafts: bool = False
    # Engine variants at k auto, beside specdec_auto: "+"-joined options, run as specdec_auto_<variant>:
    # w<N> or wauto (draft_width), race (verification; sampling only).
    variants: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # keep just these methods (empty: all)


@dataclass
class Run:
    method: str
    prompt_class: str
    prompt_index: int
    new_tokens: int
    seconds: float
    metrics: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def measure_costs(
    target: TargetModel, draft: TargetModel | None, ks, context_len: int = 128, repeats: int = 5
) -> Costs:
    """The draft's forward over 1 token and the target's over 1 and each k + 1 tokens, after a context of
    `context_len`, with the calibration's forward timer (no cache: the bench measures afresh)."""
    widths = sorted({1, *(k + 1 for k in ks)})
    with torch.inference_mode():
        draft_step = forward_seconds(draft, 1, [1], context_len, repeats)[0] if draft is not None else 0.0
        return Costs(draft_step, tuple(zip(widths, forward_seconds(target, 1, widths, context_len, repeats))))


def costs_json(costs: Costs, ks) -> dict:
    """The costs as bench.json holds them: the calibration's fields, and the target forward over 1 token,
    the cost ratio c and, per k, the target's cost for k + 1 positions relative to 1 (cli/report.py)."""
    growth = {k: costs.verify_cost(k + 1) for k in ks}
    return costs.to_dict() | {"target_step_s": costs.target(1), "target_k_plus_1_s": growth, "ratio": costs.cost_ratio}


def _chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt as `generate(chat=True)` encodes it (plain text without a chat template)."""
    return _encode(text, tokenizer, bool(getattr(tokenizer, "chat_template", None)), len(tokenizer))


def _hf_runner(target, sampling_kwargs: dict, max_new_tokens: int, assistant_config: dict | None = None, **extra):
    """transformers' generate; assistant_config temporarily overrides the assistant's generation_config."""
    assistant = extra.get("assistant_model")

    def run(ids: list[int]):
        inputs = torch.tensor([ids], device=target.device)
        saved = {}
        if assistant_config:
            saved = {key: getattr(assistant.generation_config, key) for key in assistant_config}
            for key, value in assistant_config.items():
                setattr(assistant.generation_config, key, value)
        try:
            with torch.inference_mode():
                out = target.generate(
                    inputs,
                    attention_mask=torch.ones_like(inputs),
                    max_new_tokens=max_new_tokens,
                    **sampling_kwargs,
                    **extra,
                )
        finally:
            for key, value in saved.items():
                setattr(assistant.generation_config, key, value)
        return out.shape[1] - len(ids), None

    return run


def _specdec_runner(target: HFCausalLM, drafter, k, settings: BenchSettings, tokenizer, seed: int, **options):
    decoder = SpeculativeDecoder(target, drafter, tokenizer)
    decoder.calibration(1)  # auto k and auto width use it: measured (or read from disk) before any timed run
    # The same law as the transformers runs: temperature only, no top-k/top-p (generate's default top-k is 50).
    sampling = {"temperature": 0} if settings.temperature == 0 else {"temperature": settings.temperature, "top_k": 0}

    def run(ids: list[int]):
        out = decoder.generate(
            ids, num_draft_tokens=k, max_new_tokens=settings.max_new_tokens, seed=seed, **sampling, **options
        )
        return len(out.token_ids), out.metrics.to_dict()

    return run


def build_methods(settings: BenchSettings, target: HFCausalLM, draft_model, hf_draft_model, tokenizer) -> dict:
    greedy = settings.temperature == 0
    hf_sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0}
    )
    n = settings.max_new_tokens
    target_model = target.model
    methods: dict[str, Callable] = {}
    if settings.hf_methods:
        methods["hf_target"] = _hf_runner(target_model, hf_sampling, n)
        if hf_draft_model is not None:
            methods["hf_assisted"] = _hf_runner(target_model, hf_sampling, n, assistant_model=hf_draft_model)
            pinned = {
                "num_assistant_tokens": settings.pinned_gamma,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            methods["hf_assisted_pinned"] = _hf_runner(
                target_model, hf_sampling, n, pinned, assistant_model=hf_draft_model
            )
        methods["hf_prompt_lookup"] = _hf_runner(target_model, hf_sampling, n, prompt_lookup_num_tokens=10)
    if settings.swap_drafts and draft_model is not None and hf_draft_model is not None:
        methods["hf_assisted_int8_draft"] = _hf_runner(target_model, hf_sampling, n, assistant_model=draft_model)
        unquantised = ModelDrafter(HFCausalLM(hf_draft_model, name=settings.draft), vocab_size=target.vocab_size)
        for k in (4, "auto"):
            methods[f"specdec_unquantised_draft_{k}"] = _specdec_runner(target, unquantised, k, settings, tokenizer, 0)
    target = HFCausalLM(target_model, name=settings.target)  # a fresh cache: the transformers runs share the model
    methods["specdec_target"] = _specdec_runner(target, None, 1, settings, tokenizer, 0)
    if draft_model is not None:
        drafter = ModelDrafter(HFCausalLM(draft_model, name=settings.draft), vocab_size=target.vocab_size)
        for k in settings.ks:
            methods[f"specdec_k{k}"] = _specdec_runner(target, drafter, k, settings, tokenizer, 0)
        methods["specdec_auto"] = _specdec_runner(target, drafter, "auto", settings, tokenizer, 0)
        for variant in settings.variants:
            options = {}
            for option in variant.split("+"):
                if option == "race":
                    options["verification"] = "race"
                elif option.startswith("w"):
                    options["draft_width"] = "auto" if option == "wauto" else int(option[1:])
                else:
                    raise ValueError(f"unknown bench variant option {option!r} in {variant!r}")
            if options.get("verification") == "race" and settings.temperature == 0:
                continue  # under greedy every method is the same rule
            methods[f"specdec_auto_{variant}"] = _specdec_runner(
                target, drafter, "auto", settings, tokenizer, 0, **options
            )
    if settings.ngram:
        methods["specdec_ngram"] = _specdec_runner(target, NgramDrafter(), "auto", settings, tokenizer, 0)
    if settings.only:
        methods = {name: fn for name, fn in methods.items() if name in settings.only}
    return methods


def leviathan_bound(alpha: float, k: int | None, cost_ratio: float) -> float:
    """S = E[N] / (k c + 1); for k=None (auto) the bound at the best k."""
    if k is None:
        k = best_draft_length(alpha, alpha, leviathan_cost(cost_ratio), 16)
    return geometric_speedup(alpha, k, cost_ratio)


def acceptance_alpha(metrics: dict) -> float:
    """Per-token acceptance as a geometric MLE: accepted / (accepted + rejections)."""
    trials = metrics["accepted_tokens"] + metrics["recovered_tokens"]
    return metrics["accepted_tokens"] / trials if trials else 0.0


def summarise(runs: list[Run], costs: Costs | None) -> dict:
    """Per method: median tokens/s over its runs, speedups, acceptance, bound, overhead."""
    by_method: dict[str, list[Run]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)
    baseline = (
        statistics.median(r.tokens_per_second for r in by_method["hf_target"])
        if "hf_target" in by_method
        else statistics.median(r.tokens_per_second for r in by_method["specdec_target"])
    )
    hf_best = max(
        (
            statistics.median(r.tokens_per_second for r in rs)
            for m, rs in by_method.items()
            if m.startswith("hf_") and m != "hf_target"
        ),
        default=None,
    )
    summary = {}
    for method, method_runs in by_method.items():
        tps = statistics.median(r.tokens_per_second for r in method_runs)
        row = {
            "tokens_per_second": tps,
            "speedup_vs_target": tps / baseline,
            "speedup_vs_hf_best": tps / hf_best if hf_best else None,
            "runs": len(method_runs),
        }
        merged = [r.metrics for r in method_runs if r.metrics]
        if merged:
            total = SpeculativeMetrics()
            for m in merged:
                total = total + SpeculativeMetrics.from_dict(m)
            data = total.to_dict()
            alpha = acceptance_alpha(data)
            k = int(method[9:]) if method.startswith("specdec_k") else None
            row |= {
                "acceptance_rate": data["acceptance_rate"],
                "alpha": alpha,
                "mean_acceptance_length": data["mean_acceptance_length"],
                "acceptance_rate_per_position": data["acceptance_rate_per_position"],
                "time_split": {
                    "draft": data["draft_time_s"],
                    "target": data["target_time_s"],
                    "other": data["other_time_s"],
                    "wall": data["wall_time_s"],
                },
                "engine_overhead_share": data["other_time_s"] / data["wall_time_s"] if data["wall_time_s"] else 0,
            }
            if costs is not None and (method.startswith("specdec_k") or method == "specdec_auto"):
                bound = leviathan_bound(alpha, k, costs.cost_ratio)
                row |= {"bound": bound, "share_of_bound": row["speedup_vs_target"] / bound}
        summary[method] = row
    return summary


def run_benchmark(settings: BenchSettings, progress: Callable[[str], None] = print) -> dict:
    """Load the models, measure costs, run every method interleaved, and summarise. Returns JSON-able data."""
    from specdec.models.resolution import load_model

    progress(f"loading {settings.target} and {settings.draft}")
    decoder = SpeculativeDecoder.from_pretrained(
        settings.target,
        settings.draft,
        dtype=settings.dtype,
        device="cpu",
        draft_quantization=settings.draft_quantization,
    )
    tokenizer = decoder.tokenizer
    draft_model = hf_draft = None
    if settings.draft:
        draft_model = decoder.drafter.adapter.model  # what specdec drafts with (int8 by default on CPU)
        quantised = draft_quantization_for(settings.draft_quantization, "cpu") is not None
        # transformers' assisted generation gets the draft as the user has it: unquantised.
        hf_draft = load_model(settings.draft, dtype=settings.dtype, device="cpu") if quantised else draft_model
    costs = measure_costs(decoder.target, decoder.drafter.adapter, settings.ks) if draft_model is not None else None
    methods = build_methods(settings, decoder.target, draft_model, hf_draft, tokenizer)
    prompts = [
        (c, i, _chat_ids(tokenizer, PROMPTS[c][i])) for c in settings.classes for i in range(settings.prompts_per_class)
    ]
    runs: list[Run] = []
    for repeat in range(settings.repeats):
        for prompt_class, index, ids in prompts:
            for method, fn in methods.items():
                start = time.perf_counter()
                new_tokens, metrics = fn(ids)
                seconds = time.perf_counter() - start
                runs.append(Run(method, prompt_class, index, new_tokens, seconds, metrics))
                progress(
                    f"repeat {repeat + 1} {prompt_class}[{index}] {method}: "
                    f"{new_tokens / seconds:.2f} tok/s ({new_tokens} tokens)"
                )
    by_class = {c: summarise([r for r in runs if r.prompt_class == c], costs) for c in settings.classes}
    return {
        "settings": asdict(settings),
        "machine": host_info(),
        "date": datetime.date.today().isoformat(),
        "costs": None if costs is None else costs_json(costs, settings.ks),
        "summary": summarise(runs, costs),
        "by_class": by_class,
        "runs": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in runs],
    }


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _json_type(value) -> str:
    return JSON_TYPES.get(type(value), "a number")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_results(data) -> dict:
    """An earlier bench.json read back: the parts the table and the serving export read, or a ValueError
    naming the part that is wrong (a hand-edited or foreign JSON would otherwise fail deep inside)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {_json_type(data)}")
    for key in ("settings", "summary"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"expected {key!r} as an object, got {_json_type(data.get(key))}")
    settings = data["settings"]
    if not isinstance(settings.get("target"), str) or not isinstance(settings.get("draft"), (str, type(None))):
        raise ValueError("expected settings.target (a name) and settings.draft (a name or null)")
    for method, row in data["summary"].items():
        if not isinstance(row, dict):
            raise ValueError(f"expected summary.{method} as an object, got {_json_type(row)}")
        shown = ("speedup_vs_target", "mean_acceptance_length", "share_of_bound")  # if present
        bad = [key for key in ("tokens_per_second",) if not _is_number(row.get(key))]
        bad += [key for key in shown if key in row and not _is_number(row[key])]
        if row.get("acceptance_rate") is not None and not _is_number(row["acceptance_rate"]):  # null: nothing drafted
            bad.append("acceptance_rate")
        if bad:
            raise ValueError(f"expected summary.{method}.{bad[0]} as a number")
    return data
