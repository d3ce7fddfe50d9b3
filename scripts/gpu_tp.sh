#!/usr/bin/env bash
# Tensor parallelism on the GPUs (docs/tensor-parallel.md). Run from the checkout root:
#
#   KDTREE_COMMIT=<hash> OUT=out PYTHONPATH=. bash scripts/gpu_tp.sh
#
#   tests     tests/engine/test_parallel.py -k nccl: NCCL at world size 1 against one device, and
#             `validate --tp 2 --device cuda` where 2 GPUs are visible      -> tp_tests.log
#   then, for N = 1, 2, 4, 8 up to the visible GPUs:
#   validate  torchrun --nproc-per-node N -m engine validate --tp N --device cuda -> validate_tp-N.{txt,json}
#   bench     torchrun --nproc-per-node N scripts/tp_bench.py: AR and verify steps of kimi-k2 (K2's
#             attention dims) and k2-mid, time in the collectives against the all-reduce's bus
#             bandwidth measured in the same run                            -> tp-N.{md,json}
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export KDTREE_COMMIT="${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
gpus=$(nvidia-smi -L | wc -l)

echo "== build kernels"
build_kernels

echo "== NCCL tests ($gpus GPU(s))"
timeout 300 python3 -m pytest tests/engine/test_parallel.py -k nccl -p no:cacheprovider -q -rs >"$OUT/tp_tests.log" 2>&1
echo "exit $?"
tail -3 "$OUT/tp_tests.log"

for n in 1 2 4 8; do
    [[ $n -le $gpus ]] || break
    echo "== validate --tp $n"
    timeout 600 torchrun --nproc-per-node "$n" -m engine validate --tp "$n" --device cuda \
        --json "$OUT/validate_tp-$n.json" >"$OUT/validate_tp-$n.txt" 2>&1
    echo "exit $?"
    tail -1 "$OUT/validate_tp-$n.txt"
    echo "== tp_bench --tp $n"
    timeout 600 torchrun --nproc-per-node "$n" scripts/tp_bench.py --out "$OUT" >"$OUT/tp_bench-$n.log" 2>&1
    echo "exit $?"
    cat "$OUT/tp-$n.md" 2>/dev/null || tail -5 "$OUT/tp_bench-$n.log"
done
