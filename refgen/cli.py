"""`refgen`: write, verify and inspect the golden fixtures.

    refgen list                              presets and fixture kinds
    refgen generate --all                    the committed fixtures into tests/golden
    refgen generate --preset kimi-k2         one preset (repeatable); --config-file PATH for a config.json
    refgen generate --checkpoint DIR --layers 2 --experts 8 --out DIR   a fixture from a real checkpoint, sliced
    refgen generate --kernels-large          the large kernel cases (never committed)
    refgen verify [PATH]                     regenerate and compare; exit 1 on drift
    refgen show FILE                         what a fixture holds

Bad input ends in one line `refgen: error: ...` and exit status 2; drift in
exit status 1 with one line per drifting tensor. Files are written atomically.
"""

from __future__ import annotations

import os
import sys

# The reference multiplies small matrices: BLAS threads cost more than they
# give. Only a process that starts as `refgen` sets this, before numpy loads
# (an explicit setting in the environment wins; an importer is left alone).
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
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

import kdtr_format  # noqa: E402
from kdtr_format import PRESETS, KdtrError, ModelConfig  # noqa: E402

from . import __version__  # noqa: E402
from .checkpoint import (CheckpointError, checkpoint_fixture, fixture_name, load, open_checkpoint,  # noqa: E402
                         plan_import)
from .fixtures import (DEFAULT_PLAN, GOLDEN_PRESETS, Fixture, FixtureError, check_plan,  # noqa: E402
                       compare, model_fixture, stored_hash_problem, write_fixture)
from .kernel_cases import KERNEL_KINDS, kernel_cases, kernel_fixture, kernel_path  # noqa: E402
from .weights import weight_shapes  # noqa: E402

DEFAULT_DIR = "tests/golden"
MAX_WEIGHT_BYTES = 2 << 30      # refgen holds every weight in float64: refuse configs beyond this
MAX_REPORTED = 40               # drift lines printed per file

KIND_HELP = {
    "model": "config, weights, 3 prompts, prefill logits, AR greedy, DDTree traces",
    "tree_build": "top-k and best-first tree build edge cases (B = 0, 1, beyond possible, ties, L = 0, 1)",
    "verify_attention": "ragged tree-verify MLA attention batches (K2 and tiny dims)",
    "accept_compact": "accept walks (non-prefix paths) and the KV compaction they imply",
}


class CliError(click.ClickException):
    """Bad input: reported as one line, exit status 2."""

    exit_code = 2


class _Group(click.Group):
    """Reports every click error and CliError as one line on stderr."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        extra.pop("standalone_mode", None)
        try:
            code = super().main(args, prog_name or "refgen", standalone_mode=False, **extra)
        except click.ClickException as exc:
            click.echo(f"refgen: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code if isinstance(exc, CliError) else 2)
        except click.Abort:
            click.echo("refgen: error: aborted", err=True)
            sys.exit(130)
        sys.exit(code or 0)


def _stdout() -> Console:
    """Tables keep their columns when piped (rich assumes 80 columns then)."""
    return Console(width=None if sys.stdout.isatty() else 132)


def _stderr() -> Console:
    return Console(stderr=True)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="refgen")
def main() -> None:
    """Golden fixtures for DDTree on DeepSeek-V3 / Kimi-K2 models (docs/fixtures.md)."""


# ---------------------------------------------------------------------------- list

@main.command("list")
def list_command() -> int:
    """Presets and fixture kinds."""
    console = _stdout()
    presets = Table(title="presets")
    for column in ("name", "vocab", "hidden", "layers", "heads", "kv_lora", "experts", "weights MB", "fixture"):
        presets.add_column(column)
    for name, cfg in PRESETS.items():
        presets.add_row(name, str(cfg.vocab_size), str(cfg.hidden_size), str(cfg.num_hidden_layers),
                        str(cfg.num_attention_heads), str(cfg.kv_lora_rank), str(cfg.n_routed_experts),
                        f"{_weight_bytes(cfg) / 1e6:.1f}",
                        "committed" if name in GOLDEN_PRESETS else "on demand (--preset)")
    console.print(presets)
    kinds = Table(title="fixture kinds")
    for column in ("kind", "file", "cases", "holds"):
        kinds.add_column(column)
    kinds.add_row("model", "<preset>.kdtr", f"{len(DEFAULT_PLAN.traces)} traces", KIND_HELP["model"])
    for kind in KERNEL_KINDS:
        kinds.add_row(kind, kernel_path(kind, False),
                      f"{len(kernel_cases(kind, False))} (+{len(kernel_cases(kind, True))} large)",
                      KIND_HELP[kind])
    console.print(kinds)
    return 0


def _weight_bytes(cfg: ModelConfig) -> int:
    return 4 * sum(int(np.prod(shape)) for shape in weight_shapes(cfg).values())


# ---------------------------------------------------------------------------- generate

@dataclass(frozen=True)
class _Job:
    """One fixture file to write: its path relative to the output directory,
    progress steps, and how to build it."""

    path: str
    steps: int
    build: Callable[[Callable[[int], None]], Fixture]


def _model_job(cfg: ModelConfig, name: str, seed: int, source: str) -> _Job:
    return _Job(f"{name}.kdtr", DEFAULT_PLAN.steps,
                lambda step: model_fixture(cfg, name, seed, DEFAULT_PLAN, step, source))


def _checkpoint_job(directory: Path, layers: int | None, experts: int | None, seed: int) -> _Job:
    """Opens and maps the checkpoint now, so a bad one is reported before any work; reads the
    slice and computes the references when built (progress: a step per weight, then the plan's)."""
    plan = plan_import(open_checkpoint(directory), layers, experts)
    name = fixture_name(plan)
    for note in plan.notes:
        _stderr().print(f"note: {note}", highlight=False, markup=False)
    return _Job(f"{name}.kdtr", plan.steps + DEFAULT_PLAN.steps,
                lambda step: checkpoint_fixture(load(plan, step), seed, DEFAULT_PLAN, step))


def _kernel_job(kind: str, seed: int, large: bool) -> _Job:
    return _Job(kernel_path(kind, large), len(kernel_cases(kind, large)),
                lambda step: kernel_fixture(kind, seed, large, step))


def _config_from_file(path: Path) -> tuple[ModelConfig, str]:
    """An HF-style config.json -> (config, fixture name: the file's stem, or its
    directory's name for a file called config.json)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"config file {path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"config file {path}: not valid JSON ({exc})") from None
    try:
        cfg = ModelConfig.from_dict(data)
    except KdtrError as exc:
        raise CliError(f"config file {path}: {exc}") from None
    try:
        check_plan(cfg, DEFAULT_PLAN)
    except FixtureError as exc:
        raise CliError(f"config file {path}: {exc}") from None
    if _weight_bytes(cfg) > MAX_WEIGHT_BYTES:
        raise CliError(f"config file {path}: its weights would take {_weight_bytes(cfg) / 2**30:.1f} GiB "
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


def _run_jobs(jobs: list[_Job], out: Path, console: Console) -> list[tuple[_Job, float]]:
    """Build and write every job with progress bars -> (job, seconds) per job."""
    done = []
    columns = (TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for job in jobs:
            task = progress.add_task(job.path, total=job.steps)
            began = time.perf_counter()
            try:
                fixture = job.build(lambda steps: progress.advance(task, steps))
                write_fixture(out / job.path, fixture)
            except (FixtureError, KdtrError) as exc:
                raise CliError(f"{job.path}: {exc}") from None
            except OSError as exc:
                raise CliError(f"cannot write {out / job.path}: {exc.strerror or exc}") from None
            done.append((job, time.perf_counter() - began))
    return done


@main.command()
@click.option("--preset", "presets", multiple=True, metavar="NAME",
              help=f"A preset to write ({', '.join(PRESETS)}); repeatable.")
@click.option("--all", "all_", is_flag=True,
              help=f"Every committed fixture: presets {', '.join(GOLDEN_PRESETS)} and the kernel cases.")
@click.option("--config-file", type=click.Path(path_type=Path), metavar="PATH",
              help="An HF-style config.json to write a model fixture for.")
@click.option("--checkpoint", type=click.Path(path_type=Path), metavar="DIR",
              help="A DeepSeek-V3 / Kimi K2.x checkpoint directory (HF safetensors; bf16, FP8 or INT4) "
                   "to write a model fixture from (docs/checkpoints.md).")
@click.option("--layers", type=click.IntRange(min=1), metavar="K",
              help="With --checkpoint: keep the first K layers (then the final norm and the head).")
@click.option("--experts", type=click.IntRange(min=1), metavar="E",
              help="With --checkpoint: keep the first E routed experts of every MoE layer.")
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_DIR, show_default=True,
              help="Output directory.")
@click.option("--kernels/--no-kernels", default=None,
              help="Write the small kernel-case fixtures (default: with --all only).")
@click.option("--kernels-large", is_flag=True, help="Write the large kernel cases (*_large.kdtr).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def generate(presets: tuple[str, ...], all_: bool, config_file: Path | None, checkpoint: Path | None,
             layers: int | None, experts: int | None, out: Path, kernels: bool | None, kernels_large: bool,
             seed: int) -> int:
    """Write golden fixtures."""
    unknown = [name for name in presets if name not in PRESETS]
    if unknown:
        raise CliError(f"unknown preset {unknown[0]!r} (known: {', '.join(PRESETS)})")
    jobs = [_model_job(PRESETS[name], name, seed, "preset")
            for name in dict.fromkeys((*GOLDEN_PRESETS, *presets) if all_ else presets)]
    if config_file is not None:
        if not config_file.is_file():
            raise CliError(f"config file {config_file}: no such file")
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
        jobs += [_kernel_job(kind, seed, large=True) for kind in KERNEL_KINDS]
    if not jobs:
        raise CliError("nothing to generate: give --all, --preset NAME, --config-file PATH, --checkpoint DIR "
                       "or --kernels")
    _prepare_out(out, jobs)
    done = _run_jobs(jobs, out, _stderr())

    table = Table(title=f"fixtures written to {out}")
    for column in ("file", "tensors", "MB", "min margin", "time s"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for job, seconds in done:
        with kdtr_format.open(out / job.path) as reader:
            margin = reader.metadata.get("min_margin")
            table.add_row(job.path, str(len(reader)), f"{(out / job.path).stat().st_size / 1e6:.2f}",
                          "-" if margin is None else f"{margin:.4g}", f"{seconds:.1f}")
    _stdout().print(table)
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


def _fixture_files(path: Path) -> tuple[list[Path], list[str]]:
    """The fixture files under `path` (a file or a directory) and, for a directory,
    the committed fixtures it lacks."""
    if path.is_file():
        return [path], []
    if not path.is_dir():
        raise CliError(f"{path}: no such file or directory")
    files = sorted(path.rglob("*.kdtr"))
    expected = [f"{name}.kdtr" for name in GOLDEN_PRESETS] + [kernel_path(k, False) for k in KERNEL_KINDS]
    return files, [name for name in expected if not (path / name).is_file()]


def _verify_file(path: Path, scratch: Path, console: Console) -> list[str]:
    """Problems of one committed fixture file: its own hash, then a regeneration."""
    try:
        with kdtr_format.open(path) as committed:
            problems = [p for p in [stored_hash_problem(committed)] if p]
            job = _regenerate(committed.metadata)
            fresh = scratch / job.path
            fresh.parent.mkdir(parents=True, exist_ok=True)
            with Progress(TextColumn("{task.description:<34}"), BarColumn(), console=console,
                          transient=True) as progress:
                task = progress.add_task(f"regenerating {path.name}", total=job.steps)
                write_fixture(fresh, job.build(lambda steps: progress.advance(task, steps)))
            with kdtr_format.open(fresh) as regenerated:
                problems += compare(committed, regenerated)
            fresh.unlink()
    except (FixtureError, KdtrError) as exc:
        problems = [str(exc)]
    return problems


@main.command()
@click.argument("path", type=click.Path(path_type=Path), default=DEFAULT_DIR, required=False)
def verify(path: Path) -> int:
    """Regenerate the fixtures under PATH (a directory or one file) and compare:
    integer tensors byte-identical, floats within 1e-12 relative, metadata equal
    but for provenance. Exit 1 on any drift."""
    files, missing = _fixture_files(path)
    if not files and not missing:
        raise CliError(f"{path}: no .kdtr fixtures found")
    console, failed = _stdout(), 0
    for name in missing:
        console.print(f"[red]MISSING[/red] {path / name}: run `refgen generate --all`", highlight=False)
        failed += 1
    with tempfile.TemporaryDirectory(prefix="refgen-verify-") as scratch:
        for file in files:
            began = time.perf_counter()
            problems = _verify_file(file, Path(scratch), _stderr())
            seconds = time.perf_counter() - began
            if not problems:
                console.print(f"[green]ok[/green]      {file} ({seconds:.1f} s)", highlight=False)
                continue
            failed += 1
            console.print(f"[red]DRIFT[/red]   {file}: {len(problems)} problem(s)", highlight=False)
            for line in problems[:MAX_REPORTED]:
                console.print(f"  {line}", highlight=False, markup=False)
            if len(problems) > MAX_REPORTED:
                console.print(f"  ... and {len(problems) - MAX_REPORTED} more", highlight=False)
    verdict = "[red]FAILED[/red]" if failed else "[green]passed[/green]"
    console.print(f"{verdict}: {len(files) + len(missing) - failed} of {len(files) + len(missing)} "
                  "fixtures regenerate identically", highlight=False)
    return 1 if failed else 0


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


@main.command()
@click.argument("file", type=click.Path(path_type=Path))
def show(file: Path) -> int:
    """What a fixture holds: kind, preset, prompts, traces or cases, sizes."""
    if not file.is_file():
        raise CliError(f"{file}: no such file")
    try:
        reader = kdtr_format.open(file)
    except KdtrError as exc:
        raise CliError(f"{file}: {exc}") from None
    with reader:
        meta, console = reader.metadata, _stdout()
        hash_problem = stored_hash_problem(reader)
        generator = meta.get("generator", {})
        console.print(f"[bold]{file}[/bold]: kind {meta.get('kind')!s}, "
                      f"generator {generator.get('name')} {generator.get('version')} "
                      f"(numpy {generator.get('numpy')}), seed {generator.get('seed')}", highlight=False)
        console.print(f"content hash {meta.get('content_hash', '-')[:16]}... "
                      f"{'[green]matches[/green]' if not hash_problem else '[red]' + hash_problem + '[/red]'}",
                      highlight=False)
        sizes = Table(title="sizes")
        for column in ("group", "tensors", "MB"):
            sizes.add_column(column)
        for group, count, nbytes in _groups(reader):
            sizes.add_row(group, str(count), f"{nbytes / 1e6:.2f}")
        console.print(sizes)
        if meta.get("kind") == "model":
            _show_model(meta, console)
        elif "cases" in meta:
            _show_cases(meta, console)
    return 0


def _show_model(meta: dict[str, Any], console: Console) -> None:
    cfg = meta.get("config", {})
    console.print(f"preset {meta.get('preset')} ({meta.get('source')}): vocab {cfg.get('vocab_size')}, "
                  f"hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
                  f"{cfg.get('num_attention_heads')} heads; margin threshold {meta.get('margin_threshold'):.3g}, "
                  f"min margin {meta.get('min_margin'):.3g}, min top-k gap {meta.get('min_topk_gap')}",
                  highlight=False)
    prompts = Table(title="prompts")
    for column in ("name", "length", "seed", "draw"):
        prompts.add_column(column)
    for p in meta.get("prompts", []):
        prompts.add_row(p["name"], str(p["length"]), str(p["seed"]), str(p["draw"]))
    console.print(prompts)
    traces = Table(title="traces")
    for column in ("name", "prompt", "drafter", "block", "budget", "tokens", "rounds",
                   "forwards dd/ar", "non-prefix", "min margin"):
        traces.add_column(column)
    for t in meta.get("traces", []):
        drafter = t["drafter"]
        label = drafter["kind"] + (f" {drafter['accuracy']}" if "accuracy" in drafter else "") + \
            (f" (draw {drafter['draw']})" if drafter.get("draw") else "")
        traces.add_row(t["name"], t["prompt"], label, str(t["ddtree"]["block_size"]),
                       str(t["ddtree"]["budget"]), str(t["max_new_tokens"]), str(t["rounds"]),
                       f"{t['target_forwards']}/{t['ar_target_forwards']}", str(t["non_prefix_rounds"]),
                       f"{t['min_margin']:.3g}")
    console.print(traces)


def _show_cases(meta: dict[str, Any], console: Console) -> None:
    cases = meta["cases"]
    table = Table(title=f"{meta.get('kind')} cases{' (large)' if meta.get('large') else ''}")
    keys = [k for k in cases[0] if k != "name"] if cases else []
    for column in ("name", *keys):
        table.add_column(column)
    for case in cases:
        table.add_row(case["name"], *(_short(case.get(k)) for k in keys))
    console.print(table)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
