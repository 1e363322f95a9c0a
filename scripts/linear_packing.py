"""Forward time of the embedded Qwen models with and without packed Linear weights (specdec.packing).

    .venv/bin/python scripts/linear_packing.py --out docs/bench/linear-packing-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/linear_packing.py \
        --out docs/bench/linear-packing-avx2.json

Each model is loaded twice by specdec's loading path, once with `pack=False`. The two are timed in
alternation (one forward each, in turn) at every width, after a 200-token context; medians of
--repeats. The 200-token prefill is timed too. Also the largest |logit difference| between the two.
"""

import argparse
import gc
import json
import statistics
import time

import torch

from specdec.adapters import HFCausalLM
from specdec.resolution import load_model, parse_dtype

WIDTHS = (1, 2, 3, 5, 9, 11)
CONTEXT = 200
MODELS = {  # label: (alias, load_model options)
    "target": ("qwen2.5-coder-1.5b", {}),  # dtype auto
    "target-int8": ("qwen2.5-coder-1.5b", {"quantization": "int8", "keep_outliers": True}),  # as --target-quantization
    "draft": ("qwen2.5-coder-0.5b", {}),  # dtype auto, as --draft-quantization none
}


def forward_seconds(adapter: HFCausalLM, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward over `ids` after the adapter's cached context, then the cache is cut back to it."""
    length = adapter.lengths.clone()
    start = time.perf_counter()
    logits = adapter.forward(ids, torch.ones(ids.shape, dtype=torch.bool), keep_logits=ids.shape[1])
    seconds = time.perf_counter() - start
    adapter.rollback(length)
    return seconds, logits


def _row(times: dict, plain: torch.Tensor, packed: torch.Tensor) -> dict:
    row = {name: statistics.median(t) for name, t in times.items()}
    diff = float((plain.float() - packed.float()).abs().max())
    return row | {"speedup": row["plain"] / row["packed"], "max_abs_logit_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated labels of MODELS")
    parser.add_argument("--out")
    args = parser.parse_args()
    out = {
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "dtype_auto": str(parse_dtype("auto", "cpu")),
        "repeats": args.repeats,
        "models": {},
    }
    tokens = torch.randint(0, 1000, (1, CONTEXT + max(WIDTHS)), generator=torch.Generator().manual_seed(0))
    context, new = tokens[:, :CONTEXT], tokens[:, CONTEXT:]
    for label in args.models.split(","):
        out["models"][label] = measure(label, context, new, args.repeats)  # one model pair in memory at a time
        gc.collect()
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def measure(label: str, context: torch.Tensor, new: torch.Tensor, repeats: int) -> dict:
    alias, options = MODELS[label]
    plain = HFCausalLM(load_model(alias, device="cpu", pack=False, **options), name="plain")
    packed = HFCausalLM(load_model(alias, device="cpu", **options), name="packed")
    rows = {}
    adapters = (("plain", plain), ("packed", packed))
    logits = {}
    with torch.inference_mode():
        times = {"plain": [], "packed": []}
        for _ in range(2):  # the prefill, twice each; the second leaves the context in the cache
            for name, adapter in adapters:
                adapter.reset(1)
                start = time.perf_counter()
                logits[name] = adapter.forward(context, torch.ones(context.shape, dtype=torch.bool))
                times[name].append(time.perf_counter() - start)
        rows[CONTEXT] = _row(times, logits["plain"], logits["packed"])
        print(label, "prefill", {k: round(v, 4) for k, v in rows[CONTEXT].items()}, flush=True)
        for width in WIDTHS:
            times = {"plain": [], "packed": []}
            for _, adapter in adapters:
                forward_seconds(adapter, new[:, :width])  # warm-up
            for _ in range(repeats):
                for name, adapter in adapters:
                    seconds, logits[name] = forward_seconds(adapter, new[:, :width])
                    times[name].append(seconds)
            rows[width] = _row(times, logits["plain"], logits["packed"])
            print(label, width, {k: round(v, 4) for k, v in rows[width].items()}, flush=True)
    return {"packed_linears": packed.model.specdec_packed_linears, "widths": rows}


if __name__ == "__main__":
    main()
