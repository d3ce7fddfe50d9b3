#!/usr/bin/env bash
# An MLA kernel change's whole check in one GPU call (issue 34), most important first, the output
# folder tarred after each stage so that a call stopped at its limit still brings back what ran:
#
#   KDTREE_KERNELS_LIB=new.so KDTREE_KERNELS_LIB_NOA=new-noa.so BASE_LIB=main.so \
#       [PLANT_LIB=plant.so] [PLANT_PYTHONPATH=dir] [PLANT_TEST=-k...] [VARIANT_LIB=name=variant.so] \
#       bash scripts/gpu_mla_change.sh
#
# 1. the kernel tests (tests/kernels/test_mla_verify.py, test_paged_kv.py,
#    tests/engine/test_fused_attention.py) with the change's default build and with its build
#    without sm_90a (KDTREE_CUDA_ARCHS=sm_90,compute_90: the mma.sync path of every other GPU);
# 2. a plant, if named, under the test that should catch it (PLANT_TEST: pytest's -k): a library
#    (PLANT_LIB), or Python modules ahead of the checkout's (PLANT_PYTHONPATH, e.g. a copy of
#    kernels_cuda/ with one change: the dispatch lives in mla_ops.py as well as in the library;
#    `python3 -P`: `-m` would put the checkout ahead of PYTHONPATH, and the plant would not load);
# 3. a variant of the change, if named (VARIANT_LIB, an sm_90a build): its kernel tests;
# 4. scripts/mla_ab.py, one round, BASE_LIB against the change (and the variant) for the one-scorer
#    kernel, auto's on Hopper (with FlashMLA's chains, and FlashInfer's where built), the seesaw
#    and mma.sync;
# 5. scripts/gpu_peers_mla.sh bench: the issue's table;
# 6. scripts/gpu_mla.sh sanitize, if time is left.
# Everything lands in $OUT/change.tgz. DEADLINE (seconds, default 540) bounds the stages' starts.
# Libraries are built on the CPU machine (python3 -m kernels_cuda.build) and carried compressed
# (the device README's 64 MiB limit): see kernels_cuda/NOTES-mla.md, "Next steps".
set -uo pipefail
cd "$(dirname "$0")/.."
: "${KDTREE_KERNELS_LIB:?names the default build of the change}"
: "${KDTREE_KERNELS_LIB_NOA:?names the build of the change without sm_90a}"
: "${BASE_LIB:?names the library to compare against, e.g. a build of main}"
DEADLINE="${DEADLINE:-540}"
source scripts/gpu_env.sh
export PYTHONPATH="$PYTHONPATH:tests:tests/kernels"
R="$OUT/change"
mkdir -p "$R"
snap() { tar -czf "$OUT/change.tgz" -C "$OUT" change; }
TESTS="tests/kernels/test_mla_verify.py tests/kernels/test_paged_kv.py tests/engine/test_fused_attention.py"

timeout "$(left 150)" python3 -m pytest $TESTS -q -rfs -n 8 -p no:cacheprovider >"$R/tests.txt" 2>&1
echo "tests (default build): $(tail -1 "$R/tests.txt")"
KDTREE_KERNELS_LIB="$KDTREE_KERNELS_LIB_NOA" KDTREE_CUDA_ARCHS=$NOA_ARCHS timeout "$(left 150)" \
    python3 -m pytest $TESTS -q -rfs -n 8 -p no:cacheprovider >"$R/tests-noa.txt" 2>&1
echo "tests (no sm_90a): $(tail -1 "$R/tests-noa.txt")"
if [[ -n "${PLANT_LIB:-}${PLANT_PYTHONPATH:-}" ]]; then
    KDTREE_KERNELS_LIB="${PLANT_LIB:-$KDTREE_KERNELS_LIB}" PYTHONPATH="${PLANT_PYTHONPATH:+$PLANT_PYTHONPATH:}$PYTHONPATH" \
        timeout "$(left 60)" python3 -P -m pytest $TESTS ${PLANT_TEST:-} -q -p no:cacheprovider >"$R/plant.txt" 2>&1
    echo "plant (should fail): $(tail -1 "$R/plant.txt")"
fi
if [[ -n "${VARIANT_LIB:-}" ]]; then
    KDTREE_KERNELS_LIB="${VARIANT_LIB#*=}" timeout "$(left 80)" python3 -m pytest tests/kernels/test_mla_verify.py \
        tests/kernels/test_paged_kv.py -q -rfs -n 8 -p no:cacheprovider >"$R/tests-variant.txt" 2>&1
    echo "tests (variant ${VARIANT_LIB%%=*}): $(tail -1 "$R/tests-variant.txt")"
fi
snap

for kernel in wgmma wgmma_pairs mma; do
    extra=$([[ $kernel == wgmma ]] && echo --flashmla ${VARIANT_LIB:+--lib "$VARIANT_LIB"} \
        $([[ -f .peers/flashinfer_mla/libflashinfer_mla.so ]] && echo --flashinfer))
    timeout "$(left 100)" python3 scripts/mla_ab.py --rounds 1 --kernel $kernel --lib base="$BASE_LIB" \
        --lib new="$KDTREE_KERNELS_LIB" $extra --out "$R/ab-$kernel.json" 2>&1 | tee "$R/ab-$kernel.txt"
done
snap

echo "== peers at ${SECONDS}s"
OUT="$R/peers" DEADLINE=$((DEADLINE - 120 - SECONDS)) bash scripts/gpu_peers_mla.sh bench 2>&1 | tail -16
snap

if ((SECONDS < DEADLINE - 100)); then
    echo "== sanitize at ${SECONDS}s"
    OUT="$R/mla" timeout "$(left 150)" bash scripts/gpu_mla.sh sanitize 2>&1 | tail -8
    rm -f "$R/mla/kernels.sass"
fi
snap
echo "== done in ${SECONDS}s: $OUT/change.tgz"
