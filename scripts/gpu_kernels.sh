#!/usr/bin/env bash
# Kernels v3 (issue 16) on one GPU machine in one call, within about 6 minutes: build, the GPU
# tests of the tree kernels, the sampling kernel and the peers' loader, the benchmarks (top-k
# v3 / v4 side by side with the tree build, sampling, the MLA kernel beside SGLang's kernels),
# compute-sanitizer (memcheck, racecheck) on small cases of the new kernels, and planted bugs
# that the tests must catch. Run from the checkout root, with .peers/ carried
# (scripts/fetch_peers.sh made it):
#
#   PYTHONPATH=. bash scripts/gpu_kernels.sh [all|tests|sanitize|plant|bench]
#
# Every stage gets at most what is left of the DEADLINE seconds (default 400) and its own cap,
# so the last stages shrink rather than the call overrunning; each benchmark rewrites its JSON
# after every case. Under $OUT (default ./out): build.log, tests.log, tree_bench.json,
# mla_bench.json, kernels-bench.md (the tables), sanitizer.log, plant.log, and the benchmarks'
# logs bench_tree.log and bench_mla.log (8 files at most come back).
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"
DEADLINE="${DEADLINE:-400}"

echo "== build"
build_kernels || exit 1
grep -B1 -A3 -E "topk_v4|sample_choices|topk_logprobs" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c

# Planted bugs, each a copy of the tree sources with one change, built in the background while
# the tests run (the MLA source is left out: these libraries serve only the tests named below).
PLANT=/tmp/kdtree_plant
plant_build() {  # plant_build NAME FILE OLD NEW
    local dir="$PLANT/$1"
    mkdir -p "$dir"
    cp kernels_cuda/csrc/*.cuh kernels_cuda/csrc/tree_*.cu "$dir"/
    python3 - "$dir/$2" "$3" "$4" <<'PY' || return 1
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"plant: {old!r} is not once in {path}"
open(path, "w").write(text.replace(old, new))
PY
    nvcc -O3 -std=c++17 -shared -Xcompiler=-fPIC --expt-relaxed-constexpr -cudart=static \
        -gencode=arch=compute_90a,code=sm_90a -I"$dir" "$dir"/tree_*.cu -o "$dir/lib.so" >"$dir/build.log" 2>&1
}
if want plant; then
    rm -rf "$PLANT"
    plant_build sample-ge tree_sample.cu "base_cdf + (exclusive + c[k]) > u" "base_cdf + (exclusive + c[k]) >= u" &
    plant_build sample-no-guard tree_sample.cu "if (p[k] > 0.0) {" "if (true) {" &
    plant_build topk-no-tie-check tree_topk_v4.cu \
        "const bool exact = bound == kMinKey || log_prob(key_value(bound - 1), lse) < lp_k;" "const bool exact = true;" &
    plant_build topk-first-bound tree_topk_v4.cu \
        "bound = max(bound, ws.bound[static_cast<size_t>(row) * splits + s]);" \
        "bound = s == 0 ? ws.bound[static_cast<size_t>(row) * splits] : bound;" &
fi

if want tests; then
    echo "== tests"
    timeout "$(left 100)" python3 -m pytest tests/kernels/test_sample_kernel.py tests/kernels/test_tree_kernels.py \
        tests/kernels/test_build.py tests/kernels/peers -q -rfs --durations=8 -p no:cacheprovider --maxfail=25 \
        2>&1 | tee "$OUT/tests.log" | tail -25
fi

if want bench; then
    echo "== benchmarks: tree build (top-k v3 / v4) and sampling"
    KDTREE_BENCH=1 KDTREE_BENCH_BASELINES=0 KDTREE_BENCH_BUDGET_MS=60 KDTREE_BENCH_OUT="$OUT/tree_bench.json" timeout "$(left 45)" \
        python3 -m pytest tests/kernels/test_bench_tree.py -q -rs -p no:cacheprovider >"$OUT/bench_tree.log" 2>&1
    tail -3 "$OUT/bench_tree.log"
    echo "== benchmarks: MLA with the peers"
    KDTREE_BENCH=1 KDTREE_BENCH_KERNEL_ONLY=1 KDTREE_BENCH_OUT="$OUT/mla_bench.json" timeout "$(left 100)" \
        python3 -m pytest tests/kernels/test_bench_mla.py -q -rs -p no:cacheprovider >"$OUT/bench_mla.log" 2>&1
    tail -3 "$OUT/bench_mla.log"
    python3 - "$OUT" <<'PY'
import datetime, json, os, sys
out = sys.argv[1]
f = lambda v, d=3: f"{v:.{d}f}" if isinstance(v, float) else ("n/a" if v is None else str(v))
lines = []
if os.path.exists(f"{out}/tree_bench.json"):
    d = json.load(open(f"{out}/tree_bench.json"))
    c = d["ceilings"]
    lines += [f"## Tree build and top-k v3 / v4 ({c['gpu']}, {datetime.date.today()}, copy {c['copy_TBps']:.2f} TB/s)", "",
              "| batch | budget | logits | floor ms | top-k v3 | v4 | v4 x floor | v3 x floor | v4 speedup | build | chain v4 | chain x floor | v4 == v3 |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["cases"]:
        lines.append(f"| {r['batch']} | {r['budget']} | {r['dtype']} | {r['floor_ms']:.4f} | {f(r['topk_v3_graph_ms'])} | "
                     f"{f(r['topk_graph_ms'])} | {f(r.get('topk_floor_multiple'), 2)} | {f(r.get('topk_v3_floor_multiple'), 2)} | "
                     f"{f(r.get('topk_speedup_v4'), 2)} | {f(r['build_graph_ms'])} | {f(r['kernel_graph_ms'])} | "
                     f"{f(r.get('graph_floor_multiple'), 2)} | {r['v4_same_as_v3']} |")
    lines += ["", "| batch | nodes | logits | floor ms | sample ms | x floor | ns / logit | torch ms | speedup | same as torch |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in d.get("sample_cases", []):
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['dtype']} | {r['floor_ms']:.4f} | {f(r['kernel_graph_ms'])} | "
                     f"{f(r.get('graph_floor_multiple'), 2)} | {f(r.get('ns_per_logit'), 4)} | {f(r.get('torch_ms'), 2)} | "
                     f"{f(r.get('speedup_vs_torch'), 1)} | {r.get('same_as_torch', 'not run')} |")
if os.path.exists(f"{out}/mla_bench.json"):
    d = json.load(open(f"{out}/mla_bench.json"))
    c = d["ceilings"]
    lines += ["", f"## MLA tree verify beside SGLang ({c['gpu']}, copy {c['copy_TBps']:.2f} TB/s, bf16 {c['bf16_TFLOPs']:.0f} TFLOP/s)", "",
              "| ctx | tree | batch | ours ms | %bw | %mma | SGLang extend ms | x | err | SGLang decode ms | x | err |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["cases"]:
        peer = lambda n: (f(r.get(f"{n}_ms")), f(r.get(f"{n}_ratio"), 1), f(r.get(f"{n}_error"), 4)) if f"{n}_ms" in r \
            else ((f"void: {r[n + '_void']}"[:60], "", "") if f"{n}_void" in r else ("", "", ""))
        e, dd = peer("sglang_extend"), peer("sglang_decode")
        lines.append(f"| {r['context']} | {r['tree']} | {r['batch']} | {r['kernel_ms']:.3f} | {100 * r['bw_fraction']:.1f} | "
                     f"{100 * r['mma_fraction']:.1f} | {e[0]} | {e[1]} | {e[2]} | {dd[0]} | {dd[1]} | {dd[2]} |")
    if d["cases"] and "peers_void" in d["cases"][0]:
        lines.append(f"peers: {d['cases'][0]['peers_void']}")
open(f"{out}/kernels-bench.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
fi
if want sanitize; then
    echo "== compute-sanitizer (new kernels: sample_choices, top-k v4 row / split / merge / v3 fallback)"
    cat >/tmp/kernels_small.py <<'PY'
import numpy as np, torch
from kernels_cuda import tree_ops
g = torch.Generator(device="cuda").manual_seed(0)
u = lambda *s: torch.rand(*s, generator=g, device="cuda", dtype=torch.float64)
for logits in (torch.randn(2, 3, 3000, generator=g, device="cuda").bfloat16(),   # vector loads
               torch.randn(1, 4, 4099, generator=g, device="cuda")):              # scalar loads, partial tile
    tree_ops.sample_choices(logits, 0.7, u(*logits.shape[:-1]))
    tree_ops.sample_choices(logits, 1.0, u(*logits.shape[:-1]))
for rows, k in ((2, 64), (1, 200), (67, 16)):                                    # split 8, split 2, one CTA a row
    tree_ops.topk_logprobs(torch.randn(rows, 8196, generator=g, device="cuda"), k, 4)
tie = np.full((1, 8704), -5.0, dtype=np.float32)                                 # split row handed to v3
tie[0, 4 * np.arange(960, 1024)], tie[0, 4 * np.arange(448, 512)] = 0.0, -1e-30
tree_ops.topk_logprobs(torch.from_numpy(tie).cuda(), 64, 4)
torch.cuda.synchronize()
print("small cases ran")
PY
    cap="$(left 45)"
    for tool in memcheck racecheck; do                        # side by side: the cases are small
        (timeout "$cap" compute-sanitizer --tool "$tool" python3 /tmp/kernels_small.py >"/tmp/sanitize-$tool.log" 2>&1
         echo "exit $?" >>"/tmp/sanitize-$tool.log") &
    done
    wait
    for tool in memcheck racecheck; do
        { echo "-- $tool"; cat "/tmp/sanitize-$tool.log"; } >>"$OUT/sanitizer.log"
        echo "-- $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small cases|^exit" "/tmp/sanitize-$tool.log" | tr '\n' ' ')"
    done
fi

if want plant; then
    echo "== planted bugs (each must make its tests fail)"
    wait
    cap="$(left 40)"
    plant_run() {  # plant_run NAME TEST_SELECTION... (in the background; all four side by side)
        local name=$1; shift
        if [[ ! -f "$PLANT/$name/lib.so" ]]; then
            echo "not built: $(tail -2 "$PLANT/$name/build.log" 2>/dev/null)" >"$PLANT/$name/tests.log"
            return
        fi
        KDTREE_KERNELS_LIB="$PLANT/$name/lib.so" timeout "$cap" python3 -m pytest -q -p no:cacheprovider "$@" \
            >"$PLANT/$name/tests.log" 2>&1
    }
    plant_run sample-ge tests/kernels/test_sample_kernel.py -k "adversarial or tiny" &
    plant_run sample-no-guard tests/kernels/test_sample_kernel.py -k "random_rows and float32 or zero_probability" &
    plant_run topk-no-tie-check tests/kernels/test_tree_kernels.py -k "tie_below_the_bound" &
    plant_run topk-first-bound tests/kernels/test_tree_kernels.py -k "tie_below_the_bound" &
    wait
    for name in sample-ge sample-no-guard topk-no-tie-check topk-first-bound; do
        { echo "$name: $(tail -1 "$PLANT/$name/tests.log")"; grep -E "^FAILED" "$PLANT/$name/tests.log" | head -4; } \
            | tee -a "$OUT/plant.log"
    done
fi

echo "== done in ${SECONDS}s"
