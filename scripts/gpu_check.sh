#!/usr/bin/env bash
# One prepared GPU check (run through the device tool): the static-cache and host-sync tests on CUDA
# (real graph capture, syncs counted per round), the profile of a compiled decode step, then the GPU bench.
# transformers 5.24 travels as a wheel in .whl/ (carry it: the image has 5.17); cli/ maps to specdec_cli.
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
# TESTS picks the test files. JOB=probe runs scripts/gpu_compiled_probe.py instead of the profile and bench.
# SECTIONS and BUDGET (seconds for the bench) pick a shorter bench; PROFILE=0 skips the profile; BENCH_ARGS
# go to gpu_bench.py (e.g. "--repeats 3"); BACKEND=inductor tries torch.compile's
# fused kernels (minutes of compile per shape) instead of the adapter's own CUDA graphs of the eager kernels.
set -uo pipefail
OUT=${OUT:-/tmp/out}
SECTIONS=${SECTIONS:-greedy,compiled,sampled,batch,useless,syncs}
BUDGET=${BUDGET:-280}
BACKEND=${BACKEND:-graphs}
mkdir -p /tmp/pp "$OUT" && ln -sfn "$PWD/cli" /tmp/pp/specdec_cli
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/pp:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
SPECDEC_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -s -p no:cacheprovider ${TESTS:-tests/test_static_cache.py \
    tests/test_syncs.py tests/test_read_ahead.py} > "$OUT/tests.txt" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.txt"
grep "rounds:" "$OUT/tests.txt"; tail -12 "$OUT/tests.txt"
if [ "${JOB:-bench}" = probe ]; then  # read-ahead and inductor-graphs against eager transformers (BUDGET seconds)
    timeout $((BUDGET + 60)) python3 scripts/gpu_compiled_probe.py --out "$OUT" --budget "$BUDGET" 2>&1 | tail -40
    exit 0
fi
[ "${PROFILE:-1}" = 0 ] || timeout 100 python3 scripts/gpu_profile.py --out "$OUT" --backend "$BACKEND" 2>&1 | head -16
timeout $((BUDGET + 20)) python3 scripts/gpu_bench.py --out "$OUT" --budget "$BUDGET" --sections "$SECTIONS" --backend "$BACKEND" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^greedy\|^sampled\|^useless" | tail -60
