"""Time and memory of a sliced import of a K2-shaped checkpoint, and of validating it (docs/scale_up_k2.md).

    PYTHONPATH=. python3 scripts/k2_slice_import.py --work /tmp/k2 [--quant fp8|int4] [--threads N]
                                                    [--no-validate] [--keep]

1. Writes a synthetic checkpoint at Kimi K2's real dims (hidden 7168, vocab 163840, 64 heads,
   q_lora 1536, kv_lora 512, moe_intermediate 2048, intermediate 18432) in K2's shipped layout
   (FP8 blocks; or K2 Thinking's INT4 experts with --quant int4) with 3 layers (1 dense, 2 MoE)
   and 16 routed experts, so that the slice below is smaller than the checkpoint. Weights are
   seeded normals scaled as refgen's presets (std 1/sqrt(fan_in), output projections 0.5x,
   norms U(0.8, 1.2), head std 3/sqrt(D)), made one tensor at a time. A checkpoint already in
   WORK is reused.
2. Runs what ``refgen generate --checkpoint DIR --layers 2 --experts 8`` runs, in a fresh process,
   phase by phase (open and map; read the slice: hash, check and dequantize; the float64
   references of the default plan on N threads, default every core; write), recording each
   phase's seconds, peak resident memory (sampled every 0.2 s from /proc/self/status: total,
   anonymous, and file-backed, i.e. the memory-mapped checkpoint and fixture pages) and the
   load average at its end, and the process's high-water mark (VmHWM).
3. Runs ``kdtree validate --fixtures FIXTURE`` on the fixture it wrote (the built-in engine, float32
   on the CPU), recording its seconds, exit status and the same memory figures, sampled from
   /proc/PID/status.

Prints one JSON object (also written to WORK/k2_slice_import_QUANT.json). Needs about 7 GB of disk
for the checkpoint and about 0.5 GB for the fixture (deleted unless --keep), and about 15 GB of RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PHASES = r'''
import json, os, sys, threading, time
from pathlib import Path
from refgen.checkpoint import checkpoint_fixture, load, open_checkpoint, plan_import
from refgen.files import write_fixture
from refgen.model import set_threads

def status():
    # VmRSS, RssAnon, RssFile of this process in GiB (/proc/self/status; kB there)
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "RssAnon", "RssFile")}

peak = {}
def sample():                      # numpy releases the GIL in its heavy loops: a 0.2 s sampler sees them
    while True:
        for k, v in status().items():
            peak[k] = max(peak.get(k, 0.0), v)
        time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()

directory, out, threads = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
set_threads(threads)
phases, began = {}, time.perf_counter()
def phase(name, work):
    peak.clear()
    t = time.perf_counter()
    result = work()
    phases[name] = {"seconds": round(time.perf_counter() - t, 1),
                    **{f"peak_{k}_gib": round(v, 2) for k, v in peak.items()},
                    "load_average": round(os.getloadavg()[0], 1)}
    print(name, phases[name], file=sys.stderr, flush=True)
    return result

steps = [0]
def step(n):
    steps[0] += n
    print(f"  step {steps[0]} at {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)

plan = phase("open and map", lambda: plan_import(open_checkpoint(directory), layers=2, experts=8))
imported = phase("read the slice (sha256, finiteness, dequantize)", lambda: load(plan))
fixture = phase("references (default plan)", lambda: checkpoint_fixture(imported, seed=0, progress=step))
path = out / f"{imported.name}.kdtr"
phase("write fixture", lambda: write_fixture(path, fixture))
hwm = int(dict(line.split(":", 1) for line in open("/proc/self/status"))["VmHWM"].split()[0]) / 2**20
print(json.dumps({"phases": phases, "total_seconds": round(time.perf_counter() - began, 1),
                  "peak_rss_gib": round(hwm, 2), "fixture": str(path), "fixture_bytes": path.stat().st_size,
                  "counts": plan.counts, "read_bytes": plan.bytes, "threads": threads,
                  "min_margin": fixture.metadata["min_margin"]}))
'''


def k2_slice_config(layers: int = 3, experts: int = 16):
    import dataclasses

    from kdtr_format import CONFIGS
    return dataclasses.replace(CONFIGS["kimi-k2-full"], num_hidden_layers=layers, n_routed_experts=experts)


class SeededWeights:
    """Project-named float32 weights of `cfg`, each drawn when asked (from the name and the seed)."""

    def __init__(self, cfg, seed: int = 0) -> None:
        from refgen.weights import weight_shapes
        self.shapes = weight_shapes(cfg)
        self.seed = seed

    def __iter__(self):
        return iter(self.shapes)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        rng = np.random.default_rng([self.seed, *name.encode()])
        if name.endswith("norm"):
            return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)
        out = np.empty(shape, dtype=np.float32)
        flat = out.reshape(-1)
        std = np.float32(_std(name, shape))
        for start in range(0, flat.size, 1 << 26):            # in pieces, to bound the scratch
            piece = flat[start:start + (1 << 26)]
            piece[:] = rng.standard_normal(piece.size, dtype=np.float32) * std
        return out


def _std(name: str, shape: tuple[int, ...]) -> float:
    if name == "embed_tokens":
        return 1.0
    if name == "lm_head":
        return 3.0 / np.sqrt(shape[-1])
    if name.endswith("e_score_correction_bias"):
        return 0.1
    return (0.5 if name.endswith(("attn.wo", "w_down")) else 1.0) / np.sqrt(shape[-1])


def watched(command: list[str], env: dict[str, str]) -> dict:
    """Run `command`, sampling its memory every 0.2 s (/proc/PID/status) -> seconds, exit status,
    peak resident / anonymous / file-backed GiB, its high-water mark, the load average at its end."""
    began = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: dict[str, float] = {}

    def sample() -> None:
        while child.poll() is None:
            try:
                fields = dict(line.split(":", 1) for line in open(f"/proc/{child.pid}/status"))
            except (OSError, ValueError):
                break
            for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                peak[key] = max(peak.get(key, 0.0), int(fields[key].split()[0]) / 2**20)
            time.sleep(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = child.communicate()[0]
    sampler.join()
    return {"seconds": round(time.perf_counter() - began, 1), "exit_status": child.returncode,
            **{f"peak_{k}_gib": round(peak.get(k, 0.0), 2) for k in ("VmRSS", "RssAnon", "RssFile")},
            "peak_rss_gib": round(peak.get("VmHWM", 0.0), 2), "load_average": round(os.getloadavg()[0], 1),
            "last_lines": output.strip().splitlines()[-3:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (checkpoint and fixture)")
    parser.add_argument("--quant", choices=("fp8", "int4"), default="fp8")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of the float64 references (default: every core)")
    parser.add_argument("--no-validate", dest="validate", action="store_false", help="skip kdtree validate")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the fixture")
    args = parser.parse_args()
    from synthetic_checkpoint import Layout, write_checkpoint

    checkpoint, out = args.work / f"k2-synthetic-{args.quant}", args.work / "fixtures"
    out.mkdir(parents=True, exist_ok=True)
    cfg = k2_slice_config()
    if not (checkpoint / "model.safetensors.index.json").is_file():
        began = time.perf_counter()
        write_checkpoint(checkpoint, cfg, SeededWeights(cfg), Layout(quant=args.quant, shard_bytes=2 << 30),
                         progress=lambda name: print(f"writing {name}", file=sys.stderr, flush=True),
                         keep_dequantized=False)
        print(f"checkpoint written in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", PHASES, str(checkpoint), str(out), str(args.threads)], env=env,
                         cwd=REPO, stdout=subprocess.PIPE, text=True)
    if run.returncode != 0:
        print(f"import failed (exit {run.returncode})", file=sys.stderr)
        return 1
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result.update(wall_seconds=round(time.perf_counter() - began, 1), checkpoint_bytes=size, quant=args.quant,
                  checkpoint={"layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts},
                  slice={"layers": 2, "experts": 8}, date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(),
                  ram_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1))
    if args.validate:
        result["validate"] = watched([sys.executable, "-m", "engine", "validate", "--fixtures", result["fixture"]],
                                     env)
    text = json.dumps(result, indent=2)
    (args.work / f"k2_slice_import_{args.quant}.json").write_text(text)
    print(text)
    if not args.keep:
        shutil.rmtree(out)
        shutil.rmtree(checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
