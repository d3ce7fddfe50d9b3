"""`kdtree diverge`: the first tensor where two ways of computing the same tokens differ."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click
from rich.console import Console
from rich.filesize import decimal
from rich.text import Text

from kdtr_format import KdtrError
from kdtr_format.clikit import CliError, OutputFile, console, shown, table

from .common import DTYPES, Device, _check_device, _free_bytes, _wrapped, _wrote, cli

if TYPE_CHECKING:
    from ..diverge import Divergence
    from ..diverge_run import Memory, Subject
    from ..diverge_ways import Way


@cli.command("diverge")
@click.option("--fixture", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A model fixture: its weights, a prompt, its AR tokens and trees.")
@click.option("--config", "config", default=None,
              help="Or a config (a preset, or kdtr_format.CONFIGS such as k2-mid) with the engine benchmark's "
                   "seeded random weights.")
@click.option("--prompt", default=None, help="The fixture's prompt name (default: the longest).")
@click.option("--prompt-length", default=64, show_default=True, type=click.IntRange(min=1),
              help="With --config: random prompt tokens.")
@click.option("--prompt-seed", default=1, show_default=True, type=int, help="With --config: the prompt's seed.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --config: the weights' seed.")
@click.option("--way", type=click.Choice(("chunk", "tree", "batch")), default="chunk", show_default=True,
              help="What AR decode is compared with: one causal chunk, a tree verify, or a batch.")
@click.option("--tokens", "count", default=16, show_default=True, type=click.IntRange(min=1),
              help="New tokens compared (chunk, batch).")
@click.option("--trace", default=None,
              help="With --fixture and --way tree: the round as TRACE/ROUND (default: the longest accepted path).")
@click.option("--batch", default=4, show_default=True, type=click.IntRange(min=2), help="Requests of the batch way.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--impl", type=str, default=None, help="Adapter factory (model and intermediates capabilities).")
@click.option("--invariant", is_flag=True, help="The built-in engine in batch-invariant mode.")
@click.option("--json", "json_path", type=OutputFile(), default=None, help="Also write the finding as JSON here.")
def diverge_command(fixture: Path | None, config: str | None, prompt: str | None, prompt_length: int,
                    prompt_seed: int, seed: int, way: str, count: int, trace: str | None, batch: int, dtype: str,
                    device: str, impl: str | None, invariant: bool, json_path: Path | None) -> int:
    """Where AR decode and a verify of the same tokens differ: the first op beyond the dtype's noise, the
    first bit for bit (exit 1 if any)."""
    if (fixture is None) == (config is None):
        raise CliError("give exactly one of --fixture PATH and --config NAME")
    if invariant and impl is not None:
        raise CliError("--invariant is the built-in engine's mode; an --impl adapter is what it is")
    if config is not None and prompt is not None:
        raise CliError("--prompt names a fixture's prompt; with --config use --prompt-length and --prompt-seed")
    pick = None
    if trace is not None:
        name, _, number = trace.partition("/")
        if not number.isdigit():
            raise CliError(f"--trace {trace!r}: expected TRACE/ROUND, e.g. t1/0")
        pick = (name, int(number))
    _check_device(device)
    from .. import diverge_run
    from ..adapter import TorchAdapter
    from ..validate import load_impl, write_json
    from ..validate.fixtures import full_fixtures

    try:
        adapter = load_impl(impl) if impl else TorchAdapter(device, invariant=invariant)
        if not callable(getattr(adapter, "intermediates", None)):
            raise CliError(f"--impl {impl}: the adapter has no `intermediates` method (protocol capability)")
        set_dtype = getattr(adapter, "set_dtype", None)
        if dtype != "float32" and not callable(set_dtype):
            raise CliError(f"--dtype {dtype}: the adapter has no `set_dtype` method")
        if callable(set_dtype):
            set_dtype(dtype)
        if fixture is not None:
            subject = _reading_subject(full_fixtures(fixture), prompt, adapter, diverge_run.from_fixture)
            held = len(subject.tokens)
            if way != "tree" and count > held:
                if _given("count"):
                    raise CliError(f"--tokens {count}: {subject.label} holds {held} AR tokens to compare; give "
                                   f"--tokens {held} or fewer")
                count = held
        elif not isinstance(adapter, TorchAdapter):
            raise CliError("--config builds the built-in engine; use --fixture with --impl")
        else:
            cfg = diverge_run.named_config(config)
            if prompt_length + count > cfg.max_position_embeddings:
                raise CliError(f"--prompt-length {prompt_length} + --tokens {count} need {prompt_length + count} "
                               f"positions; {config} has max_position_embeddings {cfg.max_position_embeddings}")
            need = diverge_run.memory_needed(cfg, dtype, prompt_length, count)
            _check_memory(f"--config {config}", need, device)
            subject = diverge_run.from_config(config, adapter, seed, prompt_length, prompt_seed)
        a, b, divergence = diverge_run.run(subject, way, count, batch, pick)
    except ValueError as exc:          # the fixture, config, prompt, trace or way named does not fit
        raise CliError(str(exc)) from None
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise CliError(f"ran out of memory on {device} ({type(exc).__name__}: {exc}); a smaller config, prompt "
                       "or --tokens needs less") from None
    render_divergence(subject, a, b, divergence, console())
    if json_path is not None:
        write_json(divergence, json_path)
        _wrote(json_path)
    return 1 if divergence.first is not None else 0


def _given(name: str) -> bool:
    """Whether option `name` was given on the command line (not its default)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (click.core.ParameterSource.DEFAULT, None)


def _check_memory(what: str, need: Memory, device: str) -> None:
    """State on stderr what a run needs, or refuse it when the device (its weights) or the host
    (the captured values; everything on the CPU) has less available."""
    parts = [(need.total, "cpu")] if device == "cpu" else [(need.device, device), (need.captures, "cpu")]
    for size, where in parts:
        free = _free_bytes(where)
        if size > free:
            raise CliError(f"{what} needs {need}: more than the {decimal(free)} available on {where}; take a "
                           "smaller config (e.g. k2-mid) or a fixture")
    click.echo(f"kdtree: note: {what} needs {need}; {decimal(_free_bytes(device))} available on {device}", err=True)


def _out_of_memory(exc: BaseException) -> bool:
    """Whether an exception is an allocation that failed (numpy's MemoryError, torch's CPU
    allocator or a CUDA out-of-memory error)."""
    import torch

    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or "can't allocate memory" in str(exc)


def _reading_subject(fixture: Path, prompt: str | None, adapter: Any, from_fixture: Callable) -> Subject:
    """from_fixture, a broken file's error naming the file."""
    try:
        return from_fixture(fixture, prompt, adapter)
    except KdtrError as exc:
        raise CliError(f"{fixture}: {exc}") from None


def render_divergence(subject: Subject, a: Way, b: Way, divergence: Divergence, out: Console, rows: int = 16) -> None:
    """The explanation, the differing points in compute order and the decisions that differ."""
    width = out.width if out.is_terminal else None
    out.print(_wrapped(f"kdtree diverge: {shown(subject.label)}; {shown(a.label)} vs {shown(b.label)}, "
                       f"{len(a.tokens) - a.prompt_length} new tokens after {a.prompt_length}", width, style="bold"))
    for line in divergence.explanation:
        out.print(_wrapped(shown(line), width, "  ", "    "))
    differing = [p for p in divergence.points if p.tokens]
    if differing:
        points = table("layer", "point", "tokens", "values differ", "max ulp", "x noise", "verdict",
                       title=f"points that differ, in compute order (max ulp at the row's scale; x noise: of "
                             f"the {divergence.dtype} noise; cause: every input agrees)",
                       right=("tokens", "max ulp", "x noise"))
        for p in differing[:rows]:
            points.add_row("-" if p.layer is None else str(p.layer), p.point, str(len(p.tokens)),
                           f"{p.values} / {p.size}", "-" if p.max_ulps is None else f"{p.max_ulps:.3g}",
                           "-" if p.noise_ratio is None else f"{p.noise_ratio:.2g}",
                           f"{p.verdict}, cause" if p.inputs_agree else p.verdict)
        out.print(points)
        if len(differing) > rows:
            out.print(Text(f"  ... and {len(differing) - rows} more points"))
    flipped = [c for c in divergence.decisions if c.choice_a != c.choice_b]
    if flipped:
        choices = table("token", "position", a.label, "margin", b.label, "margin ", title="greedy choices that differ")
        for c in flipped[:rows]:
            choices.add_row(str(c.token), str(c.position), str(c.choice_a), f"{c.margin_a:.3g}", str(c.choice_b),
                            f"{c.margin_b:.3g}")
        out.print(choices)


