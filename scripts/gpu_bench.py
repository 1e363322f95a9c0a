"""GPU benchmark: a layer-skip pair built from configs on the device, specdec against transformers,
interleaved in one process (issues 9 and 10).

    specdec bench gpu -- --out scripts/results/gpu/          # on a CUDA machine
    specdec bench gpu -- --tiny --device cpu --out /tmp/gpu-dry   # a dry run of every section on CPU

The pair: a random-weight Llama target (24 layers x 2048 hidden, ~1.4B parameters; --size large:
32 x 2560) and a draft made of its first 2 layers, sharing its embeddings, final norm and head. The
target's later layers are scaled down until greedy acceptance at k = 4 is about 0.8, so the draft is
useful as a real one would be. A useless draft (an unrelated random 2-layer model) checks that `auto`
stops speculating.

Sections (each writes its rows to the JSON as soon as it finishes; a time budget skips the rest):
- greedy, batch 1: transformers generate (eager), assisted (defaults and pinned k=4), prompt lookup;
  specdec eager: target alone, k=4, k=4 without the confidence stop, auto (defaults);
  specdec compiled (static cache + captured CUDA graphs): target alone, k=4 without the stop, auto.
- T = 0.7, batch 1: the same methods (sampling; no top-k / top-p on either side).
- batch 8 (ragged prompts): specdec target alone, k=4, auto.
- useless draft: specdec target alone vs auto, eager and compiled.
- host syncs per round (torch.cuda.set_sync_debug_mode) for eager and compiled rounds.
- transformers' own compiled recipe: generate(cache_implementation="static"), where it runs.
Writes gpu_bench.json and gpu_bench.md in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import SpeculativeDecoder
from specdec.bench.main import count_host_syncs
from specdec.drafters import ModelDrafter
from specdec.models.adapters import HFCausalLM
from specdec.models.adapters.capture import COMPILE_MODES
from specdec.models.adapters.static import StaticHFCausalLM

SIZES = {  # layers, hidden, intermediate, heads
    "tiny": (4, 64, 128, 4),
    "small": (24, 2048, 5632, 16),
    "large": (32, 2560, 6912, 20),
}


class Bench:
    def __init__(self, args):
        self.args, self.start = args, time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {"settings": vars(args), "sections": {}, "errors": {}, "notes": {}}
        if torch.cuda.is_available():
            self.data["device"] = torch.cuda.get_device_name()
        self.data["torch"], self.data["transformers"] = torch.__version__, __import__("transformers").__version__

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def save(self) -> None:
        (self.out / "gpu_bench.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "gpu_bench.md").write_text(markdown(self.data))

    def error(self, name: str, error: BaseException) -> None:
        self.data["errors"][name] = "".join(traceback.format_exception_only(error)).strip()[-1500:]
        print(f"ERROR {name}: {self.data['errors'][name]}", flush=True)
        self.save()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def build_pair(size: str, device: str, dtype, vocab: int):
    layers, hidden, inter, heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(dtype).eval()
        draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})
        draft = LlamaForCausalLM(draft_config).to(dtype).eval()
        torch.manual_seed(1)
        useless = LlamaForCausalLM(draft_config).to(dtype).eval()
    # The draft is the target's first two layers: shared modules, no copies.
    draft.model.embed_tokens, draft.model.norm, draft.lm_head = (
        target.model.embed_tokens,
        target.model.norm,
        target.lm_head,
    )
    draft.model.layers = torch.nn.ModuleList(list(target.model.layers[:2]))
    for model in (target, draft, useless):
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
    return target, draft, useless


LATER_LAYER_SCALE = 0.0078125  # 2^-7: what tune_acceptance chose on the H100 runs (greedy k=4 acceptance ~0.9)


def tuned_pair(size: str, device: str):
    """The layer-skip target and draft at the scale the bench runs tuned, without tuning again:
    float16 on CUDA, float32 elsewhere."""
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    target, draft, _ = build_pair(size, device, dtype, 32000 if size != "tiny" else 512)
    shrink_later_layers(target, LATER_LAYER_SCALE)
    return target, draft


def shrink_later_layers(target, factor: float) -> None:
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def tune_acceptance(target, draft, prompt, goal: float = 0.75) -> tuple[float, float]:
    """Scale the later layers down (x0.5 per step) until greedy k=4 acceptance reaches `goal`."""
    total, acceptance = 1.0, 0.0
    for _ in range(12):
        decoder = SpeculativeDecoder(HFCausalLM(target), ModelDrafter(HFCausalLM(draft), stop_below=None))
        out = decoder.generate(prompt, max_new_tokens=48, num_draft_tokens=4, temperature=0)
        acceptance = out.metrics.acceptance_rate
        if acceptance >= goal:
            break
        shrink_later_layers(target, 0.5)
        total *= 0.5
    return total, acceptance


def hf_runner(model, prompts, n: int, sampling: dict, **extra):
    ids = [torch.tensor([p], device=model.device) for p in prompts]

    def run():
        tokens = 0
        for inputs in ids:
            with torch.inference_mode():
                out = model.generate(
                    inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, **sampling, **extra
                )
            tokens += out.shape[1] - inputs.shape[1]
        return tokens, None

    return run


def pinned(assistant):
    config = assistant.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 4, "constant"
    config.assistant_confidence_threshold = 0.0


def specdec_runner(decoder: SpeculativeDecoder, prompts, n: int, k, sampling: dict, batch: bool = False, **options):
    sampling = sampling | options  # e.g. draft_width

    def run():
        if batch:
            out = decoder.generate(prompts, max_new_tokens=n, num_draft_tokens=k, seed=0, **sampling)
            return sum(len(r.token_ids) for r in out), out[0].batch_metrics.to_dict()
        tokens, metrics = 0, None
        for prompt in prompts:
            out = decoder.generate(prompt, max_new_tokens=n, num_draft_tokens=k, seed=0, **sampling)
            tokens += len(out.token_ids)
            metrics = out.metrics if metrics is None else metrics + out.metrics
        return tokens, metrics.to_dict() | {"calibration": out.calibration}

    return run


def run_section(bench: Bench, name: str, methods: dict, baseline: str, warmup: tuple = ()) -> None:
    """Each method once to warm up (compiled ones capture here), then `repeats` interleaved rounds."""
    rows: dict[str, dict] = {}
    for method in warmup:
        if method in methods:
            try:
                seconds, _ = timed(methods[method])
                rows.setdefault(method, {})["warmup_s"] = seconds
            except Exception as error:  # a failing method is recorded and skipped, the others go on
                bench.error(f"{name}/{method}", error)
                methods.pop(method)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(bench.args.repeats):
        for method, fn in list(methods.items()):
            if bench.left() < 20:
                bench.data["notes"][name] = "cut short by the time budget"
                break
            try:
                seconds, (tokens, metrics) = timed(fn)
            except Exception as error:
                bench.error(f"{name}/{method}", error)
                methods.pop(method)
                continue
            times[method].append(tokens / seconds)
            row = rows.setdefault(method, {})
            row["tokens"] = tokens
            if metrics:
                row["acceptance_rate"] = metrics["acceptance_rate"]
                row["mean_acceptance_length"] = metrics["mean_acceptance_length"]
                rounds = max(metrics["rounds"], 1)
                row["drafted_per_round"] = metrics["drafted_tokens"] / rounds
                row["draft_forwards_per_round"] = metrics["draft_forwards"] / rounds
                row["rounds"] = metrics["rounds"]
                row["lookup_tokens"], row["lookup_accepted"] = metrics["lookup_tokens"], metrics["lookup_accepted"]
                if metrics.get("calibration"):
                    row["calibration"] = metrics["calibration"]
            print(f"{name} {method}: {tokens / seconds:.1f} tok/s", flush=True)
    for method, samples in times.items():
        if samples:
            rows[method]["tokens_per_second"] = statistics.median(samples)
            rows[method]["samples"] = samples
    base = rows.get(baseline, {}).get("tokens_per_second")
    for row in rows.values():
        if base and "tokens_per_second" in row:
            row["speedup_vs_baseline"] = row["tokens_per_second"] / base
    bench.data["sections"][name] = {"baseline": baseline, "rows": rows}
    bench.save()


def captured(model, name: str, capacity: int, widths: tuple[int, ...], backend: str) -> StaticHFCausalLM:
    """A static-cache adapter whose narrow forwards run as captured graphs, padded to `widths`.
    backend: "graphs" (the adapter's own CUDA graphs, compile=True's default on CUDA), "inductor"
    (torch.compile, mode reduce-overhead), "inductor-graphs" (inductor's kernels in the adapter's own
    CUDA graphs), or a torch.compile backend such as "cudagraphs"."""
    mode = backend if backend in COMPILE_MODES else "inductor"
    adapter = StaticHFCausalLM(model, name=name, max_length=capacity, compile=mode, compile_widths=widths)
    if mode != backend and torch.cuda.is_available():
        adapter.captures.compiled = torch.compile(model, dynamic=False, fullgraph=True, backend=backend)
    return adapter


def count_syncs(fn) -> tuple[int, dict]:
    """Host syncs torch reports while fn runs, and where in specdec they were made."""
    _, sites = count_host_syncs(fn)
    return (-1, {}) if sites is None else (sum(sites.values()), dict(sites))


GREEDY, SAMPLED = {"temperature": 0}, {"temperature": 0.7, "top_k": 0}
HF_GREEDY, HF_SAMPLED = {"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
WARM = (  # the batch-1 methods warmed up before their section's timed rounds
    "hf_target",
    "hf_assisted",
    "hf_assisted_pinned_k4",
    "specdec_target",
    "specdec_compiled_target",
    "specdec_compiled_k4_nostop",
    "specdec_compiled_auto_nostop",
    "specdec_compiled_auto",
    "specdec_auto",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-bench")
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--tiny", action="store_true", help="the tiny size: a dry run of every section")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=float, default=420, help="seconds; later sections are skipped")
    parser.add_argument("--sections", default="greedy,compiled,sampled,batch,useless,syncs,hf_static")
    parser.add_argument(
        "--backend",
        default="graphs",
        help="how the narrow forwards are captured: graphs (the adapter's own CUDA graphs of the eager "
        "kernels, seconds to capture; compile=True's default on CUDA), inductor (torch.compile "
        "reduce-overhead: fused kernels, minutes to compile), inductor-graphs (inductor's kernels in the "
        "adapter's own CUDA graphs) or cudagraphs (torch.compile's backend)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.size = "tiny"
    return args


@dataclass
class Setup:
    """What the sections run: the tuned pair, the useless draft, the prompt, and the eager and compiled
    decoders (compiled ones capture on their first run)."""

    args: argparse.Namespace
    dtype: torch.dtype
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    useless: LlamaForCausalLM
    prompt: list[int]
    prompts: list[list[int]]
    eager_target: HFCausalLM
    eager: dict[str, SpeculativeDecoder]
    capacity: int
    compiled_target: StaticHFCausalLM
    compiled_draft: StaticHFCausalLM
    compiled: dict[str, SpeculativeDecoder]

    @property
    def n(self) -> int:
        return self.args.new_tokens


def tuned_models(bench: Bench, args, dtype):
    """Build the pair and the useless draft, tune the target's later layers, record the pair."""
    vocab = 32000 if args.size != "tiny" else 512
    target, draft, useless = build_pair(args.size, args.device, dtype, vocab)
    prompt = torch.randint(1, vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    scale, acceptance = tune_acceptance(target, draft, prompt)
    bench.data["pair"] = {
        "size": args.size,
        "layers": SIZES[args.size][0],
        "hidden": SIZES[args.size][1],
        "parameters": sum(p.numel() for p in target.parameters()),
        "later_layer_scale": scale,
        "greedy_acceptance_k4": acceptance,
    }
    bench.save()
    return target, draft, useless, prompt


def build_setup(bench: Bench, args) -> Setup:
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    target, draft, useless, prompt = tuned_models(bench, args, dtype)
    eager_target = HFCausalLM(target, name="target")
    eager = {
        "target": SpeculativeDecoder(eager_target, None),
        "k4": SpeculativeDecoder(eager_target, ModelDrafter(HFCausalLM(draft, name="draft"))),
        "nostop": SpeculativeDecoder(eager_target, ModelDrafter(HFCausalLM(draft, name="draft"), stop_below=None)),
    }
    capacity = 64 + args.new_tokens + 32
    compiled_target = captured(target, "target", capacity, (1, 2, 5, 11), args.backend)
    compiled_draft = captured(draft, "draft", capacity, (1, 2), args.backend)
    compiled = {
        "target": SpeculativeDecoder(compiled_target, None),
        "nostop": SpeculativeDecoder(compiled_target, ModelDrafter(compiled_draft, stop_below=None)),
        "defaults": SpeculativeDecoder(compiled_target, ModelDrafter(compiled_draft)),
    }
    return Setup(
        args=args,
        dtype=dtype,
        target=target,
        draft=draft,
        useless=useless,
        prompt=prompt,
        prompts=[prompt],
        eager_target=eager_target,
        eager=eager,
        capacity=capacity,
        compiled_target=compiled_target,
        compiled_draft=compiled_draft,
        compiled=compiled,
    )


def methods_for(setup: Setup, s: dict, hf_s: dict, with_compiled: bool) -> dict:
    """The batch-1 methods (transformers, specdec eager, and compiled if asked) at sampling s / hf_s."""
    target, draft, prompts, n = setup.target, setup.draft, setup.prompts, setup.n
    eager, compiled, device, dtype = setup.eager, setup.compiled, setup.args.device, setup.dtype
    assistant = LlamaForCausalLM(draft.config).to(device, dtype)  # transformers mutates its assistant's config
    assistant.load_state_dict(draft.state_dict())
    pinned_assistant = LlamaForCausalLM(draft.config).to(device, dtype)
    pinned_assistant.load_state_dict(draft.state_dict())
    pinned(pinned_assistant)
    methods = {
        "hf_target": hf_runner(target, prompts, n, hf_s),
        "hf_assisted": hf_runner(target, prompts, n, hf_s, assistant_model=assistant),
        "hf_assisted_pinned_k4": hf_runner(target, prompts, n, hf_s, assistant_model=pinned_assistant),
        "hf_prompt_lookup": hf_runner(target, prompts, n, hf_s, prompt_lookup_num_tokens=10),
        "specdec_target": specdec_runner(eager["target"], prompts, n, 1, s),
        "specdec_k4": specdec_runner(eager["k4"], prompts, n, 4, s),
        "specdec_k4_nostop": specdec_runner(eager["nostop"], prompts, n, 4, s),
        "specdec_auto": specdec_runner(eager["k4"], prompts, n, "auto", s),  # draft_width auto: trees
        "specdec_auto_chain": specdec_runner(eager["k4"], prompts, n, "auto", s, draft_width=1),
    }
    if with_compiled:
        methods |= {
            "specdec_compiled_target": specdec_runner(compiled["target"], prompts, n, 1, s),
            "specdec_compiled_k4_nostop": specdec_runner(compiled["nostop"], prompts, n, 4, s),
            "specdec_compiled_auto_nostop": specdec_runner(compiled["nostop"], prompts, n, "auto", s),
            "specdec_compiled_auto": specdec_runner(compiled["defaults"], prompts, n, "auto", s),
        }
    return methods


def greedy_section(bench: Bench, setup: Setup, with_compiled: bool) -> None:
    run_section(bench, "greedy_b1", methods_for(setup, GREEDY, HF_GREEDY, with_compiled), "hf_target", WARM)
    seconds = {"target": setup.compiled_target.compile_seconds, "draft": setup.compiled_draft.compile_seconds}
    bench.data["compile_seconds"] = seconds
    bench.save()


def batch_section(bench: Bench, setup: Setup, with_compiled: bool) -> None:
    """Batch 8, ragged prompts: specdec target alone, k=4 and auto (and compiled, on adapters of their own)."""
    ragged, n, eager, args = [setup.prompt[: 32 + 4 * i] for i in range(8)], setup.n, setup.eager, setup.args
    methods = {
        "specdec_target_b8": specdec_runner(eager["target"], ragged, n, 1, GREEDY, batch=True),
        "specdec_k4_b8": specdec_runner(eager["k4"], ragged, n, 4, GREEDY, batch=True),
        "specdec_auto_b8": specdec_runner(eager["k4"], ragged, n, "auto", GREEDY, batch=True),
    }
    if with_compiled:  # adapters of their own: a batch of 8 is another cache, other graphs
        target_b8 = captured(setup.target, "target", setup.capacity, (1, 2, 5), args.backend)
        draft_b8 = captured(setup.draft, "draft", setup.capacity, (1, 2), args.backend)
        methods |= {
            "specdec_compiled_target_b8": specdec_runner(
                SpeculativeDecoder(target_b8, None), ragged, n, 1, GREEDY, batch=True
            ),
            "specdec_compiled_auto_b8": specdec_runner(
                SpeculativeDecoder(target_b8, ModelDrafter(draft_b8)), ragged, n, "auto", GREEDY, batch=True
            ),
        }
    warm_b8 = ("specdec_auto_b8", "specdec_compiled_target_b8", "specdec_compiled_auto_b8")
    run_section(bench, "greedy_b8", methods, "specdec_target_b8", warm_b8)


def useless_section(bench: Bench, setup: Setup, with_compiled: bool) -> None:
    """The target alone against auto with an unrelated draft: auto should stop speculating."""
    prompts, n = setup.prompts, setup.n
    useless_decoder = SpeculativeDecoder(setup.eager_target, ModelDrafter(HFCausalLM(setup.useless, name="useless")))
    methods = {
        "specdec_target": specdec_runner(setup.eager["target"], prompts, n, 1, GREEDY),
        "specdec_auto_useless_draft": specdec_runner(useless_decoder, prompts, n, "auto", GREEDY),
    }
    if with_compiled:
        compiled_useless = captured(setup.useless, "useless", setup.capacity, (1, 2), setup.args.backend)
        methods |= {
            "specdec_compiled_target": specdec_runner(setup.compiled["target"], prompts, n, 1, GREEDY),
            "specdec_compiled_auto_useless_draft": specdec_runner(
                SpeculativeDecoder(setup.compiled_target, ModelDrafter(compiled_useless)), prompts, n, "auto", GREEDY
            ),
        }
    warm_useless = ("specdec_auto_useless_draft", "specdec_compiled_auto_useless_draft")
    run_section(bench, "useless_draft", methods, "specdec_target", warm_useless)


def syncs_section(bench: Bench, setup: Setup) -> None:
    """Host syncs per round for eager and compiled rounds."""
    counted = (("eager_k4", setup.eager["nostop"]), ("compiled_k4", setup.compiled["nostop"]))
    counted += (("compiled_defaults", setup.compiled["defaults"]),)  # the stop's reads wait on events: not counted
    for name, decoder in counted:
        try:
            results = []
            syncs = count_syncs(
                lambda d=decoder, r=results: r.append(d.generate(setup.prompt, max_new_tokens=32, **GREEDY))
            )
            syncs, sites = syncs
            bench.data.setdefault("syncs_per_round", {})[name] = syncs / max(results[0].metrics.rounds, 1)
            bench.data.setdefault("sync_sites", {})[name] = sites
        except Exception as error:
            bench.error(f"syncs/{name}", error)
    bench.save()


def hf_static_section(bench: Bench, setup: Setup) -> None:
    """transformers' own compiled recipe (static cache) against specdec compiled k=4."""
    target, prompts, n = setup.target, setup.prompts, setup.n
    methods = {
        "hf_target": hf_runner(target, prompts, n, HF_GREEDY),
        "hf_static_compiled": hf_runner(target, prompts, n, HF_GREEDY, cache_implementation="static"),
        "specdec_compiled_k4_nostop": specdec_runner(setup.compiled["nostop"], prompts, n, 4, GREEDY),
    }
    run_section(bench, "hf_static", methods, "hf_target", ("hf_static_compiled",))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sections = set(args.sections.split(","))
    bench = Bench(args)
    setup = build_setup(bench, args)
    with_compiled = "compiled" in sections
    if "greedy" in sections:
        greedy_section(bench, setup, with_compiled)
    if "sampled" in sections and bench.left() > 60:
        run_section(bench, "sampled_b1", methods_for(setup, SAMPLED, HF_SAMPLED, with_compiled), "hf_target", WARM)
    if "batch" in sections and bench.left() > 60:
        batch_section(bench, setup, with_compiled)
    if "useless" in sections and bench.left() > 40:
        useless_section(bench, setup, with_compiled)
    if "syncs" in sections and bench.left() > 30 and torch.cuda.is_available():
        syncs_section(bench, setup)
    if "hf_static" in sections and bench.left() > 90:
        hf_static_section(bench, setup)
    bench.data["elapsed_s"] = time.perf_counter() - bench.start
    bench.save()
    print(markdown(bench.data))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(data: dict) -> str:
    title = f"# GPU bench ({data.get('device', 'cpu')}, torch {data['torch']}, transformers {data['transformers']})"
    lines = [title, ""]
    if "pair" in data:
        lines += [f"Pair: {json.dumps(data['pair'])}", ""]
    for name, section in data["sections"].items():
        lines += [f"## {name} (baseline {section['baseline']})", "", "| method | tok/s | vs baseline | acceptance |"]
        lines += ["|---|---:|---:|---:|"]
        for method, row in section["rows"].items():
            tps, speed, acc = row.get("tokens_per_second"), row.get("speedup_vs_baseline"), row.get("acceptance_rate")
            lines.append(f"| {method} | {_fmt(tps, '.1f')} | {_fmt(speed, '.2f')}x | {_fmt(acc, '.2f')} |")
        lines.append("")
    for key in ("compile_seconds", "syncs_per_round", "sync_sites", "errors", "notes"):
        if data.get(key):
            lines += [f"{key}: `{json.dumps(data[key])}`", ""]
    return "\n".join(lines)
