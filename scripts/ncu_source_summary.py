"""Summarize Nsight Compute's per-instruction page: where each kernel's warps stall, and what it executes.

    ncu --set full --import-source no -k regex:NAME -c N -o prof python3 case.py
    ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    python3 scripts/ncu_source_summary.py source.csv.gz [--top 30]

For each kernel in the file: the warp instructions executed, the warp-state samples by stall
reason (a share of all samples), the dynamic instruction mix by opcode, and the `--top`
instructions with the most samples, each with its two largest reasons. An instruction's line
number is its index in the kernel's SASS, so that neighbours can be read in the same file.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys
from dataclasses import dataclass


@dataclass
class Kernel:
    name: str
    rows: list[dict[str, str]]

    def value(self, row: dict[str, str], column: str) -> float:
        text = row.get(column, "")
        return float(text.replace(",", "")) if text not in ("", "-") else 0.0

    def total(self, column: str) -> float:
        return sum(self.value(r, column) for r in self.rows)


SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_kernels(path: str) -> list[Kernel]:
    """The kernels of an `ncu --page source --csv` export (plain or gzip), in order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    kernels = []
    for block in text.split('"Kernel Name",')[1:]:
        name_line, table = block.split("\n", 1)
        rows = list(csv.reader(io.StringIO(table)))
        header = rows[0]
        kernels.append(Kernel(next(csv.reader([name_line]))[0],
                              [dict(zip(header, r)) for r in rows[1:] if len(r) == len(header)]))
    return kernels


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(kernel: Kernel, top: int) -> str:
    reasons = [c for c in kernel.rows[0] if c.startswith("stall_") and "Not Issued" not in c] if kernel.rows else []
    samples, executed = kernel.total(SAMPLES), kernel.total(EXECUTED)
    lines = [f"== {kernel.name[:110]}",
             f"   SASS {len(kernel.rows)} instructions; executed {executed / 1e6:.1f} M warp instructions; "
             f"{samples:.0f} samples"]
    if samples:
        shares = sorted(((kernel.total(c) / samples, c[len("stall_"):]) for c in reasons), reverse=True)
        lines.append("   stalls: " + ", ".join(f"{name} {share:.3f}" for share, name in shares if share >= 0.005))
    mix = collections.Counter()
    for row in kernel.rows:
        mix[opcode(row["Source"])] += kernel.value(row, EXECUTED)
    if executed:
        lines.append("   executed: " + ", ".join(f"{op} {n / executed:.3f}" for op, n in mix.most_common(16)))
    ranked = sorted(range(len(kernel.rows)), key=lambda i: -kernel.value(kernel.rows[i], SAMPLES))[:top]
    for i in sorted(ranked):
        row = kernel.rows[i]
        why = sorted(((kernel.value(row, c), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        lines.append(f"   {i:6d} {kernel.value(row, SAMPLES) / samples * 100:5.2f}% "
                     f"x{kernel.value(row, EXECUTED):>10.0f}  {row['Source'].strip()[:64]:64s} "
                     + ", ".join(f"{name} {n:.0f}" for n, name in why if n))
    return "\n".join(lines)


def count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    parser.add_argument("--top", type=count, default=30, help="instructions with the most samples to list")
    args = parser.parse_args()
    try:
        kernels = read_kernels(args.csv)
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        parser.error(f"cannot read {args.csv}: {exc}")
    if not kernels:
        parser.error(f"{args.csv} has no \"Kernel Name\" section: not an `ncu --page source --csv` export")
    for kernel in kernels:
        print(summarize(kernel, args.top))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # piped into head
        sys.exit(0)
