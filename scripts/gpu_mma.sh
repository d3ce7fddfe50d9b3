#!/usr/bin/env bash
# Issue 25 on one GPU machine in one call: the MLA verify kernel built two ways, a library
# without sm_90a (sm_90,compute_90: the mma.sync path every non-Hopper GPU takes) and the
# default fat binary (build.py: sm_80, sm_90a, sm_120, compute_80), each checked by the GPU
# tests of tests/kernels (MLA, paged KV, tree kernels, sampling, build, peers); planted bugs
# that those tests must catch; compute-sanitizer on small mma.sync cases; then the benchmark
# grid: the no-sm_90a build beside SGLang's Triton extend and decode kernels, and the fat build's
# wgmma, mma.sync and 100 KB-tile kernels in the same call. Run from the checkout root with
# .peers/ there (scripts/fetch_peers.sh):
#
#   PYTHONPATH=. bash scripts/gpu_mma.sh [all|tests|bench|profile]
#
# Every stage gets at most what is left of DEADLINE seconds (default 420) and its own cap.
# Under $OUT (default ./out): build.log (both builds, SASS counts), tests.log (both test runs,
# planted bugs, sanitizer), mla_noa.json, mla_fat.json (benchmark rows), mla-tables.md (the
# tables, SM clocks during the benchmark, a variant timed beside the kernel: group 1 not held
# half a tile behind group 0), variant.json, ncu.txt (one mma.sync launch, `profile` stage).
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"
DEADLINE="${DEADLINE:-420}"
SUBSET="ctx32768-tree128-b8 or ctx8192-tree16-b8 or ctx32768-tree64-b32 or ctx1024-tree128-b1 or ctx1024-tree64-b8 or ctx32768-tree1-b8 or ctx8192-tree128-b1"
LOG="$OUT/build.log"

echo "== build (no sm_90a, and the default fat binary, side by side)"
build_both
for name in noa fat; do
    lib=$([[ $name == noa ]] && echo "$LIB_NOA" || echo "$LIB_FAT")
    { echo "-- $name: $lib"; grep -B1 -A3 "mla_k2_mma" "/tmp/build-$name.log" | grep -E "registers|spill" | sort | uniq -c
      grep -B4 "^/.*\.so$" "/tmp/build-$name.log" | grep -E "^ +(sm|compute)_"; } | tee -a "$LOG"
    [[ -f "$lib" ]] || { tail -20 "/tmp/build-$name.log"; exit 1; }
    cuobjdump -sass "$lib" >"/tmp/$name.sass" 2>&1
    echo "$name SASS: $(grep -c HGMMA "/tmp/$name.sass") HGMMA, $(grep -c "HMMA.16816" "/tmp/$name.sass") HMMA.16816," \
         "$(grep -cE "LDL|STL" "/tmp/$name.sass") local-memory instructions" | tee -a "$LOG"
done
echo "build done at ${SECONDS}s"

# Planted bugs, each a copy of the sources with one change, built (no sm_90a unless named) while the tests run.
PLANT=/tmp/kdtree_plant
plant_build() {  # plant_build NAME ARCHS FILE OLD NEW
    local dir="$PLANT/$1"
    mkdir -p "$dir/kernels_cuda"
    cp -r kernels_cuda/*.py kernels_cuda/csrc "$dir/kernels_cuda/"
    python3 - "$dir/kernels_cuda/csrc/$3" "$4" "$5" <<'PY' || return 1
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"plant: {old!r} is not once in {path}"
open(path, "w").write(text.replace(old, new))
PY
    (cd "$dir" && KDTREE_CUDA_ARCHS=$2 KDTREE_CACHE_DIR="$dir/cache" python3 -m kernels_cuda.build >"$dir/build.log" 2>&1)
}

if want tests; then
    echo "== tests: both builds side by side, compute-sanitizer beside them, planted bugs building"
    mkdir -p "$PLANT"
    plant_build mma-no-zero-fill sm_90 mla_mma.cu "const bool valid = slot < key_end;" "const bool valid = true;" &
    plant_build mma-one-slice sm_90 mla_mma.cu "for (int d = 1; d < 4; ++d) {" "for (int d = 1; d < 3; ++d) {" &
    plant_build no-wgmma-dispatch sm_90a mla_verify.cu "if (major == 9 && minor == 0 && wgmma_built()) return 2;" \
        "if (major == 9 && minor == 0 && !wgmma_built()) return 2;" &
    plant_build mma-one-vis-word sm_90 mla_mma.cu "((base >> 5) + 1 < p.vis_words ? (uint64_t)word[1] << 32 : 0ull)" \
        "0ull" &
    plant_build variant-no-stagger sm_90 mla_mma.cu "const bool stagger = stages >= 4;" "const bool stagger = false;" &
    cat >/tmp/mma_small.py <<'PY'
import torch
from kernels_cuda.mla_ops import pack_visibility
# mma.sync, both tile plans: 3 splits of 32 keys, 1 of 96, then paged (page 3, shuffled, 2 splits of 64)
ctx, n = 77, 9
vis = pack_visibility(torch.ones(n, n, dtype=torch.bool).tril()).cuda()
g = torch.Generator(device="cuda").manual_seed(0)
i = lambda *v: torch.tensor(v, dtype=torch.int32, device="cuda")
r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
o = torch.empty(n, 64, 512, dtype=torch.bfloat16, device="cuda"); lse = torch.empty(n, 64, device="cuda")
for kernel in ("mma", "mma_100k"):
    for splits, keys in ((3, 32), (1, 96)):
        torch.ops.kdtree.mla_verify_out(r(n, 64, 512), r(n, 64, 64), r(ctx + n + 5, 512), r(ctx + n + 5, 64), i(ctx),
                                        i(n), i(0, n), i(5), vis, 0.1, n, splits, keys, kernel, o, lse)
    pages = -(-(ctx + n) // 3) + 2
    table = torch.randperm(pages, device="cuda")[:pages - 2].to(torch.int32)[None]
    torch.ops.kdtree.mla_verify_out(r(n, 64, 512), r(n, 64, 64), r(pages, 3, 512), r(pages, 3, 64), i(ctx), i(n),
                                    i(0, n), None, vis, 0.1, n, 2, 64, kernel, o, lse, table)
torch.cuda.synchronize()
assert not o.isnan().any()
print("small cases ran")
PY
    cap="$(left 170)"
    for tool in memcheck racecheck; do
        (KDTREE_KERNELS_LIB="$LIB_NOA" PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool "$tool" \
            --kernel-name kns=mla python3 /tmp/mma_small.py >"/tmp/sanitize-$tool.log" 2>&1
         echo "exit $?" >>"/tmp/sanitize-$tool.log") &
    done
    KDTREE_KERNELS_LIB="$LIB_NOA" KDTREE_CUDA_ARCHS=$NOA_ARCHS timeout "$cap" python3 -m pytest tests/kernels -q -rfs \
        -p no:cacheprovider --durations=5 >/tmp/tests-noa.log 2>&1 &
    KDTREE_KERNELS_LIB="$LIB_FAT" timeout "$cap" python3 -m pytest tests/kernels -q -rfs -p no:cacheprovider \
        --durations=5 >/tmp/tests-fat.log 2>&1 &
    wait
    for name in noa fat; do
        { echo "-- tests with the $name library"; grep -E "^(FAILED|ERROR)" "/tmp/tests-$name.log" | head -20
          tail -1 "/tmp/tests-$name.log"; } | tee -a "$OUT/tests.log"
    done
    for tool in memcheck racecheck; do
        echo "-- $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small cases|^exit" "/tmp/sanitize-$tool.log" | tr '\n' ' ')" \
            | tee -a "$OUT/tests.log"
        grep -m3 -E "Invalid|Race|hazard" "/tmp/sanitize-$tool.log" | tee -a "$OUT/tests.log"
    done
    echo "== planted bugs (each must make its tests fail)"
    plant_run() {  # plant_run NAME ARCHS TEST_SELECTION... (in the background, side by side)
        local name=$1 archs=$2; shift 2
        local lib="$(tail -1 "$PLANT/$name/build.log")"
        if [[ ! -f "$lib" ]]; then echo "$name: not built: $(grep -m1 error "$PLANT/$name/build.log")" >"$PLANT/$name.out"; return; fi
        echo "$name: $(KDTREE_KERNELS_LIB="$lib" KDTREE_CUDA_ARCHS=$archs timeout "$(left 40)" python3 -m pytest -q \
            -p no:cacheprovider "$@" 2>&1 | tail -1)" >"$PLANT/$name.out"
    }
    plant_run mma-no-zero-fill sm_90 tests/kernels/test_mla_verify.py -k "never_leak and mma" &
    plant_run mma-one-slice sm_90 tests/kernels/test_mla_verify.py -k "matches_reference and kimi-k2-bfloat16-mma" &
    plant_run no-wgmma-dispatch sm_90a tests/kernels/test_mla_verify.py -k "device_takes" &
    plant_run mma-one-vis-word sm_90 tests/kernels/test_mla_verify.py -k "matches_reference and fully_visible and mma" &
    wait
    cat "$PLANT"/mma-*.out "$PLANT"/no-*.out | tee -a "$OUT/tests.log"
    cat /tmp/tests-noa.log /tmp/tests-fat.log /tmp/sanitize-*.log >>"$OUT/tests.log"
fi

if want bench; then
    echo "== benchmarks: the no-sm_90a build beside SGLang (tests/kernels/test_bench_mla.py, contiguous grid)"
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 250 >/tmp/clocks.csv &
    smi=$!
    KDTREE_KERNELS_LIB="$LIB_NOA" KDTREE_BENCH=1 KDTREE_BENCH_KERNEL_ONLY=1 KDTREE_BENCH_OUT="$OUT/mla_noa.json" \
        timeout "$(left 150)" python3 -m pytest tests/kernels/test_bench_mla.py -k "k2" -q -p no:cacheprovider \
        >/tmp/bench-noa.log 2>&1
    tail -1 /tmp/bench-noa.log
    kill "$smi"
    variant="$(tail -1 "$PLANT/variant-no-stagger/build.log" 2>/dev/null)"
    if [[ -f "$variant" ]]; then
        echo "== variant beside the kernel (no stagger), same cases"
        for lib in "$variant" "$LIB_NOA"; do
            KDTREE_KERNELS_LIB="$lib" KDTREE_BENCH=1 KDTREE_BENCH_KERNEL_ONLY=1 KDTREE_BENCH_PEERS=0 \
                KDTREE_BENCH_OUT="/tmp/variant-$([[ $lib == "$variant" ]] && echo v || echo k).json" \
                timeout "$(left 30)" python3 -m pytest tests/kernels/test_bench_mla.py -k "k2 and ($SUBSET)" -q \
                -p no:cacheprovider >/dev/null 2>&1
        done
        python3 -c "import json; json.dump({'variant': json.load(open('/tmp/variant-v.json')), 'kernel': json.load(open('/tmp/variant-k.json'))}, open('$OUT/variant.json', 'w'))"
    fi
    echo "== benchmarks: the fat build, wgmma with mma and mma_100k beside it; paged KV"
    KDTREE_KERNELS_LIB="$LIB_FAT" KDTREE_BENCH=1 KDTREE_BENCH_KERNEL_ONLY=1 KDTREE_BENCH_PEERS=0 \
        KDTREE_BENCH_ALSO=mma,mma_100k KDTREE_BENCH_OUT="$OUT/mla_fat.json" timeout "$(left 100)" \
        python3 -m pytest tests/kernels/test_bench_mla.py -q -p no:cacheprovider >/tmp/bench-fat.log 2>&1
    tail -1 /tmp/bench-fat.log
    python3 - "$OUT/mla_noa.json" "$OUT/mla_fat.json" <<'PY' | tee "$OUT/mla-tables.md"
import datetime, json, os, sys
load = lambda p: json.load(open(p)) if os.path.exists(p) else {"ceilings": {}, "cases": []}
noa, fat = load(sys.argv[1]), load(sys.argv[2])
f = lambda v, d=3: f"{v:.{d}f}" if isinstance(v, float) else "-"
key = lambda r: (r["context"], r["tree"], r["batch"])
peers = {key(r): r for r in noa["cases"]}
for name, d in (("no sm_90a (mma.sync)", noa), ("fat binary", fat)):
    c = d["ceilings"]
    if c:
        print(f"{name}: {c['gpu']}, {datetime.date.today()}, copy {c['copy_TBps']:.2f} TB/s, bf16 {c['bf16_TFLOPs']:.0f} TFLOP/s")
print("\n| ctx | tree | batch | mma ms (no sm_90a) | TFLOP/s | % bf16 | % copy | SGLang extend ms | x extend | SGLang decode ms | x decode |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in noa["cases"]:
    print(f"| {r['context']} | {r['tree']} | {r['batch']} | {r['kernel_ms']:.3f} | {r['TFLOPs']:.0f} | {100 * r['mma_fraction']:.1f} | "
          f"{100 * r['bw_fraction']:.1f} | {f(r.get('sglang_extend_ms'))} | {f(r.get('sglang_extend_ratio'), 2)} | "
          f"{f(r.get('sglang_decode_ms'))} | {f(r.get('sglang_decode_ratio'), 2)} |")
print("\n| ctx | tree | batch | wgmma ms | % bf16 | x SGLang extend | x SGLang decode | mma ms (fat) | mma_100k ms | mma_100k / mma |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in fat["cases"]:
    p = peers.get(key(r), {})
    ext, dec = p.get("sglang_extend_ms"), p.get("sglang_decode_ms")
    mma, small = r.get("mma_ms"), r.get("mma_100k_ms")
    print(f"| {r['context']} | {r['tree']} | {r['batch']} | {r['kernel_ms']:.3f} | {100 * r['mma_fraction']:.1f} | "
          f"{f(ext / r['kernel_ms'] if ext else None, 2)} | {f(dec / r['kernel_ms'] if dec else None, 2)} | {f(mma)} | "
          f"{f(small)} | {f(small / mma if isinstance(small, float) and isinstance(mma, float) else None, 2)} |")
if fat.get("paged"):
    print("\n| ctx | tree | batch | page | kernel | paged ms | contiguous ms | paged / contiguous | contiguous wgmma ms | bits |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for r in fat["paged"]:
        print(f"| {r['context']} | {r['tree']} | {r['batch']} | {r['page_size']} | {r['path']} | {r['paged_ms']:.3f} | "
              f"{r['contiguous_ms']:.3f} | {r['ratio']:.2f} | {f(r.get('contiguous_auto_ms'))} | "
              f"{'equal' if r['bitwise_equal'] else 'DIFFER'} |")
rows = noa["cases"]
ext = [r["sglang_extend_ratio"] for r in rows if "sglang_extend_ratio" in r]
dec = [r["sglang_decode_ratio"] for r in rows if "sglang_decode_ratio" in r]
mid = [r["sglang_extend_ratio"] for r in rows if "sglang_extend_ratio" in r and 16 <= r["tree"] <= 128]
rate = [r["mma_fraction"] for r in rows if r["context"] >= 8192 and r["tree"] >= 16]
clocks = [float(l.split(",")[0]) for l in open("/tmp/clocks.csv") if l.strip()] if os.path.exists("/tmp/clocks.csv") else []
power = [float(l.split(",")[1]) for l in open("/tmp/clocks.csv") if l.strip()] if clocks else []
if clocks:
    s = sorted(clocks)
    print(f"\nSM clock during the no-sm_90a benchmark ({len(s)} samples of 250 ms): min {s[0]:.0f}, median "
          f"{s[len(s) // 2]:.0f}, max {s[-1]:.0f} MHz; power max {max(power):.0f} W")
if os.path.exists(os.path.join(os.path.dirname(sys.argv[1]), "variant.json")):
    v = json.load(open(os.path.join(os.path.dirname(sys.argv[1]), "variant.json")))
    ref = {key(r): r["kernel_ms"] for r in v["kernel"]["cases"]}
    print("\n| ctx | tree | batch | mma ms | no-stagger variant ms | variant / mma |\n|---:|---:|---:|---:|---:|---:|")
    for r in v["variant"]["cases"]:
        k = ref.get(key(r))
        print(f"| {r['context']} | {r['tree']} | {r['batch']} | {f(k)} | {r['kernel_ms']:.3f} | "
              f"{f(r['kernel_ms'] / k if k else None, 3)} |")
print(f"\ntargets (no sm_90a): x SGLang extend min {f(min(ext, default=None), 2)} (>= 1), at 16-128 tokens min "
      f"{f(min(mid, default=None), 2)} (>= 3); x SGLang decode min {f(min(dec, default=None), 2)} (>= 1); "
      f"% bf16 at ctx >= 8k, 16+ tokens min {f(100 * min(rate) if rate else None, 1)} (>= 40)")
PY
fi
if want profile; then
    echo "== ncu: one mma.sync launch (ctx 32k, 64 tree tokens, batch 8), then one wgmma launch"
    cat >/tmp/one_case.py <<'PY'
import sys
sys.path[:0] = ["tests", "tests/kernels"]
from test_bench_mla import make_inputs
from kernels_cuda.mla_ops import mla_verify
x = make_inputs(32768, 64, 8, seed=1)
args = {k: v for k, v in x.items() if k != "dense"}
for kernel in ("mma", "mma", sys.argv[1]):
    mla_verify(**args, max_tree=64, max_kv=32768 + 64, kernel=kernel)
PY
    for kernel in mma wgmma; do
        KDTREE_KERNELS_LIB="$LIB_FAT" timeout "$(left 45)" ncu --clock-control none --kernel-name "regex:mla_k2_$kernel" \
            --launch-skip $([[ $kernel == mma ]] && echo 1 || echo 0) --launch-count 1 --section SpeedOfLight \
            --section WarpStateStats --section ComputeWorkloadAnalysis --metrics \
            sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
            python3 /tmp/one_case.py "$kernel" >>"$OUT/ncu.txt" 2>&1
    done
    grep -E "Duration|SM Frequency|Tensor|hmma|Issued Ipc|Stall|wavefronts|bank_conflicts|per_second|Throughput" "$OUT/ncu.txt" | head -40
fi
echo "== done in ${SECONDS}s"
