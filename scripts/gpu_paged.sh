#!/usr/bin/env bash
# Paged KV on one GPU machine in one call (docs/paged-kv.md): the kernels' paged tests, the
# engine's paged tests (CUDA graphs and decoding on paged caches, the golden paged cases through
# its stages and attention), `validate` of the built-in engine on a paged cache (the paged_kv
# rows and the tiny model's), and the engine's paged-vs-contiguous forward benchmark.
#
#   PYTHONPATH=. bash scripts/gpu_paged.sh
#
# Under $OUT (default ./out): paged_tests.log, validate_paged.txt, paged_bench.log,
# engine-paged-h200.json. A library named by $KDTREE_KERNELS_LIB is used as it is.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export KDTREE_COMMIT="${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
build_kernels || exit 1

echo "== paged tests (kernels, engine, validate rows)"
timeout 240 python3 -m pytest tests/kernels/test_paged_kv.py tests/engine/test_paged.py tests/engine/test_paged_validate.py \
    tests/engine/test_graphs.py -k "cuda or paged or graph" -q -rfs -p no:cacheprovider >"$OUT/paged_tests.log" 2>&1
echo "exit $?"
grep -E "passed|failed|error" "$OUT/paged_tests.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/paged_tests.log" | head -20

echo "== validate --device cuda --page-size 16 (paged_kv and tiny fixtures)"
timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/validate_paged.txt" | grep -vE "^  (exact|within)"
from engine.validate import validate
for fixture in ("tests/golden/kernels/paged_kv.kdtr", "tests/golden/tiny.kdtr"):
    report = validate(device="cuda", fixtures=fixture, page_size=16)
    for c in report.checks:
        print(f"  {c.status.value:16s} {c.section:28s} {c.name:40s} {c.detail}")
    print(fixture, report.backends, report.summary())
PY

echo "== paged vs contiguous engine steps (k2-mid, bf16)"
KDTREE_PAGED_OUT="$OUT/engine-paged-h200.json" timeout 150 python3 -m pytest tests/engine/test_bench_paged.py \
    -p no:cacheprovider -q -rs -s >"$OUT/paged_bench.log" 2>&1
echo "exit $?"
grep -E "^\{|passed|failed|error" "$OUT/paged_bench.log" | tail -20
