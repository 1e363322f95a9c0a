"""The draft step two ways, on the real Qwen pair at this host's defaults: the draft adapter's forward
alone (calibration without the drafter) and through the drafter's own `propose` (what `auto` uses).

    .venv/bin/python scripts/calibration_probe.py
"""

from __future__ import annotations

import time

import specdec
from specdec import calibration


def main() -> None:
    decoder = specdec.SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", device="cpu")
    draft = decoder.drafter.adapter
    for name, extra in (("forward", {}), ("drafter", {"drafter": decoder.drafter})):
        start = time.perf_counter()
        costs = calibration.calibrate(decoder.target, draft, refresh=True, **extra)
        print(
            f"{name}: measured in {time.perf_counter() - start:.1f} s; draft step {costs.draft_step_s * 1000:.1f} ms, "
            f"target(1) {costs.target(1) * 1000:.1f} ms, ratio {costs.cost_ratio:.3f}"
        )


if __name__ == "__main__":
    main()
