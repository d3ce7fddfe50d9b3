"""The stand-ins for sglang's modules answer as SGLang does, and the loader says why it cannot load."""

from __future__ import annotations

import pytest
import torch

from peers import PeerUnavailable, load_sglang, sglang_srt_environ, sglang_srt_utils
import peers


def test_environ_defaults_and_overrides(monkeypatch) -> None:
    envs = sglang_srt_environ.envs
    monkeypatch.delenv("SGLANG_MLA_DECODE_TUNE", raising=False)
    monkeypatch.delenv("SGLANG_TRITON_FP8_PREFILL_ATTN", raising=False)
    assert envs.SGLANG_MLA_DECODE_TUNE.get() is False and envs.SGLANG_TRITON_FP8_PREFILL_ATTN.get() is True
    monkeypatch.setenv("SGLANG_MLA_DECODE_TUNE", "True")
    monkeypatch.setenv("SGLANG_TRITON_FP8_PREFILL_ATTN", "0")
    monkeypatch.setenv("SGLANG_FORCE_LEAN_GRID_CU_MULT", "2.5")
    assert envs.SGLANG_MLA_DECODE_TUNE.get() is True and envs.SGLANG_TRITON_FP8_PREFILL_ATTN.get() is False
    assert envs.SGLANG_FORCE_LEAN_GRID_CU_MULT.get() == 2.5
    with pytest.raises(AttributeError, match="SGLANG_NOT_A_VARIABLE is not among"):
        envs.SGLANG_NOT_A_VARIABLE.get()


def test_utils_answer_for_this_torch() -> None:
    assert sglang_srt_utils.is_hip() == (torch.version.hip is not None)
    assert sglang_srt_utils.is_cuda() == torch.cuda.is_available()
    if torch.version.hip is None:
        assert not sglang_srt_utils.is_gfx95_supported() and not sglang_srt_utils.is_gfx1250_supported()
    cores = sglang_srt_utils.get_device_core_count()
    assert cores == (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0)


def test_loader_names_what_is_missing(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(peers, "PEERS", tmp_path)
    monkeypatch.setattr(peers, "ATTENTION", tmp_path / "sglang" / "kernels" / "ops" / "attention")
    with pytest.raises(PeerUnavailable, match="run scripts/fetch_peers.sh"):
        load_sglang()


def test_sglang_kernels_import_with_the_standins() -> None:
    """With the fetched files and triton (the GPU machine), SGLang's modules import through our stand-ins."""
    if not (peers.ATTENTION / "extend_attention.py").is_file():
        pytest.skip(f"SGLang's kernels are not in {peers.PEERS} (run scripts/fetch_peers.sh)")
    pytest.importorskip("triton", reason="SGLang's kernels need triton")
    sgl = load_sglang()
    assert callable(sgl.extend_attention_fwd) and callable(sgl.decode_attention_fwd)
    assert sgl.version == "sglang 0.5.23"
