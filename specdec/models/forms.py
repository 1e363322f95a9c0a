"""Weight forms: what the Linears of a model loaded by name hold, one object per form.

A form says how it converts the model transformers loads (`build`), what it promises (`own_weights`: the
model's own weights, so speculation gives the target's tokens; or another model, exact for itself:
docs/DESIGN.md, contract 7), and how it is kept on disk (`kept`, in specdec.models.ready). Loading
(specdec.models.resolution.load_model), the checks of the loading options (specdec.loading), the
calibration's key (specdec.tuning.calibration, through the `specdec_weights` stamp) and the benches read
these objects; nothing else names a form.

How a float Linear then runs (plain, or packed for oneDNN) is not a weight form: the same numbers, in the
kernel measured fastest on the host (specdec.models.packing).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models import ready
from specdec.models.packing import cpu_flags

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
LoadFloat = Callable[[torch.dtype], torch.nn.Module]  # transformers' model in a dtype (specdec.models.resolution)


def native_bf16() -> bool:
    """Does this CPU compute bfloat16 natively (AVX-512 BF16 or AMX), as PyTorch is allowed to use it?
    ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2 (a simulated AVX2 host) count as no."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return False
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if limit and not limit.startswith(("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def parse_dtype(dtype: str | torch.dtype | None, device: str | torch.device, alone: bool = False) -> torch.dtype:
    """None/"auto": float16 on CUDA; on CPU bfloat16 where it is native (AVX-512 BF16 / AMX), else
    float32: on AVX2, bfloat16 beats float32 for one token but loses at the verify widths 5-9 and over
    several rows. alone: the target decodes without a draft, one row of one token per forward, so
    bfloat16 on every CPU (half float32's bytes to stream: 1.6x float32's tokens/s on a simulated AVX2
    host, docs/BENCHMARKS.md)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:  # transformers would refuse it deep inside from_pretrained
            raise ValueError(
                f"dtype {dtype} is not a floating dtype; choose float32, bfloat16 or float16 "
                "(for int8 weights use quantization int8)"
            )
        return dtype
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"dtype must be a name (auto, float32, bfloat16, float16) or a torch.dtype; got {dtype!r}")
    if dtype in (None, "auto"):
        if str(device).startswith("cuda"):
            return torch.float16
        return torch.bfloat16 if native_bf16() or alone else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, float32, bfloat16, float16")
    return DTYPES[dtype]


@dataclass(frozen=True)
class WeightForm:
    """One form, by the name `quantization` (and --draft-quantization / --target-quantization) gives it."""

    name: str
    own_weights: bool  # the promise: the model's own weights, or another model (exact for itself)
    kept: str  # how an offline alias is kept on disk in this form, ready to run (specdec.models.ready)
    cpu_only: bool = False
    from_gguf: bool = False  # built from a GGUF file's own codes: a .gguf file or an offline alias

    def dtype(self, dtype, device) -> torch.dtype:
        """The dtype transformers loads the model in for this form."""
        return parse_dtype(dtype, device)

    def build(self, load_float: LoadFloat, torch_dtype, model_dir: Path | None, gguf: Path | None, keep_outliers):
        """The model in this form: `load_float(dtype)` converted (or its kept form read, for an alias's
        `model_dir`)."""
        return load_float(torch_dtype)


class Int8Form(WeightForm):
    def dtype(self, dtype, device) -> torch.dtype:
        return torch.float32  # torch.ao quantises from float32; its activations stay float32

    def build(self, load_float, torch_dtype, model_dir, gguf, keep_outliers):
        from specdec.models.quantize import quantize_int8

        kept = None if model_dir is None else ready.int8_file(model_dir, keep_outliers)
        model = ready.load_int8(kept) if kept is not None else None
        if model is None:
            model = quantize_int8(load_float(torch_dtype), keep_outliers=keep_outliers)
            if kept is not None:
                ready.keep_int8(model.eval(), kept)
        return model


class Int4Form(WeightForm):
    def dtype(self, dtype, device) -> torch.dtype:
        """An int4 model's other layers: bfloat16, or float32 where asked for. The int4 kernel computes each
        row alone (its output does not depend on the verify's width), so in float32 speculation is
        token-exact for the int4 model; in bfloat16 it is exact up to bf16 near-ties, as for every bfloat16
        model."""
        if dtype in ("float32", torch.float32):
            return torch.float32
        if dtype not in (None, "auto", "bfloat16", torch.bfloat16):
            raise ValueError(f"an int4 model runs its other layers in bfloat16 or float32: dtype {dtype} is refused")
        return torch.bfloat16

    def build(self, load_float, torch_dtype, model_dir, gguf, keep_outliers):
        """The model's Linears swapped into int4 (`codes`; specdec.models.int4): an alias's from its kept int4
        file, which the first load writes (decoding the GGUF and packing its codes took ~10 s for the 1.5B)."""
        from specdec.models.int4 import keep_int4, load_kept_int4

        model = load_float(torch_dtype)
        kept = None if model_dir is None else ready.int4_file(model_dir, self.name)
        counts = load_kept_int4(model, kept) if kept is not None else None
        if counts is None:
            counts = self.codes(model, gguf)
            if kept is not None:
                keep_int4(model, counts, kept)
        model.specdec_int4 = counts  # for reports: which Linears went int4 (by GGUF type)
        return model

    def codes(self, model, gguf) -> dict:
        """Swap the Linears the GGUF holds in 4 bits for Int4Linears of those codes -> the counts."""
        from specdec.models.int4 import apply_gguf_int4

        return apply_gguf_int4(model, gguf).counts()


class RoundedInt4Form(Int4Form):
    def codes(self, model, gguf) -> dict:
        """Every Linear's own weights rounded to 4 bits in groups of 32 (specdec.models.int4.quantize_int4)."""
        from specdec.models.int4 import quantize_int4

        return quantize_int4(model)


WEIGHT_FORMS = {
    form.name: form
    for form in (
        WeightForm("none", own_weights=True, kept="safetensors in its dtype (<alias>/<dtype>/)"),
        Int8Form(
            "int8",
            own_weights=False,
            kept="the whole int8 model, pickled (<alias>/int8-*.pt)",
            cpu_only=True,
        ),
        Int4Form(
            "int4",
            own_weights=False,
            kept="the packed 4-bit codes (<alias>/int4-*.safetensors) beside the bf16 model",
            cpu_only=True,
            from_gguf=True,
        ),
        RoundedInt4Form(
            "int4-rtn",
            own_weights=False,
            kept="the packed 4-bit codes (<alias>/int4-rtn-*.safetensors) beside the bf16 model",
            cpu_only=True,
        ),
    )
}


def weight_form(quantization: str | None, device: str = "cpu", role: str = "model") -> WeightForm:
    """The form a `quantization` names (None: "none"), refused where it cannot run on `device`."""
    form = WEIGHT_FORMS.get(quantization or "none")
    if form is None:
        raise ValueError(f"unknown {role} quantization {quantization!r}; choose {', '.join(WEIGHT_FORMS)}")
    if form.cpu_only and device != "cpu":
        raise ValueError(
            f"{form.name} weights run on CPU only; on CUDA use quantization none (--draft-quantization none, "
            "no --target-quantization)"
        )
    return form
