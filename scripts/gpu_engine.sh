#!/usr/bin/env bash
# The engine's GPU part in one call: `kdtree validate --device cuda` (the torch engine with the
# CUDA stages and attention kernels when they load) and the end-to-end engine benchmarks
# (k2-mid, bf16, batch 1 and 8, oracle and layerskip drafters; AR vs DDTree side by side).
# Run from the checkout root:
#
#   PYTHONPATH=. bash scripts/gpu_engine.sh [all|validate|bench]
#
# Writes under $OUT (default ./out): gpu.txt, build.log, validate_cuda.txt, validate_cuda.json,
# engine_bench.log, engine_bench.json (pytest-benchmark) and engine_bench.md (the table).
# Wheels in .whl/ are installed by scripts/gpu_env.sh.
# KDTREE_BENCH=1 decodes 256 tokens a request instead of 64.
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"

echo "== build kernels"
build_kernels

if [[ "$stage" == all || "$stage" == validate ]]; then
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

if [[ "$stage" == all || "$stage" == bench ]]; then
echo "== engine benchmarks"
timeout 420 python3 -m pytest tests/engine/test_bench_engine.py -k gpu -p no:cacheprovider -q -rs \
    --benchmark-enable --benchmark-json "$OUT/engine_bench.json" >"$OUT/engine_bench.log" 2>&1
tail -5 "$OUT/engine_bench.log"
python3 - "$OUT" <<'PY' | tee "$OUT/engine_bench.md"
import json, sys
data = json.load(open(f"{sys.argv[1]}/engine_bench.json"))
print("| config | dtype | drafter | batch | AR tok/s | DDTree tok/s | speedup | tau | speedup / tau (target >= 0.8) | "
      "target forwards AR / DDTree | DDTree ms per stage |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for b in data["benchmarks"]:
    e = b["extra_info"]
    stages = ", ".join(f"{k} {v:.0f}" for k, v in e["ddtree_stage_ms"].items() if v)
    verdict = "met" if e["speedup_over_tau"] >= 0.8 else "not met"
    print(f"| {e['config']} | {e['dtype']} | {e['drafter']} | {e['batch']} | {e['ar_tokens_per_s']:.0f} | "
          f"{e['ddtree_tokens_per_s']:.0f} | {e['speedup']:.2f} | {e['tau']:.2f} | "
          f"{e['speedup_over_tau']:.2f} ({verdict}) | {e['ar_target_forwards']} / {e['ddtree_target_forwards']} | "
          f"{stages} |")
if data["benchmarks"]:
    e = data["benchmarks"][0]["extra_info"]
    print(f"\nGPU: {e['gpu']}; backends: {e['backends']}; tokens match AR: "
          f"{[b['extra_info']['tokens_match'] for b in data['benchmarks']]}")
PY
fi
