"""Inductor's compile cache across processes (issue 10): the first generate of compile="inductor-graphs" on a
tiny Llama (2 layers x 32, float32, CPU), in a fresh process, with the cache empty and then filled by the
previous process. specdec keeps the cache under $SPECDEC_CACHE_DIR/inductor (default ~/.cache/specdec).

    rm -rf /tmp/cc && for i in 1 2; do env -u TORCHINDUCTOR_CACHE_DIR SPECDEC_CACHE_DIR=/tmp/cc \\
        PYTHONPATH=. .venv/bin/python scripts/compile_cache.py; done
"""

import os
import tempfile
import time
from pathlib import Path

import specdec
from specdec.adapters.static import StaticHFCausalLM
from tests.tiny import build


def main() -> None:
    model = build("llama", 0, Path(tempfile.mkdtemp()) / "t", layers=2, hidden=32)
    adapter = StaticHFCausalLM(model, max_length=64, compile="inductor-graphs", compile_widths=[1, 3])
    start = time.perf_counter()
    specdec.generate([3, 1, 4, 1, 5], target=adapter, draft="ngram", max_new_tokens=20, num_draft_tokens=2)
    seconds, where = time.perf_counter() - start, os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print(f"first generate (compiles two shapes): {seconds:.1f} s; cache {where}")


if __name__ == "__main__":
    main()
