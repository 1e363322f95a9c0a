"""Per-token acceptance of a partial draft head (draft_vocab) against the full head, teacher-forced.

    .venv/bin/python scripts/draft_vocab_acceptance.py --out docs/bench/draft-vocab-acceptance.json

Free of timing noise: the target's greedy text for each bench prompt (128 tokens, the shipped pair:
Qwen2.5-Coder-0.5B int8 drafting for 1.5B bfloat16) is scored in one forward by each model; at each
position the draft's law is cut to the partial head's subset as it would stand there (base ids,
special ids, the prompt's and the earlier output's tokens). Reported: the greedy agreement
(argmax q == argmax p) and, at T = 0.7, the expected acceptance sum_x min(p(x), q(x)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec import SpeculativeDecoder
from specdec.api import _special_ids
from specdec.bench import PROMPTS, _chat_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32768,65536")
    parser.add_argument("--out")
    args = parser.parse_args()
    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
    target, draft = decoder.target.model, decoder.drafter.adapter.model
    specials = _special_ids(decoder.tokenizer, decoder.target)
    sizes = [int(s) for s in args.sizes.split(",")] + [None]
    rows = []
    for cls in ("code", "editing", "chat"):
        for index in range(2):
            ids = _chat_ids(decoder.tokenizer, PROMPTS[cls][index])
            out = decoder.generate(ids, max_new_tokens=128, num_draft_tokens="auto").token_ids
            seq = torch.tensor([ids + out])
            with torch.inference_mode():
                p_logits = target(seq).logits[0, len(ids) - 1 : -1].float()
                q_logits = draft(seq).logits[0, len(ids) - 1 : -1].float()
            for size in sizes:
                seen = set(ids) | specials
                greedy, sampled = [], []
                for j, token in enumerate(out):
                    q = q_logits[j].clone()
                    if size is not None:
                        outside = torch.ones_like(q, dtype=torch.bool)
                        outside[:size] = False
                        outside[list(seen)] = False
                        q[outside] = float("-inf")
                    greedy.append(float(q.argmax() == p_logits[j].argmax()))
                    p7, q7 = torch.softmax(p_logits[j] / 0.7, -1), torch.softmax(q / 0.7, -1)
                    sampled.append(float(torch.minimum(p7, q7).sum()))
                    seen.add(token)
                rows.append(
                    {
                        "class": cls,
                        "prompt": index,
                        "head": size or "full",
                        "greedy_agreement": statistics.mean(greedy),
                        "t0.7_expected_acceptance": statistics.mean(sampled),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    summary = {
        str(size or "full"): {
            key: statistics.mean(r[key] for r in rows if r["head"] == (size or "full"))
            for key in ("greedy_agreement", "t0.7_expected_acceptance")
        }
        for size in sizes
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
