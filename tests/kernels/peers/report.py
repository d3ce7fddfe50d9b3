"""The tables and the issue-34 targets from tests/kernels/test_bench_mla_peers.py's JSON.

    python3 -m peers.report RUN.json [--noa NOA.json]  > docs/results/mla-peers-<gpu>.md

(with tests/kernels on PYTHONPATH). NOA.json: the tree grid run with a library built without
sm_90a (its default kernel is mma.sync), whose rates judge the mma.sync target and fill the
"no sm_90a" column; without it, that target is not measured (the "mma" column of RUN.json is
the mma.sync kernel of the sm_90a library, shown for information). Each target is judged over
the rows it names: met, not met (with the worst case), or not measured (no row of that shape
carries the figure, e.g. a peer void in every case). The chain table gets FlashInfer's columns
when the run timed it (scripts/build_flashinfer_mla.sh had built it); a run on Hopper also gets
the two wgmma kernels forced side by side (the one-scorer kernel, auto's, and the seesaw), with
how often and by how much each was the faster. Exit 2 with one line for a file that cannot be
read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """At least `at_least` of `figure` in every row of `grid` that `where` picks."""

    text: str
    grid: str                                   # "chain" or "tree"
    figure: str                                 # a row key
    at_least: float
    where: Callable[[dict], bool]
    percent: bool = False                       # shown as a percentage


TARGETS = (
    Target("decode, batch >= 8, context >= 8k: >= 1.0x FlashMLA", "chain", "flashmla_ratio", 1.0,
           lambda r: r["tokens"] == 1 and r["batch"] >= 8 and r["context"] >= 8192),
    Target("decode, batch >= 8, context >= 8k: >= 85% of the copy bandwidth", "chain", "bw_fraction", 0.85,
           lambda r: r["tokens"] == 1 and r["batch"] >= 8 and r["context"] >= 8192, percent=True),
    Target("decode, batch 1, context >= 8k: >= 0.8x FlashMLA", "chain", "flashmla_ratio", 0.8,
           lambda r: r["tokens"] == 1 and r["batch"] == 1 and r["context"] >= 8192),
    Target("causal chains of 2-16 tokens: >= 0.9x FlashMLA at every shape", "chain", "flashmla_ratio", 0.9,
           lambda r: 2 <= r["tokens"] <= 16),
    Target("trees of 16-128 tokens, context >= 8k: >= 65% of the bf16 rate", "tree", "mma_fraction", 0.65,
           lambda r: 16 <= r["tokens"] <= 128 and r["context"] >= 8192, percent=True),
    Target("trees of 16-128 tokens: >= 10x SGLang's extend kernel at every case", "tree", "sglang_extend_ratio",
           10.0, lambda r: 16 <= r["tokens"] <= 128),
    Target("mma.sync build (no sm_90a), context >= 8k, 16+ tokens: >= 40% of the bf16 rate", "tree", "noa_fraction", 0.40,
           lambda r: r["tokens"] >= 16 and r["context"] >= 8192, percent=True),
)


@dataclass(frozen=True)
class Verdict:
    target: Target
    measured: int                               # rows of the target's shape that carry the figure
    expected: int                               # rows of the target's shape
    worst: dict | None                          # the row with the lowest figure

    @property
    def status(self) -> str:
        if self.worst is None:
            return "not measured"
        return "met" if self.worst[self.target.figure] >= self.target.at_least else "NOT MET"


def merge_noa(data: dict, noa: dict) -> dict:
    """data with each tree row's no-sm_90a figures (noa_ms, noa_fraction) from noa's row of the
    same case, as a fraction of data's bf16 ceiling (one machine's ceiling for both runs)."""
    rate = data["ceilings"]["bf16_TFLOPs"]
    theirs = {(r["context"], r["tokens"], r["batch"]): r for r in noa.get("tree", [])}
    trees = []
    for r in data.get("tree", []):
        other = theirs.get((r["context"], r["tokens"], r["batch"]))
        if other is not None and other.get("kernel") == "mma":
            r = {**r, "noa_ms": other["kernel_ms"], "noa_fraction": r["flops"] / other["kernel_ms"] / 1e9 / rate}
        trees.append(r)
    return {**data, "tree": trees}


def judge(data: dict) -> list[Verdict]:
    """Each target over the run's rows."""
    verdicts = []
    for target in TARGETS:
        rows = [r for r in data.get(target.grid, []) if target.where(r)]
        have = [r for r in rows if isinstance(r.get(target.figure), (int, float))]
        worst = min(have, key=lambda r: r[target.figure]) if have else None
        verdicts.append(Verdict(target, len(have), len(rows), worst))
    return verdicts


def _num(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _pct(value) -> str:
    return f"{100 * value:.1f}" if isinstance(value, (int, float)) else "-"


def _case(r: dict) -> str:
    return f"ctx {r['context']} / {r['tokens']} tokens / batch {r['batch']}"


def hopper_kernels(data: dict) -> list[str]:
    """The two wgmma kernels forced in every case that timed both (a run on Hopper): their times,
    the seesaw's over the one-scorer kernel's, and a line counting where each was the faster."""
    rows = [(grid, r) for grid in ("chain", "tree") for r in data.get(grid, [])
            if isinstance(r.get("wgmma_ms"), (int, float)) and isinstance(r.get("wgmma_pairs_ms"), (int, float))]
    if not rows:
        return []
    ratios = [r["wgmma_pairs_ms"] / r["wgmma_ms"] for _, r in rows]
    one_faster = [x for x in ratios if x > 1]
    seesaw_faster = [1 / x for x in ratios if x <= 1]
    summary = f"The one-scorer kernel was the faster in {len(one_faster)} of {len(rows)} cases"
    summary += f" (by {min(one_faster):.3f}-{max(one_faster):.2f}x)" if one_faster else ""
    summary += (f", the seesaw in {len(seesaw_faster)} (by at most {max(seesaw_faster):.3f}x)." if seesaw_faster
                else ", the seesaw in none.")
    out = ["", "## The two Hopper kernels, forced", "",
           "One-scorer: `wgmma`, the kernel `auto` takes; seesaw: `wgmma_pairs`, run when named. " + summary, "",
           "| grid | ctx | tokens | batch | one-scorer ms | seesaw ms | seesaw / one-scorer |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for (grid, r), ratio in zip(rows, ratios):
        out.append(f"| {grid} | {r['context']} | {r['tokens']} | {r['batch']} | {_num(r['wgmma_ms'])} | "
                   f"{_num(r['wgmma_pairs_ms'])} | {ratio:.2f} |")
    return out


def render(data: dict) -> str:
    c = data["ceilings"]
    out = [f"GPU: {c['gpu']}; ceilings measured in the run: copy {c['copy_TBps']:.2f} TB/s, "
           f"bf16 {c['bf16_TFLOPs']:.0f} TFLOP/s; pages of {data.get('page_size', '?')} slots.", ""]
    out += ["## Targets", "", "| target | status | worst case | figure | rows measured |", "|---|---|---|---:|---:|"]
    for v in judge(data):
        t = v.target
        figure = "-" if v.worst is None else (_pct(v.worst[t.figure]) + " %" if t.percent
                                              else _num(v.worst[t.figure], 2) + "x")
        out.append(f"| {t.text} | {v.status} | {_case(v.worst) if v.worst else '-'} | {figure} | "
                   f"{v.measured} / {v.expected} |")
    chains = data.get("chain", [])
    flashinfer = any("flashinfer" in r for r in chains)           # a run where FlashInfer's MLA was built
    fi_title, fi_head, fi_rule = ((" and FlashInfer", " FlashInfer ms | FlashInfer / kdtree | FlashInfer error |",
                                   "---:|---:|---:|") if flashinfer else ("", "", ""))
    out += ["", "## Decode and causal chains: kdtree beside FlashMLA" + fi_title, "",
            "FlashMLA / kdtree > 1: kdtree faster. Error: relative Frobenius difference of the two bf16 outputs.", "",
            "| ctx | tokens | batch | kdtree ms | FlashMLA ms | FlashMLA / kdtree | kdtree % copy | FlashMLA % copy "
            "| kdtree % bf16 | error |" + fi_head,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + fi_rule]
    for r in chains:
        note = f" ({r['flashmla_void']})" if "flashmla_void" in r else ""
        line = (f"| {r['context']} | {r['tokens']} | {r['batch']} | {_num(r['kernel_ms'])} | "
                f"{_num(r.get('flashmla_ms'))}{note} | {_num(r.get('flashmla_ratio'), 2)} | {_pct(r['bw_fraction'])} | "
                f"{_pct(r.get('flashmla_bw_fraction'))} | {_pct(r['mma_fraction'])} | "
                f"{_num(r.get('flashmla_error'), 4) if 'flashmla_error' in r else '-'} |")
        if flashinfer:
            note = f" ({r['flashinfer_void']})" if "flashinfer_void" in r else ""
            line += (f" {_num(r.get('flashinfer_ms'))}{note} | {_num(r.get('flashinfer_ratio'), 2)} | "
                     f"{_num(r.get('flashinfer_error'), 4) if 'flashinfer_error' in r else '-'} |")
        out.append(line)
    out += ["", "## Trees: kdtree (wgmma and mma.sync) beside SGLang's extend kernel", "",
            "mma: the mma.sync kernel of the same (sm_90a) library; no sm_90a: the default kernel of a library "
            "built without sm_90a (mma.sync), from the second run.", "",
            "| ctx | tokens | batch | kdtree ms | kdtree % bf16 | mma ms | mma % bf16 | no sm_90a ms | no sm_90a % bf16 "
            "| SGLang extend ms | SGLang / kdtree | error |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data.get("tree", []):
        note = f" ({r['sglang_extend_void']})" if "sglang_extend_void" in r else ""
        out.append(f"| {r['context']} | {r['tokens']} | {r['batch']} | {_num(r['kernel_ms'])} | "
                   f"{_pct(r['mma_fraction'])} | {_num(r.get('mma_ms'))} | {_pct(r.get('mma_fraction_mma'))} | "
                   f"{_num(r.get('noa_ms'))} | {_pct(r.get('noa_fraction'))} | "
                   f"{_num(r.get('sglang_extend_ms'))}{note} | {_num(r.get('sglang_extend_ratio'), 2)} | "
                   f"{_num(r.get('sglang_extend_error'), 4) if 'sglang_extend_error' in r else '-'} |")
    out += hopper_kernels(data)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m peers.report", description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the JSON test_bench_mla_peers.py wrote ($KDTREE_BENCH_OUT)")
    parser.add_argument("--noa", help="the tree grid's JSON from a library built without sm_90a")
    args = parser.parse_args(argv)
    path = args.json
    try:
        with open(path) as f:
            data = json.load(f)
        if args.noa:
            path = args.noa
            with open(path) as f:
                data = merge_noa(data, json.load(f))
        text = render(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"peers.report: cannot read {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
