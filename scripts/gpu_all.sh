#!/usr/bin/env bash
# Every GPU check of the project in one device call, on the stock GPU image. Run from the
# checkout root:
#
#   OUT=out PYTHONPATH=. bash scripts/gpu_all.sh
#
# Stages, each capped and all within DEADLINE seconds (default 540); a failing stage does not
# stop the next:
#   build     the default fat library (sm_80, sm_90a, sm_120, compute_80) and one without sm_90a
#             (sm_90,compute_90: the mma.sync path every non-Hopper GPU takes), side by side;
#             libraries named by $KDTREE_KERNELS_LIB and $KDTREE_KERNELS_LIB_NOA are used as
#             they are (built here beforehand with the same sources)          -> build.log
#   tests     pytest tests/kernels tests/engine with the fat library, WORKERS processes (default
#             15), less test_bench_gpu_k2_mid (300 s alone: scripts/gpu_engine.sh's bench stage)
#                                                                              -> gpu_tests.log
#   noa       pytest tests/kernels with the library without sm_90a (KDTREE_CUDA_ARCHS names its
#             targets: the dispatch test expects mma.sync, not wgmma, from it) -> gpu_tests_noa.log
#   validate  kdtree validate --device cuda, float32 then bfloat16
#                                       -> validate_cuda_{float32,bfloat16}.{txt,json}
# Also under $OUT: gpu.txt (GPU name, driver, clocks) and summary.txt (one line per stage).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
DEADLINE="${DEADLINE:-540}"
WORKERS="${WORKERS:-15}"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
counts() { grep -E "(passed|failed|error).* in [0-9.]+s" "$1" | tail -1 | tr -d "="; }

echo "== build" | tee "$OUT/build.log"
build_both
for lib in "$LIB_FAT" "$LIB_NOA"; do
    [[ -f "$lib" ]] && echo "library $lib" >>"$OUT/build.log" || summary "build: no library ($lib)"
done
summary "build: done at ${SECONDS} s"

echo "== GPU tests (kernels, engine), fat library"
KDTREE_KERNELS_LIB="$LIB_FAT" timeout "$(left 300)" python3 -m pytest tests/kernels tests/engine -p no:cacheprovider \
    -q -rfEs -n "$WORKERS" --dist loadfile --durations=20 -k "not test_bench_gpu_k2_mid" >"$OUT/gpu_tests.log" 2>&1
summary "tests (exit $?): $(counts "$OUT/gpu_tests.log") at ${SECONDS} s"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20

echo "== GPU tests (kernels), no sm_90a"
KDTREE_KERNELS_LIB="$LIB_NOA" KDTREE_CUDA_ARCHS=$NOA_ARCHS timeout "$(left 150)" python3 -m pytest tests/kernels -p no:cacheprovider \
    -q -rfEs -n "$WORKERS" --dist loadfile >"$OUT/gpu_tests_noa.log" 2>&1
summary "noa (exit $?): $(counts "$OUT/gpu_tests_noa.log") at ${SECONDS} s"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_noa.log" | head -20

for dtype in float32 bfloat16; do
    echo "== kdtree validate --device cuda --dtype $dtype"
    KDTREE_KERNELS_LIB="$LIB_FAT" timeout "$(left 200)" python3 -c "from engine.cli import main; main()" validate --device cuda --dtype "$dtype" \
        --json "$OUT/validate_cuda_$dtype.json" >"$OUT/validate_cuda_$dtype.txt" 2>&1
    summary "validate $dtype (exit $?): $(grep -E "PASSED|FAILED" "$OUT/validate_cuda_$dtype.txt" | tail -1) at ${SECONDS} s"
done
