#!/usr/bin/env bash
# The MLA tree-verify kernel beside FlashMLA and SGLang in one GPU run (issue 34): run on the GPU
# machine from the repository root, with .peers/ carried (scripts/fetch_peers.sh fills it; with
# .peers/flashinfer_mla/ from scripts/build_flashinfer_mla.sh, FlashInfer's MLA joins the chains) and,
# optionally, libraries built elsewhere (KDTREE_KERNELS_LIB: the default fat build;
# KDTREE_KERNELS_LIB_NOA: one built with KDTREE_CUDA_ARCHS=sm_90,compute_90; each built here
# otherwise, or when the carried one does not load).
#
#   bash scripts/gpu_peers_mla.sh [all|bench|profile]
#
# bench: FlashInfer's MLA against a float32 reference (tests/kernels/peers/test_flashinfer_mla.py,
# in $OUT/flashinfer.log; skipped where not built; left out of the benchmark if it fails), then
# tests/kernels/test_bench_mla_peers.py over its full grids (KDTREE_BENCH=1), the JSON in
# $OUT/mla_peers.json; then the tree grid with the no-sm_90a library, its mma.sync kernel alone
# (KDTREE_BENCH_PEERS=0), in $OUT/mla_peers_noa.json; the tables with the targets judged in
# $OUT/mla-peers.md (python3 -m peers.report). profile: ncu (clocks left alone) on one launch each
# of FlashMLA's decode kernel and kdtree's, at ctx 32k / 1 token / batch 32 and ctx 8k / chain of
# 16 / batch 32, with the warps' stall reasons, into $OUT/ncu.txt; then the per-instruction page of
# kdtree's kernel (auto's: on Hopper the one-scorer wgmma kernel) and FlashMLA's at the chain case
# (`--set full`), summarized by scripts/ncu_source_summary.py into $OUT/ncu-source-summary.txt.
# DEADLINE (seconds, default 520) bounds the whole script.
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-all}"
DEADLINE="${DEADLINE:-520}"
source scripts/gpu_env.sh
export PYTHONPATH="$PYTHONPATH:tests:tests/kernels"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
for name in KDTREE_KERNELS_LIB KDTREE_KERNELS_LIB_NOA; do
    if [[ -n "${!name:-}" ]] && ! KDTREE_KERNELS_LIB="${!name}" python3 -c "from kernels_cuda import _lib; _lib.library()" \
        >>"$OUT/build.log" 2>&1; then
        echo "the carried library ${!name} does not load here: building" | tee -a "$OUT/gpu.txt"
        unset "$name"
    fi
done
build_both
echo "libraries: $LIB_FAT (fat), $LIB_NOA (no sm_90a)" | tee -a "$OUT/build.log"
cat /tmp/build-fat.log /tmp/build-noa.log >>"$OUT/build.log" 2>/dev/null
export KDTREE_KERNELS_LIB="$LIB_FAT"
python3 -c "
from peers import load_flashinfer, load_flashmla, PeerUnavailable
for name, load in (('FlashMLA', load_flashmla), ('FlashInfer', load_flashinfer)):
    try:
        print(name + ':', load().version)
    except PeerUnavailable as exc:
        print(name, 'unavailable:', exc)
" 2>&1 | tee -a "$OUT/gpu.txt"

if want bench; then
    echo "== tests/kernels/peers/test_flashinfer_mla.py: FlashInfer's MLA against a float32 reference"
    if ! timeout "$(left 60)" python3 -m pytest tests/kernels/peers/test_flashinfer_mla.py -q -rfs -p no:cacheprovider \
        >"$OUT/flashinfer.log" 2>&1; then
        export KDTREE_BENCH_FLASHINFER=0      # a peer that fails its check is not timed (nor can crash the grid)
        echo "FlashInfer left out of the benchmark: its check failed ($OUT/flashinfer.log)"
    fi
    tail -3 "$OUT/flashinfer.log"
    echo "== tests/kernels/test_bench_mla_peers.py, full grids"
    KDTREE_BENCH=1 KDTREE_BENCH_OUT="$OUT/mla_peers.json" timeout "$(left 420)" python3 -m pytest \
        tests/kernels/test_bench_mla_peers.py -q -rfs -p no:cacheprovider >"$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log"
    echo "== the tree grid, no-sm_90a library (mma.sync), kdtree alone"
    KDTREE_KERNELS_LIB="$LIB_NOA" KDTREE_CUDA_ARCHS=$NOA_ARCHS KDTREE_BENCH=1 KDTREE_BENCH_PEERS=0 \
        KDTREE_BENCH_OUT="$OUT/mla_peers_noa.json" timeout "$(left 150)" python3 -m pytest \
        tests/kernels/test_bench_mla_peers.py -k tree -q -rfs -p no:cacheprovider >>"$OUT/bench.log" 2>&1
    tail -1 "$OUT/bench.log"
    python3 -m peers.report "$OUT/mla_peers.json" --noa "$OUT/mla_peers_noa.json" | tee "$OUT/mla-peers.md" |
        sed -n '1,14p'
fi

if want profile; then
    echo "== ncu: FlashMLA's decode kernel and kdtree's, one launch each per case"
    cat >/tmp/one_case.py <<'PY'
import sys
from test_bench_mla_peers import flashmla, flashmla_call, kdtree_call, make_case
fm = flashmla()
for context, tokens, batch in ((32768, 1, 32), (8192, 16, 32)):
    x = make_case(context, tokens, batch, chain=True, seed=1)
    for call in (kdtree_call(x, context, tokens, batch), flashmla_call(fm, x, context, tokens, batch)):
        call()
PY
    timeout "$(left 100)" ncu --clock-control none --kernel-name "regex:mla_k2_wgmma|flash_fwd_splitkv_mla_kernel" \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        --metrics dram__bytes_read.sum.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        python3 /tmp/one_case.py >"$OUT/ncu.txt" 2>&1
    grep -E "mla_k2_wgmma|flash_fwd_splitkv|Duration|DRAM Throughput|Compute \(SM\)|dram__bytes|gmma|Registers Per|Grid Size|Achieved Occ" \
        "$OUT/ncu.txt" | head -60
    echo "== ncu per instruction: kdtree's and FlashMLA's kernel at ctx 8k / chain of 16 / batch 32"
    cat >/tmp/chain_case.py <<'PY'
from test_bench_mla_peers import flashmla, flashmla_call, kdtree_call, make_case
x = make_case(8192, 16, 32, chain=True, seed=1)
for call in (kdtree_call(x, 8192, 16, 32), flashmla_call(flashmla(), x, 8192, 16, 32)):
    call()
PY
    timeout "$(left 150)" ncu --set full --import-source no --clock-control none -c 2 -o /tmp/chain_prof \
        --kernel-name "regex:mla_k2_|flash_fwd_splitkv_mla_kernel" python3 /tmp/chain_case.py \
        >"$OUT/ncu-source.log" 2>&1 &&
        timeout "$(left 60)" ncu -i /tmp/chain_prof.ncu-rep --page source --csv --print-source sass \
            2>>"$OUT/ncu-source.log" |
        gzip >"$OUT/ncu-source.csv.gz" &&
        python3 scripts/ncu_source_summary.py "$OUT/ncu-source.csv.gz" --top 25 | tee "$OUT/ncu-source-summary.txt" |
        head -30
fi
echo "== done in ${SECONDS}s"
