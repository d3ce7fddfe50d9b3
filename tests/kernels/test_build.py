"""kernels_cuda.build: one shared library from every csrc/*.cu, cached by content, no GPU needed.

The compile test reuses the cache (`$KDTREE_CACHE_DIR` or ~/.cache/kdtree/kernels), so it
costs one build per source change (the CI gate builds first); the failure and caching
tests compile a two-line source of their own. All skip with a reason where nvcc is absent.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from kernels_cuda import build as kbuild

try:
    NVCC = kbuild.find_nvcc()
except kbuild.BuildError:
    NVCC = None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")

TREE_SYMBOLS = ("kdtree_status_string", "kdtree_topk_logprobs", "kdtree_build_trees", "kdtree_compile_trees",
                "kdtree_accept_greedy", "kdtree_compact_kv", "kdtree_sample_choices")


@needs_nvcc
def test_library_builds_and_exports_the_launchers() -> None:
    path = kbuild.build()
    assert path.is_file() and path.parent == kbuild.cache_dir()
    lib = ctypes.CDLL(str(path))
    for name in TREE_SYMBOLS:
        assert hasattr(lib, name), name
    lib.kdtree_status_string.restype = ctypes.c_char_p
    assert lib.kdtree_status_string(-2) == b"size exceeds a kernel limit"
    assert kbuild.build() == path                            # cached: same content, same file


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """A private csrc/ with one small source and a private cache."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.cu").write_text('extern "C" int kdtree_probe() { return 7; }\n')
    monkeypatch.setattr(kbuild, "CSRC", csrc)
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KDTREE_CUDA_ARCHS", "compute_90")              # PTX only: no ptxas, quick
    return csrc


@needs_nvcc
def test_cache_key_follows_sources_flags_and_picks_up_new_files(tiny_sources) -> None:
    path = kbuild.build()
    assert ctypes.CDLL(str(path)).kdtree_probe() == 7
    mtime = path.stat().st_mtime_ns
    assert kbuild.build() == path and path.stat().st_mtime_ns == mtime     # no recompile
    assert kbuild.plan("sm_90a,compute_90").output != path                  # flags are in the key
    (tiny_sources / "a.cu").write_text('extern "C" int kdtree_probe() { return 9; }\n')
    edited = kbuild.plan().output
    assert edited != path                                                   # source bytes are in the key
    (tiny_sources / "c.cuh").write_text("#pragma once\n")
    assert kbuild.plan().output != edited                                   # headers too
    (tiny_sources / "b.cu").write_text('extern "C" int kdtree_probe2() { return 8; }\n')
    lib = ctypes.CDLL(str(kbuild.build()))
    assert lib.kdtree_probe() == 9 and lib.kdtree_probe2() == 8             # every .cu, one library


@needs_nvcc
def test_compile_error_is_one_clear_line_and_leaves_nothing(tiny_sources, capsys) -> None:
    (tiny_sources / "a.cu").write_text("this is not C++\n")
    assert kbuild.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kernels_cuda.build: error: nvcc failed") and "a.cu" in err
    assert os.listdir(kbuild.cache_dir()) == []


def test_architecture_list(monkeypatch, capsys) -> None:
    assert kbuild.arch_flags("sm_90a,compute_90") == ["-gencode=arch=compute_90a,code=sm_90a",
                                                      "-gencode=arch=compute_90,code=compute_90",
                                                      "-DKDTREE_SM90A"]           # the wgmma path's code
    assert kbuild.arch_flags(" sm_80 ") == ["-gencode=arch=compute_80,code=sm_80"]
    for bad in ("90a", "sm90", "sm_9", "", "sm_90,"[:-1] + ";compute_90"):
        with pytest.raises(kbuild.BuildError, match="architecture"):
            kbuild.arch_flags(bad)
    monkeypatch.setenv("KDTREE_CUDA_ARCHS", "volta")
    if NVCC is None:
        monkeypatch.setattr(kbuild, "find_nvcc", lambda: kbuild.Path("/bin/true"))
    assert kbuild.main([]) == 1
    assert capsys.readouterr().err.strip() == (
        "kernels_cuda.build: error: bad CUDA architecture 'volta': expected sm_XY[a] or compute_XY[a], "
        "e.g. sm_90a,compute_90")


def test_default_build_is_a_fat_binary() -> None:
    """Machine code for Ampere / Ada, Hopper with wgmma, Blackwell workstation GPUs, and PTX for
    the rest from compute capability 8.0 (B200), each target saying which MLA path it gets."""
    flags = kbuild.arch_flags(kbuild.DEFAULT_ARCHS)
    for code in ("sm_80", "sm_90a", "sm_120"):
        assert any(f.endswith(f"code={code}") for f in flags), code
    assert "-gencode=arch=compute_80,code=compute_80" in flags and "-DKDTREE_SM90A" in flags
    paths = {entry: kbuild.arch_paths(entry) for entry in kbuild.DEFAULT_ARCHS.split(",")}
    assert "wgmma" in paths["sm_90a"] and all("mma.sync" in paths[e] for e in ("sm_80", "sm_120", "compute_80"))
    assert all("tree kernels" in p for p in paths.values())
    assert "CUDA cores only" in kbuild.arch_paths("sm_75") and "PTX" in paths["compute_80"]


@needs_nvcc
def test_cli_names_each_targets_paths_then_the_library(tiny_sources, capsys) -> None:
    assert kbuild.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"  compute_90: {kbuild.arch_paths('compute_90')}"
    assert kbuild.Path(lines[-1]) == kbuild.build() and len(lines) == 2     # the path last, for scripts


def test_missing_nvcc_is_reported(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kbuild, "Path", type(tmp_path))
    monkeypatch.setattr(kbuild.shutil, "which", lambda name: None)
    real_is_file = kbuild.Path.is_file
    monkeypatch.setattr(kbuild.Path, "is_file", lambda self: False if self.name == "nvcc" else real_is_file(self))
    with pytest.raises(kbuild.BuildError, match="nvcc not found"):
        kbuild.find_nvcc()
