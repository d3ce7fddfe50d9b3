"""FlashInfer's MLA through our wrapper, fa2 and fa3, on a few tiny cases: a first look after a failure.

Run on the GPU machine from the repository root, with .peers/flashinfer_mla/ carried:

    python3 scripts/flashinfer_mla_probe.py            # both backends, each in its own process
    python3 scripts/flashinfer_mla_probe.py fa3        # one, in this process

Per case (context, tokens, batch: decode, then causal chains): whether the device workspace holds
the schedule the planner staged in the pinned one (the copy fimla_plan makes), the plan's grid,
the output's first non-finite element (token, head, column) if any, and the relative error against
the float32 reference of tests/kernels/peers/test_flashinfer_mla.py. A CUDA fault ends the backend's
process (the context is lost) and is printed; the other backend still runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [(100, 1, 1), (1000, 1, 3), (1000, 4, 3), (4097, 16, 2)]


def probe(backend: str) -> None:
    import torch

    from peers import load_flashinfer
    from peers.test_flashinfer_mla import HEADS, LATENT, SCALE, planned_case, reference

    fi = load_flashinfer(backend)
    print(f"{fi.version} on {torch.cuda.get_device_name()}", flush=True)
    for context, tokens, batch in CASES:
        q, kcache, block_table, plan = planned_case(fi, context, tokens, batch)
        info = list(plan.info)
        staged = info[15] + 4 * (info[1] + 1)           # through work_indptr, the last array the plan fills
        copied = torch.equal(plan.int_ws[:staged].cpu(), plan.int_host[:staged])
        print(f"  ctx {context} tokens {tokens} batch {batch}: grid {info[0]}x{info[1]}, "
              f"schedule on the device {'matches' if copied else 'DIFFERS FROM'} the staged one", flush=True)
        out = fi.run(plan, q.view(batch * tokens, HEADS, -1), kcache, block_table.view(-1), SCALE)
        torch.cuda.synchronize()
        bad = (~out.isfinite()).nonzero()
        want = reference(q, kcache, block_table, context, SCALE).view(batch * tokens, HEADS, LATENT)
        error = ((out.float() - want).norm() / want.norm()).item()
        where = f"{len(bad)} non-finite, first at {tuple(bad[0].tolist())}" if len(bad) else "all finite"
        print(f"    {where}; relative error {error:.2e} ({'ok' if error < 1e-2 else 'WRONG'})", flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        sys.path.insert(0, str(ROOT / "tests" / "kernels"))
        from peers import PeerUnavailable

        if sys.argv[1] not in ("fa2", "fa3"):
            print(f"flashinfer_mla_probe: {sys.argv[1]!r} is not a backend (fa2, fa3)", file=sys.stderr)
            return 2
        try:
            probe(sys.argv[1])
        except PeerUnavailable as exc:
            print(f"flashinfer_mla_probe: {exc}", file=sys.stderr)
            return 1
        return 0
    status = 0
    for backend in ("fa2", "fa3"):
        print(f"== {backend}", flush=True)
        status |= subprocess.run([sys.executable, __file__, backend]).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
