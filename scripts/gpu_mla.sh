#!/usr/bin/env bash
# The tree-verify MLA kernel on a GPU machine in one call: build, tests, compute-sanitizer
# (memcheck, racecheck on small cases), benchmarks. Run from the checkout root:
#
#   PYTHONPATH=. bash scripts/gpu_mla.sh [all|tests|sanitize|bench]
#
# Logs go to $OUT (default ./out): build.log, tests.log, sanitizer.log, bench.log,
# mla_bench.json. A library named by $KDTREE_KERNELS_LIB is used as it is (no build).
# Wheels in .whl/ are installed by scripts/gpu_env.sh. Each stage has its own time limit; the last lines printed are the benchmark
# table.
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"

echo "== build"
build_kernels || exit 1
grep -A2 "mla_" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c
if command -v cuobjdump >/dev/null; then   # wgmma shows as HGMMA, mma.sync as HMMA
    cuobjdump -sass "$KDTREE_KERNELS_LIB" >"$OUT/kernels.sass" 2>&1
    echo "SASS: $(grep -c HGMMA "$OUT/kernels.sass") HGMMA, $(grep -c " HMMA" "$OUT/kernels.sass") HMMA," \
         "$(grep -cE "LDL|STL" "$OUT/kernels.sass") local-memory instructions"
fi

if [[ "$stage" == all || "$stage" == tests ]]; then
    echo "== tests"
    timeout 240 python3 -m pytest tests/kernels/test_mla_verify.py tests/kernels/test_paged_kv.py -q -rfs --durations=5 \
        2>&1 | tee "$OUT/tests.log" | tail -25
fi

if [[ "$stage" == all || "$stage" == sanitize ]]; then
    echo "== compute-sanitizer"
    cat >/tmp/mla_small.py <<'EOF'
import math, torch
from kernels_cuda.mla_ops import pack_visibility, tensor_core_kernel
# small cases: tiny dims float32 (generic path) and K2 bf16 (tensor-core path), 3 splits then 1;
# then paged (block table, shuffled pages, 2 spare): K2 bf16 page 16 (tensor cores, 4 boxes a
# chunk; a split of 64 keys and one of 128) and page 1 (CUDA cores). On Hopper the seesaw kernel
# too, forced (it runs only when named): K2 bf16 at context 300 (5 tiles: both key
# slots refilled), splits of 192 and 320 keys, contiguous and in pages of 16.
pairs = ["wgmma_pairs"] if tensor_core_kernel(torch.device("cuda")) == "wgmma" else []
ctx, n = 77, 9
vis = torch.ones(n, n, dtype=torch.bool).tril()
g = torch.Generator(device="cuda").manual_seed(0)
i = lambda *v: torch.tensor(v, dtype=torch.int32, device="cuda")
for heads, lora, rope, dtype in ((4, 64, 16, torch.float32), (64, 512, 64, torch.bfloat16)):
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)
    o = torch.empty(n, heads, lora, dtype=dtype, device="cuda"); lse = torch.empty(n, heads, device="cuda")
    for splits, keys in ((3, 32), (1, 96)):
        torch.ops.kdtree.mla_verify_out(r(n, heads, lora), r(n, heads, rope), r(ctx + n + 5, lora), r(ctx + n + 5, rope),
            i(ctx), i(n), i(0, n), i(5), pack_visibility(vis).cuda(), 0.1, n, splits, keys, "auto", o, lse)
    torch.cuda.synchronize()
    assert not o.isnan().any()
r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
o = torch.empty(n, 64, 512, dtype=torch.bfloat16, device="cuda"); lse = torch.empty(n, 64, device="cuda")
for kernel in pairs:
    for splits, keys in ((2, 192), (1, 320)):
        torch.ops.kdtree.mla_verify_out(r(n, 64, 512), r(n, 64, 64), r(300 + n + 5, 512), r(300 + n + 5, 64),
            i(300), i(n), i(0, n), i(5), pack_visibility(vis).cuda(), 0.1, n, splits, keys, kernel, o, lse)
    torch.cuda.synchronize()
    assert not o.isnan().any()
for page, kernel in [(16, "auto"), (1, "cuda_cores")] + [(16, k) for k in pairs]:
    pages = -(-(ctx + n) // page) + 2
    table = torch.randperm(pages, device="cuda")[:pages - 2].to(torch.int32)[None]
    for splits, keys in ((2, 64), (1, 128)):
        torch.ops.kdtree.mla_verify_out(r(n, 64, 512), r(n, 64, 64), r(pages, page, 512), r(pages, page, 64),
            i(ctx), i(n), i(0, n), None, pack_visibility(vis).cuda(), 0.1, n, splits, keys, kernel, o, lse, table)
    torch.cuda.synchronize()
    assert not o.isnan().any()
print("small cases ran")
EOF
    for tool in memcheck racecheck; do
        echo "-- $tool" | tee -a "$OUT/sanitizer.log"
        # one cudaMalloc per tensor, so that a read past a small tensor (a block table's row) is outside an allocation
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool "$tool" --kernel-name kns=mla \
            python3 /tmp/mla_small.py >>"$OUT/sanitizer.log" 2>&1
        echo "exit $?" | tee -a "$OUT/sanitizer.log"
    done
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small cases|exit|rror" "$OUT/sanitizer.log" | head -20
fi

if [[ "$stage" == all || "$stage" == bench ]]; then
    echo "== benchmarks"
    KDTREE_BENCH=1 KDTREE_BENCH_OUT="$OUT/mla_bench.json" timeout 260 \
        python3 -m pytest tests/kernels/test_bench_mla.py -q -rs >"$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log"
    python3 - "$OUT/mla_bench.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["ceilings"]
print(f"{c['gpu']}: copy {c['copy_TBps']:.2f} TB/s, bf16 mma {c['bf16_TFLOPs']:.0f} TFLOP/s")
print(f"{'ctx':>6} {'tree':>4} {'B':>3} {'ms':>8} {'call':>7} {'floor':>7} {'TB/s':>5} {'%bw':>5} {'TF/s':>6} {'%mma':>5} {'torch':>8} {'x':>6} {'generic':>8} bound")
for r in d["cases"]:
    g = f"{r['generic_ms']:8.3f}" if "generic_ms" in r else " " * 8
    t = f"{r['torch_ms']:8.3f} {r['speedup_vs_torch']:6.1f}" if "torch_ms" in r else " " * 15
    print(f"{r['context']:>6} {r['tree']:>4} {r['batch']:>3} {r['kernel_ms']:8.3f} {r['call_ms']:7.3f} {r['floor_ms']:7.3f} {r['TBps']:5.2f} "
          f"{100 * r['bw_fraction']:5.1f} {r['TFLOPs']:6.1f} {100 * r['mma_fraction']:5.1f} {t} {g} {r['bound']}")
print(f"paged KV: {'ctx':>6} {'tree':>4} {'B':>3} {'page':>4} {'path':>12} {'paged':>8} {'contig':>8} {'ratio':>6} bits")
for r in d.get("paged", []):
    tc = f"  (tensor cores contiguous {r['tensor_core_ms']:.3f})" if "tensor_core_ms" in r else ""
    print(f"          {r['context']:>6} {r['tree']:>4} {r['batch']:>3} {r['page_size']:>4} {r['path']:>12} "
          f"{r['paged_ms']:8.3f} {r['contiguous_ms']:8.3f} {r['ratio']:6.3f} {'equal' if r['bitwise_equal'] else 'DIFFER'}{tc}")
EOF
fi
