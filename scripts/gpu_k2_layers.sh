#!/usr/bin/env bash
# One MLA layer and one MoE layer of the torch engine at full Kimi K2 dims in bf16, on the GPU: time,
# peak memory and the fraction of the same run's ceilings (docs/scale_up_k2.md). Run from the checkout root:
#
#   PYTHONPATH=. [K2_SELECT="pytest -k expression"] [K2_TIMEOUT=480] bash scripts/gpu_k2_layers.sh
#
# Writes under $OUT (default ./out): gpu.txt, build.log, k2_layers.log, k2_layers.json (pytest-benchmark;
# each case's numbers in extra_info) and k2_layers.md (the table for docs/scale_up_k2.md). Needs about
# 48 GiB of GPU memory; the CUDA attention cases run only when the kernels build.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

echo "== build kernels"
build_kernels || echo "kernels unavailable: only the torch attention cases run"

echo "== K2 layer benchmarks"
timeout "${K2_TIMEOUT:-480}" python3 -m pytest tests/engine/test_bench_k2_layers.py -p no:cacheprovider -q -rs \
    ${K2_SELECT:+-k "$K2_SELECT"} --benchmark-enable --benchmark-json "$OUT/k2_layers.json" >"$OUT/k2_layers.log" 2>&1
tail -5 "$OUT/k2_layers.log"
python3 - "$OUT" <<'PY' | tee "$OUT/k2_layers.md"
import json, sys
data = json.load(open(f"{sys.argv[1]}/k2_layers.json"))
rows = sorted((b["extra_info"] for b in data["benchmarks"]),
              key=lambda e: (e["layer"], e["attention"], e["context"], e["tokens"], e["batch"]))
print("| layer | attention | batch | tokens | context | ms | floor ms | fraction of floor | weights GiB | "
      "peak activations GiB | experts touched |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for e in rows:
    print(f"| {e['layer']} | {e['attention']} | {e['batch']} | {e['tokens']} | {e['context']} | {e['ms']:.3f} | "
          f"{e['floor_ms']:.3f} | {e['fraction_of_floor']:.2f} | {e['weight_gib']:.2f} | "
          f"{e['peak_activation_gib']:.3f} | {e.get('experts_touched', '-')} |")
if rows:
    e = rows[0]
    print(f"\nGPU: {e['gpu']}; torch {e['torch']}; ceilings measured in the same run: copy "
          f"{e['copy_gb_s']:.0f} GB/s, bf16 matmul {e['bf16_tflop_s']:.0f} TFLOP/s")
PY
