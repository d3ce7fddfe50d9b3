#!/usr/bin/env bash
# Fetch the peers' kernels that tests/kernels/test_bench_mla.py times beside ours, into the
# git-ignored folder .peers/ (carry it to the GPU machine: it is about 180 KB). Run from anywhere:
#
#   bash scripts/fetch_peers.sh            # pip downloads the pinned sglang wheel
#   SGLANG_WHEEL=path.whl bash scripts/fetch_peers.sh   # or takes that wheel file
#
# Takes exactly four pure-Python Triton files of sglang 0.5.23 (the tree-verify kernel
# extend_attention.py, the MLA decode kernel decode_attention.py, the split policy
# metadata.py, and score_mod.py, which they import) and checks their sha256. The modules
# of sglang they import and we do not carry (sglang.srt.utils, sglang.srt.environ) are
# our own stand-ins in tests/kernels/peers/. Exits non-zero, leaving .peers/ as it was,
# when a download, an extraction or a checksum fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.5.23
SRC=sglang/kernels/ops/attention
DEST=.peers
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

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
rm -rf "$DEST"
mv "$tmp/out" "$DEST"
echo "peers in $DEST: sglang $VERSION ($SRC: extend_attention, decode_attention, metadata, score_mod)"
