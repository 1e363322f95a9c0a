"""Exact distance of the LOSSY lenient acceptance from the target law, per leniency.

    .venv/bin/python scripts/lossy_distance.py

For random target/draft pairs (softmax of 3*N(0,1) logits over 1000 tokens; the
draft is the target's logits plus noise of std 1), computes the emitted token's
law under lenient acceptance exactly and reports its total-variation distance
from the target law, and the acceptance it buys. Prints one JSON object.
"""

import json

import torch

from specdec.diagnostics import expected_acceptance, lenient_output_law, total_variation
from specdec.verify import acceptance_probs


def main() -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 1000, generator=g)
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits + torch.randn(2000, 1000, generator=g), -1)
    rows = {}
    for leniency in (1.0, 1.25, 1.5, 2.0, 4.0):
        law = lenient_output_law(target, draft, leniency)
        accept = (draft.double() * acceptance_probs(target, draft, leniency)).sum(-1)
        rows[str(leniency)] = {
            "mean_total_variation": round(float(total_variation(law, target).mean()), 4),
            "max_total_variation": round(float(total_variation(law, target).max()), 4),
            "mean_acceptance": round(float(accept.mean()), 4),
        }
    print(
        json.dumps(
            {"exact_alpha": round(float(expected_acceptance(target, draft).mean()), 4), "by_leniency": rows}, indent=1
        )
    )


if __name__ == "__main__":
    main()
