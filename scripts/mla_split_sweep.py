"""Time the MLA verify kernel at every split length its plan can pick, beside the plan's pick.

The kernel is the one `auto` runs; the plan is kernels_cuda/mla_ops.py `plan_splits`. The sweep
shows how much the plan's cost model leaves on the table, case by case, in one GPU run (issue 34:
decode and short splits).

    PYTHONPATH=.:tests:tests/kernels python3 scripts/mla_split_sweep.py --out sweep.json [--budget-ms 15]

Cases: tests/kernels/test_bench_mla_peers.py's inputs (K2 dims, bf16, paged, pages of 64),
contexts 1k / 8k / 32k, chains of 1 / 2 / 4 / 8 / 16 tokens and random trees of 16 / 64 / 128,
batches 1 / 8 / 32. Each split length the plan can pick (1 to MAX_SPLITS splits) is forced by
replacing `plan_splits` for one CUDA-graph capture; each time is the median replay time
(gpu_bench.graph_time_ms). The JSON, written after every case, holds per case the plan's split
length and every length's split count and ms; `--fit` prints, for SPLIT_COST_TILES 0-16 (at the
plan's COMBINE_COST_TILES) and for COMBINE_COST_TILES 0-0.5 (at its SPLIT_COST_TILES), the time of
the length the plan would pick against each case's best.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

CONTEXTS = (1024, 8192, 32768)
SHAPES = tuple((t, True) for t in (1, 2, 4, 8, 16)) + tuple((t, False) for t in (16, 64, 128))
BATCHES = (1, 8, 32)


def split_lengths(max_kv: int) -> dict[int, int]:
    """{split_keys: splits}: every split length the plan can pick for max_kv keys (1 to MAX_SPLITS splits)."""
    import kernels_cuda.mla_ops as ops
    tiles = math.ceil(max_kv / ops.KEY_BLOCK)
    lengths: dict[int, int] = {}
    for s in range(1, min(tiles, ops.MAX_SPLITS) + 1):
        keys = ops.KEY_BLOCK * math.ceil(tiles / s)
        lengths.setdefault(keys, math.ceil(max_kv / keys))
    return lengths


def sweep(out: str, budget_ms: float) -> None:
    import torch
    import kernels_cuda.mla_ops as ops
    from gpu_bench import graph_time_ms
    from test_bench_mla_peers import HEADS, kdtree_call, make_case

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    default_plan = ops.plan_splits
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            for tokens, chain in SHAPES:
                max_kv = context + tokens
                x = make_case(context, tokens, batch, chain, seed=1)
                call = kdtree_call(x, context, tokens, batch)
                plan = default_plan(batch, tokens, HEADS, max_kv, True, sm_count)
                lengths = split_lengths(max_kv)
                ms = {}
                for keys, splits in sorted(lengths.items()):
                    ops.plan_splits = lambda *a, _p=ops.SplitPlan(splits, keys), **k: _p
                    try:
                        ms[keys] = graph_time_ms(call, budget_ms)
                    finally:
                        ops.plan_splits = default_plan
                best = min((v, k) for k, v in ms.items() if isinstance(v, float))
                rows.append(dict(context=context, tokens=tokens, batch=batch, chain=chain, sm_count=sm_count,
                                 plan_keys=plan.split_keys, splits={str(k): n for k, n in lengths.items()},
                                 ms={str(k): v for k, v in ms.items()}))
                print(f"ctx {context:5d} {'chain' if chain else 'tree '} {tokens:3d} batch {batch:3d}: plan "
                      f"{plan.num_splits:3d} splits {ms[plan.split_keys]} ms, best {lengths[best[1]]:3d} "
                      f"{best[0]:.4f} ms ({len(ms)} lengths)", flush=True)
                with open(out, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
                del x, call
                torch.cuda.empty_cache()


def plan_over_best(rows: list[dict], split_cost: float, combine_cost: float) -> list[float]:
    """Per sweep row: the measured time of the split length plan_splits picks with
    SPLIT_COST_TILES = split_cost and COMBINE_COST_TILES = combine_cost, over the row's best time
    (inf where that length was not timed)."""
    import kernels_cuda.mla_ops as ops
    from test_bench_mla_peers import HEADS
    default = ops.SPLIT_COST_TILES, ops.COMBINE_COST_TILES
    ops.SPLIT_COST_TILES, ops.COMBINE_COST_TILES = split_cost, combine_cost
    try:
        ratios = []
        for r in rows:
            ms = {int(k): v for k, v in r["ms"].items() if isinstance(v, float)}
            plan = ops.plan_splits(r["batch"], r["tokens"], HEADS, r["context"] + r["tokens"], True, r["sm_count"])
            ratios.append(ms.get(plan.split_keys, math.inf) / min(ms.values()))
        return ratios
    finally:
        ops.SPLIT_COST_TILES, ops.COMBINE_COST_TILES = default


def summary(ratios: list[float]) -> str:
    """plan / best ratios -> their geomean, worst and count within 5%, one line."""
    finite = [v for v in ratios if v != math.inf]
    mean = math.exp(sum(math.log(v) for v in finite) / len(finite)) if finite else math.nan
    return (f"plan / best geomean {mean:.3f}, worst {max(ratios):.3f}, within 5% in "
            f"{sum(v <= 1.05 for v in ratios)} of {len(ratios)}, untimed {len(ratios) - len(finite)}")


def fit(path: str) -> None:
    """The plan's picks read against the sweep's measured times, for each SPLIT_COST_TILES of 0-16
    and each COMBINE_COST_TILES of 0-0.5 (the other at the plan's value)."""
    import kernels_cuda.mla_ops as ops
    with open(path) as f:
        rows = json.load(f)["rows"]
    if not rows:
        raise ValueError("the sweep holds no rows")
    for cost in range(0, 17):
        print(f"SPLIT_COST_TILES {cost:4d}: {summary(plan_over_best(rows, cost, ops.COMBINE_COST_TILES))}")
    for step in range(0, 11):
        cost = step * 0.05
        print(f"COMBINE_COST_TILES {cost:4.2f}: {summary(plan_over_best(rows, ops.SPLIT_COST_TILES, cost))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mla_split_sweep.json", help="the JSON written (default %(default)s)")
    parser.add_argument("--budget-ms", type=float, default=15.0, help="replay time per timing (default %(default)s)")
    parser.add_argument("--fit", metavar="JSON", help="read a sweep's JSON and judge the plan's cost model")
    args = parser.parse_args(argv)
    if not args.budget_ms > 0:
        parser.error(f"--budget-ms {args.budget_ms}: give a positive time")
    try:
        if args.fit:
            fit(args.fit)
        else:
            import torch
            if not torch.cuda.is_available():
                raise SystemExit("mla_split_sweep: needs a CUDA GPU (none is visible to torch)")
            sweep(args.out, args.budget_ms)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise SystemExit(f"mla_split_sweep: {args.fit or args.out}: {type(exc).__name__}: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
