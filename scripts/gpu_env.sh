# Sourced by scripts/gpu_*.sh: $OUT (default ./out), unbuffered Python from the checkout, and the
# wheels in .whl/ (packages the GPU machine lacks, e.g. google-crc32c) installed into its
# interpreter, so that subprocesses see them too.
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-.}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
fi
