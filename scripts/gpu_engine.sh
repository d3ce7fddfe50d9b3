#!/usr/bin/env bash
# The engine's GPU part in one call. Run from the checkout root:
#
#   KDTREE_COMMIT=<hash> PYTHONPATH=. bash scripts/gpu_engine.sh [all|tests|bench|validate]
#
# Stages (all = tests, then bench; each has its own time limit, and a failing stage does not
# stop the next; their limits add to more than the device tool's 600 s a call: run them as two
# calls there):
#   tests     the GPU tests of the forward: CUDA graphs (replay bitwise equal to eager, no host
#             sync, graphed decoding), invariant mode on CUDA, the verify kernel's invariant plan,
#             the model's CUDA variants, the paged cache, the fused layers and their invariant
#             form (at most 400 s)
#                                                 -> gpu_tests.log
#   bench     tests/engine/test_bench_engine.py -k gpu: ceilings, AR and verify steps against
#             their floors, the oracle accuracy sweep (tests/engine_bench.Plan: work not begun
#             within Plan.seconds, 300, is recorded as skipped; the JSON is rewritten after every
#             point, so a run cut short keeps its figures), then the table and the plot
#                                                 -> engine_bench.log, engine-gpu-h200.{json,md,png}
#   validate  `kdtree validate --device cuda` (not in all: about 3 minutes) -> validate_cuda.{txt,json}
#
# The paged-KV cycle (its tests, validate on a paged cache, the paged-vs-contiguous benchmark)
# is scripts/gpu_paged.sh. Also under $OUT (default ./out): gpu.txt, build.log. KDTREE_BENCH=1 decodes 256 tokens a request
# instead of 96 (longer); KDTREE_BENCH=quick sweeps three accuracies (0.4, 0.82, 0.97), one (0.97) at the
# side budgets (about half the DDTree time, for a call that also runs the tests). A kernels library named by $KDTREE_KERNELS_LIB is used as it is.
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"
export KDTREE_COMMIT="${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

echo "== build kernels"
build_kernels

if [[ "$stage" == all || "$stage" == tests ]]; then
    echo "== GPU tests (graphs, invariant mode, the model's CUDA variants)"
    timeout 400 python3 -m pytest tests/engine/test_graphs.py tests/engine/test_invariant.py tests/engine/test_model.py \
        tests/engine/test_paged.py tests/engine/test_fused.py tests/engine/test_fused_attention.py \
        -k "cuda or graph or replay or host or mla_invariant or fused" -p no:cacheprovider -q -rfs --durations=10 \
        >"$OUT/gpu_tests.log" 2>&1
    echo "exit $?"
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi

if [[ "$stage" == all || "$stage" == bench ]]; then
    echo "== engine benchmark (k2-mid)"
    KDTREE_BENCH_OUT="$OUT/engine-gpu-h200.json" timeout 420 python3 -m pytest tests/engine/test_bench_engine.py \
        -k gpu -p no:cacheprovider -q -rs -s >"$OUT/engine_bench.log" 2>&1
    echo "exit $?"
    tail -3 "$OUT/engine_bench.log"
    if [[ -s "$OUT/engine-gpu-h200.json" ]]; then
        python3 tests/engine_report.py "$OUT/engine-gpu-h200.json" "$OUT/engine-gpu-h200" | sed -n '/^## Targets/,/^## Steps/p'
    fi
fi

if [[ "$stage" == validate ]]; then
    echo "== validate --device cuda"
    # engine.validate needs neither click nor rich (the device may lack them): call it directly.
    timeout 240 python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/validate_cuda.txt"
import sys
from engine.validate import validate, write_json
report = validate(device="cuda", log=print)
for c in report.checks:
    print(f"{c.section:32s} {c.name:38s} {c.status.value:17s} "
          f"{'' if c.error is None else f'{c.error:.2e}':>9s} {'' if c.tolerance is None else f'{c.tolerance:.2e}':>9s} {c.detail}")
print("backends:", report.backends)
print(report.summary())
write_json(report, f"{sys.argv[1]}/validate_cuda.json")
PY
fi
