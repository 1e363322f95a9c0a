#!/usr/bin/env bash
# One prepared GPU check (run through the device tool, ~7 min): the static-cache tests with real CUDA-graph
# capture, the profile of a compiled decode step, then the GPU bench (greedy, compiled, sampled, batch 8).
# transformers 5.24 travels as a wheel in .whl/ (carry it: the image has 5.17); cli/ maps to specdec_cli.
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/pp "$OUT" && ln -sfn "$PWD/cli" /tmp/pp/specdec_cli
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/pp:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
SPECDEC_TEST_DEVICE=cuda timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_static_cache.py 2>&1 | tail -8 | tee "$OUT/tests.txt"
timeout 100 python3 scripts/gpu_profile.py --out "$OUT" 2>&1 | tail -14
timeout 290 python3 scripts/gpu_bench.py --out "$OUT" --budget 280 --sections greedy,compiled,sampled,batch,useless,syncs 2>&1 \
    | grep -v "^greedy\|^sampled\|^useless" | tail -60
