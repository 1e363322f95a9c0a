"""Where a compiled decode step's time goes on the GPU (the gpu_bench layer-skip pair).

    python scripts/gpu_profile.py --out DIR [--backend graphs|inductor|cudagraphs]

Times, per generated token of the target alone: the captured forward replayed directly in a loop
(the chip's floor through our adapter), the adapter's full `forward` (slot bookkeeping, masks), a
whole `generate` (the engine: warping, verify, commit, rollback, host syncs), and transformers'
eager `generate` for scale; host syncs per token; then a torch profile of one generate, top
host-side ops by self CPU time; then the eager path (specdec against transformers, each profiled).
Writes profile.json, profile.txt and profile-eager.txt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scripts.gpu_bench import captured, count_syncs, tuned_pair
from specdec import SpeculativeDecoder
from specdec.adapters import HFCausalLM


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call(fn, calls: int) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-profile")
    parser.add_argument("--backend", default="graphs")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cuda", help="cpu with --size tiny: a dry run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    target, _ = tuned_pair(args.size, device)
    vocab = target.config.vocab_size
    adapter = captured(target, "target", 256, (1, 2, 5, 11), args.backend)
    decoder = SpeculativeDecoder(adapter, None)
    prompt = torch.randint(1, vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    decoder.generate(prompt, max_new_tokens=64, temperature=0)  # capture
    result = {
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "compile_s": adapter.compile_seconds,
    }
    for _ in range(2):
        start = time.perf_counter()
        out_tokens = decoder.generate(prompt, max_new_tokens=128, temperature=0)
        sync()
        result["generate_ms_per_token"] = 1000 * (time.perf_counter() - start) / len(out_tokens.token_ids)
    inputs = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=16, do_sample=False)
        sync()
        start = time.perf_counter()
        hf = target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=128, do_sample=False)
        sync()
    result["hf_eager_generate_ms_per_token"] = 1000 * (time.perf_counter() - start) / (hf.shape[1] - len(prompt))
    result["same_tokens_as_hf"] = hf[0, len(prompt) :].tolist() == out_tokens.token_ids
    syncs, sites = count_syncs(lambda: decoder.generate(prompt, max_new_tokens=32, temperature=0))
    result["syncs_per_token"], result["sync_sites"] = syncs / 32, sites
    ids = torch.ones(1, 1, dtype=torch.long, device=device)
    valid = torch.ones(1, 1, dtype=torch.bool)  # host bookkeeping: valid and lengths come from the CPU
    keep = torch.tensor([100])

    def adapter_step():
        adapter.rollback(keep)
        adapter.forward(ids, valid)

    adapter.reset(1)
    adapter.forward(torch.tensor([prompt + prompt], device=device), torch.ones(1, 128, dtype=torch.bool))
    result["adapter_forward_ms"] = 1000 * per_call(adapter_step, 100)
    graphs = getattr(adapter, "_graphs", {})
    shape = next((s for s in graphs if s[:2] == (1, 1)), None)
    if shape is not None and graphs[shape].graph is not None:
        graph = graphs[shape].graph

        @torch.inference_mode()  # the cache's offsets are inference tensors
        def replay():  # each replay advances every layer's write offset: take it back
            graph.replay()
            adapter.cache.crop(-1)

        result["graph_replay_and_offset_reset_ms"] = 1000 * per_call(replay, 200)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decoder.generate(prompt, max_new_tokens=32, temperature=0)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (out / "profile.txt").write_text(table)
    # The eager path (a model the graphs cannot hold): specdec's loop against transformers' generate, both
    # host-bound here, with where each spends its host time (profile-eager.txt).
    eager = SpeculativeDecoder(HFCausalLM(target, name="target"), None)
    eager.generate(prompt, max_new_tokens=16, temperature=0)
    tables = []
    for name, run in (
        ("specdec_eager", lambda: eager.generate(prompt, max_new_tokens=64, temperature=0)),
        (
            "hf_eager",
            lambda: target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=64, do_sample=False),
        ),
    ):
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            run()
            sync()
            result[f"{name}_ms_per_token"] = 1000 * (time.perf_counter() - start) / 64
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as eager_prof:
                run()
        tables.append(f"== {name}\n" + eager_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    (out / "profile-eager.txt").write_text("\n".join(tables))
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(table)


if __name__ == "__main__":
    main()
