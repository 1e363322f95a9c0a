"""`specdec bench widths`: what one target forward costs as it widens, per forward path (issue 38).

First the Linear forms the loading chose for each of the model's Linear shapes, with this host's timings
(specdec.models.packing.kernel_table: timed once per host and kept beside the calibration). Then the
per-width cost table: for widths 1, 2, 4, 6, 8 and 10 over a cached context (a verify's shape), the
milliseconds of one forward of the Qwen2.5-Coder-1.5B target through each candidate, in one process,
interleaved round by round (median of the rounds after the first, min in brackets). Candidates, in
--dtype (bfloat16 by default; float32 is the AVX2 default):
  packed         oneDNN-packed Linears, eager, dynamic cache, the lean forward (the default forward)
  transformers   the same through transformers' own forward (specdec.models.lean off)
  unpadded       the same, without padding one- to three-row inputs to MIN_ROWS (specdec.models.packing.pad_inputs)
  inductor       plain Linears, static cache, torch.compile with inductor freezing (it packs the Linears
                 itself and fuses the rest), one graph per width
  autotune       as inductor, with max-autotune (inductor's C++ GEMM templates compete with oneDNN)
  int4           the GGUF's Q4_K codes in torch's CPU int4 kernel, the rest packed (--target-quantization int4)
  int4-inductor  the same weights, static cache, compiled with freezing and max-autotune (its WOQ int4 template)
Build time includes compiling every width (inductor caches graphs on disk: a second run pays less).
Run it again under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (with --dtype float32) for an AVX2 host.

    .venv/bin/specdec bench widths -- --candidates packed int4 --rounds 6
    .venv/bin/specdec bench widths -- --model qwen2.5-coder-0.5b --quantization int8 --candidates packed transformers
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/specdec bench widths -- --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.bench.host import describe, host_info
from specdec.models.adapters import HFCausalLM
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.models.forms import WEIGHT_FORMS
from specdec.models.packing import (
    DEFAULT,
    FORMS,
    MIN_ROWS,
    TIMED_WIDTHS,
    fastest,
    fastest_of,
    kernel_table,
    measured_forms,
    pack_linears,
    pad_inputs,
    set_padding,
)
from specdec.models.resolution import DRAFT_FORMS, form_timings, kernel_file, load_model

CANDIDATES = ("packed", "transformers", "unpadded", "inductor", "autotune", "int4", "int4-inductor")
WIDTHS = (1, 2, 4, 6, 8, 10)


def build(name: str, alias: str, dtype: str, widths, quantization: str | None = None) -> HFCausalLM:
    """One candidate's adapter (compiled ones compile on each width's first forward)."""
    if name in ("packed", "transformers", "unpadded"):
        model = load_model(alias, dtype=dtype, quantization=quantization)
        if name == "unpadded":
            set_padding(model, 1)
        adapter = HFCausalLM(model, name=name)
        if name == "transformers":
            adapter.lean = None
        return adapter
    if name == "int4":
        return HFCausalLM(load_model(alias, quantization="int4", dtype=dtype), name=name)
    import torch._inductor.config as inductor

    inductor.freezing = True
    if name in ("autotune", "int4-inductor"):
        inductor.max_autotune = True
        inductor.max_autotune_gemm_backends = "CPP,ATEN"
    quantization = "int4" if name == "int4-inductor" else None
    model = load_model(alias, dtype=dtype, quantization=quantization, pack=False)
    return StaticHFCausalLM(model, name=name, compile="inductor", compile_widths=widths)


def print_kernel_table(alias: str, dtype: str, quantization: str | None) -> None:
    """The model's Linear shapes, each form's microseconds per call at each timed width, and the form loading
    chose (the least sum), then its one-token forward padded and not: this host's kept table
    (specdec.models.packing), timed first where it lacks one."""
    model = load_model(alias, dtype=dtype, quantization=quantization, pack=False)
    table = kernel_table(model, kernel_file(), progress=print)
    print(f"\nLinear forms of {alias} on this host, us per call at widths {', '.join(map(str, TIMED_WIDTHS))} "
          f"({kernel_file()}):")  # fmt: skip
    print("| shape | " + " | ".join(form.name for form in FORMS) + " | chosen |")
    print("|---|" + "---|" * (len(FORMS) + 1))
    for shape, timings in table.items():
        cells = [" / ".join(f"{1e6 * s:.0f}" for s in timings[form.name]) for form in FORMS]
        chosen = fastest(timings, TIMED_WIDTHS, DEFAULT.name)  # as loading takes it for a verifying model
        print(f"| {shape} | " + " | ".join(cells) + f" | {chosen} |")
    pack_linears(model, forms=measured_forms(model, kernel_file()))
    timings = pad_inputs(model, kernel_file(), progress=print)
    if timings:
        padded = f"padded to {MIN_ROWS}" if model.specdec_packed_rows > 1 else "not padded"
        print(f"\nIts one-token forward: {1e3 * timings['1']:.1f} ms unpadded, {1e3 * timings[str(MIN_ROWS)]:.1f} ms "
              f"with packed inputs padded to {MIN_ROWS} rows: one to three rows run {padded}")  # fmt: skip
    del model


def print_draft_forms(alias: str) -> None:
    """The alias's one-token forward in each of DRAFT_FORMS, as draft_quantization "auto" times it (kept in
    kernels.json, timed first where it lacks them), and the form it takes."""
    seconds = form_timings(alias, DRAFT_FORMS, progress=print, widths=(1,))
    cells = ", ".join(f"{form} {1e3 * s:.1f} ms" for form, s in seconds.items())
    chosen = fastest_of(seconds, DRAFT_FORMS[0])  # as fastest_form takes it
    print(f"\n{alias} as a draft, one-token forward: {cells}; auto takes {chosen}")


def forward_ms(adapter: HFCausalLM, context: torch.Tensor, extra: torch.Tensor, width: int) -> float:
    """One forward of `width` new tokens after the context, then rolled back to the context."""
    start = time.perf_counter()
    adapter.forward(extra[:, :width], torch.ones(1, width, dtype=torch.bool), keep_logits=width)
    seconds = time.perf_counter() - start
    adapter.rollback(torch.tensor([context.shape[1]]))
    return 1000 * seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", nargs="+", default=["packed", "int4"], choices=CANDIDATES)
    parser.add_argument("--dtype", default="bfloat16", help="the float layers' dtype (int4: the layers left float)")
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per (candidate, width), after one warm-up")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before each forward")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=list(WEIGHT_FORMS),
        help="the packed, transformers and unpadded candidates' weight form (int8: the draft as the defaults run it)",
    )
    parser.add_argument(
        "--draft-forms", action="store_true", help="also the model's one-token forward in each draft weight form"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (1, args.context + max(args.widths)), generator=generator)
    context, extra = ids[:, : args.context], ids[:, args.context :]
    print_kernel_table(args.model, args.dtype, args.quantization)
    if args.draft_forms:
        print_draft_forms(args.model)
    adapters, compile_s = {}, {}
    for name in args.candidates:
        start = time.perf_counter()
        adapters[name] = build(name, args.model, args.dtype, args.widths, args.quantization)
        adapters[name].reset(1)
        with torch.inference_mode():
            adapters[name].forward(context, torch.ones_like(context, dtype=torch.bool))
            for width in args.widths:  # the warm-up round: each compiled shape compiles here
                forward_ms(adapters[name], context, extra, width)
        compile_s[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: built and warmed up in {compile_s[name]} s", flush=True)
    times = {(name, w): [] for name in adapters for w in args.widths}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for width in args.widths:
                for name, adapter in adapters.items():
                    times[name, width].append(forward_ms(adapter, context, extra, width))
    table = {
        name: {w: (round(statistics.median(times[name, w]), 1), round(min(times[name, w]), 1)) for w in args.widths}
        for name in adapters
    }
    host = host_info()
    print(f"\n{describe(host)}\n{args.dtype}: ms per forward over {args.context} cached tokens, median (min) of "
          f"{args.rounds} rounds")  # fmt: skip
    print("| candidate | " + " | ".join(f"w{w}" for w in args.widths) + " | w6 / w1 | build + warm-up s |")
    print("|---|" + "---:|" * (len(args.widths) + 2))
    for name, row in table.items():
        cells = " | ".join(f"{m} ({lo})" for m, lo in row.values())
        ratio = f"{row[6][0] / row[1][0]:.2f}" if 1 in row and 6 in row else "-"
        print(f"| {name} | {cells} | {ratio} | {compile_s[name]} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        raw = {f"{name} w{width}": ms for (name, width), ms in times.items()}
        data = {"host": host, "settings": vars(args) | {"out": str(args.out)}, "build_s": compile_s, "ms": table}
        args.out.write_text(json.dumps(data | {"raw_ms": raw}, indent=1))
