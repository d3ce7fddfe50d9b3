"""The `kdtree` command line: `validate` (the main job) and `demo`.

    kdtree validate [--fixtures DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [--json PATH] [--impl module:factory]
    kdtree diverge (--fixture PATH | --config NAME) [--way chunk|tree|batch] [--dtype bfloat16] [--json PATH]
    kdtree demo [--preset tiny] [--prompt 1,2,3] [--budget 32] [--block-size 8] [--plot PATH]

Bad input ends in one line on stderr (`kdtree: error: ...`) and a non-zero
exit; nothing is left half-written (--json and --plot go through a temporary
file and a rename).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig, KdtrError

from .adapter import TorchAdapter
from .decode import DecodeResult, ar_decode, ddtree_decode
from .diverge import Divergence, Way
from .diverge_run import WAYS, Subject, from_config, from_fixture, run
from .drafters import LayerSkipDrafter, OracleDrafter
from .metrics import STAGES
from .validate import Report, Status, ValidateError, find_fixtures, load_impl, model_fixture_config, validate, write_json

STATUS_STYLE = {Status.EXACT: "green", Status.WITHIN: "green", Status.NEAR_TIE: "yellow",
                Status.SKIPPED: "dim", Status.FAIL: "bold red"}


def _number(x: float | None) -> str:
    return "" if x is None else f"{x:.2e}"


def _cpu_threads(device: str) -> None:
    """Tiny models gain nothing from intra-op threads, and lose much when the cores are shared."""
    if device == "cpu":
        torch.set_num_threads(1)


def _console() -> Console:
    """A console as wide as the terminal, and 160 columns when writing to a file or pipe."""
    console = Console()
    if not console.is_terminal:
        console.width = 160
    return console


def render(report: Report, console: Console) -> None:
    table = Table(title=f"kdtree validate: {report.implementation}", title_justify="left")
    for column in ("fixture", "check", "status", "worst error", "tolerance", "margin", "regime", "detail"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        table.add_row(c.section, c.name, f"[{STATUS_STYLE[c.status]}]{c.status.value}[/]", _number(c.error),
                      _number(c.tolerance), _number(c.margin), c.regime, c.detail)
    console.print(table)
    if report.backends:
        console.print("backends: " + ", ".join(f"{k}: {v}" for k, v in report.backends.items()))
    console.print(f"fixtures: {report.fixtures}")
    console.print(f"[{'bold red' if report.failed else 'bold green'}]{report.summary()}[/]")


def _check_device_and_json(device: str, json_path: str | None) -> None:
    if device not in ("cpu", "cuda"):
        raise click.ClickException(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is visible")
    if json_path is not None and not Path(json_path).resolve().parent.is_dir():
        raise click.ClickException(f"--json {json_path}: directory {Path(json_path).parent} does not exist")


def render_divergence(subject: Subject, a: Way, b: Way, divergence: Divergence, console: Console,
                      rows: int = 16) -> None:
    """The explanation, the differing points in compute order and the decisions that differ."""
    console.print(f"[bold]kdtree diverge[/]: {subject.label}; {a.label} vs {b.label}, "
                  f"{len(a.tokens) - a.prompt_length} new tokens after {a.prompt_length}")
    for line in divergence.explanation:
        console.print(f"  {line}", highlight=False)
    differing = [p for p in divergence.points if p.tokens]
    if differing:
        table = Table(title="points that differ, in compute order", title_justify="left")
        for column in ("layer", "point", "tokens differ", "values differ", "max ulp (row scale)", "cause"):
            table.add_column(column)
        for p in differing[:rows]:
            table.add_row("-" if p.layer is None else str(p.layer), p.point, str(len(p.tokens)),
                          f"{p.values} / {p.size}", "-" if p.max_ulps is None else f"{p.max_ulps:.3g}",
                          "yes" if p.inputs_agree else "")
        console.print(table)
        if len(differing) > rows:
            console.print(f"  ... and {len(differing) - rows} more points")
    flipped = [c for c in divergence.decisions if c.choice_a != c.choice_b]
    if flipped:
        table = Table(title="greedy choices that differ", title_justify="left")
        for column in ("token", "position", a.label, "margin", b.label, "margin"):
            table.add_column(column)
        for c in flipped[:rows]:
            table.add_row(str(c.token), str(c.position), str(c.choice_a), f"{c.margin_a:.3g}", str(c.choice_b),
                          f"{c.margin_b:.3g}")
        console.print(table)


@click.group()
def cli() -> None:
    """kdtree: validate DDTree speculative decoding on DeepSeek-V3 / Kimi-K2-class models."""


@cli.command("validate")
@click.option("--fixtures", "fixtures", type=str, default=None,
              help="Fixture directory (default: tests/golden, else generated into a cache dir).")
@click.option("--device", type=str, default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Compute dtype of the implementation and the tolerance regime it is judged in.")
@click.option("--json", "json_path", type=str, default=None, help="Also write the report as JSON here.")
@click.option("--impl", type=str, default=None,
              help="Adapter factory to validate: module:factory or path/to/file.py:factory "
                   "(default: the built-in torch engine).")
def validate_command(fixtures: str | None, device: str, dtype: str, json_path: str | None, impl: str | None) -> int:
    """Check an implementation against the golden fixtures; exit 1 on any failure."""
    _check_device_and_json(device, json_path)
    _cpu_threads(device)
    adapter = load_impl(impl) if impl else None
    console = _console()
    report = validate(adapter, fixtures, device, log=lambda line: console.print(f"[dim]{line}[/]"), dtype=dtype)
    render(report, console)
    if json_path is not None:
        write_json(report, json_path)
    return 1 if report.failed else 0


@cli.command("diverge")
@click.option("--fixture", type=str, default=None, help="A model fixture: its weights, a prompt, its AR tokens and trees.")
@click.option("--config", "config", type=str, default=None,
              help="Or a config (a preset, or kdtr_format.CONFIGS such as k2-mid) with seeded random weights.")
@click.option("--prompt", default=None, help="The fixture's prompt name (default: the longest).")
@click.option("--prompt-length", default=64, show_default=True, type=click.IntRange(min=1),
              help="With --config: random prompt tokens.")
@click.option("--prompt-seed", default=1, show_default=True, type=int, help="With --config: the prompt's seed.")
@click.option("--seed", default=0, show_default=True, type=int, help="With --config: the weights' seed.")
@click.option("--way", type=click.Choice(WAYS), default="chunk", show_default=True,
              help="What AR decode is compared with: one causal chunk, a tree verify, or a batch.")
@click.option("--tokens", "count", default=16, show_default=True, type=click.IntRange(min=1),
              help="New tokens compared (chunk, batch).")
@click.option("--trace", default=None, help="With --fixture and --way tree: the round as TRACE/ROUND (default: "
                                            "the largest tree).")
@click.option("--batch", default=4, show_default=True, type=click.IntRange(min=2), help="Requests of the batch way.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", type=str, default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--impl", type=str, default=None, help="Adapter factory (model + intermediates capabilities).")
@click.option("--json", "json_path", type=str, default=None, help="Also write the finding as JSON here.")
def diverge_command(fixture: str | None, config: str | None, prompt: str | None, prompt_length: int,
                    prompt_seed: int, seed: int, way: str, count: int, trace: str | None, batch: int, dtype: str,
                    device: str, impl: str | None, json_path: str | None) -> int:
    """The first op where AR decode and a verify of the same tokens differ bit for bit (exit 1 if any)."""
    if (fixture is None) == (config is None):
        raise click.ClickException("give exactly one of --fixture PATH and --config NAME")
    _check_device_and_json(device, json_path)
    pick = None
    if trace is not None:
        name, _, number = trace.partition("/")
        if not number.isdigit():
            raise click.ClickException(f"--trace {trace!r}: expected TRACE/ROUND, e.g. t1/0")
        pick = (name, int(number))
    if config is not None and prompt is not None:
        raise click.ClickException("--prompt names a fixture's prompt; with --config use --prompt-length and "
                                   "--prompt-seed")
    if fixture is not None and not Path(fixture).is_file():
        raise click.ClickException(f"--fixture {fixture}: no such file")
    _cpu_threads(device)
    adapter = load_impl(impl) if impl else TorchAdapter(device)
    if not callable(getattr(adapter, "intermediates", None)):
        raise click.ClickException(f"--impl {impl}: the adapter has no `intermediates` method (protocol capability)")
    set_dtype = getattr(adapter, "set_dtype", None)
    if dtype != "float32" and not callable(set_dtype):
        raise click.ClickException(f"--dtype {dtype}: the adapter has no `set_dtype` method")
    if callable(set_dtype):
        set_dtype(dtype)
    if fixture is not None:
        subject = from_fixture(fixture, prompt, adapter)
    elif not isinstance(adapter, TorchAdapter):
        raise click.ClickException("--config builds the built-in engine; use --fixture with --impl")
    else:
        subject = from_config(config, adapter, seed, prompt_length, prompt_seed)
    a, b, divergence = run(subject, way, count, batch, pick)
    render_divergence(subject, a, b, divergence, _console())
    if json_path is not None:
        write_json(divergence, json_path)
    return 1 if divergence.first is not None else 0


@cli.command("demo")
@click.option("--preset", default="tiny", show_default=True, help="A preset with a model fixture.")
@click.option("--fixture", "fixture", type=str, default=None,
              help="The model fixture to take weights from (default: <fixtures>/<preset>.kdtr).")
@click.option("--prompt", default=None, help="Comma-separated token ids (default: the fixture's longest prompt).")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--budget", default=32, show_default=True, type=int)
@click.option("--block-size", default=8, show_default=True, type=int)
@click.option("--accuracy", default=0.8, show_default=True, type=float, help="The oracle drafter's accuracy.")
@click.option("--device", type=str, default="cpu", show_default=True)
@click.option("--plot", "plot_path", type=str, default=None, help="Save a PNG histogram of acceptance lengths.")
def demo_command(preset: str, fixture: str | None, prompt: str | None, max_new_tokens: int, budget: int,
                 block_size: int, accuracy: float, device: str, plot_path: str | None) -> int:
    """AR and DDTree side by side on a preset's fixture weights (oracle and layerskip drafters)."""
    if preset not in PRESETS:
        raise click.ClickException(f"unknown preset {preset!r}; presets are {', '.join(PRESETS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is visible")
    ddtree = DDTreeConfig(block_size=block_size, budget=budget)
    if plot_path is not None:
        _require_matplotlib()
        if not Path(plot_path).resolve().parent.is_dir():
            raise click.ClickException(f"--plot {plot_path}: directory {Path(plot_path).parent} does not exist")
    path = Path(fixture) if fixture else find_fixtures(None) / f"{preset}.kdtr"
    if not path.is_file():
        raise click.ClickException(f"no fixture {path} (run `refgen generate --preset {preset}`)")
    _cpu_threads(device)
    with kdtr_format.open(path) as reader:
        cfg = model_fixture_config(reader, path)
        if reader.metadata.get("preset") != preset or cfg != PRESETS[preset]:
            raise click.ClickException(f"{path.name} holds preset {reader.metadata.get('preset')!r}, "
                                       f"not {preset!r}")
        tokens = _parse_prompt(prompt) if prompt else _longest_prompt(reader)
        adapter = TorchAdapter(device)
        adapter.load_weights(cfg, {n[len("weights/"):]: np.array(reader[n]) for n in reader.names("weights/")})
    model = adapter.model

    ar = ar_decode(model, [tokens], max_new_tokens, stages=adapter.stages)
    truth = [tokens + ar.tokens[0]]
    runs = {"AR": ar}
    runs[f"DDTree oracle (acc {accuracy}, upper bound)"] = ddtree_decode(
        model, OracleDrafter(truth, cfg.vocab_size, accuracy, seed=0, device=model.device), [tokens], ddtree,
        max_new_tokens, stages=adapter.stages)
    layers = max(1, cfg.num_hidden_layers // 2)
    runs[f"DDTree layerskip ({layers} of {cfg.num_hidden_layers} layers)"] = ddtree_decode(
        model, LayerSkipDrafter(cfg, adapter.weights, layers, model.device, model.dtype), [tokens], ddtree,
        max_new_tokens, stages=adapter.stages)
    _print_demo(_console(), preset, tokens, ddtree, runs)
    if plot_path is not None:
        _plot({k: v for k, v in runs.items() if k != "AR"}, plot_path, ddtree.block_size)
    return 0 if all(r.tokens == ar.tokens for r in runs.values()) else 1


def _parse_prompt(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.ClickException(f"--prompt {text!r}: expected comma-separated token ids") from None
    if not tokens:
        raise click.ClickException("--prompt is empty")
    return tokens


def _longest_prompt(reader) -> list[int]:
    prompts = reader.metadata["prompts"]
    longest = max(prompts, key=lambda p: p["length"])["name"]
    return np.asarray(reader[f"prompts/{longest}/tokens"]).tolist()


def _print_demo(console: Console, preset: str, prompt: list[int], ddtree: DDTreeConfig,
                runs: dict[str, DecodeResult]) -> None:
    ar_tokens = runs["AR"].tokens[0]
    console.print(f"preset {preset}; prompt ({len(prompt)} tokens): {prompt}")
    console.print(f"block size {ddtree.block_size}, budget {ddtree.budget}; AR tokens: {ar_tokens}")
    table = Table(title="AR vs DDTree", title_justify="left")
    for column in ("run", "tokens == AR", "target forwards", "tau", "tokens/s", *STAGES):
        table.add_column(column, justify="right")
    for name, result in runs.items():
        m = result.metrics
        same = "[green]yes[/]" if result.tokens[0] == ar_tokens else "[bold red]NO[/]"
        table.add_row(name, same, str(m.target_forwards), f"{m.mean_acceptance:.2f}", f"{m.tokens_per_second:.1f}",
                      *(f"{m.stage_seconds[s] * 1e3:.1f} ms" for s in STAGES))
    console.print(table)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException("--plot needs matplotlib (pip install 'kdtree[plot]')") from None


def _plot(runs: dict[str, DecodeResult], path: str, block_size: int) -> None:
    """A PNG histogram of acceptance lengths per run, written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    for i, (name, result) in enumerate(runs.items()):
        counts = result.metrics.acceptance_histogram(block_size)
        ax.bar(np.arange(len(counts)) + (i - (len(runs) - 1) / 2) * width, counts, width=width,
               label=f"{name} (tau {result.metrics.mean_acceptance:.2f})")
    ax.set_xlabel("tokens committed per round (acceptance length)")
    ax.set_ylabel("rounds")
    ax.legend()
    fig.tight_layout()
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".png", dir=target.resolve().parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors, exit status 1 on failure (2 on usage errors)."""
    try:
        code = cli.main(args=argv, prog_name="kdtree", standalone_mode=False)
    except click.UsageError as exc:
        click.echo(f"kdtree: error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"kdtree: error: {exc.format_message()}", err=True)
        sys.exit(1)
    except (ValidateError, KdtrError, ValueError, OSError) as exc:
        click.echo(f"kdtree: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
