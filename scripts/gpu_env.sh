# Sourced by scripts/gpu_*.sh: $OUT (default ./out) with the GPU named in gpu.txt, unbuffered Python from the checkout, and the
# wheels in .whl/ (packages the GPU machine lacks, e.g. google-crc32c) installed into its
# interpreter, so that subprocesses see them too.
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-.}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
fi

# Stage helpers for scripts with a time budget: `left CAP` gives the seconds for the next stage,
# at most CAP, of what is left of $DEADLINE; `want NAME` is true when $stage is all or NAME.
left() {  # left CAP: seconds for the next stage, at most CAP
    local rest=$((DEADLINE - SECONDS))
    ((rest < 5)) && rest=5
    echo $((rest < $1 ? rest : $1))
}
want() { [[ "$stage" == all || "$stage" == "$1" ]]; }

# build_kernels: compile every kernels_cuda/csrc/*.cu into the shared library (cached by content)
# and export its path as KDTREE_KERNELS_LIB; a library already named there is used as it is.
# The build log, with ptxas' register and spill report, is $OUT/build.log.
build_kernels() {
    if [[ -n "${KDTREE_KERNELS_LIB:-}" ]]; then
        echo "using $KDTREE_KERNELS_LIB" | tee "$OUT/build.log"
        return 0
    fi
    if ! timeout 240 python3 -m kernels_cuda.build --verbose >"$OUT/build.log" 2>&1; then
        tail -20 "$OUT/build.log"
        return 1
    fi
    export KDTREE_KERNELS_LIB="$(tail -1 "$OUT/build.log")"
    echo "built $KDTREE_KERNELS_LIB"
}

# build_both: the default fat library and one without sm_90a ($NOA_ARCHS: the mma.sync path every
# non-Hopper GPU takes), compiled side by side (each cached by content), their paths in LIB_FAT
# and LIB_NOA; one named by $KDTREE_KERNELS_LIB or $KDTREE_KERNELS_LIB_NOA is used as it is.
# Build logs, with ptxas' register and spill report: /tmp/build-fat.log, /tmp/build-noa.log.
NOA_ARCHS=sm_90,compute_90
build_both() {
    LIB_FAT="${KDTREE_KERNELS_LIB:-}" LIB_NOA="${KDTREE_KERNELS_LIB_NOA:-}"
    [[ -n "$LIB_FAT" ]] || timeout 300 python3 -m kernels_cuda.build --verbose >/tmp/build-fat.log 2>&1 &
    [[ -n "$LIB_NOA" ]] ||
        KDTREE_CUDA_ARCHS=$NOA_ARCHS timeout 300 python3 -m kernels_cuda.build --verbose >/tmp/build-noa.log 2>&1 &
    wait
    LIB_FAT="${LIB_FAT:-$(tail -1 /tmp/build-fat.log)}" LIB_NOA="${LIB_NOA:-$(tail -1 /tmp/build-noa.log)}"
}
