"""One serving engine against the fixtures, every configuration of it: install, export, serve,
validate, report.

    python3 scripts/engines/run_engine.py vllm-cpu                    # scripts/engines/vllm_cpu.sh
    python3 scripts/engines/run_engine.py llama-cpp                   # scripts/engines/llama_cpp.sh
    python3 scripts/engines/run_engine.py vllm-cpu --ci               # ci/gate's `engines` step
    ... --only 'tiny f32 no-MLA draft' --runs greedy,sampling         # a subset

For each configuration (configs.py): the exports it serves (`refgen export`, into the work
directory), the server on 127.0.0.1 at a free port (waited for, bounded; stopped by its PID on
any exit), then each run as `kdtree validate --server ... --json` (a speculative configuration's
with --require-speculation). A server that died during a run is started again for the next.

Every row is classified against the known defects (configs.DEFECTS): "pass", "known defect,
still present", "known defect FIXED (news)", "new failure". Results: the raw JSON reports under
<out>/engines/<engine>/, and the table of docs/results/engines.md's section for the engine
(report.py), rewritten each run. Exit 0 when every row is as expected, 1 when one is not (a new
failure, or a fixed defect: news either way), 2 when the engine could not be installed or a
server could not be started (never a silent skip), unless a known defect says it does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from configs import CI_CONFIGS, CONFIGS, NUM_SPECULATIVE_TOKENS, RUNS, Config  # noqa: E402
from install import Engine, InstallError, described_version, install  # noqa: E402
from report import NOT_STARTED, Row, write_results  # noqa: E402
from serve import Server, StartError, free_port, install_signal_exit  # noqa: E402

from refgen.export_gguf import GGUF_FILE  # noqa: E402

START_S = {"vllm-cpu": 420.0, "llama-cpp": 120.0}     # bound on a server's start (2 shared cores)
RUN_TIMEOUT_S = 900.0                                 # bound on one validate run
MAX_MODEL_LEN = 512
# `kdtree` of this checkout (run from ROOT, whose packages come first on sys.path), whatever
# kdtree an installed console script would run
KDTREE = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main())"]


@dataclass(frozen=True)
class Exported:
    """What a configuration serves: the target export, and the draft's (draft / mtp: None for mtp,
    whose module is in the target's)."""

    target: Path
    draft: Path | None = None


class Exports:
    """`refgen export`s in `work`, each made once per run of the runner; for llama.cpp with
    `--gguf`, the model as one GGUF file beside (refgen/export_gguf.py: the converter's tensors and
    keys, a vocabulary whose replies detokenize to the export's words, " t762 t465")."""

    def __init__(self, work: Path, engine: Engine, log) -> None:
        self.work, self.engine, self.log, self.made = work, engine, log, {}

    def fixture(self, stem: str) -> Path:
        committed = ROOT / "tests" / "golden" / f"{stem}.kdtr"
        if committed.is_file():
            return committed
        generated = self.work / "fixtures" / f"{stem}.kdtr"
        if not generated.is_file():
            self.log(f"refgen generate --preset {stem}")
            _refgen("generate", "--preset", stem, "--out", str(generated.parent))
        return generated

    def export(self, stem: str, dtype: str, *extra: str) -> Path:
        key = "-".join([stem, dtype, *extra]).replace("--", "")
        out = self.work / "exports" / key
        if key not in self.made:
            if out.exists():
                shutil.rmtree(out)
            fixture = self.fixture(stem)
            if self.engine.name == "llama-cpp":
                extra = (*extra, "--gguf")
            self.log(f"refgen export {stem} --dtype {dtype} {' '.join(extra)}".rstrip())
            _refgen("export", str(fixture), "--out", str(out), "--dtype", dtype, *extra)
            self.made[key] = out
        return out

    def of(self, config: Config) -> Exported:
        if config.speculation == "mtp":
            return Exported(self.export(config.fixture, config.dtype, "--mtp"))
        target = self.export(config.fixture, config.dtype)
        if config.speculation != "draft":
            return Exported(target)
        return Exported(target, self.export(config.fixture, config.dtype, "--layers", str(config.draft_layers)))


def _refgen(*args: str) -> None:
    run = subprocess.run([sys.executable, "-m", "refgen", *args], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or run.stdout.strip().splitlines() or ["no output"])[-1]
        raise StartError(f"refgen {' '.join(args[:2])}: {last}")


def server_command(engine: Engine, config: Config, exported: Exported, port: int) -> tuple[list[str], dict]:
    """The command line and environment that serve `config` on 127.0.0.1:port."""
    env = {**os.environ}
    if engine.name == "vllm-cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"                  # GiB; vLLM's CPU backend needs it set
        if not config.mla:
            env["VLLM_MLA_DISABLE"] = "1"
        command = [str(engine.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(exported.target),
                   "--dtype", config.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1",
                   "--port", str(port)]
        if config.mla and config.dtype == "float32":
            # on a CPU with AMX vLLM picks AMX_MLA, which refuses float32 weights ("expect weight to be
            # bfloat16, float16, int8, fp8_e4m3 or uint8"); CPU_MLA, its reference MLA, computes in float32
            command += ["--attention-backend", "CPU_MLA"]
        speculative = {
            "ngram": {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                      "prompt_lookup_max": max(2, config.ngram_min), "prompt_lookup_min": config.ngram_min},
            "draft": {"method": "draft_model", "model": str(exported.draft),
                      "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
            "mtp": {"method": "mtp", "num_speculative_tokens": 1},
        }.get(config.speculation)
        if speculative is not None:
            command += ["--speculative-config", json.dumps(speculative)]
        return command, env
    # llama-server samples with top-k 40 and min-p 0.05 unless told: off, so that temperature T
    # samples softmax(logits / T) (the client sends top_p 1 with every request). Its KV cache is
    # float16 unless told: the configuration's dtype, so that a float32 export is served in float32.
    cache = {"float32": "f32", "bfloat16": "bf16"}[config.dtype]
    command = [str(engine.server), "-m", str(exported.target / GGUF_FILE), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(4 * MAX_MODEL_LEN), "-np", "4", "-t", "1", "--top-k", "0", "--min-p", "0", "--metrics",
               "--cache-type-k", cache, "--cache-type-v", cache]
    if config.speculation == "draft":      # --model-draft alone loads the draft and drafts nothing: --spec-type too
        command += ["--spec-type", "draft-simple", "--model-draft", str(exported.draft / GGUF_FILE),
                    "--spec-draft-n-max", str(NUM_SPECULATIVE_TOKENS),
                    "--cache-type-k-draft", cache, "--cache-type-v-draft", cache]
    return command, env


def validate(url: str, config: Config, exported: Exported, run: str, report: Path, log_path: Path) -> tuple[int, float]:
    """One `kdtree validate --server` run -> (its exit status, seconds)."""
    command = [*KDTREE, "validate", "--server", url, "--fixtures", str(exported.target), "--json", str(report),
               *RUNS[run]]
    if config.speculation != "none":
        command.append("--require-speculation")
    began = time.monotonic()
    with open(log_path, "w") as out:
        try:
            status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                    cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            status = 124
    return status, time.monotonic() - began


def run_config(engine: Engine, version: str, config: Config, exports: Exports, out: Path, runs: list[str],
               log) -> list[Row]:
    """Every run of one configuration -> its rows; a configuration that cannot be exported or
    started gives rows of status NOT_STARTED for the runs left, with the reason."""
    rows: list[Row] = []
    server: Server | None = None
    try:
        exported = exports.of(config)
        for run in runs:
            if server is None or not server.alive():
                if server is not None:
                    log(f"  the server died ({server.last_error()}); starting it again")
                    server.stop()
                port = free_port()
                command, env = server_command(engine, config, exported, port)
                server = Server(command, env, out / f"{config.slug}.server.log", port, START_S[engine.name])
                log(f"  starting {config.name} on port {port}")
                server.__enter__()
                log(f"  answering after {server.start_seconds:.0f} s")
            stem = f"{config.slug}.{run.replace(' ', '-')}"
            status, seconds = validate(server.url, config, exported, run, out / f"{stem}.json", out / f"{stem}.log")
            rows.append(Row.of(engine.name, version, config, run, status, seconds, out / f"{stem}.json",
                               server.start_seconds))
            log(f"  {run}: {rows[-1].verdict} ({rows[-1].outcome}) {seconds:.0f} s; {rows[-1].speculation_line}")
    except StartError as exc:
        log(f"  not started: {exc}")
        rows += [Row.not_started(engine.name, version, config, run, str(exc)) for run in runs[len(rows):]]
    finally:
        if server is not None:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=sorted(CONFIGS))
    parser.add_argument("--ci", action="store_true", help="only CI's configurations (configs.CI_CONFIGS)")
    parser.add_argument("--only", action="append", default=[], help="a configuration's name (repeatable)")
    parser.add_argument("--runs", default=None, help="comma-separated runs (default: every run of a configuration)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results",
                        help="where engines.md and engines/<engine>/*.json go")
    parser.add_argument("--work", type=Path, default=None, help="the exports' directory (default: a temporary one)")
    args = parser.parse_args(argv)
    install_signal_exit()

    def log(line: str) -> None:
        print(line, flush=True)

    configs = [c for c in (CI_CONFIGS if args.ci else CONFIGS[args.engine]) if c.engine == args.engine]
    if args.only:
        unknown = set(args.only) - {c.name for c in configs}
        if unknown:
            parser.error(f"no configuration named {sorted(unknown)[0]!r}; known: {', '.join(c.name for c in configs)}")
        configs = [c for c in configs if c.name in args.only]
    chosen = None if args.runs is None else args.runs.split(",")
    if chosen and set(chosen) - set(RUNS):
        parser.error(f"unknown run {sorted(set(chosen) - set(RUNS))[0]!r}; known: {', '.join(RUNS)}")
    try:
        engine = install(args.engine, log)
    except InstallError as exc:
        log(f"engines: {exc}")
        return 2
    version = described_version(engine)
    results = args.out / "engines" / args.engine
    results.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kdtree-engines-") as scratch:
        exports = Exports(args.work or Path(scratch), engine, log)
        for config in configs:
            log(f"{config.name}")
            rows += run_config(engine, version, config, exports, results,
                               [r for r in config.runs if chosen is None or r in chosen], log)
    written = write_results(args.out, engine.name, rows)
    unexpected = [r for r in rows if not r.as_expected]
    for row in unexpected:
        log(f"UNEXPECTED: {row.name}, {row.run}: {row.outcome}: {row.failures[0] if row.failures else row.summary}")
    log(f"{len(rows)} row(s), {len(unexpected)} unexpected; wrote {written}")
    if any(r.status == NOT_STARTED and not r.as_expected for r in rows):
        return 2
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
