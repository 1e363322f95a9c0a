"""Host-side tensor ops per round outside the captured forwards (the GPU's per-round host cost, counted on
any device): the gpu_bench tiny pair on the static cache with compile="graphs" (CUDA's default; on the
CPU its graph buffers run eagerly), greedy, no stop. Every aten op dispatched outside a model forward is
counted (on CUDA each is a kernel launch or a copy, ~5-15 us of host time), by the specdec function
that issued it.

    PYTHONPATH=. .venv/bin/python scripts/round_ops.py [--k 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.gpu_bench import tuned_pair
from specdec import SpeculativeDecoder
from specdec.adapters import static
from specdec.adapters.static import StaticHFCausalLM
from specdec.drafters import ModelDrafter, NoDrafter


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.inside, self.ops, self.sites = 0, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops[str(func.overloadpacket)] += 1
            frame = next((f for f in reversed(traceback.extract_stack(limit=12)) if "/specdec/" in f.filename), None)
            self.sites[f"{frame.filename.split('/specdec/')[-1]}:{frame.name}" if frame else "?"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    target, draft = tuned_pair("tiny", "cpu")
    prompt = torch.randint(1, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    counter = Count()
    run = static.CapturedForward._run

    def inside(self):  # a model forward: replayed inside the graph on CUDA, not counted
        counter.inside += 1
        try:
            return run(self)
        finally:
            counter.inside -= 1

    static.CapturedForward._run = inside
    for name, drafter in (("target alone", None), (f"draft, k={args.k}", draft)):
        t = StaticHFCausalLM(target, max_length=256, compile="graphs", compile_widths=(1, 2, 5, 11))
        d = (
            None
            if drafter is None
            else ModelDrafter(StaticHFCausalLM(draft, max_length=256, compile="graphs"), stop_below=None)
        )
        decoder = SpeculativeDecoder(t, d if d is not None else NoDrafter())
        k = 1 if drafter is None else args.k
        decoder.generate(prompt, max_new_tokens=args.tokens, num_draft_tokens=k, temperature=0)  # warm-up
        counter.ops.clear(), counter.sites.clear()
        with counter:
            out = decoder.generate(prompt, max_new_tokens=args.tokens, num_draft_tokens=k, temperature=0)
        rounds = out.metrics.rounds
        total = sum(counter.ops.values())
        print(f"{name}: {rounds} rounds, {total / rounds:.1f} ops per round outside the forwards", flush=True)
        for site, n in counter.sites.most_common(12):
            print(f"  {n / rounds:6.1f}  {site}")
        print("  top ops:", ", ".join(f"{op} {n / rounds:.1f}" for op, n in counter.ops.most_common(10)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
