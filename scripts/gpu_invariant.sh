#!/usr/bin/env bash
# Invariant mode's GPU checks and its float32 sweep in one call. Run from the checkout root:
#
#   [KDTREE_KERNELS_LIB=<lib>] [KDTREE_KERNELS_PLANT=<lib>] PYTHONPATH=. \
#       bash scripts/gpu_invariant.sh [all|tests|plant|sweep]
#
#   tests  the attention kernel's plans (tests/kernels/test_mla_verify.py, the paged invariant
#          plan), invariant mode on CUDA (tests/engine/test_invariant.py, test_fused.py,
#          test_fused_attention.py, test_graphs.py' CUDA cases)       -> gpu_tests.log
#   plant  test_invariant.py's kernel-plan test against a library built from a planted source
#          ($KDTREE_KERNELS_PLANT; skipped without one): it must fail  -> plant.log
#   sweep  scripts/sweep_float32_invariant.py                          -> sweep-float32.{json,log}
set -uo pipefail
stage="${1:-all}"
DEADLINE=$((SECONDS + ${KDTREE_DEADLINE:-570}))
source "$(dirname "$0")/gpu_env.sh"
build_kernels

if want tests; then
    echo "== GPU tests"
    timeout "$(left 330)" python3 -m pytest tests/kernels/test_mla_verify.py tests/kernels/test_paged_kv.py \
        tests/engine/test_invariant.py tests/engine/test_fused.py tests/engine/test_fused_attention.py \
        tests/engine/test_graphs.py -k "not paged_kv or invariant or cuda_cores" -p no:cacheprovider -q -rfs \
        --durations=5 >"$OUT/gpu_tests.log" 2>&1
    echo "exit $?"
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -2
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -10
fi

if want plant && [[ -n "${KDTREE_KERNELS_PLANT:-}" ]]; then
    echo "== planted library (must fail)"
    KDTREE_KERNELS_LIB="$KDTREE_KERNELS_PLANT" timeout "$(left 90)" python3 -m pytest tests/engine/test_invariant.py \
        -k mla_invariant_plan -p no:cacheprovider -q >"$OUT/plant.log" 2>&1
    echo "exit $? (1: the test caught the plant)"
    grep -E "passed|failed|assert" "$OUT/plant.log" | tail -3
fi

if want sweep; then
    echo "== float32 sweep"
    timeout "$(left 240)" python3 scripts/sweep_float32_invariant.py "$OUT/sweep-float32.json" \
        >"$OUT/sweep-float32.log" 2>&1
    echo "exit $?"
    tail -2 "$OUT/sweep-float32.log" | cut -c1-400
fi
