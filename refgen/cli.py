"""`refgen`: write, verify and inspect the golden fixtures.

    refgen list                              presets and fixture kinds
    refgen generate --all                    the committed fixtures into tests/golden
    refgen generate --preset kimi-k2         one preset (repeatable); --config-file PATH for a config.json
    refgen generate --checkpoint DIR --layers 2 --experts 8 --out DIR   a fixture from a real checkpoint, sliced
    refgen generate --kernels-large          the large kernel cases (never committed)
    refgen generate --all --full             the same, with the tensors drawn from the seed (full fixtures)
    refgen materialize tests/golden --out DIR   full fixtures from slim ones (the committed files are slim)
    refgen verify [PATH]...                  regenerate and compare; exit 1 on drift
    refgen show FILE                         what a fixture holds
    refgen export FILE --out DIR [--dtype bfloat16] [--mtp] [--gguf]   its model as an HF checkpoint directory, to serve

Bad input ends in one line `refgen: error: ...` and exit status 2; drift in
exit status 1 with one line per drifting tensor; Ctrl-C in 130 (the exit statuses
of every kdtree command line: kdtr_format/clikit.py). Files are written atomically.
"""

from __future__ import annotations

import os
import sys

# The reference multiplies small matrices: BLAS threads cost more than they
# give. Only a process that starts as `refgen` sets this, before numpy loads
# (an explicit setting in the environment wins; an importer is left alone).
# The large products (a K2-sized head, MLP, experts) are shared among refgen's
# own threads instead, a block of rows each (--threads; refgen.model.set_threads).
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import click  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402
from rich.text import Text  # noqa: E402

import kdtr_format  # noqa: E402
from kdtr_format import PRESETS, KdtrError, ModelConfig, read_hf_config  # noqa: E402
from kdtr_format.clikit import Cli, CliError, OutputDirectory, console, records, shown, table  # noqa: E402

from . import __version__  # noqa: E402
from .checkpoint import (CheckpointError, checkpoint_fixture, fixture_name, load, open_checkpoint,  # noqa: E402
                         plan_import)
from .files import SEEDED_KEY, omitted, slim_hint, stored_hash_problem, write_fixture  # noqa: E402
from .fixtures import (DEFAULT_PLAN, GOLDEN_PRESETS, Fixture, FixtureError, check_plan, model_fixture,  # noqa: E402
                       model_steps)
from .kernel_cases import KERNEL_KINDS, kernel_cases, kernel_fixture, kernel_path  # noqa: E402
from . import export as exporting  # noqa: E402
from .materialize import materialize as materialize_file  # noqa: E402
from .model import set_threads  # noqa: E402
from .regen import REGEN_REL, compare  # noqa: E402

DEFAULT_DIR = "tests/golden"
COMMITTED_DIR = Path(__file__).resolve().parents[1] / DEFAULT_DIR   # this checkout's golden fixtures
IDENTICALLY = (f"integers and drawn floats identical, computed floats within {REGEN_REL:g} of their scale: "
               "the logit scale for logits and margins")   # as the README says
MAX_WEIGHT_BYTES = 2 << 30      # refgen holds every weight in float64: refuse configs beyond this
MAX_REPORTED = 40               # drift lines printed per file

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
THREADS = click.option("--threads", type=click.IntRange(min=1), metavar="N",
                       help=f"Threads sharing the float64 reference's large products (default: every core "
                            f"this process may use, {CORES} here). The numbers do not depend on it.")

KIND_HELP = {
    "model": "config, weights, 3 prompts, prefill logits, AR greedy, DDTree traces",
    "tree_build": "top-k and best-first tree build edge cases (B = 0, 1, beyond possible, ties, L = 0, 1)",
    "verify_attention": "ragged tree-verify MLA attention batches (K2 and tiny dims)",
    "accept_compact": "accept walks (non-prefix paths) and the KV compaction they imply",
    "paged_kv": "verify attention and KV compaction through block tables (pages 1, 3, 16, 64)",
    "corpus": "the bugs other DDTree integrations shipped, one named regression case each",
}


@click.group(cls=Cli, name="refgen", bad_input=(KdtrError, FixtureError))
@click.version_option(__version__, "--version", prog_name="refgen")
def main() -> None:
    """Golden fixtures for DDTree on DeepSeek-V3 / Kimi-K2 models (docs/fixtures.md)."""


# ---------------------------------------------------------------------------- list

@main.command("list")
def list_command() -> int:
    """Presets and fixture kinds."""
    out = console()
    presets = table("name", "vocab", "hidden", "layers", "heads", "kv_lora", "experts", "MB", "fixture",
                    title="presets (MB: the weights in float32)",
                    right=("vocab", "hidden", "layers", "heads", "kv_lora", "experts", "MB"))
    for name, cfg in PRESETS.items():
        presets.add_row(name, str(cfg.vocab_size), str(cfg.hidden_size), str(cfg.num_hidden_layers),
                        str(cfg.num_attention_heads), str(cfg.kv_lora_rank), str(cfg.n_routed_experts),
                        f"{kdtr_format.weight_bytes(cfg) / 1e6:.1f}",
                        "tests/golden" if name in GOLDEN_PRESETS else "not committed")
    out.print(presets)
    out.print("fixture: tests/golden holds it (committed, slim);\n"
              "  not committed: `refgen generate --preset NAME --out DIR` writes it", markup=False)
    kinds = [("model", f"<preset>.kdtr, {len(DEFAULT_PLAN.traces)} traces: {KIND_HELP['model']}")]
    kinds += [(kind, f"{kernel_path(kind, False)}, {len(kernel_cases(kind, False))} cases "
                     f"(+{len(kernel_cases(kind, True))} large): {KIND_HELP[kind]}") for kind in KERNEL_KINDS]
    out.print(records("fixture kinds", kinds))
    return 0


# ---------------------------------------------------------------------------- generate

@dataclass(frozen=True)
class _Job:
    """One fixture file to write: its path relative to the output directory, progress steps,
    and how to build it (build(step, read): `step` after each of `steps` cases; a checkpoint
    job calls `read` with the bytes of each weight it reads, `reading` bytes in all, first)."""

    path: str
    steps: int
    build: Callable[[Callable[[int], None], Callable[[int], None]], Fixture]
    reading: int = 0


def _model_job(cfg: ModelConfig, name: str, seed: int, source: str) -> _Job:
    return _Job(f"{name}.kdtr", model_steps(DEFAULT_PLAN),
                lambda step, read: model_fixture(cfg, name, seed, DEFAULT_PLAN, step, source))


def _checkpoint_job(directory: Path, layers: int | None, experts: int | None, seed: int) -> _Job:
    """Opens and maps the checkpoint now, so a bad one is reported before any work; reads the
    slice and computes the references when built."""
    plan = plan_import(open_checkpoint(directory), layers, experts)
    name = fixture_name(plan)
    for note in plan.notes:
        console(stderr=True).print(Text(f"note: {shown(note)}"))
    return _Job(f"{name}.kdtr", model_steps(DEFAULT_PLAN),
                lambda step, read: checkpoint_fixture(load(plan, read), seed, DEFAULT_PLAN, step),
                reading=plan.bytes)


def _kernel_job(kind: str, seed: int, large: bool) -> _Job:
    return _Job(kernel_path(kind, large), len(kernel_cases(kind, large)),
                lambda step, read: kernel_fixture(kind, seed, large, step))


def _config_from_file(path: Path) -> tuple[ModelConfig, str]:
    """An HF-style config.json -> (config, fixture name: the file's stem, or its
    directory's name for a file called config.json). The loader's notes go to stderr."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"config file {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"config file {path}: not valid JSON ({exc})") from None
    try:
        cfg, notes = read_hf_config(data)
    except KdtrError as exc:
        raise CliError(f"config file {path}: {exc}") from None
    for note in notes:
        click.echo(f"refgen: note: config file {shown(path)}: {shown(note)}", err=True)
    try:
        check_plan(cfg, DEFAULT_PLAN)
    except FixtureError as exc:
        raise CliError(f"config file {path}: {exc}") from None
    weights = kdtr_format.weight_bytes(cfg)
    if weights > MAX_WEIGHT_BYTES:
        raise CliError(f"config file {path}: its weights would take {weights / 2**30:.1f} GiB "
                       f"in float32 (refgen materializes them; the cap is {MAX_WEIGHT_BYTES / 2**30:.0f} GiB)")
    name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    if name in PRESETS:
        raise CliError(f"config file {path}: its fixture would be named {name!r}, a preset's name; "
                       "rename the file")
    return cfg, name


def _prepare_out(out: Path, jobs: list[_Job]) -> None:
    for job in jobs:
        directory = (out / job.path).parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot create output directory {directory}: {exc.strerror or exc}") from None
        if not os.access(directory, os.W_OK):
            raise CliError(f"output directory {directory} is not writable")


def _progress(on: Console, done: TextColumn | None = None) -> Progress:
    """Progress bars on a terminal (80 columns hold them), nothing on a pipe: how much is done
    (`done`, default the percentage), the time taken and the time left at the pace so far."""
    return Progress(TextColumn("{task.description:<30}", markup=False), BarColumn(bar_width=16),
                    done or TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(), TextColumn("left"),
                    TimeRemainingColumn(), console=on, transient=True, disable=not on.is_terminal)


def _build(job: _Job, progress: Progress, description: str) -> Fixture:
    """A job's fixture, with a bar for its cases and, for a checkpoint, one for reading it."""
    task = progress.add_task(description, total=job.steps)
    read = progress.add_task("  reading the checkpoint", total=job.reading) if job.reading else None
    return job.build(lambda steps: progress.advance(task, steps),
                     lambda size: progress.advance(read, size) if read is not None else None)


def _run_jobs(jobs: list[_Job], out: Path, progress_console: Console, slim: bool) -> list[tuple[_Job, float]]:
    """Build and write every job (`slim`: without its seeded tensors) with progress bars -> (job, seconds)
    per job."""
    done = []
    with _progress(progress_console) as progress:
        for job in jobs:
            began = time.perf_counter()
            try:
                fixture = _build(job, progress, job.path)
                write_fixture(out / job.path, fixture, slim=slim)
            except (FixtureError, KdtrError) as exc:
                raise CliError(f"{job.path}: {exc}") from None
            except OSError as exc:
                raise CliError(f"cannot write {out / job.path}: {exc.strerror or exc}") from None
            done.append((job, time.perf_counter() - began))
    return done


@main.command(no_args_is_help=True)
@click.option("--preset", "presets", multiple=True, metavar="NAME",
              help=f"A preset to write ({', '.join(PRESETS)}); repeatable.")
@click.option("--all", "all_", is_flag=True,
              help=f"Every committed fixture: presets {', '.join(GOLDEN_PRESETS)} and the kernel cases.")
@click.option("--config-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="PATH",
              help="An HF-style config.json to write a model fixture for.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR",
              help="A DeepSeek-V3 / Kimi K2.x checkpoint directory (HF safetensors; bf16, FP8 or INT4) "
                   "to write a model fixture from (docs/checkpoints.md).")
@click.option("--layers", type=click.IntRange(min=1), metavar="K",
              help="With --checkpoint: keep the first K layers (then the final norm and the head).")
@click.option("--experts", type=click.IntRange(min=1), metavar="E",
              help="With --checkpoint: keep the first E routed experts of every MoE layer.")
@click.option("--out", type=OutputDirectory(), default=DEFAULT_DIR, show_default=True,
              help="Output directory.")
@click.option("--kernels/--no-kernels", default=None,
              help="Write the small kernel-case fixtures (default: with --all only).")
@click.option("--kernels-large", is_flag=True, help="Write the large kernel cases (*_large.kdtr).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--full", is_flag=True,
              help="Also write the tensors drawn from the seed (weights, kernel-case inputs): full fixtures, "
                   "as `refgen materialize` makes. Default: slim, as committed.")
@THREADS
def generate(presets: tuple[str, ...], all_: bool, config_file: Path | None, checkpoint: Path | None,
             layers: int | None, experts: int | None, out: Path, kernels: bool | None, kernels_large: bool,
             seed: int, full: bool, threads: int | None) -> int:
    """Write golden fixtures (slim: docs/fixtures.md "Slim and full")."""
    set_threads(threads or CORES)
    unknown = [name for name in presets if name not in PRESETS]
    if unknown:
        raise CliError(f"unknown preset {unknown[0]!r} (known: {', '.join(PRESETS)})")
    jobs = [_model_job(PRESETS[name], name, seed, "preset")
            for name in dict.fromkeys((*GOLDEN_PRESETS, *presets) if all_ else presets)]
    if config_file is not None:
        cfg, name = _config_from_file(config_file)
        jobs.append(_model_job(cfg, name, seed, "config-file"))
    if checkpoint is None and (layers or experts):
        raise CliError("--layers and --experts slice a checkpoint: give --checkpoint DIR")
    if checkpoint is not None:
        try:
            jobs.append(_checkpoint_job(checkpoint, layers, experts, seed))
        except CheckpointError as exc:
            raise CliError(f"checkpoint {checkpoint}: {exc}") from None
    if kernels if kernels is not None else all_:
        jobs += [_kernel_job(kind, seed, large=False) for kind in KERNEL_KINDS]
    if kernels_large:
        jobs += [_kernel_job(kind, seed, large=True) for kind in KERNEL_KINDS if kernel_cases(kind, True)]
    if not jobs:
        raise CliError("nothing to generate: give --all, --preset NAME, --config-file PATH, --checkpoint DIR "
                       "or --kernels")
    _prepare_out(out, jobs)
    done = _run_jobs(jobs, out, console(stderr=True), slim=not full)

    written = table("file", "tensors", "MB", "min margin", "time s", title=f"fixtures written to {out}",
                    right=("tensors", "MB", "min margin", "time s"))
    for job, seconds in done:
        with kdtr_format.open(out / job.path) as reader:
            margin = reader.metadata.get("min_margin")
            written.add_row(job.path, str(len(reader)), f"{(out / job.path).stat().st_size / 1e6:.2f}",
                            "-" if margin is None else f"{margin:.4g}", f"{seconds:.1f}")
    console().print(written)
    return 0


# ---------------------------------------------------------------------------- verify

def _regenerate(metadata: dict[str, Any]) -> _Job:
    """The job that regenerates a fixture from its own metadata."""
    try:
        kind, seed = metadata["kind"], metadata["generator"]["seed"]
        if kind == "model":
            name, source = metadata["preset"], metadata["source"]
            if source == "preset":
                if name not in PRESETS:
                    raise FixtureError(f"metadata.preset: unknown preset {name!r}")
                return _model_job(PRESETS[name], name, seed, source)
            if source == "checkpoint":
                origin = metadata["checkpoint"]
                return _checkpoint_job(Path(origin["path"]), origin["layers"], origin["experts"], seed)
            return _model_job(ModelConfig.from_dict(metadata["config"]), name, seed, source)
        if kind in KERNEL_KINDS:
            return _kernel_job(kind, seed, bool(metadata["large"]))
    except (KeyError, TypeError) as exc:
        raise FixtureError(f"metadata: missing or malformed entry {exc}") from None
    raise FixtureError(f"metadata.kind: unknown fixture kind {kind!r}")


def _fixture_files(path: Path) -> tuple[list[Path], list[Path]]:
    """The fixture files under `path` (a file or a directory) and, for this checkout's
    committed golden directory, the committed fixtures it lacks."""
    if path.is_file():
        return [path], []
    files = sorted(p for p in path.rglob("*.kdtr") if p.is_file())
    if path.resolve() != COMMITTED_DIR.resolve():
        return files, []
    expected = [f"{name}.kdtr" for name in GOLDEN_PRESETS] + [kernel_path(k, False) for k in KERNEL_KINDS]
    return files, [path / name for name in expected if not (path / name).is_file()]


def _all_fixture_files(paths: tuple[Path, ...]) -> tuple[list[Path], list[Path]]:
    """_fixture_files of every path (default: DEFAULT_DIR), each file once."""
    if not paths:
        if not Path(DEFAULT_DIR).is_dir():
            raise CliError(f"no {DEFAULT_DIR} here: give PATH (run from a checkout, or name the fixtures)")
        paths = (Path(DEFAULT_DIR),)
    files, missing = {}, []
    for path in paths:
        found, lacking = _fixture_files(path)
        if not found and not lacking:
            raise CliError(f"{path}: no .kdtr fixtures found")
        files.update((file.resolve(), file) for file in found)
        missing += lacking
    return list(files.values()), missing


def _verify_file(path: Path, scratch: Path, progress_console: Console) -> list[str]:
    """Problems of one fixture file: its own hash, then a regeneration (written slim: its
    seeded tensors are compared by their checksums)."""
    try:
        with kdtr_format.open(path) as committed:
            _require_fixture(committed.metadata)
            problems = [p for p in [stored_hash_problem(committed)] if p]
            job = _regenerate(committed.metadata)
            fresh = scratch / job.path
            fresh.parent.mkdir(parents=True, exist_ok=True)
            with _progress(progress_console) as progress:
                write_fixture(fresh, _build(job, progress, f"regenerating {path.name}"), slim=True)
            with kdtr_format.open(fresh) as regenerated:
                problems += compare(committed, regenerated)
            fresh.unlink()
    except (FixtureError, KdtrError) as exc:
        problems = [str(exc)]
    return problems


def _require_fixture(metadata: dict[str, Any]) -> None:
    """FixtureError unless the metadata is a refgen fixture's."""
    if not isinstance(metadata.get("kind"), str) or "kdtree_fixture" not in metadata:
        raise FixtureError("a KDTR file, but not a refgen fixture (its metadata has no kdtree_fixture and "
                           "kind); `kdtr inspect` shows any KDTR file")


@main.command(help=f"Regenerate the fixtures under each PATH (a directory or one file; default {DEFAULT_DIR}) "
                   f"and compare: {IDENTICALLY}; the tensors a slim file omits by their sha256; metadata equal "
                   f"but for provenance (docs/fixtures.md, \"Regeneration\"). This checkout's {DEFAULT_DIR} must "
                   "also hold every committed fixture. Exit 1 on any drift.")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path), metavar="[PATH]...")
@THREADS
def verify(paths: tuple[Path, ...], threads: int | None) -> int:
    set_threads(threads or CORES)
    files, missing = _all_fixture_files(paths)
    out, failed = console(), 0
    for path in missing:
        out.print(f"[red]MISSING[/red] {escape(str(path))}: run `refgen generate --all`")
        failed += 1
    with tempfile.TemporaryDirectory(prefix="refgen-verify-") as scratch:
        for file in files:
            began = time.perf_counter()
            problems = _verify_file(file, Path(scratch), console(stderr=True))
            seconds = time.perf_counter() - began
            if not problems:
                out.print(f"[green]ok[/green]      {escape(str(file))} ({seconds:.1f} s)")
                continue
            failed += 1
            out.print(f"[red]DRIFT[/red]   {escape(str(file))}: {len(problems)} problem(s)")
            for line in problems[:MAX_REPORTED]:
                out.print(f"  {line}", markup=False)
            if len(problems) > MAX_REPORTED:
                out.print(f"  ... and {len(problems) - MAX_REPORTED} more")
    total = len(files) + len(missing)
    verdict = "[red]FAILED[/red]" if failed else "[green]passed[/green]"
    out.print(f"{verdict}: {total - failed} of {total} fixtures regenerate identically ({IDENTICALLY})")
    return 1 if failed else 0


# ---------------------------------------------------------------------------- materialize

def _destinations(sources: tuple[Path, ...], out: Path) -> list[tuple[Path, Path]]:
    """(source file, destination) pairs: a file SRC to out/<its name>, a directory's fixtures
    to the same relative paths under out."""
    pairs: dict[Path, Path] = {}
    for source in sources:
        if source.is_file():
            found = [(source, out / source.name)]
        else:
            found = [(file, out / file.relative_to(source))
                     for file in sorted(source.rglob("*.kdtr")) if file.is_file()]
            if not found:
                raise CliError(f"{source}: no .kdtr fixtures found")
        for file, destination in found:
            if pairs.get(destination, file).resolve() != file.resolve():
                raise CliError(f"{pairs[destination]} and {file} would both be written to {destination}")
            pairs[destination] = file
    return [(file, destination) for destination, file in pairs.items()]


@main.command(no_args_is_help=True)
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path), metavar="SRC...")
@click.option("--out", type=OutputDirectory(), required=True, help="Output directory (created when missing).")
def materialize(sources: tuple[Path, ...], out: Path) -> int:
    """Write full fixtures from slim ones: the tensors drawn from the seed (weights, kernel-case
    inputs) drawn again, each checked against its recorded sha256. A directory SRC: every
    fixture under it, at the same relative path under --out. Files are written atomically."""
    pairs = _destinations(sources, out)
    written = table("file", "drawn again", "MB", "time s", title=f"full fixtures written to {out}",
                    right=("drawn again", "MB", "time s"))
    with _progress(console(stderr=True), TextColumn("{task.completed}/{task.total}")) as progress:
        task = progress.add_task("materializing", total=len(pairs))
        for source, destination in pairs:
            began = time.perf_counter()
            try:
                destination.parent.mkdir(parents=True, exist_ok=True)
                with kdtr_format.open(source) as reader:
                    _require_fixture(reader.metadata)
                    drawn = materialize_file(reader, destination)
            except (FixtureError, KdtrError) as exc:
                raise CliError(f"{source}: {exc}") from None
            except OSError as exc:
                raise CliError(f"cannot write {destination}: {exc.strerror or exc}") from None
            written.add_row(str(destination.relative_to(out)), str(drawn), f"{destination.stat().st_size / 1e6:.2f}",
                            f"{time.perf_counter() - began:.1f}")
            progress.advance(task, 1)
    console().print(written)
    return 0


def _omitted_lines(file: Path, reader: Any) -> list[str]:
    """What `show` says of a slim file: the seeded tensors it omits, by group, and how to materialize it."""
    missing = omitted(reader)
    if not missing:
        return []
    records, groups = reader.metadata[SEEDED_KEY], {}
    for name in missing:
        entry = groups.setdefault(_seeded_group(name), [0, 0])
        entry[0] += 1
        entry[1] += int(np.prod(records[name]["shape"])) * np.dtype(records[name]["dtype"]).itemsize
    sizes = ", ".join(f"{group} {count} ({nbytes / 1e6:.2f} MB)" for group, (count, nbytes) in groups.items())
    return [f"slim: omits {len(missing)} tensors drawn from the seed (their sha256 in the metadata): {escape(sizes)}; "
            f"{escape(slim_hint(file))}"]


def _seeded_group(name: str) -> str:
    """weights, bf16/weights, or a kernel-case input's name (q_lat, c_kv, ...)."""
    if name.startswith("cases/"):
        return name.rsplit("/", 1)[-1]
    return "bf16/weights" if name.startswith("bf16/") else "weights"


# ---------------------------------------------------------------------------- show

def _groups(reader: Any) -> Iterator[tuple[str, int, int]]:
    """(top-level group, tensors, bytes) of a fixture."""
    sizes: dict[str, list[int]] = {}
    for name in reader.names():
        entry = sizes.setdefault(name.split("/", 1)[0], [0, 0])
        entry[0] += 1
        entry[1] += reader.info(name).nbytes
    for group, (count, nbytes) in sizes.items():
        yield group, count, nbytes


@main.command(no_args_is_help=True)
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def show(file: Path) -> int:
    """What a fixture FILE holds: kind, preset, prompts, traces or cases, sizes."""
    try:
        with kdtr_format.open(file) as reader:
            _require_fixture(reader.metadata)
            parts = _show(file, reader.metadata, stored_hash_problem(reader), list(_groups(reader)))
            parts += _omitted_lines(file, reader)
    except (FixtureError, KdtrError) as exc:
        raise CliError(f"{file}: {exc}") from None
    out = console()
    for part in parts:
        out.print(part)
    return 0


def _show(file: Path, meta: dict[str, Any], hash_problem: str | None,
          groups: list[tuple[str, int, int]]) -> list[Any]:
    """What `show` prints (renderables); FixtureError when the metadata lacks what a fixture holds."""
    try:
        generator = meta["generator"]
        parts: list[Any] = [
            Text.assemble((shown(file), "bold"), f": kind {shown(meta['kind'])}, generator {shown(generator['name'])} "
                          f"{shown(generator['version'])} (numpy {shown(generator['numpy'])}), seed "
                          f"{shown(generator['seed'])}"),
            Text.assemble(f"content hash {shown(str(meta.get('content_hash', '-'))[:16])}... ",
                          ("matches", "green") if not hash_problem else (shown(hash_problem), "red"))]
        sizes = table("group", "tensors", "MB", title="sizes", right=("tensors", "MB"))
        for group, count, nbytes in groups:
            sizes.add_row(group, str(count), f"{nbytes / 1e6:.2f}")
        parts.append(sizes)
        if meta["kind"] == "model":
            parts += _show_model(meta)
        elif "cases" in meta:
            title = f"{meta['kind']} cases{' (large)' if meta.get('large') else ''}"
            parts.append(records(title, [(case["name"], _fields({k: v for k, v in case.items() if k != "name"}))
                                         for case in meta["cases"]]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FixtureError(f"malformed {meta['kind']} fixture metadata ({type(exc).__name__}: {exc})") from None
    return parts


def _show_model(meta: dict[str, Any]) -> list[Any]:
    cfg = meta["config"]
    summary = Text(f"preset {shown(meta['preset'])} ({shown(meta['source'])}): vocab {shown(cfg['vocab_size'])}, "
                   f"hidden {shown(cfg['hidden_size'])}, {shown(cfg['num_hidden_layers'])} layers, "
                   f"{shown(cfg['num_attention_heads'])} heads; margin threshold {meta['margin_threshold']:.3g}, "
                   f"min margin {meta['min_margin']:.3g}, min top-k gap {meta['min_topk_gap']:.3g}")
    prompts = table("name", "length", "seed", "draw", title="prompts", right=("length", "seed", "draw"))
    for p in meta["prompts"]:
        prompts.add_row(p["name"], str(p["length"]), str(p["seed"]), str(p["draw"]))
    traces = []
    for t in meta["traces"]:
        drafter = t["drafter"]
        label = drafter["kind"] + (f" {drafter['accuracy']}" if "accuracy" in drafter else "") + \
            (f" (draw {drafter['draw']})" if drafter.get("draw") else "")
        traces.append((t["name"], _fields({
            "prompt": t["prompt"], "drafter": label, "block": t["ddtree"]["block_size"],
            "budget": t["ddtree"]["budget"], "tokens": t["max_new_tokens"], "rounds": t["rounds"],
            "forwards": f"{t['target_forwards']} (AR {t['ar_target_forwards']})",
            "non-prefix rounds": t["non_prefix_rounds"], "min margin": t["min_margin"]})))
    return [summary, prompts, records("traces", traces)]


def _fields(fields: dict[str, Any]) -> str:
    return ", ".join(f"{key} {_short(value)}" for key, value in fields.items())


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_short, value)) + "]"
    return "-" if value is None else str(value)


# ---------------------------------------------------------------------------- export

@main.command("export", no_args_is_help=True)
@click.argument("fixture", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The checkpoint directory to write (must not exist, or be empty).")
@click.option("--dtype", type=click.Choice(exporting.DTYPES), default="float32", show_default=True,
              help="float32: the fixture's weights; bfloat16: its bf16 cases' weights; fp8: DeepSeek's FP8 "
                   "blocks (a model of its own, its fixture generated beside it).")
@click.option("--layers", type=click.IntRange(min=1), metavar="K",
              help="Only the first K layers, the final norm and the head: a draft model for speculative decoding, "
                   "labelled DeepseekV2ForCausalLM (vLLM and SGLang turn a DeepseekV3 draft into an MTP module).")
@click.option("--fp8-block", type=click.IntRange(min=1, max=4096), default=128, show_default=True, metavar="N",
              help="With --dtype fp8: N x N scale blocks.")
@click.option("--shard-mb", type=click.IntRange(min=1), default=exporting.SHARD_BYTES >> 20, show_default=True,
              help="Safetensors shards of at most this many MB (one model.safetensors when everything fits).")
@click.option("--mtp", is_flag=True,
              help="With DeepSeek-V3's multi-token-prediction module (layer num_hidden_layers, weights that often "
                   "agree with the target) and its float64 draft logits (mtp-reference.npz), to serve "
                   "with MTP speculative decoding.")
@click.option("--gguf", is_flag=True,
              help="Also model.gguf: the model as one GGUF file that llama.cpp loads (its converter refuses the "
                   "export's word-level tokenizer).")
def export_command(fixture: Path, out: Path, dtype: str, layers: int | None, fp8_block: int, shard_mb: int,
                   mtp: bool, gguf: bool) -> int:
    """The model of a model FIXTURE as a Hugging Face checkpoint directory that transformers, vLLM and
    SGLang load, with the fixture to validate the served tokens against (docs/serving.md)."""
    if dtype != "fp8" and fp8_block != 128:
        raise CliError("--fp8-block applies to --dtype fp8")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        exporting.check_out(out, dtype, layers, mtp, gguf)
    except exporting.ExportError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot create {out.parent}: {exc.strerror or exc}") from None
    try:
        with kdtr_format.open(fixture) as reader:
            src = exporting.source(reader, dtype)
            for note in exporting.server_notes(src.cfg):
                console(stderr=True).print(f"note: {note}", highlight=False, markup=False)
            with _progress(console(stderr=True), TextColumn("{task.completed}/{task.total}")) as progress:
                task = progress.add_task(f"exporting {fixture.name}",
                                         total=exporting.steps(src.cfg, dtype, layers, mtp))
                written = exporting.export(reader, fixture, out, dtype, layers, (fp8_block, fp8_block),
                                           shard_mb << 20, lambda steps: progress.advance(task, steps), mtp, gguf)
    except (FixtureError, KdtrError) as exc:
        raise CliError(f"{fixture}: {exc}") from None
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from None
    files = table("file", "MB", title=f"{dtype} checkpoint", right=("MB",))
    for name, size in sorted(written.files.items()):
        files.add_row(name, f"{size / 1e6:.2f}")
    out_console = console()
    out_console.print(files)
    said = [f"written to {shown(out)}"]               # one line each, a path never broken: the terminal folds it
    if written.fixture is None:
        said.append(f"a draft model of {layers} layer(s): no fixture; serve it as the draft of the full export")
    else:
        said += ["serve it (docs/serving.md), then:", f"  kdtree validate --server URL --fixtures {shown(out)}"]
    if mtp:
        agreement = written.manifest["mtp"]["agreement"]
        said.insert(1, f"MTP layer {written.manifest['mtp']['layer']}: its drafts are the target's tokens at "
                       f"{agreement['agreeing']} of {agreement['judged']} AR positions")
    for line in said:
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0
