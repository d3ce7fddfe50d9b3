#!/usr/bin/env bash
# Build FlashInfer's paged MLA attention as a peer of kdtree's MLA verify kernel (issue 34), on a
# machine with nvcc and no GPU, into the git-ignored .peers/flashinfer_mla/ (carry it to the GPU
# machine: 3.7 MB; nothing of FlashInfer's Python package, JIT or dependencies goes there).
# Run from anywhere, after scripts/fetch_peers.sh (which keeps this folder when it refills .peers/):
#
#   bash scripts/build_flashinfer_mla.sh                       # pip downloads the pinned wheel
#   FLASHINFER_WHEEL=flashinfer_python-0.7.4-py3-none-any.whl bash scripts/build_flashinfer_mla.sh
#
# Takes the headers of the flashinfer-python 0.7.4 wheel (FlashInfer's include/, and the CUTLASS
# and CCCL headers it vendors: its kernels need CCCL newer than CUDA 13.0's), checked by the
# wheel's sha256, and compiles our C wrapper scripts/peers/flashinfer_mla.cu twice, in parallel:
# FlashInfer's Hopper kernel (its "fa3" backend, include/flashinfer/attention/mla_hopper.cuh) for
# sm_90a; the planner (scheduler.cuh's MLAPlan) and the FA2-style kernel ("fa2", mla.cuh) for
# sm_80 and sm_90a. bf16, latent 512, rotary 64, masks none and causal. One shared library with the
# CUDA runtime and libstdc++ linked in (it needs only libc). Prints the build time and the size.
#
# Measured on the 2-core CPU machine with nvcc 13.0.88, 2026-12-07: compiled and linked in 43 and
# 49 s (65-77 s while another test run shared the two cores), 49-56 s in all with the 101 MB
# download and the 60 MB of headers unpacked; the library is 3,721,688 bytes.
#
# Exits non-zero, leaving .peers/flashinfer_mla/ as it was, when the download, the checksum or the
# build fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.7.4
WHEEL_SHA=a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32
DEST=.peers/flashinfer_mla
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

wheel="${FLASHINFER_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: "flashinfer-python==$VERSION" -d "$tmp/wheel"
    wheel="$(ls "$tmp"/wheel/flashinfer_python-"$VERSION"-*.whl)"
fi
echo "$WHEEL_SHA  $wheel" | sha256sum --quiet -c
unzip -q "$wheel" 'flashinfer/data/include/*' 'flashinfer/data/cutlass/include/*' 'flashinfer/data/cccl/*' \
    'flashinfer/_build_meta.py' -d "$tmp/src"
data="$tmp/src/flashinfer/data"
commit="$(sed -n 's/^__git_commit__ = "\(.*\)"/\1/p' "$tmp/src/flashinfer/_build_meta.py")"

# FlashInfer's own JIT flags for these modules (flashinfer/jit/cpp_ext.py, core.py): its CCCL first.
flags=(-std=c++17 -O3 -use_fast_math --expt-relaxed-constexpr -static-global-template-stub=false
       -Xcompiler=-fPIC -DNDEBUG -DFLASHINFER_ENABLE_BF16
       -I"$data/cccl/cub" -I"$data/cccl/libcudacxx/include" -I"$data/cccl/thrust"
       -isystem "$data/include" -isystem "$data/cutlass/include")
src=scripts/peers/flashinfer_mla.cu
mkdir -p "$tmp/out"
start=$SECONDS
nvcc "${flags[@]}" -DFIMLA_SM90 -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -gencode=arch=compute_90a,code=sm_90a \
    -c "$src" -o "$tmp/fa3.o" &
fa3=$!
nvcc "${flags[@]}" -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
    -c "$src" -o "$tmp/fa2.o"
wait "$fa3"
nvcc -shared -cudart=static -Xcompiler=-static-libstdc++,-static-libgcc -Xlinker=--exclude-libs=ALL \
    "$tmp/fa3.o" "$tmp/fa2.o" -o "$tmp/out/libflashinfer_mla.so"
seconds=$((SECONDS - start))
echo "flashinfer-python $VERSION (git ${commit:0:12})" >"$tmp/out/VERSION"

rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$tmp/out" "$DEST"
nvcc_version="$(nvcc --version | sed -n 's/.*release .*, V\([0-9.]*\).*/\1/p')"
echo "FlashInfer MLA in $DEST: $(cat "$DEST/VERSION"); built in ${seconds} s with nvcc $nvcc_version;" \
     "$(stat -c %s "$DEST/libflashinfer_mla.so") bytes"
