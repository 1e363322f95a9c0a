#!/usr/bin/env bash
# One prepared GPU check (run through the device tool): the static-cache and host-sync tests on CUDA
# (real graph capture, syncs counted per round), then the GPU bench (`specdec bench gpu`, scripts/gpu_bench.py).
# transformers 5.24 travels as a wheel in .whl/ (carry it: the image has 5.17); cli/ maps to specdec_cli.
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=480)
# JOB=tests runs only the engine, verify and sampling tests on CUDA (TEST_TIMEOUT seconds, default 330).
# TESTS picks the test files. SECTIONS and BUDGET (seconds for the bench) pick a shorter bench; BENCH_ARGS
# go to gpu_bench.py (e.g. "--repeats 3"); BACKEND=inductor tries torch.compile's
# fused kernels (minutes of compile per shape) instead of the adapter's own CUDA graphs of the eager kernels.
# The GPU profile (scripts/gpu_profile.py) and the compiled-decode probe were deleted: docs/notes/deleted-scripts.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
JOB=${JOB:-bench}
SECTIONS=${SECTIONS:-greedy,compiled,sampled,batch,useless,syncs}
BUDGET=${BUDGET:-280}
BACKEND=${BACKEND:-graphs}
if [ "$JOB" = tests ]; then
    TESTS=${TESTS:-tests/test_engine.py tests/test_verify.py tests/test_sampling_metrics.py}
    TEST_TIMEOUT=${TEST_TIMEOUT:-330}
fi
mkdir -p /tmp/pp "$OUT" && ln -sfn "$PWD/cli" /tmp/pp/specdec_cli
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/pp:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
SPECDEC_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -s -p no:cacheprovider --durations=8 \
    ${TESTS:-tests/test_static_cache.py tests/test_syncs.py tests/test_read_ahead.py} > "$OUT/tests.txt" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.txt"
grep "rounds:" "$OUT/tests.txt"; tail -12 "$OUT/tests.txt"
[ "$JOB" = tests ] && exit 0
# the suite's main(argv) without the CLI (the device image may lack typer): what `specdec bench gpu --` runs
timeout $((BUDGET + 20)) python3 -c 'import runpy, sys; runpy.run_path("scripts/gpu_bench.py")["main"](sys.argv[1:])' --out "$OUT" --budget "$BUDGET" --sections "$SECTIONS" --backend "$BACKEND" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^greedy\|^sampled\|^useless" | tail -60
