"""Cross-tokenizer defaults on this host's ISA (run it under a simulated AVX2 host too):
SmolLM2-135M drafting for Qwen2.5-Coder-1.5B, the defaults (draft_width "auto") against a chain,
greedy, one code and one chat prompt, 64 tokens. Prints siblings scored and tokens/s.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/crosstok_avx2_check.py
"""

from __future__ import annotations

import torch

import specdec
from specdec.bench import PROMPTS


def main() -> None:
    print("cpu capability:", torch.backends.cpu.get_cpu_capability())
    decoder = specdec.SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", "smollm2-135m", device="cpu")
    for prompt in (PROMPTS["code"][0], PROMPTS["chat"][0]):
        for width in ("auto", 1):
            out = decoder.generate(
                prompt, max_new_tokens=64, temperature=0, chat=True, draft_width=width, num_draft_tokens=4
            )
            m = out.metrics
            print(
                f"width={width}: {m.tokens_per_second:.2f} tok/s, {m.rounds} rounds, "
                f"{m.tree_nodes} siblings scored, {m.sibling_tokens} rounds ended on one"
            )
        print("calibration:", out.calibration)


if __name__ == "__main__":
    main()
