"""Milliseconds per NgramDrafter.find (copy drafts' and `--draft ngram`'s lookup) on texts of growing
length with no repeat (the whole text is searched for each n-gram length), median of 5 x 20 calls.

    PYTHONPATH=. .venv/bin/python scripts/ngram_find_speed.py

With `auto` k and copy drafts on, find runs once per draft step per row (the copy-aware stop's hint)
and once per round (the copies appended after the chain).
"""

import random
import statistics
import time

from specdec.drafters import NgramDrafter


def main() -> None:
    rng = random.Random(0)
    drafter = NgramDrafter()
    for length in (200, 1000, 4000, 16000):
        text = [rng.randrange(30000) for _ in range(length)]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                drafter.find(text, 10)
            times.append((time.perf_counter() - start) / 20 * 1e3)
        print(f"{length} tokens: {statistics.median(times):.3f} ms per find", flush=True)


if __name__ == "__main__":
    main()
