"""Invariant mode's float32 kernels at the engine benchmark's shapes, on one GPU: tile rows and
attention splits, timed, and whether the tile changes any bit.

    PYTHONPATH=. python3 scripts/sweep_float32_invariant.py [OUT.json]
    PYTHONPATH=. python3 scripts/sweep_float32_invariant.py --table OUT.json      # its tables again

An exact float32 tile product (`tl.dot(..., input_precision="ieee")`) is lowered by Triton to
one FMA chain per output element, over k in order, so the rows of a tile should change no bit
of a row's output, only the work that padding rows cost. This measures both at k2-mid's shapes
(tests/engine/test_bench_engine.py), float32:

- the dense products (`linear`, invariant) of every weight of the layer and the head, at the
  benchmark's row counts, per tile rows, beside cuBLAS (`x @ w.T`);
- the experts (`experts`, invariant: 16 routed + 1 shared, top 4) per tile rows;
- the attention (`InvariantAttention`) per (split keys, heads a program, warps), beside the CUDA
  kernel's default split plan and its invariant plan (`CudaAttention`).

"rN": float32 tiles of at most N rows (`tiles.INVARIANT_BLOCK_M`; a call of fewer rows takes the
smallest power of two holding them). Each timing is the median of CUDA-event timings
(tests/kernels/gpu_bench.py); "bits" is the largest difference from the first candidate of the
same reduction order (0.0: the same bits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, "tests/kernels")
sys.path.insert(0, "scripts")

from engine.cuda_attention import CudaAttention  # noqa: E402
from engine.fused import linear, moe, tiles  # noqa: E402
from engine.fused.attention import InvariantAttention  # noqa: E402
from gpu_bench import cuda_time_ms  # noqa: E402
from sweep_invariant_attention import HEADS, RANK, ROPE, SHAPES, chain_visibility  # noqa: E402

ROWS = [1, 8, 17, 65, 136, 520, 2056]
WEIGHTS = {"q_a + kv_a": (2112, 2048), "q_b": (12288, 1536), "o": (2048, 8192), "head": (32768, 2048)}
TILE_ROWS = [1, 2, 4, 8, 16, 32]
ATTENTION = [(128, 16, 4), (64, 16, 4), (64, 4, 2)]


def tile_rows_for(m: int) -> list[int]:
    """The tile rows swept at m rows: every one where m rows make at most 64 tiles, else 16 and 32
    (a 1-row tile reads the weight once a row: seconds a call at thousands of rows)."""
    return [r for r in TILE_ROWS if m <= 64 * r or r >= 16]


def with_tile_rows(rows: int, fn):
    """fn() with invariant mode's float32 tile rows set to `rows`."""
    kept = tiles.INVARIANT_BLOCK_M[torch.float32]
    tiles.INVARIANT_BLOCK_M[torch.float32] = rows
    try:
        return fn()
    finally:
        tiles.INVARIANT_BLOCK_M[torch.float32] = kept


def products(g: torch.Generator) -> list[dict]:
    out = []
    for name, (n, k) in WEIGHTS.items():
        w = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
        for m in ROWS:
            x = torch.randn(m, k, generator=g, device="cuda")
            row = {"part": "linear", "weight": name, "rows": m, "cublas_ms": cuda_time_ms(lambda: x @ w.T)}
            first = None
            for rows in tile_rows_for(m):
                got = with_tile_rows(rows, lambda: linear.linear(x, w, invariant=True))
                first = got if first is None else first
                row[f"r{rows}_ms"] = with_tile_rows(
                    rows, lambda: cuda_time_ms(lambda: linear.linear(x, w, invariant=True)))
                row[f"r{rows}_bits"] = float((got - first).abs().max())
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


EXPERTS = (16, 1, 4, 1024, 2048)    # k2-mid's MoE: routed, shared, top-k, inner width, model width


def expert_weights(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """-> w_gate, w_up [E, I, D], w_down [E, D, I] float32 (E routed + shared), scaled by 1/sqrt(fan-in)."""
    e, shared, _, inner, width = EXPERTS
    w_gate, w_up = (torch.randn(e + shared, inner, width, generator=g, device="cuda") / width ** 0.5 for _ in "gu")
    return w_gate, w_up, torch.randn(e + shared, width, inner, generator=g, device="cuda") / inner ** 0.5


def expert_inputs(g: torch.Generator, m: int) -> tuple[torch.Tensor, ...]:
    """m rows -> h [m, D] float32, idx int32 [m, k + shared] (k random routed, then the shared
    expert), weight float32 [m, k + shared], real uint8 [m] (all ones)."""
    e, shared, top, _, width = EXPERTS
    h = torch.randn(m, width, generator=g, device="cuda")
    routed = torch.rand(m, e, generator=g, device="cuda").topk(top, dim=1).indices
    idx = torch.cat([routed, torch.full((m, shared), e, device="cuda")], 1).to(torch.int32)
    weight = torch.rand(m, top + shared, generator=g, device="cuda")
    return h, idx, weight, torch.ones(m, dtype=torch.uint8, device="cuda")


def experts(g: torch.Generator) -> list[dict]:
    w_gate, w_up, w_down = expert_weights(g)
    out = []
    for m in ROWS:
        h, idx, weight, real = expert_inputs(g, m)

        def call():
            return moe.experts(h, idx, weight, real, w_gate, w_up, w_down, invariant=True)
        row = {"part": "experts", "rows": m}
        first = None
        for rows in tile_rows_for(m):
            got = with_tile_rows(rows, call)
            first = got if first is None else first
            row[f"r{rows}_ms"] = with_tile_rows(rows, lambda: cuda_time_ms(call))
            row[f"r{rows}_bits"] = float((got - first).abs().max())
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def attention(g: torch.Generator) -> list[dict]:
    out = []
    for batch, n, context in SHAPES:
        starts = torch.tensor([context + 16 * b for b in range(batch)], device="cuda")
        slots = int(starts.max()) + n + 1
        q_lat, q_pe = (torch.randn(batch, n, HEADS, d, generator=g, device="cuda") for d in (RANK, ROPE))
        c_kv, k_pe = (torch.randn(batch, slots, d, generator=g, device="cuda") for d in (RANK, ROPE))
        n_new = torch.full((batch,), n, device="cuda")
        vis = chain_visibility(batch, n)
        default = CudaAttention().bind(starts, n_new, vis, slots)
        invariant = CudaAttention(invariant=True).bind(starts, n_new, vis, slots)
        expected = default(q_lat, q_pe, c_kv, k_pe, 0.07)
        row = {"part": "attention", "batch": batch, "rows": batch * n, "slots": slots,
               "default_ms": cuda_time_ms(lambda: default(q_lat, q_pe, c_kv, k_pe, 0.07)),
               "cuda_invariant_ms": cuda_time_ms(lambda: invariant(q_lat, q_pe, c_kv, k_pe, 0.07)),
               "cuda_invariant_diff": float((invariant(q_lat, q_pe, c_kv, k_pe, 0.07) - expected).abs().max())}
        firsts: dict[int, torch.Tensor] = {}
        for split_keys, block_h, warps in ATTENTION:
            attend = InvariantAttention(split_keys, block_h, warps).bind(starts, n_new, vis, slots)
            got = attend(q_lat, q_pe, c_kv, k_pe, 0.07)
            first = firsts.setdefault(split_keys, got)
            key = f"s{split_keys}_h{block_h}_w{warps}"
            row[key + "_ms"] = cuda_time_ms(lambda: attend(q_lat, q_pe, c_kv, k_pe, 0.07))
            row[key + "_bits"] = float((got - first).abs().max())
            row[key + "_diff"] = float((got - expected).abs().max())
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def table(doc: dict) -> str:
    """The sweep's JSON as markdown: ms per candidate (and whether its bits differ)."""
    def cell(row: dict, key: str) -> str:
        if key + "_ms" not in row:
            return "-"
        flag = "" if row.get(key + "_bits", 0.0) == 0.0 else " (bits differ)"
        return f"{row[key + '_ms']:.3f}{flag}"
    tiles_ = [f"r{r}" for r in TILE_ROWS]
    lines = ["| part | rows | " + " | ".join(f"at most {r} rows" for r in TILE_ROWS) + " | cuBLAS |",
             "|---" * (3 + len(TILE_ROWS)) + "|"]
    for row in doc["experts"] + doc["linear"]:
        name = row["part"] + (f" {row['weight']}" if "weight" in row else "")
        lines.append(f"| {name} | {row['rows']} | " + " | ".join(cell(row, t) for t in tiles_)
                     + f" | {row.get('cublas_ms', float('nan')):.3f} |")
    plans = [f"s{s}_h{h}_w{w}" for s, h, w in ATTENTION]
    lines += ["", "| batch | rows | CUDA default | CUDA invariant | " + " | ".join(
        f"Triton {s} keys, {h} heads, {w} warps" for s, h, w in ATTENTION) + " |", "|---" * (4 + len(plans)) + "|"]
    for row in doc["attention"]:
        lines.append(f"| {row['batch']} | {row['rows']} | {row['default_ms']:.3f} | {row['cuda_invariant_ms']:.3f} | "
                     + " | ".join(cell(row, p) for p in plans) + " |")
    return "\n".join(lines)


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sweep_float32_invariant", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write the sweep's JSON here")
    parser.add_argument("--table", metavar="JSON", help="print the tables of a sweep's JSON and stop")
    opts = parser.parse_args(args)
    if opts.table:
        try:
            print(table(json.loads(Path(opts.table).read_text())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"sweep_float32_invariant: cannot read a sweep from {opts.table}: {exc}", file=sys.stderr)
            return 1
        return 0
    if not torch.cuda.is_available():
        print("sweep_float32_invariant: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    doc = {"gpu": torch.cuda.get_device_name(), "attention": attention(g), "experts": experts(g),
           "linear": products(g)}
    if opts.out:
        Path(opts.out).write_text(json.dumps(doc, indent=1))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
