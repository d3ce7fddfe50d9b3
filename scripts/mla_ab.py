"""Time one MLA kernel of several builds of the kernels library, and FlashMLA and FlashInfer, on the
same cases in one GPU run: the A/B test of a kernel change (issue 34), where a difference of a few percent is
only meaningful between builds timed in the same run, in alternating rounds.

    PYTHONPATH=.:tests:tests/kernels python3 scripts/mla_ab.py --kernel wgmma \
        --lib base=.libs/h.so --lib new=.libs/new.so [--rounds 3] [--flashmla] [--flashinfer] [--out ab.json]

Each round runs every build in its own process (a library is loaded once a process) over the
cases (paged K2 inputs, pages of 64: tests/kernels/test_bench_mla_peers.py's make_case, chains
and random trees), each case's time the median CUDA-graph replay time (gpu_bench.graph_time_ms). The
peers run the chains only, each after one eager call (FlashInfer plans its splits there); a peer
that a graph cannot capture is timed eagerly, its case marked "eager" in the JSON.
The report is each build's median over the rounds, and its ratio to the first build's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = (  # (context, tokens, batch, chain)
    (32768, 1, 32, True), (8192, 1, 8, True), (32768, 1, 1, True),
    (8192, 4, 32, True), (8192, 16, 32, True), (32768, 16, 8, True),
    (8192, 64, 8, False), (32768, 128, 32, False), (1024, 16, 32, False),
)


PEERS = ("flashmla", "flashinfer")


def case_id(context: int, tokens: int, batch: int, chain: bool) -> str:
    return f"ctx{context}-{'chain' if chain else 'tree'}{tokens}-b{batch}"


def time_cases(kernel: str, peer: str | None) -> tuple[dict[str, float], list[str]]:
    """In this process: each case's time (ms) of kdtree's `kernel`, or of the peer ("flashmla",
    "flashinfer"; chains only), and the cases timed eagerly (a peer's graph capture failed)."""
    import torch
    from gpu_bench import graph_time_ms, peer_time_ms
    from test_bench_mla_peers import (flashinfer_call, flashmla_call, kdtree_call, load_flashinfer, load_flashmla,
                                      make_case)

    peer_call = {None: None, "flashmla": (load_flashmla, flashmla_call),
                 "flashinfer": (load_flashinfer, flashinfer_call)}[peer]
    lib = peer_call[0]() if peer_call else None
    times, eager = {}, []
    for context, tokens, batch, chain in CASES:
        if peer_call and not chain:
            continue
        x = make_case(context, tokens, batch, chain, seed=1)
        name = case_id(context, tokens, batch, chain)
        if peer_call:
            call = peer_call[1](lib, x, context, tokens, batch)
            call()
            ms, eagerly = peer_time_ms(call)
            if eagerly:
                eager.append(name)
        else:
            ms = graph_time_ms(kdtree_call(x, context, tokens, batch, kernel))
            if isinstance(ms, str):
                raise RuntimeError(f"{name}: {ms}")
        times[name] = ms
        del x
        torch.cuda.empty_cache()
    return times, eager


def round_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 100")
    return int(text)


def build(entry: str) -> tuple[str, str]:
    """--lib NAME=PATH -> (NAME, PATH) of an existing file."""
    name, sep, path = entry.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{entry!r} is not NAME=PATH")
    if name in PEERS:
        raise argparse.ArgumentTypeError(f"the name {name!r} is --{name}'s")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a file")
    return name, os.path.abspath(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="auto", help="kdtree's kernel name (mla_ops.verify_kernel's choices)")
    parser.add_argument("--lib", action="append", default=[], type=build, metavar="NAME=PATH",
                        help="a build to time (one or more; the first is the others' reference)")
    parser.add_argument("--rounds", type=round_count, default=3, help="1 to 100 (default 3)")
    parser.add_argument("--flashmla", action="store_true", help="time FlashMLA's chains in each round too")
    parser.add_argument("--flashinfer", action="store_true", help="time FlashInfer's chains in each round too")
    parser.add_argument("--out", help="write the rounds and medians as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        times, eager = time_cases(args.kernel, args.child if args.child in PEERS else None)
        print(json.dumps({"times": times, "eager": eager}))
        return 0

    builds = dict(args.lib)
    if not builds:
        parser.error("name at least one build: --lib NAME=PATH")
    import torch
    if not torch.cuda.is_available():
        print("mla_ab: needs a CUDA GPU: none visible to torch", file=sys.stderr)
        return 1
    runs = list(builds) + [peer for peer in PEERS if getattr(args, peer)]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    eager: dict[str, set[str]] = {name: set() for name in runs}
    for _ in range(args.rounds):
        for name in list(runs):
            env = dict(os.environ)
            if name not in PEERS:
                env["KDTREE_KERNELS_LIB"] = builds[name]
            try:
                done = subprocess.run([sys.executable, __file__, "--kernel", args.kernel, "--child", name],
                                      env=env, capture_output=True, text=True, timeout=300)
                why = None if done.returncode == 0 else \
                    f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}"
            except subprocess.TimeoutExpired:
                why = "no result within 300 s"
            if why and name in PEERS:           # a peer that fails is left out; the builds' rows stay
                print(f"mla_ab: {name} left out: {why}", file=sys.stderr)
                runs.remove(name)
                continue
            if why:
                print(f"mla_ab: {name}: {why}", file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rounds[name].append(result["times"])
            eager[name].update(result["eager"])
    medians = {name: {case: statistics.median(r[case] for r in rounds[name]) for case in rounds[name][0]}
               for name in runs}
    first = runs[0]
    print(f"{'case':24s}" + "".join(f"{name:>16s}" for name in runs))
    for case, base in medians[first].items():
        cells = [f"{base:10.4f} ms"] + [
            f"{medians[n][case]:8.4f}{'*' if case in eager[n] else ' '}{base / medians[n][case]:5.3f}x"
            if case in medians[n] else f"{'':16s}"
            for n in runs[1:]]
        print(f"{case:24s}" + "".join(f"{c:>16s}" for c in cells))
    print(f"(each build's median over {args.rounds} rounds; x = {first}'s time / the build's;"
          " * timed eagerly: the peer's graph capture failed)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kernel": args.kernel, "builds": builds, "rounds": rounds, "medians": medians,
                       "eager": {name: sorted(cases) for name, cases in eager.items() if cases}}, f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("mla_ab: interrupted", file=sys.stderr)
        sys.exit(130)
