"""GPT-2 (Conv1D layers) with and without packed weights (specdec.packing): a random model of gpt2-medium's
shape (no weights travel here), forward after a 200-token context, medians of 5, interleaved.

    PYTHONPATH=. .venv/bin/python scripts/gpt2_packing.py
"""

import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GPT2Config

from specdec.packing import pack_linears

torch.manual_seed(0)
cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16)  # gpt2-medium's shape, random weights
plain = AutoModelForCausalLM.from_config(cfg).eval()
packed = copy.deepcopy(plain)
n = pack_linears(packed)
ctx = torch.randint(0, 50000, (1, 200))


def run(m, w):
    with torch.inference_mode():
        out = m(input_ids=ctx, use_cache=True)
        pkv = out.past_key_values
        ids = torch.randint(0, 50000, (1, w))
        s = time.perf_counter()
        m(input_ids=ids, past_key_values=pkv, use_cache=True)
        return time.perf_counter() - s


print("packed modules", n)
for w in (1, 5, 11):
    t = {"plain": [], "packed": []}
    for _ in range(5):
        t["plain"].append(run(plain, w))
        t["packed"].append(run(packed, w))
    p, q = statistics.median(t["plain"]), statistics.median(t["packed"])
    print(w, round(p * 1000, 1), round(q * 1000, 1), round(p / q, 2))
