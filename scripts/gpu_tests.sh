#!/usr/bin/env bash
# The engine tests on CUDA (through the device tool), full log to $OUT/tests.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/pp "$OUT" && ln -sfn "$PWD/cli" /tmp/pp/specdec_cli
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1 SPECDEC_TEST_DEVICE=cuda
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_engine.py tests/test_verify.py tests/test_sampling_metrics.py > "$OUT/tests.txt" 2>&1
echo "pytest exit: $?" >> "$OUT/tests.txt"
tail -20 "$OUT/tests.txt"
