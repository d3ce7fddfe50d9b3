"""Our stand-in for `sglang.srt.utils`: the five functions SGLang's Triton attention kernels
import from it, with SGLang's meanings (platform checks on the torch build and the device).

SGLang's own module imports most of SGLang; these kernels need only these answers.
"""

from __future__ import annotations

import torch


def is_hip() -> bool:
    """A ROCm build of torch."""
    return torch.version.hip is not None


def is_cuda() -> bool:
    """A CUDA build of torch with a device visible."""
    return torch.cuda.is_available() and torch.version.cuda is not None


def _amd_arch_is(prefix: str) -> bool:
    return is_hip() and prefix in torch.cuda.get_device_properties(0).gcnArchName


def is_gfx95_supported() -> bool:
    """An AMD gfx95x GPU (False on every CUDA build)."""
    return _amd_arch_is("gfx95")


def is_gfx1250_supported() -> bool:
    """An AMD gfx1250 GPU (False on every CUDA build)."""
    return _amd_arch_is("gfx1250")


def get_device_core_count(device_id: int = 0) -> int:
    """Streaming multiprocessors of the device, 0 without one."""
    return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0
