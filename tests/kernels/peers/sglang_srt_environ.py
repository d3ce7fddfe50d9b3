"""Our stand-in for `sglang.srt.environ`: `envs.NAME.get()` for the variables SGLang's Triton
attention kernels read, with sglang 0.5.23's defaults, overridable from the environment as in
SGLang. A name it does not know raises AttributeError naming it (add it here with SGLang's
default from sglang/srt/environ.py of the pinned version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULTS: dict[str, bool | float] = {
    "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": False,
    "SGLANG_MLA_DECODE_TUNE": False,
    "SGLANG_FORCE_LEAN_GRID_CU_MULT": 1.0,
    "SGLANG_TRITON_FP8_PREFILL_ATTN": True,
    "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": True,
}


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: bool | float

    def get(self) -> bool | float:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return type(self.default)(raw)


class Envs:
    def __getattr__(self, name: str) -> EnvVar:
        if name not in DEFAULTS:
            raise AttributeError(f"sglang.srt.environ stand-in: {name} is not among the variables it knows "
                                 f"({', '.join(DEFAULTS)}); add it with sglang's default")
        return EnvVar(name, DEFAULTS[name])


envs = Envs()
