#!/usr/bin/env bash
# One prepared GPU check (run through the device tool): tests on CUDA, then the GPU benchmark.
# Uses the device image's own torch/transformers; maps cli/ to specdec_cli without installing.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/pp "$OUT" && ln -sfn "$PWD/cli" /tmp/pp/specdec_cli
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1 SPECDEC_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_verify.py tests/test_sampling_metrics.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
timeout 200 python3 scripts/gpu_bench.py --out "$OUT/gpu_bench.json" 2>&1 | tail -60
