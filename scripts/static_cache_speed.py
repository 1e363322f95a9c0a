"""Static KV cache vs DynamicCache, and compiled vs eager forwards, on CPU.

    .venv/bin/python scripts/static_cache_speed.py            # writes docs/bench/static-cache.json

1. A long greedy run of the target alone (no draft) on SmolLM2-135M: HFCausalLM (DynamicCache,
   which concatenates the whole cache at every step) vs StaticHFCausalLM (preallocated, written in
   place), interleaved repeats; tokens must be identical. Seconds per block of tokens show how
   each cost grows with the context.
2. compile=True vs eager on the static adapter: SmolLM2 (a shorter run), and per-step times of
   two random tiny Llamas, where Python overhead rather than weights dominates. Inductor's
   on-disk caches are off, so compile_s is a cold warm-up.

--lockstep N runs the two long runs side by side instead, taking turns every N rounds (one thread each,
one running at a time), so a slow spell of the shared host lands on both; each run's time is the sum of
its own turns.

Intra-op threads default to 1: on a shared 2-core host, 2 threads spend more in barriers than
they save (both adapters get the same setting).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from specdec import load_model, load_tokenizer
from specdec.adapters import HFCausalLM
from specdec.adapters.static import StaticHFCausalLM
from specdec.decoder import decode
from specdec.drafters import NoDrafter
from specdec.policy import DraftLengthPolicy
from specdec.sampling import SamplingConfig, Warping

PROMPT = "The history of the printing press begins in"


def greedy_alone(adapter, prompt: list[int], max_new_tokens: int, on_round):
    """One greedy run of the target alone through specdec's loop (no draft); on_round(batch) after each round."""
    batch, _ = decode(
        adapter,
        NoDrafter(),
        [prompt],
        max_new_tokens=max_new_tokens,
        warping=Warping.from_sampling(SamplingConfig(temperature=0)),
        policy=DraftLengthPolicy(k=1),
        on_round=on_round,
    )
    return batch


def timed_run(adapter, prompt: list[int], max_new_tokens: int, block: int) -> dict:
    """One greedy run of the target alone; wall seconds in total and per block of new tokens."""
    marks = []
    start = time.perf_counter()

    def on_round(batch):
        marks.append((len(batch.new_tokens(0)), time.perf_counter() - start))

    batch = greedy_alone(adapter, prompt, max_new_tokens, on_round)
    seconds = time.perf_counter() - start
    edges = [next(t for n, t in marks if n >= end) for end in range(block, max_new_tokens + 1, block)]
    blocks = [b - a for a, b in zip([0.0] + edges, edges)]
    return {
        "seconds": seconds,
        "tokens_per_s": max_new_tokens / seconds,
        "block_s": blocks,
        "tokens": batch.new_tokens(0),
    }


def lockstep(adapters: dict, prompt: list[int], max_new_tokens: int, turn: int) -> dict:
    """The adapters' greedy runs of the target alone side by side, taking turns every `turn` rounds (one
    thread per run, one running at a time); per run, the summed seconds of its turns and its tokens."""
    names = list(adapters)
    baton = threading.Condition()
    state = {"holder": names[0], "done": set()}
    seconds = {name: 0.0 for name in names}
    tokens = {}

    def hand_over(name: str) -> None:  # under the baton: let the next unfinished run go
        rest = [n for n in names if n not in state["done"]]
        if rest:
            later = names[names.index(name) + 1 :] + names[: names.index(name) + 1]
            state["holder"] = next(n for n in later if n in rest)
        baton.notify_all()

    def run(name: str) -> None:
        rounds, started = 0, 0.0

        def on_round(batch) -> None:
            nonlocal rounds, started
            rounds += 1
            if rounds % turn == 0:
                with baton:
                    seconds[name] += time.perf_counter() - started
                    hand_over(name)
                    baton.wait_for(lambda: state["holder"] == name)
                started = time.perf_counter()

        with baton:
            baton.wait_for(lambda: state["holder"] == name)
        started = time.perf_counter()
        try:
            tokens[name] = greedy_alone(adapters[name], prompt, max_new_tokens, on_round).new_tokens(0)
        except BaseException as error:  # the other run must not wait for a turn that never comes
            errors.append(error)
        finally:
            with baton:
                seconds[name] += time.perf_counter() - started
                state["done"].add(name)
                hand_over(name)

    errors: list[BaseException] = []
    threads = [threading.Thread(target=run, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"seconds": seconds, "tokens": tokens}


def interleaved(adapters: dict, prompt, max_new_tokens: int, repeats: int, block: int, also=()) -> dict:
    """Runs of each adapter in turn, `repeats` times; `also`: more token lists that must agree."""
    runs = {name: [] for name in adapters}
    for repeat in range(repeats):
        for name, adapter in adapters.items():
            run = timed_run(adapter, prompt, max_new_tokens, block)
            runs[name].append(run)
            print(f"  {name} #{repeat + 1}: {run['seconds']:.1f} s ({run['tokens_per_s']:.2f} tok/s)", flush=True)
    tokens = [run.pop("tokens") for name in runs for run in runs[name]] + list(also)
    medians = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    minima = {name: min(r["seconds"] for r in rs) for name, rs in runs.items()}
    block_medians = {
        name: [statistics.median(b) for b in zip(*(r["block_s"] for r in rs))] for name, rs in runs.items()
    }
    return {
        "runs": runs,
        "median_s": medians,
        "min_s": minima,
        "median_block_s": block_medians,
        "tokens_identical": all(t == tokens[0] for t in tokens),
    }


def step_ms(adapter, context: int, steps: int, repeats: int) -> list[float]:
    """Milliseconds per 1-token forward after `context` cached tokens (median over repeats of `steps`)."""
    ids = torch.randint(0, 1000, (1, context), device=adapter.device)
    one, token = torch.ones(1, 1, dtype=torch.bool, device=adapter.device), ids[:, :1]
    times = []
    for _ in range(repeats):
        adapter.reset(1)
        adapter.forward(ids, torch.ones_like(ids, dtype=torch.bool))
        for _ in range(3):  # warm-up (and, compiled, the capture)
            adapter.forward(token, one)
        start = time.perf_counter()
        for _ in range(steps):
            adapter.forward(token, one)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return times


def tiny_compile(layers: int, hidden: int) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    eager, dynamic = StaticHFCausalLM(model, max_length=256), HFCausalLM(model)
    compiled = StaticHFCausalLM(model, max_length=256, compile=True, compile_widths=[1])
    out = {"layers": layers, "hidden": hidden, "parameters": sum(p.numel() for p in model.parameters())}
    for name, adapter in (("dynamic", dynamic), ("static", eager), ("static_compiled", compiled)):
        out[f"{name}_step_ms"] = statistics.median(step_ms(adapter, context=100, steps=100, repeats=5))
    out["compile_s"] = compiled.compile_seconds
    out["compiled_speedup"] = out["static_step_ms"] / out["static_compiled_step_ms"]
    print(f"  tiny {layers}x{hidden}: {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=250, help="tokens per timed block")
    parser.add_argument("--compile-tokens", type=int, default=256, help="new tokens in the compile comparison")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-only", action="store_true", help="skip the compile comparisons")
    parser.add_argument(
        "--static-compile",
        default=None,
        help="also time the long run on the static cache compiled this way (e.g. inductor-graphs), after one "
        "untimed warm-up run that compiles every shape it meets",
    )
    parser.add_argument("--lockstep", type=int, default=0, help="run dynamic and static side by side, N rounds a turn")
    parser.add_argument("--out", default="docs/bench/static-cache.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.force_disable_caches = True  # compile_s is a cold warm-up, whatever ran before

    model = load_model(args.model, dtype=args.dtype)
    prompt = load_tokenizer(args.model)(PROMPT)["input_ids"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }

    print(f"{args.model}: {args.max_new_tokens} tokens, dynamic vs static", flush=True)
    capacity = len(prompt) + args.max_new_tokens + 16
    if args.lockstep:
        runs = []
        timed_run(HFCausalLM(model), prompt, 16, 16)  # untimed: the shared weights' first touch
        for repeat in range(args.repeats):
            adapters = {"dynamic": HFCausalLM(model), "static": StaticHFCausalLM(model, max_length=capacity)}
            if repeat % 2:  # the other one starts
                adapters = dict(reversed(adapters.items()))
            run = lockstep(adapters, prompt, args.max_new_tokens, args.lockstep)
            run["tokens_identical"] = run["tokens"]["dynamic"] == run["tokens"]["static"]
            run.pop("tokens")
            run["static_speedup"] = run["seconds"]["dynamic"] / run["seconds"]["static"]
            runs.append(run)
            print(f"  lockstep #{repeat + 1}: {json.dumps(run)}", flush=True)
        result["lockstep"] = {
            "turn_rounds": args.lockstep,
            "max_new_tokens": args.max_new_tokens,
            "runs": runs,
            "static_speedup_median": statistics.median(r["static_speedup"] for r in runs),
        }
        print(f"  static / dynamic, median of {len(runs)}: {result['lockstep']['static_speedup_median']:.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    adapters, also = {"dynamic": HFCausalLM(model), "static": StaticHFCausalLM(model, max_length=capacity)}, []
    if args.static_compile:
        compiled = StaticHFCausalLM(model, max_length=capacity, compile=args.static_compile, compile_widths=[1])
        start = time.perf_counter()
        also.append(timed_run(compiled, prompt, args.max_new_tokens, args.block)["tokens"])
        result["static_compiled_warm_up_s"] = time.perf_counter() - start
        result["static_compiled_compile_s"] = compiled.compile_seconds
        adapters[f"static_{args.static_compile}"] = compiled
        print(f"  warm-up run of static_{args.static_compile}: {result['static_compiled_warm_up_s']:.1f} s", flush=True)
    cache = interleaved(adapters, prompt, args.max_new_tokens, args.repeats, args.block, also=also)
    cache["max_new_tokens"] = args.max_new_tokens
    cache["static_speedup"] = cache["median_s"]["dynamic"] / cache["median_s"]["static"]
    cache["static_speedup_min"] = cache["min_s"]["dynamic"] / cache["min_s"]["static"]
    blocks = cache["median_block_s"]
    cache["static_speedup_per_block"] = [d / s for d, s in zip(blocks["dynamic"], blocks["static"])]
    for name in adapters:
        cache.setdefault("speedup_vs_dynamic", {})[name] = cache["median_s"]["dynamic"] / cache["median_s"][name]
    result["static_vs_dynamic"] = cache
    print(
        f"  static / dynamic speedup: {cache['static_speedup']:.3f} (medians), {cache['static_speedup_min']:.3f} "
        f"(minima); per block: {' '.join(f'{x:.2f}' for x in cache['static_speedup_per_block'])}; "
        f"all vs dynamic: {cache['speedup_vs_dynamic']}; tokens identical: {cache['tokens_identical']}",
        flush=True,
    )

    if args.cache_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return

    print(f"{args.model}: {args.compile_tokens} tokens, compiled vs eager (static cache)", flush=True)
    capacity = len(prompt) + args.compile_tokens + 16
    compiled = StaticHFCausalLM(model, max_length=capacity, compile=True, compile_widths=[1])
    warm = timed_run(compiled, prompt, args.compile_tokens, args.compile_tokens)  # captures the graph
    runs = interleaved(
        {"static": StaticHFCausalLM(model, max_length=capacity), "static_compiled": compiled},
        prompt,
        args.compile_tokens,
        args.repeats,
        args.compile_tokens,
        also=[warm["tokens"]],
    )
    runs["max_new_tokens"] = args.compile_tokens
    runs["compile_s"] = compiled.compile_seconds
    runs["first_compiled_run_s"] = warm["seconds"]
    runs["compiled_speedup"] = runs["median_s"]["static"] / runs["median_s"]["static_compiled"]
    result["compile_smollm2"] = runs
    print(f"  compiled / eager speedup: {runs['compiled_speedup']:.3f} (compile {runs['compile_s']:.1f} s)", flush=True)

    print("tiny random Llamas: per-step ms, compiled vs eager", flush=True)
    result["compile_tiny"] = [tiny_compile(2, 32), tiny_compile(8, 256)]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
