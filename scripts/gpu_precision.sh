#!/usr/bin/env bash
# The bf16 track on the GPU in one call: `kdtree validate --dtype bfloat16 --device cuda` (the torch
# engine in bf16 with the CUDA stages and attention kernels when they load, judged in the bf16
# regime) and the divergence finder on the engine benchmark's k2-mid model in bf16 on CUDA (AR
# decode against a chunk of 16 rows, the first DDTree round's tree, a batch of 8, and the chunk
# again in batch-invariant mode, where it must find no divergence).
# Run from the checkout root:
#
#   PYTHONPATH=. bash scripts/gpu_precision.sh [all|validate|diverge]
#
# Writes under $OUT (default ./out): gpu.txt, build.log, validate_bf16_cuda.txt / .json and
# diverge_k2mid_{chunk,tree,batch,chunk-invariant}.txt / .json. Look for each diverge file's
# "first divergence" line (op, layer, ulps, M of both calls) and the greedy choices that differ with
# their margins; chunk-invariant must say "no divergence".
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"

echo "== build kernels"
build_kernels

if [[ "$stage" == all || "$stage" == validate ]]; then
echo "== validate --dtype bfloat16 --device cuda"
# engine.validate needs neither click nor rich (the device may lack them): call it directly.
timeout 400 python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/validate_bf16_cuda.txt"
import sys
from engine.validate import validate, write_json
report = validate(device="cuda", log=print, dtype="bfloat16")
for c in report.checks:
    print(f"{c.section:32s} {c.name:38s} {c.status.value:17s} "
          f"{'' if c.error is None else f'{c.error:.2e}':>9s} {'' if c.tolerance is None else f'{c.tolerance:.2e}':>9s} "
          f"[{c.regime}] {c.detail}")
print("backends:", report.backends)
print(report.summary())
write_json(report, f"{sys.argv[1]}/validate_bf16_cuda.json")
PY
fi
[[ "$stage" == all || "$stage" == diverge ]] || exit 0

for run in chunk tree batch chunk-invariant; do
way="${run%-invariant}"
echo "== diverge --config k2-mid --dtype bfloat16 --device cuda: $run"
timeout 400 python3 - "$OUT" "$way" "$run" <<'PY' 2>&1 | tee "$OUT/diverge_k2mid_$run.txt"
import sys
from engine.adapter import TorchAdapter
from engine.diverge_run import from_config, run
from engine.validate import write_json
out, way, name = sys.argv[1:4]
adapter = TorchAdapter("cuda", invariant=name.endswith("invariant"))
adapter.set_dtype("bfloat16")
subject = from_config("k2-mid", adapter, seed=0, prompt_length=64, prompt_seed=1)
a, b, divergence = run(subject, way, 16, batch=8)
print(f"{subject.label}; {a.label} vs {b.label}; backends {adapter.backends}")
print("\n".join(divergence.explanation))
for p in [p for p in divergence.points if p.tokens][:24]:
    print(f"  layer {p.layer} {p.point}: {len(p.tokens)} tokens, {p.values}/{p.size} values, "
          f"max {p.max_ulps} ulp{' (cause)' if p.inputs_agree else ''}")
write_json(divergence, f"{out}/diverge_k2mid_{name}.json")
PY
done
