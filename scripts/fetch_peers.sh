#!/usr/bin/env bash
# Fetch the peers' kernels that tests/kernels/test_bench_mla*.py time beside ours, into the
# git-ignored folder .peers/ (carry it to the GPU machine: about 14 MB). Run from anywhere:
#
#   bash scripts/fetch_peers.sh            # pip downloads the pinned sglang and sgl-flash-mla wheels
#   SGLANG_WHEEL=a.whl FLASHMLA_WHEEL=b.whl bash scripts/fetch_peers.sh   # or takes those wheel files
#
# Takes exactly four pure-Python Triton files of sglang 0.5.23 (the tree-verify kernel
# extend_attention.py, the MLA decode kernel decode_attention.py, the split policy
# metadata.py, and score_mod.py, which they import) and checks their sha256. The modules
# of sglang they import and we do not carry (sglang.srt.utils, sglang.srt.environ) are
# our own stand-ins in tests/kernels/peers/.
#
# FlashMLA: the compiled extension flash_mla/_C_legacy.abi3.so of the sgl-flash-mla 1.0.0 wheel
# (SGLang's packaging of deepseek-ai/FlashMLA, built against PyTorch's stable C ABI, so it loads
# in torch 2.10 and later; it holds the sm_90a dense MLA decode kernel that upstream FlashMLA
# dropped in its 2026.09.30 release, as `torch.ops.flash_mla_legacy.dense_decode_fwd`), checked
# by the wheel's and the library's sha256; tests/kernels/peers loads it with
# torch.ops.load_library. Nothing is compiled here.
#
# FlashInfer's MLA is built, not fetched: scripts/build_flashinfer_mla.sh, into .peers/flashinfer_mla/,
# which this script keeps.
#
# Exits non-zero, leaving .peers/ as it was, when a download, an extraction or a checksum fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.5.23
SRC=sglang/kernels/ops/attention
DEST=.peers
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

FLASHMLA_VERSION=1.0.0
FLASHMLA_WHEEL_SHA=95d2761376337af4568dbadedc1807b0d90e4d8383c63fa859518a34937392b3
FLASHMLA_LIB_SHA=21aa2460ea63db67a3dd33ec3d43b8c045f9657ed6ed27efea2955039b875451

wheel="${SGLANG_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: "sglang==$VERSION" -d "$tmp/wheel"
    wheel="$(ls "$tmp"/wheel/sglang-"$VERSION"-*.whl)"
fi
mkdir -p "$tmp/out/$SRC"
for f in extend_attention.py decode_attention.py metadata.py score_mod.py; do
    unzip -p "$wheel" "$SRC/$f" >"$tmp/out/$SRC/$f"
done
(cd "$tmp/out/$SRC" && sha256sum --quiet -c) <<'SUMS'
be3baffc80ef9fe484d0b896842522b02bf671785088e05a66ca4dcdb2e8a9b3  extend_attention.py
7a3b66ce3daabbb027efd860411cd9abe4b399b1f2cfc3ed5c6c01731eb9fa0a  decode_attention.py
8aa5db57763f5ecfb01a05beba74791d0bf3921952c789d8a8432abf25c231ca  metadata.py
127e2e6466bbfac3c2189cc4f2a9d7751fd819b30d25de65378d66ae63bbafa6  score_mod.py
SUMS
echo "sglang $VERSION" >"$tmp/out/VERSION"

flashmla="${FLASHMLA_WHEEL:-}"
if [[ -z "$flashmla" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 "sgl-flash-mla==$FLASHMLA_VERSION" -d "$tmp/flashmla"
    flashmla="$(ls "$tmp"/flashmla/sgl_flash_mla-"$FLASHMLA_VERSION"-*.whl)"
fi
echo "$FLASHMLA_WHEEL_SHA  $flashmla" | sha256sum --quiet -c
mkdir -p "$tmp/out/flash_mla"
unzip -p "$flashmla" flash_mla/_C_legacy.abi3.so >"$tmp/out/flash_mla/_C_legacy.abi3.so"
echo "$FLASHMLA_LIB_SHA  $tmp/out/flash_mla/_C_legacy.abi3.so" | sha256sum --quiet -c
echo "sgl-flash-mla $FLASHMLA_VERSION" >"$tmp/out/flash_mla/VERSION"

if [[ -d "$DEST/flashinfer_mla" ]]; then     # built by scripts/build_flashinfer_mla.sh: kept
    mv "$DEST/flashinfer_mla" "$tmp/out/"
fi
rm -rf "$DEST"
mv "$tmp/out" "$DEST"
echo "peers in $DEST: sglang $VERSION ($SRC: extend_attention, decode_attention, metadata, score_mod);" \
     "sgl-flash-mla $FLASHMLA_VERSION (flash_mla/_C_legacy.abi3.so)"
