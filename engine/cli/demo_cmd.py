"""`kdtree demo`: AR and DDTree decoding of one prompt side by side, with the time per stage."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import click
import numpy as np
from rich.console import Console
from rich.text import Text

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig, KdtrError, ModelConfig
from kdtr_format.clikit import CliError, FiniteFloat, OutputFile, atomic_output, shown, table

from .common import (
    Device, _check_device, _check_tp, _engine_layout_options, _free_bytes, _on_ranks, _rank_console,
    _require_matplotlib, _wrote, cli,
)

if TYPE_CHECKING:
    from ..decode import DecodeResult


class TokenIds(click.ParamType):
    """Comma-separated token ids ("1,2,3"; spaces around commas allowed) -> list[int]."""

    name = "ids"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        items = [item.strip() for item in str(value).split(",")]
        if not any(items):
            self.fail("empty; give comma-separated token ids, e.g. 1,2,3", param, ctx)
        for item in items:
            if not re.fullmatch(r"\d+", item):
                what = "an empty item" if not item else f"{item!r} is not a token id"
                self.fail(f"{value!r}: {what}; give comma-separated token ids, e.g. 1,2,3", param, ctx)
        return [int(item) for item in items]


@dataclass(frozen=True)
class _DemoModel:
    """The model fixture the demo runs: where it is, its name and config, its longest prompt."""

    path: Path
    name: str
    cfg: ModelConfig
    prompt: list[int] | None


@cli.command("demo")
@click.option("--preset", default=None, help="Run <fixtures>/<preset>.kdtr (default: tiny).")
@click.option("--fixture", "fixture", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Any model fixture to take weights and prompt from (e.g. one made with "
                   "`refgen generate --config-file`).")
@click.option("--prompt", type=TokenIds(), default=None,
              help="Comma-separated token ids (default: the fixture's longest prompt).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate after the prompt.")
@click.option("--budget", default=32, show_default=True, type=click.IntRange(min=0),
              help="Tree nodes under the root per round.")
@click.option("--block-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Draft block: block size - 1 drafted depths.")
@click.option("--accuracy", default=0.8, show_default=True, type=FiniteFloat(0.0, 1.0),
              help="The oracle drafter's accuracy.")
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--plot", "plot_path", type=OutputFile(), default=None,
              help="Save a PNG histogram of acceptance lengths (needs matplotlib: the `plot` extra).")
@click.option("--invariant", is_flag=True, help="Run the engine in batch-invariant mode.")
@_engine_layout_options
def demo_command(preset: str | None, fixture: Path | None, prompt: list[int] | None, max_new_tokens: int,
                 budget: int, block_size: int, accuracy: float, device: str, plot_path: Path | None,
                 invariant: bool, tp: int | None, page_size: int | None) -> int:
    """AR and DDTree side by side on a model fixture's weights (oracle and layerskip drafters)."""
    if plot_path is not None:
        _require_matplotlib("--plot")
    _check_tp(tp, device)
    _check_device(device)
    model = _demo_model(preset, fixture)
    cfg, tokens, ddtree = model.cfg, prompt or model.prompt, DDTreeConfig(block_size=block_size, budget=budget)
    if not tokens:
        raise CliError(f"{model.path} holds no prompts; give --prompt")
    _check_demo_sizes(cfg, tokens, max_new_tokens, ddtree, device)
    return _on_ranks(tp, device, _demo, model, tokens, ddtree, max_new_tokens, accuracy, device, plot_path,
                     invariant, page_size)


def _demo(world: Any, model: _DemoModel, tokens: list[int], ddtree: DDTreeConfig, max_new_tokens: int,
          accuracy: float, device: str, plot_path: Path | None, invariant: bool, page_size: int | None) -> int:
    """The demo's runs on one rank (world None: unsharded) -> its exit status."""
    from ..adapter import TorchAdapter
    from ..decode import ar_decode, ddtree_decode
    from ..drafters import LayerSkipDrafter, OracleDrafter
    from ..validate.fixtures import fixture_weights

    cfg = model.cfg
    adapter = TorchAdapter(device if world is None else world.device, invariant=invariant, world=world,
                           page_size=page_size)
    with _reading(model.path) as reader:
        adapter.load_weights(cfg, fixture_weights(reader))
    target, layers = adapter.model, max(1, cfg.num_hidden_layers // 2)
    ar = ar_decode(target, [tokens], max_new_tokens, stages=adapter.stages)
    oracle = OracleDrafter([tokens + ar.tokens[0]], cfg.vocab_size, accuracy, seed=0, device=target.device)
    layerskip = LayerSkipDrafter(cfg, adapter.weights, layers, target.device, target.dtype)
    runs = {"AR": ar}
    for name, drafter in (("DDTree oracle", oracle), ("DDTree layerskip", layerskip)):
        runs[name] = ddtree_decode(target, drafter, [tokens], ddtree, max_new_tokens, stages=adapter.stages)
    _print_demo(_rank_console(world), model, tokens, ddtree, runs, 1 if world is None else world.size,
                f"oracle: knows the AR continuation, right with probability {accuracy} (an upper bound); "
                f"layerskip: the target's first {layers} of {cfg.num_hidden_layers} layers")
    if plot_path is not None and (world is None or world.rank == 0):
        _plot({k: v for k, v in runs.items() if k != "AR"}, plot_path, ddtree.block_size)
        _wrote(plot_path)
    return 0 if all(r.tokens == ar.tokens for r in runs.values()) else 1


def _demo_model(preset: str | None, fixture: Path | None) -> _DemoModel:
    """The model fixture named by --fixture, else by --preset (default tiny) in the fixture directory."""
    from ..validate import find_fixtures, model_fixture_config
    from ..validate.fixtures import full_fixtures

    if fixture is None:
        name = preset or "tiny"
        fixture = find_fixtures(None) / f"{name}.kdtr"
        if not fixture.is_file():
            hint = (f"run `refgen generate --preset {name}`" if name in PRESETS else
                    f"presets are {', '.join(PRESETS)}; or give --fixture PATH")
            raise CliError(f"--preset {name}: no fixture {fixture} ({hint})")
    with _reading(fixture) as reader:
        meta = reader.metadata
        if meta.get("kind") != "model":
            raise CliError(f"{fixture}: not a model fixture (kind {meta.get('kind')!r}); the demo needs a model's "
                           "weights (`refgen list` shows the kinds)")
        cfg = model_fixture_config(reader, fixture)
        if preset is not None and meta.get("preset") != preset:
            raise CliError(f"{fixture} holds {meta.get('preset')!r}, not --preset {preset!r}")
        prompts = meta.get("prompts") or []
        longest = max(prompts, key=lambda p: p["length"])["name"] if prompts else None
        tokens = np.asarray(reader[f"prompts/{longest}/tokens"]).tolist() if longest else None
    return _DemoModel(full_fixtures(fixture), str(meta.get("preset", fixture.stem)), cfg, tokens)


@contextmanager
def _reading(path: Path) -> Iterator[kdtr_format.Reader]:
    """kdtr_format.open(path), a broken file's error naming the file."""
    try:
        with kdtr_format.open(path) as reader:
            yield reader
    except KdtrError as exc:
        raise CliError(f"{path}: {exc}") from None


def _check_demo_sizes(cfg: ModelConfig, tokens: list[int], max_new_tokens: int, ddtree: DDTreeConfig,
                      device: str) -> None:
    """Refuse, before anything is allocated, a run the model's positions or the device's memory cannot hold."""
    from ..decode import _tree_capacity

    if max(tokens) >= cfg.vocab_size:
        raise CliError(f"--prompt: token id {max(tokens)} is outside the model's vocabulary of {cfg.vocab_size}")
    positions = len(tokens) + max_new_tokens + ddtree.depth
    if positions > cfg.max_position_embeddings:
        raise CliError(f"the prompt ({len(tokens)} tokens) + --max-new-tokens {max_new_tokens} + --block-size "
                       f"{ddtree.block_size} - 1 need {positions} positions; the model has "
                       f"max_position_embeddings {cfg.max_position_embeddings}")
    tree = min(ddtree.budget, _tree_capacity(ddtree.depth, cfg.vocab_size)) + 1
    slots = len(tokens) + max_new_tokens + tree
    need = 3 * 4 * cfg.num_attention_heads * tree * slots + 4 * tree * cfg.vocab_size   # scores x3, logits
    free = _free_bytes(device)
    if need > free:
        raise CliError(f"--budget {ddtree.budget}: a verify forward of {tree} tree tokens needs about "
                       f"{need / 1e9:.1f} GB for attention scores, more than the {free / 1e9:.1f} GB free on "
                       f"{device}; give a smaller --budget")


def _print_demo(out: Console, model: _DemoModel, prompt: list[int], ddtree: DDTreeConfig,
                runs: dict[str, DecodeResult], ranks: int, legend: str) -> None:
    """The runs side by side; ranks: the processes the engine is sharded over (--tp)."""
    ar_tokens = runs["AR"].tokens[0]
    out.print(Text(f"model {shown(model.name)} ({shown(model.path)}); prompt ({len(prompt)} tokens): {prompt}"))
    where = f"; on {ranks} ranks (--tp {ranks}: tensor and expert parallel)" if ranks > 1 else ""
    out.print(Text(f"block size {ddtree.block_size}, budget {ddtree.budget}{where}; AR tokens: {ar_tokens}"))
    summary = table("run", "same as AR", "target forwards", "tau", "tokens/s", title="AR vs DDTree",
                    right=("target forwards", "tau", "tokens/s"))
    for name, result in runs.items():
        m = result.metrics
        same = Text("yes", style="green") if result.tokens[0] == ar_tokens else Text("NO", style="bold red")
        summary.add_row(name, same, str(m.target_forwards), f"{m.mean_acceptance:.2f}", f"{m.tokens_per_second:.1f}")
    out.print(summary)
    out.print(Text(legend, style="dim"))
    from ..metrics import STAGES

    stages = table("stage", *runs, title="time per stage, ms", right=tuple(runs))
    for stage in STAGES:
        stages.add_row(stage, *(f"{r.metrics.stage_seconds[stage] * 1e3:.1f}" for r in runs.values()))
    out.print(stages)


def _plot(runs: dict[str, DecodeResult], path: Path, block_size: int) -> None:
    """A PNG histogram of acceptance lengths per run, written all or nothing."""
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
    try:
        with atomic_output(path) as file:
            fig.savefig(file, format="png")
    finally:
        plt.close(fig)
