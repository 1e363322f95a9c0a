"""The engine's own cost per token, where the model is tiny and the host work shows: the gpu_bench
tiny Llama (4 layers x 64, vocabulary 512, float32, 1 thread), target alone, 128 greedy tokens after a
64-token prompt. Medians of 7 interleaved repeats, in ms per token:
- raw: the model's forward and an argmax in a bare loop (no engine at all);
- hf: transformers `generate`;
- decode_k0: specdec's round loop (`decode`, no drafter, k = 0);
- api: `SpeculativeDecoder.generate`.

    PYTHONPATH=. .venv/bin/python scripts/loop_overhead.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

from scripts.gpu_bench import build_pair
from specdec import SpeculativeDecoder
from specdec.adapters import HFCausalLM
from specdec.decoder import decode
from specdec.drafters import NoDrafter
from specdec.policy import DraftLengthPolicy
from specdec.sampling import SamplingConfig

N = 128


def main() -> None:
    torch.set_num_threads(1)
    target, _, _ = build_pair("tiny", "cpu", torch.float32, 512)
    prompt = torch.randint(1, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    inputs = torch.tensor([prompt])
    decoder, adapter = SpeculativeDecoder(HFCausalLM(target), None), HFCausalLM(target)

    @torch.inference_mode()
    def raw():
        cache = DynamicCache(config=target.config)
        token = target(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        for _ in range(N - 1):
            token = target(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)

    @torch.inference_mode()
    def hf():
        target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=N, do_sample=False)

    def decode_k0():
        greedy = SamplingConfig(temperature=0)
        decode(adapter, NoDrafter(), [prompt], max_new_tokens=N, sampling=greedy, policy=DraftLengthPolicy(k=0))

    def api():
        decoder.generate(prompt, max_new_tokens=N, temperature=0)

    runs = {"raw": raw, "hf": hf, "decode_k0": decode_k0, "api": api}
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(7):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / N * 1e3)
    print({name: round(statistics.median(samples), 3) for name, samples in times.items()})


if __name__ == "__main__":
    main()
