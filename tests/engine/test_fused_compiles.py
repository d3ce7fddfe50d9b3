"""Every launch of the fused forward compiles for the GPUs, on a machine without one.

Triton's interpreter (the CPU tests) runs the kernels' arithmetic but accepts code the compiler
refuses. Here a child process imports the kernels compiled (no TRITON_INTERPRET), runs the fused
forward of a small model on the CPU with every launch recorded instead of run (its outputs are
garbage; nothing reads them), in default and invariant mode (with the invariant attention),
float32 and bf16, for a 1-row and a 24-row call, plus the invariant attention at K2's widths, the
invariant product's form for many rows and the expert sort of a 520-row verify, and compiles each
distinct launch for sm_90 with Triton's own ptxas (Hopper; the tiles take mma.sync as on sm_80,
and a compile costs ~0.2 s: one architecture keeps the suite short).

    python tests/engine/test_fused_compiles.py     # prints each compiled kernel, exits 1 on an error

Each line also gives the kernel's registers a thread and its stack bytes a thread (spilled
registers: ptxas's "bytes stack frame"), read from the cubin by the cuobjdump Triton ships; the
device's Triton is the one to install for figures that hold there (docs/results/fused-resources-sm90.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the fused layers are Triton kernels; Triton is not installed")

ARCHS = (90,)
POINTER = {"bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32", "int64": "*i64", "uint8": "*u8"}


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the fused tests compile and run these kernels themselves (with its Triton)")
def test_every_fused_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    kernels = {line.split()[1] for line in compiled}
    assert kernels == {"_add_rms_norm_kernel", "_latent_kernel", "_head_bmm_kernel", "_route_kernel", "_align_kernel",
                       "_align_count_kernel", "_align_scan_kernel", "_align_place_kernel", "_expert_matmul_kernel",
                       "_linear_kernel", "_sum_splits_kernel", "_split_kernel", "_combine_kernel"}, done.stdout


def signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """A launch's arguments -> (Triton signature, constexprs)."""
    import torch

    values = dict(zip([p.name for p in kernel.params], args)) | kwargs
    sig, constexprs = {}, {}
    for p in kernel.params:
        value = values[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[p.name] = POINTER[str(value.dtype).removeprefix("torch.")]
        else:
            sig[p.name] = "fp32" if isinstance(value, float) else "i32" if abs(value) < 2**31 else "i64"
    return sig, constexprs


def launches() -> dict:
    """Run fused forwards on the CPU with every kernel launch recorded, not run -> {key: launch}."""
    import dataclasses

    import torch
    from triton.runtime.jit import JITFunction

    import engine.fused  # noqa: F401  (the kernels, compiled: imported before the next line)
    from engine.fused.attention import BLOCK_KEYS, InvariantAttention
    from engine.fused.linear import linear
    from engine.fused.moe import align
    from engine.model import Transformer
    from engine.validate import random_weights
    from kdtr_format import PRESETS

    os.environ["TRITON_INTERPRET"] = "1"                 # lets the model take the fused layers on the CPU
    seen = {}

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        sig, constexprs = signature(self, args, kwargs)
        key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        seen.setdefault(key, (self, sig, constexprs, options))
    JITFunction.run = record
    for preset in ("tiny", "tiny2"):                       # q_lora + interleave; groups, neox, no q_lora
        cfg = dataclasses.replace(PRESETS[preset], num_hidden_layers=2)
        weights = random_weights(cfg)
        for dtype in (torch.float32, torch.bfloat16):
            for invariant in (False, True):        # invariant: its tensor-core attention, in two splits
                model = Transformer(cfg, weights, dtype=dtype, invariant=invariant, fused=True,
                                    attention=InvariantAttention(BLOCK_KEYS) if invariant else None)
                for n in (1, 24):
                    cache = model.new_cache(1, 2 * BLOCK_KEYS)
                    model(torch.zeros(1, n, dtype=torch.int64), torch.arange(n)[None],
                          torch.ones(1, n, n, dtype=torch.bool).tril(), torch.tensor([n]), torch.tensor([0]), cache)
    align(torch.zeros(520, 4, dtype=torch.int32), torch.ones(520, dtype=torch.uint8), 16, 64)  # a verify's spans
    align(torch.zeros(2056, 9, dtype=torch.int32), torch.ones(2056, dtype=torch.uint8), 385, 16)  # K2's experts
    for dtype in (torch.float32, torch.bfloat16):          # the invariant attention at K2's widths
        linear(torch.zeros(1, 256, dtype=dtype), torch.zeros(64, 256, dtype=dtype), invariant=True,
               split_count=2, in_program=True)            # a large M's form: the splits added in one program
        q_lat, q_pe = torch.zeros(1, 2, 64, 512, dtype=dtype), torch.zeros(1, 2, 64, 64, dtype=dtype)
        c_kv, k_pe = torch.zeros(1, 2 * BLOCK_KEYS, 512, dtype=dtype), torch.zeros(1, 2 * BLOCK_KEYS, 64, dtype=dtype)
        InvariantAttention(BLOCK_KEYS)(q_lat, q_pe, c_kv, k_pe, torch.tensor([0]), torch.tensor([2]),
                                       torch.ones(1, 2, 2, dtype=torch.bool), 0.1)
    return seen


def resources(cubin: bytes) -> str:
    """A cubin's registers and stack bytes a thread, by the cuobjdump in Triton's package
    ("resources unknown" where it has none)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return "resources unknown"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return f"{found[1]} registers, {found[2]} stack bytes" if found else "resources unknown"


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for (name, *_), (kernel, sig, constexprs, options) in launches().items():
        for arch in ARCHS:
            try:
                compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", arch, 32),
                                          options=options)
                print(f"compiled {name} sm_{arch} {constexprs} {options}: {resources(compiled.asm['cubin'])}")
            except Exception as exc:                       # noqa: BLE001 (every compiler error is reported)
                failed += 1
                print(f"FAILED {name} sm_{arch} {constexprs}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
