"""Which levers pay inside a serving batch: N rows of one Session, in one process, interleaved (issue 39).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/batch_levers.py --rows 8 --repeats 2

Configurations, each a fresh Session over the same loaded pair (its clocks learned anew), the serve bench's
held-out prompts (chat, greedy, --max-tokens each): the target alone (`--draft none`'s session); the pair
with its defaults (draft trees "auto", copy drafts after a draft model's chain); without copies; chains
only; chains without copies. tokens/s = generated tokens / the wall time from the first submit to the last
end (the session's calibration is done before). Prints drafted tokens, copies and tree nodes as well.
"""

from __future__ import annotations

import argparse
import time

from specdec import SpecConfig, SpeculativeDecoder
from specdec.bench.serve import PROMPTS
from specdec.config import encode
from specdec.serving.session import Session

CONFIGS = {
    "defaults": {},
    "no copies": {"lookup": False},
    "chains": {"width": 1},
    "chains, no copies": {"width": 1, "lookup": False},
}


def run(decoder, prompts, config, width=None, lookup=True) -> tuple[float, object]:
    session = Session(decoder, max_batch=len(prompts))
    if width is not None:
        session.width = width
    if not lookup:
        session.lookup = None
    with decoder._exclusive():
        session.step()  # started: the host's costs measured (or read) at each batch size
        requests = [session.submit(p, config) for p in prompts]
        began = time.perf_counter()
        while not all(r.done.is_set() for r in requests):
            session.step()
        wall = time.perf_counter() - began
    return sum(len(r.tokens) for r in requests) / wall, session.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    decoder = SpeculativeDecoder.from_pretrained(args.target, args.draft)
    alone = SpeculativeDecoder(decoder.target, None, decoder.tokenizer)
    chats = [[{"role": "user", "content": p}] for p in (PROMPTS * args.rows)[: args.rows]]
    prompts = [encode(c, decoder.tokenizer, True, decoder.target.vocab_size) for c in chats]
    config = SpecConfig.of(max_new_tokens=args.max_tokens, temperature=0)
    for repeat in range(args.repeats):
        base, _ = run(alone, prompts, config)
        print(f"repeat {repeat} target alone: {base:.2f} tok/s", flush=True)
        for name, options in CONFIGS.items():
            rate, m = run(decoder, prompts, config, **options)
            print(f"repeat {repeat} {name:18s}: {rate:.2f} tok/s ({rate / base:.2f}x alone), drafted "
                  f"{m.drafted_tokens}, copies {m.lookup_tokens}, tree nodes {m.tree_nodes}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
