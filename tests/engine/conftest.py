"""Shared fixtures for the engine tests: small models built once per session.

- `model_zoo.get(name)` -> ModelCase: the config, float32 weights from
  `refgen.weights.init_weights(cfg, SEED)`, the float64 numpy reference
  `refgen.model.Model`, and `case.engine(device, dtype)`, the torch
  `engine.model.Transformer` (built on first use, shared by the session).
- A test taking `model_name` runs once per entry of MODELS: the presets
  (`tiny`, `tiny2`, `kimi-k2`) plus `tiny-neox-yarn`, the `tiny` preset with
  neox rope and YaRN whose two mscale factors differ, so that a rope pairing
  or an mscale mistake changes its logits.
- A test taking `device` runs on "cpu" and on "cuda" (skipped without a GPU).
- Engine tests run torch with one intra-op thread (`one_torch_thread`).
- `small_model_fixture` -> a tiny2 model fixture generated once a session by refgen, small
  enough to validate in a fraction of a second (SMALL_PLAN, SMALL_BF16_PLAN), in a directory
  of its own (tiny2.kdtr).
- `builtin_decode_only(stages=None)`: from then on, `engine.validate.validate(None, ...)`
  checks the built-in engine with these stages and runs its own decode loops but not the
  invariant (checked on its own, and the slowest part).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from kdtr_format import PRESETS, DDTreeConfig, ModelConfig, YarnScaling
from refgen.files import write_fixture
from refgen.fixtures import FixturePlan, TraceSpec, model_fixture

SEED = 1234

# Two prompts; greedy traces of block sizes 4 and 3, one of block size 1 (root-only trees: no
# round rejects a node), two sampled ones; bf16 cases of one prompt.
SMALL_PLAN = FixturePlan(prompt_lengths=(5, 9), ar_new_tokens=8, traces=(
    TraceSpec("t0", 0, "oracle", 0.8, DDTreeConfig(block_size=4, budget=6), 8),
    TraceSpec("t1", 1, "oracle", 0.6, DDTreeConfig(block_size=3, budget=5), 8),
    TraceSpec("t2", 0, "target", None, DDTreeConfig(block_size=3, budget=4, temperature=0.6), 6),
    TraceSpec("t3", 1, "target", None, DDTreeConfig(block_size=3, budget=4, temperature=0.6), 6),
    TraceSpec("t4", 1, "oracle", 0.9, DDTreeConfig(block_size=1, budget=8), 4)))
SMALL_BF16_PLAN = FixturePlan(prompt_lengths=(4, 6), ar_new_tokens=6, traces=(
    TraceSpec("t0", 0, "oracle", 0.9, DDTreeConfig(block_size=4, budget=6), 6),))

MODELS: dict[str, ModelConfig] = {
    **PRESETS,
    "tiny-neox-yarn": dataclasses.replace(
        PRESETS["tiny"], rope_style="neox",
        rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=64, beta_fast=16.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5)),
}


@dataclass
class ModelCase:
    cfg: ModelConfig
    weights: dict[str, np.ndarray]
    reference: object                          # refgen.model.Model
    _engines: dict = field(default_factory=dict)

    def engine(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """The engine.model.Transformer of these weights on `device` in `dtype`."""
        from engine.model import Transformer

        if (device, dtype) not in self._engines:
            self._engines[device, dtype] = Transformer(self.cfg, self.weights, device=device, dtype=dtype)
        return self._engines[device, dtype]


class ModelZoo:
    def __init__(self) -> None:
        self._cases: dict[str, ModelCase] = {}

    def get(self, name: str) -> ModelCase:
        if name not in self._cases:
            from refgen.model import Model
            from refgen.weights import init_weights

            cfg = MODELS[name]
            weights = init_weights(cfg, SEED)
            self._cases[name] = ModelCase(cfg, weights, Model(cfg, weights))
        return self._cases[name]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_name" in metafunc.fixturenames:
        metafunc.parametrize("model_name", list(MODELS))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The engine tests run tiny matrices: one intra-op thread is faster than two on the
    2-core CI, and far faster when other processes share the cores (threads spin-wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_zoo() -> ModelZoo:
    return ModelZoo()


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA variant: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return request.param


@pytest.fixture(scope="session")
def small_model_fixture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("small") / "tiny2.kdtr"
    write_fixture(path, model_fixture(PRESETS["tiny2"], "tiny2", seed=0, plan=SMALL_PLAN, bf16_plan=SMALL_BF16_PLAN))
    return path


@pytest.fixture
def builtin_decode_only(monkeypatch: pytest.MonkeyPatch) -> Callable:
    import engine.validate.rows.model
    import engine.validate.run.runner
    from engine.adapter import TorchAdapter

    def use(stages=None) -> None:
        class Engine(TorchAdapter):
            def __init__(self, device="cpu", **kwargs):
                super().__init__(device, **kwargs)
                self.stages = stages or self.stages

        monkeypatch.setattr(engine.validate.run.runner, "TorchAdapter", Engine)
        monkeypatch.setattr(engine.validate.run.runner, "preset_invariant_checks", lambda adapter, preset: [])
        monkeypatch.setattr(engine.validate.rows.model, "invariant_checks", lambda *args: [])
    return use


@pytest.fixture(scope="module")
def export_dir(golden, tmp_path_factory) -> Path:
    """tiny (committed, slim) exported as a float32 checkpoint directory, for the server tests."""
    import kdtr_format
    from refgen.export import export

    path = golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader:
        return export(reader, path, tmp_path_factory.mktemp("export") / "tiny-f32").directory


@pytest.fixture(scope="module")
def engine(golden):
    """The fake servers' reference engine on tiny (tests/fake_servers.py)."""
    from fake_servers import Engine

    return Engine(golden / "tiny.kdtr")
