"""The adapter protocol (v1): how `kdtree validate` drives an implementation under test.

An adapter wraps one engine (the built-in torch engine, a C++ or vendor engine
behind Python bindings, ...) in a few plain methods on numpy arrays, one
request at a time. Every method is optional: `kdtree validate` runs the checks
whose methods exist and reports the others as "skipped (not implemented by
adapter)". docs/adapter.md is the user's guide; docs/examples/numpy_adapter.py
a worked example.

Capabilities and their methods (shapes: n tree or new tokens, V vocab, L depths,
K top-k width, S cache rows, H heads, R kv_lora, dr d_rope):

- model: ``load_weights(config: ModelConfig, weights: dict[str, np.ndarray])``
  (names as docs/fixtures.md, float32, torch layout [out, in]);
  ``reset(max_len: int)`` (an empty cache of max_len slots);
  ``forward(tokens [n] int64, positions [n] int64, visibility [n, start+n] bool, start: int)
  -> logits [n, V] float``. Token i writes its KV at the adapter's own cache slot
  start + i and sees slot s iff visibility[i, s]. The harness always makes every
  cached slot (s < start) visible and restates the committed path with a causal
  forward after each verify, so an adapter needs no compaction of its own cache.
- topk: ``topk_logprobs(draft_logits [L, V] float32, k: int) -> (topk_lp float32 [L, K], topk_id int64 [L, K])``.
- tree: ``build_tree(topk_lp [L, K] float32, topk_id [L, K] int64, budget: int, root: int)
  -> (parents [n+1], tokens [n+1], depths [n+1])`` int64, pop order, parents[0] = -1,
  tokens[0] = root; optionally a fourth item, scores float64 [n+1], compared bit for bit.
- compile: ``compile_tree(parents [n+1], depths [n+1], start: int) -> (positions [n+1],
  visibility_bits uint32 [n+1, ceil((n+1)/32)], first_child [n+1], next_sibling [n+1])``.
- accept: ``accept(parents [n+1], tokens [n+1], choices [n+1]) -> (accepted [a] int64, next_root: int)``.
- compact: ``compact(c_kv [S, R], k_pe [S, dr], start: int, accepted [a]) -> (c_kv, k_pe)``:
  row start + k <- row start + accepted[k]; other rows unchanged.
- attention: ``attention(q_lat [n, H, R], q_pe [n, H, dr], c_kv [S, R], k_pe [S, dr],
  visibility [n, S] bool, scale: float) -> o_lat [n, H, R]`` (the tree-verify kernel;
  the last n rows of c_kv / k_pe are the tree tokens, every earlier row is visible).
- intermediates: ``intermediates(tokens, positions, visibility, start) -> dict[str, array]``:
  everything `forward` does (the same cache writes), returning per new token the values at
  the capture points (engine/model.py CAPTURE_POINTS), keyed ``"layers.{i}.{point}"``
  ([n, ...], one row per token: attn_in, q_lat, q_pe, c_kv, k_pe, o_lat, attn_out,
  residual, ffn_in, router_scores, experts (int, [n, k]), ffn_out, layer_out) and
  ``"logits"`` [n, V], in the compute dtype (bfloat16 as ml_dtypes.bfloat16); optionally
  ``"layers.{i}.expert_counts"`` [E] (rows each expert computed in this call). Any subset of
  points may be given; ``logits`` is required. `kdtree diverge` compares them point by
  point; `kdtree validate --dtype bfloat16` reads ``layers.{i}.experts`` to tell routing
  flips at a near-tie from routing bugs (docs/precision.md).

Precision: ``set_dtype(dtype: str)`` with "float32" or "bfloat16", called once before
`load_weights` whenever the adapter defines it: the adapter computes in that dtype from
then on (weights still arrive as float32 arrays; for the bf16 cases they hold bf16 values
exactly). `kdtree validate --dtype bfloat16` needs it; an adapter that cannot compute in
the dtype raises ValueError (reported as one line). Without it an adapter is validated
in float32.
- known deviations (optional, any adapter): ``deviations() -> list[Deviation]``, where the
  engine differs from the reference on purpose; noted on the rows named, never changing a
  verdict (deviations.py).

`engine.adapter.TorchAdapter` exposes the built-in engine through this protocol,
so the runner takes one code path for it and for any user's engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Protocol

import numpy as np

from kdtr_format import ModelConfig

CAPABILITIES: dict[str, tuple[str, ...]] = {
    "model": ("load_weights", "reset", "forward"),
    "topk": ("topk_logprobs",),
    "tree": ("build_tree",),
    "compile": ("compile_tree",),
    "accept": ("accept",),
    "compact": ("compact",),
    "attention": ("attention",),
    "intermediates": ("intermediates",),
}


class EngineAdapter(Protocol):
    """The full protocol (module docstring); an adapter may implement any subset of capabilities."""

    name: str

    def load_weights(self, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None: ...

    def reset(self, max_len: int) -> None: ...

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                start: int) -> np.ndarray: ...

    def topk_logprobs(self, draft_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def build_tree(self, topk_lp: np.ndarray, topk_id: np.ndarray, budget: int,
                   root: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def compile_tree(self, parents: np.ndarray, depths: np.ndarray,
                     start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...

    def accept(self, parents: np.ndarray, tokens: np.ndarray,
               choices: np.ndarray) -> tuple[np.ndarray, int]: ...

    def compact(self, c_kv: np.ndarray, k_pe: np.ndarray, start: int,
                accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def attention(self, q_lat: np.ndarray, q_pe: np.ndarray, c_kv: np.ndarray, k_pe: np.ndarray,
                  visibility: np.ndarray, scale: float) -> np.ndarray: ...

    def intermediates(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                      start: int) -> dict[str, np.ndarray]: ...

    def set_dtype(self, dtype: str) -> None: ...


def capabilities(adapter: Any) -> set[str]:
    """The capabilities whose every method the adapter defines."""
    return {cap for cap, methods in CAPABILITIES.items()
            if all(callable(getattr(adapter, m, None)) for m in methods)}


def load_impl(spec: str) -> Any:
    """An adapter from ``module:factory`` or ``path/to/file.py:factory`` (factory() -> adapter).
    ValueError naming the spec when the module cannot be imported, raises while importing,
    lacks the factory, or the factory raises."""
    target, sep, factory_name = spec.rpartition(":")
    if not sep or not target or not factory_name:
        raise ValueError(f"--impl {spec!r}: expected 'module:factory' or 'path/to/file.py:factory'")
    if target.endswith(".py") and not Path(target).is_file():
        raise ValueError(f"--impl {spec!r}: no file {target}")
    try:
        module = _import(target)
    except ImportError as exc:
        raise ValueError(f"--impl {spec!r}: cannot import {target!r} ({exc}); name a module on PYTHONPATH "
                         "or in the current directory, or a file: path/to/file.py:factory") from None
    except Exception as exc:
        raise ValueError(f"--impl {spec!r}: importing {target} raised {type(exc).__name__}: {exc}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--impl {spec!r}: {target} has no callable {factory_name!r}")
    try:
        return factory()
    except Exception as exc:
        raise ValueError(f"--impl {spec!r}: {factory_name}() raised {type(exc).__name__}: {exc}") from None


def _import(target: str) -> ModuleType:
    """A module from a file path ending in .py, or by name from sys.path and then the current
    directory (where `python -m` finds it, and a `kdtree` console script would not)."""
    if target.endswith(".py"):
        path = Path(target)
        module_spec = importlib.util.spec_from_file_location(f"kdtree_impl_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(target)
    finally:
        if added:
            sys.path.remove(cwd)
