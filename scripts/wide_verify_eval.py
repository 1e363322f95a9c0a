"""Counted `auto` with chains up to 10 drafts (verify <= 11 columns, as shipped) against up to 16 (verify
<= 17 columns), under one calibration that measures both.

    PYTHONPATH=. .venv/bin/python scripts/wide_verify_eval.py --out docs/bench/wide-verify-eval.json

The calibration's widths are widened to 13 and 17 for this run, measured afresh and kept in a
file of its own (SPECDEC_CALIBRATION, set here unless given), so the shipped calibration cache stays
untouched. "base" sees only the widths up to 11 and max_k = 10, "wide" all of them and max_k = 16.
Figures as in scripts/policy_eval.py: tokens x target forward / modelled time, per class.
"""

import argparse
import dataclasses
import json
import os
import tempfile

from policy_eval import DRAFT, ROUNDS, TARGET, _recording_score, modelled_seconds

import specdec.api as api
import specdec.calibration as calibration
import specdec.decoder as decoder_module
from specdec.api import SpeculativeDecoder
from specdec.bench import PROMPTS
from specdec.policy import DraftLengthPolicy

calibration.WIDTHS = (1, 2, 3, 5, 7, 9, 11, 13, 17)
VARIANTS = {"base": (10, 11), "wide": (16, 17)}  # (max_k, widest verify)
MODE = {"max_k": 10, "width": 11}


def _policy(k=None, max_k=10, costs=None, **kwargs):
    if costs is not None:
        costs = dataclasses.replace(costs, target_s=tuple(p for p in costs.target_s if p[0] <= MODE["width"]))
    return DraftLengthPolicy(k=k, max_k=MODE["max_k"], costs=costs, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", default="code,editing,chat")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("SPECDEC_CALIBRATION", os.path.join(tempfile.mkdtemp(), "calibration.json"))
    decoder_module.score = _recording_score
    api.DraftLengthPolicy = _policy
    decoder = SpeculativeDecoder.from_pretrained(TARGET, draft=DRAFT)
    costs = decoder.calibration(1)
    assert max(w for w, _ in costs.target_s) == max(calibration.WIDTHS), "a calibration without the wide widths"
    print("costs", {w: round(t / costs.target(1), 3) for w, t in costs.target_s}, flush=True)
    summary = {}
    for prompt_class in args.classes.split(","):
        for name, (max_k, width) in VARIANTS.items():
            MODE["max_k"], MODE["width"] = max_k, width
            tokens = modelled = 0
            for prompt in PROMPTS[prompt_class]:
                ROUNDS.clear()
                result = decoder.generate(prompt, chat=True, max_new_tokens=128, num_draft_tokens="auto")
                tokens += len(result.token_ids)
                modelled += modelled_seconds(costs)
            summary.setdefault(name, {})[prompt_class] = tokens * costs.target(1) / modelled
            print(name, prompt_class, round(summary[name][prompt_class], 3), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"costs": costs.to_dict(), "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
