"""Compiled decode on the GPU: read-ahead, and inductor's kernels in the adapter's CUDA graphs (issue 10).

    python scripts/gpu_compiled_probe.py --out DIR                               # on a CUDA machine
    python scripts/gpu_compiled_probe.py --size tiny --device cpu --out /tmp/p   # a dry run

On gpu_bench's layer-skip pair (later layers scaled by 2^-7, as its runs tuned them): transformers' eager
`generate` is the baseline, run interleaved with specdec's compiled target alone, with read-ahead (the
default on CUDA) and without, and specdec's defaults with the draft (`auto`, no stop), greedy and at
T=0.7, and the defaults with greedy draft chains captured whole (`ModelDrafter.captured_chain`), per
capture mode: "graphs" (the eager kernels captured) first, then "inductor-graphs" (inductor's
fused kernels captured), whose compile time is reported; the replay time of one captured one-token
forward per mode. Phase 2 reruns the baseline and the graphs target beside the inductor rows, so every
ratio is within one phase. Writes probe.json and probe.md; a time budget ends it early, results kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

import specdec.api
from scripts.gpu_bench import captured, hf_runner, sync, timed, tuned_pair
from specdec import SpeculativeDecoder
from specdec.drafters import ModelDrafter

READ_AHEAD = {"on": None}  # None: decode's default (on, on CUDA); False: the plain loop
_decode = specdec.api.decode
specdec.api.decode = lambda *args, **kwargs: _decode(*args, read_ahead=READ_AHEAD["on"], **kwargs)


def runner(decoder, prompt, n, k, sampling, read_ahead=None, **options):
    def run():
        READ_AHEAD["on"] = read_ahead
        try:
            out = decoder.generate(prompt, max_new_tokens=n, num_draft_tokens=k, seed=0, **sampling, **options)
        finally:
            READ_AHEAD["on"] = None
        return len(out.token_ids), out.metrics.to_dict()

    return run


def replay_ms(adapter, calls: int = 150) -> float | None:
    graph = next((g for shape, g in adapter._graphs.items() if shape[1] == 1 and g.graph is not None), None)
    if graph is None:
        return None
    adapter.reset(1)  # the write pointer to slot 0: each replay below writes the next slot
    calls = min(calls, adapter.capacity - 16)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        graph.graph.replay()
    sync()
    seconds = time.perf_counter() - start
    with torch.inference_mode():  # the cache's tensors are inference tensors
        adapter._reset_write_offsets()  # the replays moved the device's write offset; back to the host's
    return 1000 * seconds / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-probe")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=300)
    parser.add_argument("--modes", default="graphs,inductor-graphs")
    args = parser.parse_args()
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    target, draft = tuned_pair(args.size, device)
    prompt = torch.randint(1, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    n, capacity = args.new_tokens, 64 + args.new_tokens + 32
    data = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "settings": vars(args),
        "phases": {},
        "errors": {},
    }

    def save():
        (out / "probe.json").write_text(json.dumps(data, indent=1))
        lines = [f"# Compiled decode probe ({data['device']}, torch {torch.__version__})", ""]
        for phase, rows in data["phases"].items():
            lines += [
                f"## {phase}",
                "",
                "| method | tok/s | vs hf_target (same T) | acceptance | samples |",
                "|---|---:|---:|---:|---|",
            ]
            for method, row in rows.items():
                base = rows.get("hf_target_T0.7" if method.endswith("T0.7") else "hf_target", {}).get("tok_s")
                if "tok_s" in row:
                    ratio = f"{row['tok_s'] / base:.2f}x" if base else "-"
                    acc = f"{row.get('acceptance', 0):.2f}"
                    lines.append(f"| {method} | {row['tok_s']:.1f} | {ratio} | {acc} | {row['samples']} |")
            lines.append("")
        lines += [f"- {k}: {v}" for k, v in data.items() if k not in ("phases", "settings")]
        (out / "probe.md").write_text("\n".join(lines) + "\n")

    greedy, sampled = {"temperature": 0}, {"temperature": 0.7, "top_k": 0}
    hf = {"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}

    def measure(phase: str, methods: dict) -> None:
        rows = data["phases"].setdefault(phase, {})
        samples: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for method, fn in list(methods.items()):
                if time.perf_counter() - began > args.budget:
                    data["errors"][phase] = "cut short by the time budget"
                    break
                try:
                    seconds, (tokens, metrics) = timed(fn)
                except Exception as error:
                    data["errors"][f"{phase}/{method}"] = "".join(traceback.format_exception(error))[-3000:]
                    print(f"ERROR {phase}/{method}:", data["errors"][f"{phase}/{method}"], flush=True)
                    methods.pop(method)
                    continue
                samples[method].append(round(tokens / seconds, 1))
                rows[method] = {"tok_s": statistics.median(samples[method]), "samples": samples[method]}
                if metrics:
                    rows[method]["acceptance"] = metrics["acceptance_rate"]
                    rows[method]["tokens_per_round"] = metrics["generated_tokens"] / max(metrics["rounds"], 1)
                    rows[method]["ms_per_round"] = 1000 * seconds / max(metrics["rounds"], 1)
                print(f"{phase} {method}: {tokens / seconds:.1f} tok/s", flush=True)
            save()

    def mode_methods(mode: str) -> dict:
        start = time.perf_counter()
        t = captured(target, "target", capacity, (1, 2, 5, 11), mode)
        d = captured(draft, "draft", capacity, (1, 2), mode)
        alone, paired = SpeculativeDecoder(t, None), SpeculativeDecoder(t, ModelDrafter(d, stop_below=None))
        chained = ModelDrafter(d, stop_below=None)
        chained.captured_chain = True  # greedy draft chains as one captured call (opt-in)
        paired_chain = SpeculativeDecoder(t, chained)
        methods = {
            f"{mode}_target": runner(alone, prompt, n, 1, greedy),
            f"{mode}_target_no_read_ahead": runner(alone, prompt, n, 1, greedy, read_ahead=False),
            f"{mode}_auto": runner(paired, prompt, n, "auto", greedy),
            f"{mode}_auto_chain": runner(paired_chain, prompt, n, "auto", greedy, draft_width=1),
            f"{mode}_target_T0.7": runner(alone, prompt, n, 1, sampled),
            f"{mode}_auto_T0.7": runner(paired, prompt, n, "auto", sampled),
        }
        for method, fn in list(methods.items()):  # capture (and compile) every shape first
            try:
                fn()
                sync()  # an asynchronous device error shows here, under its method
            except Exception as error:
                data["errors"][f"warm-up/{method}"] = "".join(traceback.format_exception(error))[-3000:]
                print(f"ERROR warm-up/{method}:", data["errors"][f"warm-up/{method}"], flush=True)
                methods.pop(method)
                save()
        sync()
        data[f"{mode}_warm_up_s"] = round(time.perf_counter() - start, 1)
        data[f"{mode}_compile_seconds"] = {"target": round(t.compile_seconds, 1), "draft": round(d.compile_seconds, 1)}
        data[f"{mode}_replay_ms"] = replay_ms(t)
        print(
            mode,
            "warm-up",
            data[f"{mode}_warm_up_s"],
            "s; one-token replay",
            data[f"{mode}_replay_ms"],
            "ms",
            flush=True,
        )
        save()
        return methods

    modes = args.modes.split(",")
    base = {"hf_target": hf_runner(target, [prompt], n, hf[0]), "hf_target_T0.7": hf_runner(target, [prompt], n, hf[1])}
    for fn in base.values():
        fn()
    first = mode_methods(modes[0])
    measure(modes[0], base | first)
    for mode in modes[1:]:
        if time.perf_counter() - began > args.budget - 60:
            data["errors"][mode] = "skipped: no time left"
            break
        methods = mode_methods(mode)
        keep = {m: first[m] for m in (f"{modes[0]}_target", f"{modes[0]}_auto", f"{modes[0]}_auto_chain") if m in first}
        measure(f"{mode} (with the baseline and {modes[0]} rerun)", base | keep | methods)
    save()


if __name__ == "__main__":
    main()
