"""OpenMP wait policy under load: the target alone (specdec's loop, no draft) and with its default
draft, quiet and with a pure-Python busy loop on one core, each in a fresh process with
OMP_WAIT_POLICY unset (libgomp's default, spinning) or PASSIVE; repeats alternate the order.

    .venv/bin/python scripts/wait_policy.py --out docs/bench/wait-policy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import specdec
decoder = specdec.SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft=sys.argv[1], device="cpu")
# warm-up; k pinned at 4, as when the figures were taken (the API default is auto since then)
decoder.generate("Write a Python quicksort function.", max_new_tokens=8, chat=True, temperature=0, num_draft_tokens=4)
start = time.perf_counter()
out = decoder.generate(
    "Write a Python quicksort function.", max_new_tokens=64, chat=True, temperature=0, num_draft_tokens=4
)
print(json.dumps({"tokens_per_s": len(out.token_ids) / (time.perf_counter() - start)}))
"""


def run(policy: str | None, draft: str, loaded: bool) -> float:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    busy = None
    if loaded:
        busy = subprocess.Popen([sys.executable, "-c", "while True: sum(range(10000))"])
        time.sleep(1)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, draft], env=env, capture_output=True, text=True, check=True)
    finally:
        if busy is not None:
            busy.kill()
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for repeat in range(args.repeats):
        for loaded in (False, True):
            for draft in ("none", "qwen2.5-coder-0.5b"):
                for policy in (None, "PASSIVE") if repeat % 2 == 0 else ("PASSIVE", None):  # alternate the order
                    tps = run(policy, draft, loaded)
                    row = {"repeat": repeat, "loaded": loaded, "draft": draft, "policy": policy or "default"}
                    rows.append(row | {"tokens_per_s": tps})
                    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
