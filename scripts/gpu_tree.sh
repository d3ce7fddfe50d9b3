#!/usr/bin/env bash
# The tree kernels (top-k, build + compile, accept, KV compaction) on a GPU machine in one
# call: build, tests, compute-sanitizer (memcheck and racecheck on small cases), benchmarks.
# Run from the checkout root:
#
#   PYTHONPATH=. bash scripts/gpu_tree.sh [all|tests|sanitize|bench]
#
# Logs go to $OUT (default ./out): build.log, tests.log, sanitizer.log, bench.log,
# tree_bench.json. A library named by $KDTREE_KERNELS_LIB is used as it is (no build).
# Wheels in .whl/ are installed by scripts/gpu_env.sh. Each stage has its own time limit; the last lines printed are the benchmark table.
set -uo pipefail
stage="${1:-all}"
source "$(dirname "$0")/gpu_env.sh"

echo "== build"
build_kernels || exit 1
grep -A2 -E "topk_logprobs|build_trees|compile_trees|accept_greedy|compact_kv" "$OUT/build.log" \
    | grep -E "registers|spill" | sort | uniq -c

if [[ "$stage" == all || "$stage" == tests ]]; then
    echo "== tests"
    timeout 150 python3 -m pytest tests/kernels/test_tree_kernels.py tests/kernels/test_build.py -q -rfs \
        --durations=5 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -30
fi

if [[ "$stage" == all || "$stage" == sanitize ]]; then
    echo "== compute-sanitizer"
    cat >/tmp/tree_small.py <<'PY'
import torch
from kernels_cuda import tree_ops
dev, vec = "cuda", lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")
g = torch.Generator(device=dev).manual_seed(0)
for logits in (torch.randn(2, 3, 20000, generator=g, device=dev),          # fast path, vectorized
               torch.randn(1, 2, 4099, generator=g, device=dev).bfloat16(),  # scalar loads
               torch.zeros(1, 1, 9000, device=dev)):                         # refinement + tie path
    lp, ids = tree_ops.topk_logprobs(logits, 40)
    b = logits.shape[0]
    out = tree_ops.build_compiled_trees(lp, ids, vec([40, 7][:b]), vec([1, 2][:b]), vec([5, 0][:b]), 41)
    n, parents, tokens, depths = out[:4]
    tree_ops.compile_trees(parents, depths, n, vec([5, 0][:b]))
    choices = tokens.roll(-1, 1)
    accepted, accept_len, next_root = tree_ops.accept_greedy(parents, tokens, n, choices, logits.shape[1] + 1)
    c_kv, k_pe = torch.randn(2, b, 60, 32, device=dev), torch.randn(2, b, 60, 8, device=dev)
    tree_ops.compact_kv(c_kv, k_pe, vec([5, 0][:b]), accepted, accept_len)
torch.cuda.synchronize()
print("small cases ran")
PY
    for tool in memcheck racecheck; do
        echo "-- $tool" | tee -a "$OUT/sanitizer.log"
        timeout 100 compute-sanitizer --tool "$tool" python3 /tmp/tree_small.py >>"$OUT/sanitizer.log" 2>&1
        echo "exit $?" | tee -a "$OUT/sanitizer.log"
    done
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|small cases|exit|rror" "$OUT/sanitizer.log" | head -20
fi

if [[ "$stage" == all || "$stage" == bench ]]; then
    echo "== benchmarks"
    KDTREE_BENCH="${KDTREE_BENCH:-1}" KDTREE_BENCH_OUT="$OUT/tree_bench.json" timeout "${BENCH_TIMEOUT:-280}" \
        python3 -m pytest tests/kernels/test_bench_tree.py -q -rs -p no:cacheprovider >"$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log"
    python3 - "$OUT/tree_bench.json" "$OUT/tree-kernels-h200.md" <<'PY'
import datetime, json, sys
d = json.load(open(sys.argv[1]))
c = d["ceilings"]
rows = d["cases"]
lines = [f"GPU: {c['gpu']}; date: {datetime.date.today()}; commit: <filled by lead>",
         f"Copy bandwidth measured in the same run: {c['copy_TBps']:.2f} TB/s (bytes read + written).", "",
         "Eager: op calls as a user makes them (host launch overhead included); graph: the same ops replayed",
         "from a CUDA graph (device time). x floor and vs (a) use the graph time.", "",
         "| batch | budget | logits | eager ms | graph ms | top-k (graph) | build+compile (graph) | floor ms | x floor "
         "| (a) ms | vs (a) | (b) ms | vs (b) eager |",
         "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
f = lambda v: f"{v:.3f}" if isinstance(v, float) else "n/a"
for r in rows:
    lines.append(f"| {r['batch']} | {r['budget']} | {r['dtype']} | {r['kernel_ms']:.3f} | {f(r['kernel_graph_ms'])} | "
                 f"{f(r['topk_graph_ms'])} | {f(r['build_graph_ms'])} | {r['floor_ms']:.4f} | "
                 f"{r.get('graph_floor_multiple', float('nan')):.2f} | {r['published_ms']:.2f} | "
                 f"{r.get('graph_speedup_vs_published', float('nan')):.1f}x | {r['engine_ms']:.2f} | "
                 f"{r['speedup_vs_engine']:.1f}x |")
errors = {r["kernel_graph_ms"] for r in rows if not isinstance(r["kernel_graph_ms"], float)}
lines += [f"graph capture: {e}" for e in errors]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
fi
