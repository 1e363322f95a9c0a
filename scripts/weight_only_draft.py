"""Weight-only quantised drafts on CPU: are torch's int8/int4 weight-only kernels cheaper than
torch.ao's dynamic int8 (specdec's CPU draft default)?

    .venv/bin/python scripts/weight_only_draft.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/weight_only_draft.py

Qwen2.5-Coder-0.5B, 2 threads: a forward over 1 and 5 tokens after a 128-token context (medians of 7
and 5) and a 256-token prefill. Each
variant swaps every nn.Linear for a module around one of torch's kernels: `_weight_int8pack_mm`
(int8 weights per output channel, bfloat16 activations) or `_weight_int4pack_mm_for_cpu`
(int4 weights, asymmetric per group of 32 or 128 inputs). `agreement`: the share of positions of a
real prompt (teacher-forced) where the variant's argmax equals the bfloat16 draft's. Prints JSON.
"""

import json
import time

import torch

from specdec import SpeculativeDecoder, load_model, load_tokenizer
from specdec.adapters import HFCausalLM
from specdec.bench import PROMPTS, _timed_forward
from specdec.quantize import quantize_int8

DRAFT = "qwen2.5-coder-0.5b"


class Int8WeightOnly(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(1).clamp_min(1e-8) / 127
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.weight, self.scale)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


class Int4WeightOnly(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, group: int):
        super().__init__()
        weight = linear.weight.detach().float()
        rows, cols = weight.shape
        grouped = weight.reshape(rows, cols // group, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = (high - low).clamp_min(1e-8) / 15
        q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(rows, cols)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel's dequantisation is (q - 8) * scale + zero, so zero = low + 8 * scale.
        zeros = low + 8 * scale
        self.register_buffer("scales", torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))
        self.group = group

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.scales)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def swapped(make):
    adapter = SpeculativeDecoder.from_pretrained(DRAFT, device="cpu", dtype="bfloat16").target
    for module in list(adapter.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, make(child))
    return adapter


def prefill_seconds(adapter, tokens: int) -> float:
    """One forward over a fresh `tokens`-token prompt (the draft's prefill), the second of two."""
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        adapter.model(ids)
        start = time.perf_counter()
        adapter.model(ids)
    return time.perf_counter() - start


def main() -> None:
    context = torch.randint(0, 1000, (1, 128))
    tokenizer = load_tokenizer(DRAFT)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS["code"][0]}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(text + "def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]])
    reference = SpeculativeDecoder.from_pretrained(DRAFT, device="cpu", dtype="bfloat16").target
    with torch.inference_mode():
        best = reference.model(ids).logits.argmax(-1)
    variants = {
        "bfloat16": lambda: reference,
        "dynamic_int8 (torch.ao, the drafts' default)": lambda: HFCausalLM(
            quantize_int8(load_model(DRAFT, dtype="float32", device="cpu")), DRAFT
        ),
        "weight_only_int8": lambda: swapped(Int8WeightOnly),
        "weight_only_int4_g32": lambda: swapped(lambda linear: Int4WeightOnly(linear, 32)),
        "weight_only_int4_g128": lambda: swapped(lambda linear: Int4WeightOnly(linear, 128)),
    }
    out = {"threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability()}
    for name, build in variants.items():
        adapter = build()
        with torch.inference_mode():
            agreement = float((adapter.model(ids).logits.argmax(-1) == best).float().mean())
        out[name] = {
            "step_s": _timed_forward(adapter, context, 1, repeats=7),
            "width5_s": _timed_forward(adapter, context, 5, repeats=5),
            "prefill256_s": prefill_seconds(adapter, 256),
            "agreement": agreement,
        }
        print(name, out[name], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
