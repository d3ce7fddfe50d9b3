#!/usr/bin/env bash
# Every GPU check of the project in one device call: kernel build, the GPU test suites
# (kernels and engine, CUDA variants included), then scripts/gpu_engine.sh (validate --device
# cuda and the end-to-end benchmark). Logs under $OUT. Run from the checkout root:
#
#   OUT=out PYTHONPATH=. bash scripts/gpu_all.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
echo "== build kernels"
build_kernels
echo "== GPU tests (kernels, engine)"
timeout 240 python3 -m pytest tests/kernels tests/engine -p no:cacheprovider -q -rs --continue-on-collection-errors \
    >"$OUT/gpu_tests.log" 2>&1
tail -15 "$OUT/gpu_tests.log"
bash scripts/gpu_engine.sh
