"""Build every kernels_cuda/csrc/*.cu into one shared library with nvcc.

Contract:
- All `csrc/*.cu` files are compiled into ONE shared library (a new .cu file is
  picked up with no change here; the files compile side by side, then link);
  `csrc/*.cuh` and `csrc/*.h` are headers.
- Targets: `KDTREE_CUDA_ARCHS` (or `--arch`), a comma-separated list of
  `sm_XY[a]` (machine code) and `compute_XY[a]` (embedded PTX) entries;
  default `sm_80,sm_90a,sm_120,compute_80`: a fat binary with machine code for
  Ampere and Ada (sm_80 runs on 8.x), Hopper (wgmma, TMA) and Blackwell
  workstation GPUs, plus PTX that the driver compiles for any other GPU of
  compute capability 8.0 and later (B200). The kernels pick their path by the
  device's compute capability at run time (`ARCH_PATHS`).
- The library is cached in `$KDTREE_CACHE_DIR` (default `~/.cache/kdtree/kernels`)
  under a name keyed by a hash of the sources, the flags and `nvcc --version`;
  it is written to a temporary file and renamed into place, so a concurrent
  or interrupted build never leaves a half-written library behind.
- No GPU is needed to build.

CLI: `python -m kernels_cuda.build [--arch LIST] [--force] [--verbose]` prints
which kernel paths each target gets, then the library's path (the last line),
or one error line and exits 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
DEFAULT_ARCHS = "sm_80,sm_90a,sm_120,compute_80"
LIB_STEM = "libkdtree_kernels"
BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-Xcompiler=-fPIC",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-cudart=static",
    "--threads=0",
)
LINK_FLAGS = ("-shared", "-cudart=static")
TREE_KERNELS = "tree kernels (top-k, build, accept, compaction, sampling)"
_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3}[af]?)$")


def arch_paths(entry: str) -> str:
    """Which GPUs a target serves and the kernel paths they get (csrc/mla_verify.cu picks the
    MLA verify kernel by the device's compute capability at run time)."""
    kind, cc = _ARCH_RE.match(entry).groups()
    major, minor = int(cc.rstrip("af")) // 10, int(cc.rstrip("af")) % 10
    mla = ("wgmma + TMA tensor cores (mma.sync for pages TMA cannot read)" if cc == "90a"
           else "mma.sync tensor cores" if major >= 8 else "CUDA cores only (tensor cores need 8.0)")
    if kind == "compute":
        gpus = f"PTX the driver compiles for GPUs >= {major}.{minor} that have no machine code here"
    elif cc.endswith(("a", "f")):
        gpus = f"machine code for {major}.{minor} ({_GPUS.get(major, 'no GPU named')})"
    else:
        gpus = f"machine code for {major}.{minor} and later {major}.x ({_GPUS.get(major, 'no GPU named')})"
    return f"{gpus}: {TREE_KERNELS}; MLA verify on {mla}"


_GPUS = {8: "A100, A10, L40S, RTX 30xx / 40xx", 9: "H100, H200", 10: "B200", 12: "RTX 50xx, RTX PRO 6000"}


class BuildError(RuntimeError):
    """nvcc is missing, an architecture is malformed, or compilation failed."""


@dataclass(frozen=True)
class BuildPlan:
    nvcc: Path
    nvcc_version: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    flags: tuple[str, ...]
    output: Path


def find_nvcc() -> Path:
    """nvcc from $CUDA_HOME/bin, then PATH, then /usr/local/cuda/bin."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise BuildError("nvcc not found: set CUDA_HOME or put nvcc on PATH")


def arch_flags(archs: str) -> list[str]:
    """'sm_90a,compute_90' -> nvcc -gencode flags (sm_X: machine code, compute_X: PTX), plus
    -DKDTREE_SM90A when Hopper's own machine code (sm_90a: wgmma, TMA) is among them."""
    flags = []
    entries = _entries(archs)
    for entry in entries:
        kind, cc = _ARCH_RE.match(entry).groups()
        code = f"sm_{cc}" if kind == "sm" else f"compute_{cc}"
        flags.append(f"-gencode=arch=compute_{cc},code={code}")
    if "sm_90a" in entries:
        flags.append("-DKDTREE_SM90A")
    return flags


def _entries(archs: str) -> list[str]:
    """'sm_80, compute_80' -> ['sm_80', 'compute_80'], each checked."""
    entries = [a.strip() for a in archs.split(",") if a.strip()]
    if not entries:
        raise BuildError(f"empty CUDA architecture list {archs!r}")
    for entry in entries:
        if not _ARCH_RE.match(entry):
            raise BuildError(
                f"bad CUDA architecture {entry!r}: expected sm_XY[a] or compute_XY[a], e.g. sm_90a,compute_90"
            )
    return entries


def cache_dir() -> Path:
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree" / "kernels")


def plan(archs: str | None = None) -> BuildPlan:
    """Resolve nvcc, sources, flags and the cached library path (nothing is compiled)."""
    nvcc = find_nvcc()
    sources = tuple(sorted(CSRC.glob("*.cu")))
    if not sources:
        raise BuildError(f"no CUDA sources in {CSRC}")
    headers = tuple(sorted([*CSRC.glob("*.cuh"), *CSRC.glob("*.h")]))
    archs = archs or os.environ.get("KDTREE_CUDA_ARCHS") or DEFAULT_ARCHS
    flags = (*BASE_FLAGS, *arch_flags(archs))
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (version, "\0".join(flags)):
        digest.update(part.encode())
    for path in (*sources, *headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    output = cache_dir() / f"{LIB_STEM}-{digest.hexdigest()[:20]}.so"
    return BuildPlan(nvcc, version, sources, headers, flags, output)


def _run(cmd: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if verbose or result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
    if result.returncode != 0:
        first = next((ln for ln in result.stderr.splitlines() if "error" in ln), result.stderr.strip()[:300])
        raise BuildError(f"nvcc failed (exit {result.returncode}): {first}")


def build(archs: str | None = None, force: bool = False, verbose: bool = False) -> Path:
    """Compile (unless cached) and return the shared library's path."""
    p = plan(archs)
    if p.output.is_file() and not force:
        return p.output
    p.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=p.output.name + ".", dir=p.output.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in p.sources]
        ptxas = ["-Xptxas=-v"] if verbose else []
        compiles = [[str(p.nvcc), *ptxas, *p.flags, f"-I{CSRC}", "-c", str(source), "-o", str(obj)]
                    for source, obj in zip(p.sources, objects)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for done in [pool.submit(_run, cmd, verbose) for cmd in compiles]:
                done.result()
        tmp = Path(work) / p.output.name
        _run([str(p.nvcc), *LINK_FLAGS, *(str(o) for o in objects), "-o", str(tmp)], verbose)
        os.replace(tmp, p.output)
    return p.output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_cuda.build", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help=f"targets, e.g. {DEFAULT_ARCHS} (default: $KDTREE_CUDA_ARCHS or that)")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--verbose", action="store_true", help="print the nvcc command and ptxas resource usage")
    args = parser.parse_args(argv)
    try:
        path = build(args.arch, force=args.force, verbose=args.verbose)
    except (BuildError, OSError) as exc:
        print(f"kernels_cuda.build: error: {exc}", file=sys.stderr)
        return 1
    for entry in _entries(args.arch or os.environ.get("KDTREE_CUDA_ARCHS") or DEFAULT_ARCHS):
        print(f"{entry:>12}: {arch_paths(entry)}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
