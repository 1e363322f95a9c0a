"""A GGUF's own 4-bit weights, run as stored through PyTorch's CPU int4 kernel (opt-in).

Words used here:
- code: a stored 4-bit integer q in 0..15.
- group: 32 consecutive input weights of one output row that share a scale and a zero.
- scale, minimum: the GGUF form of a group, w = scale * q - minimum (Q4_K: scale = d * sc,
  minimum = dmin * m; Q4_0: scale = d, minimum = 8 d; Q4_1: scale = d, minimum = -m).
- zero: torch's form of the same group, w = (q - 8) * scale + zero, hence zero = 8 scale - minimum.
  The kernel (`torch.ops.aten._weight_int4pack_mm_for_cpu`) takes scale and zero in bfloat16: that
  rounding is the only change to the weights (the codes are kept bit for bit).

`apply_gguf_int4(model, gguf_path)` swaps, in a model loaded the usual way (bfloat16, unpacked), each
Linear whose GGUF tensor is Q4_K / Q4_0 / Q4_1 for an `Int4Linear`; Linears stored in other types
(Q6_K, Q5_0, Q8_0, F16, ...) keep the float weights the model was loaded with, and the report says
which went where. Only qwen2 GGUFs are accepted: llama's converter permutes the Q/K rows, which is not
undone here.

`quantize_int4(model)` makes the same Int4Linears from a float model's own weights, for a model without a 4-bit
GGUF (the 0.5B draft's GGUF is mostly Q5_0, which this layout cannot hold): each group rounded to nearest between
its least and greatest weight (RTN, asymmetric), every Linear of 32k inputs, the head too (untied from the
embedding, which keeps its float weights). It is another model, so only a draft (exact in any form) takes it by
default, where its one-token step is measured faster (specdec.models.resolution.fastest_form).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

GROUP = 32
ARCHITECTURES = ("qwen2",)  # llama-family GGUFs permute Q/K rows (transformers undoes it on load)


@dataclass(frozen=True)
class Int4Groups:
    """A 4-bit weight in GGUF's form: w[r, c] = scale[r, c // 32] * codes[r, c] - minimum[r, c // 32]."""

    codes: np.ndarray  # [out, in] uint8, 0..15
    scale: np.ndarray  # [out, in / 32] float32
    minimum: np.ndarray  # [out, in / 32] float32

    def dequantize(self) -> np.ndarray:
        """float32 [out, in], computed as gguf.quants computes it (bit-exact for Q4_K)."""
        scale = np.repeat(self.scale, GROUP, axis=1)
        minimum = np.repeat(self.minimum, GROUP, axis=1)
        return scale * self.codes.astype(np.float32) - minimum


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """qs: [n, bytes] uint8 -> codes [n, 2 * bytes]: per run of `width` bytes, low nibbles then high."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1)


def decode_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] uint8 -> codes [n, 256], scale [n, 8], minimum [n, 8]
    (8 groups of 32 per super-block; d, dmin fp16, then 12 bytes of 6-bit sc / m, then 128 of codes)."""
    import gguf

    assert blocks.ndim == 2 and blocks.shape[1] == 144, blocks.shape
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return _nibbles(blocks[:, 16:], 32), d * sc.astype(np.float32), dmin * m.astype(np.float32)


def decode_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 blocks [n, 18] uint8 (d fp16, 16 bytes of codes; w = d * (q - 8))
    -> codes [n, 32], scale [n, 1], minimum [n, 1]."""
    assert blocks.ndim == 2 and blocks.shape[1] == 18, blocks.shape
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 2:], 16), d, 8 * d


def decode_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 blocks [n, 20] uint8 (d, m fp16, 16 bytes of codes; w = d * q + m)
    -> codes [n, 32], scale [n, 1], minimum [n, 1]."""
    assert blocks.ndim == 2 and blocks.shape[1] == 20, blocks.shape
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 4:], 16), d, -m


DECODERS = {"Q4_K": (144, decode_q4_k), "Q4_0": (18, decode_q4_0), "Q4_1": (20, decode_q4_1)}


def int4_groups(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Groups:
    """A GGUF tensor's raw bytes (`GGUFReader` tensor .data, [out, bytes per row] uint8) of a type in
    DECODERS -> its groups; shape: (out, in) of the weight."""
    block_bytes, decode = DECODERS[type_name]
    out, inner = shape
    codes, scale, minimum = decode(np.ascontiguousarray(data).reshape(-1, block_bytes))
    return Int4Groups(
        codes.reshape(out, inner), scale.reshape(out, inner // GROUP), minimum.reshape(out, inner // GROUP)
    )


def rounded_groups(weight: torch.Tensor) -> Int4Groups:
    """A float [out, in] weight (in a multiple of GROUP) rounded to nearest in its groups: the codes 0..15 span
    each group's least to greatest weight (w = scale * q - minimum, minimum = -least)."""
    out, inner = weight.shape
    groups = weight.detach().float().reshape(out, inner // GROUP, GROUP)
    least, greatest = groups.amin(-1), groups.amax(-1)
    scale = ((greatest - least) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - least[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(codes.reshape(out, inner).numpy(), scale.numpy(), (-least).numpy())


def quantize_int4(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Swap, in place, every CPU float Linear of the model whose inputs are a multiple of GROUP for an
    Int4Linear of its own weights rounded to nearest (`rounded_groups`); a head tied to the embeddings gets its
    own codes (the embedding keeps the float weight). Returns the counts, as Int4Report.counts gives them."""
    counts = Counter()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            if child.in_features % GROUP or not child.weight.is_floating_point():
                counts["kept"] += 1
                continue
            setattr(parent, name, Int4Linear.of(rounded_groups(child.weight), child.bias))
            counts["rtn"] += 1
    model.specdec_weights = "int4-rtn"  # its weight form (specdec.models.forms), for the calibration's key
    return {"int4": {"rtn": counts["rtn"]}, "kept": {"float": counts["kept"]}}


class Int4Linear(torch.nn.Module):
    """A Linear on 4-bit codes packed for torch's CPU int4 kernel, groups of 32, bfloat16 scale and zero.
    Computes in bfloat16; float32 inputs are cast to bfloat16 and the output back."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, bias=None):
        """packed: the codes as `_convert_weight_to_int4pack_for_cpu` packs them; scales_and_zeros
        [in / 32, out, 2] bfloat16. `of` makes one from a GGUF tensor's groups."""
        super().__init__()
        self.out_features, self.in_features = scales_and_zeros.shape[1], in_features
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    @classmethod
    def of(cls, groups: Int4Groups, bias: torch.Tensor | None) -> Int4Linear:
        codes = torch.from_numpy(groups.codes.astype(np.int32))  # [out, in]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale = torch.from_numpy(groups.scale)  # [out, in / 32]
        zero = 8 * scale - torch.from_numpy(groups.minimum)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(packed, scales_and_zeros, groups.codes.shape[1], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out], in x's dtype."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, group={GROUP}"


@dataclass
class Int4Report:
    """Which Linears went int4 and which kept float weights, by GGUF tensor name -> GGUF type."""

    int4: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, dict[str, int]]:
        return {"int4": dict(Counter(self.int4.values())), "kept": dict(Counter(self.kept.values()))}


def apply_gguf_int4(model: torch.nn.Module, gguf_path: str | Path) -> Int4Report:
    """Swap, in place, the model's Linears stored as Q4_K / Q4_0 / Q4_1 in the GGUF for Int4Linears.
    The model: transformers' model of that GGUF, loaded the usual way (CPU, float, Linears not yet packed)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: 4-bit GGUF weights are supported for {', '.join(ARCHITECTURES)} only, not {architecture!r}"
        )
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    report = Int4Report()
    for parent, child_name, linear, tensor in _linears(model, names, tensors, gguf_path):
        type_name = tensor.tensor_type.name
        if type_name not in DECODERS:
            report.kept[tensor.name] = type_name
            continue
        groups = int4_groups(tensor.data, type_name, tuple(linear.weight.shape))
        setattr(parent, child_name, Int4Linear.of(groups, linear.bias))
        report.int4[tensor.name] = type_name
    model.specdec_weights = "int4"  # its weight form (specdec.models.forms), for the calibration's key
    return report


def _linears(model, names, tensors: dict, gguf_path):
    """(parent, child name, Linear, GGUF tensor) for each torch.nn.Linear of the model."""
    found = []
    for prefix, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is not torch.nn.Linear:
                continue
            hf_name = f"{prefix}.{child_name}" if prefix else child_name
            gguf_name = names.get_name(f"{hf_name}.weight", try_suffixes=(".weight",))
            if gguf_name not in tensors:
                raise ValueError(f"{gguf_path}: no tensor for {hf_name} (looked for {gguf_name})")
            tensor = tensors[gguf_name]
            if tuple(int(n) for n in reversed(tensor.shape)) != tuple(child.weight.shape):
                raise ValueError(
                    f"{gguf_path}: {gguf_name} has shape {list(tensor.shape)}, {hf_name} {list(child.weight.shape)}"
                )
            found.append((parent, child_name, child, tensor))
    return found


def keep_int4(model: torch.nn.Module, counts: dict, path: Path) -> None:
    """Keep the model's Int4Linears ready to run: their packed codes and bfloat16 scales and zeros, as
    safetensors (the report's counts in its metadata), written atomically (specdec.models.ready)."""
    import json

    from safetensors.torch import save_file

    from specdec.models import ready

    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"] = module.packed, module.scales_and_zeros
    ready.write_kept(path, lambda tmp: save_file(tensors, str(tmp), metadata={"counts": json.dumps(counts)}))


def load_kept_int4(model: torch.nn.Module, path: Path) -> dict | None:
    """Swap in the Int4Linears kept by `keep_int4` (the model as `apply_gguf_int4` takes it) -> the counts;
    None where there is no kept file or it cannot be read (it is then removed)."""
    import json

    from safetensors import safe_open

    from specdec.models import ready

    def read(kept: Path) -> dict:
        with safe_open(str(kept), "pt") as file:
            counts = json.loads(file.metadata()["counts"])
            names = sorted({key.rsplit(".", 1)[0] for key in file.keys()})
            swaps = []
            for name in names:
                parent_name, _, child_name = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                linear = getattr(parent, child_name)
                packed, sz = file.get_tensor(f"{name}.packed"), file.get_tensor(f"{name}.scales_and_zeros")
                if type(linear) is not torch.nn.Linear or sz.shape[1] != linear.out_features:
                    raise ValueError(f"{name}: the kept int4 weight does not fit the model")
                swaps.append((parent, child_name, Int4Linear(packed, sz, linear.in_features, linear.bias)))
        for parent, child_name, module in swaps:  # all read and checked: the model changes only now
            setattr(parent, child_name, module)
        return counts

    return ready.read_kept(path, read, "int4 weights")
