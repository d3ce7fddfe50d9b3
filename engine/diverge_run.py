"""What `kdtree diverge` runs: an implementation and a prompt from a model fixture or a named
config, and the two ways of engine/diverge_ways.py over them, compared by engine/diverge.py
(engine/cli/diverge_cmd.py renders the finding).

- From a fixture: its float32 weights, one of its prompts; the compared tokens are the
  prompt's AR tokens (teacher-forced); the tree is a trace round's (default: the longest
  accepted path), its context the prompt and the tokens committed before the round, the
  compared path its accepted nodes.
- From a config (kdtr_format.PRESETS or CONFIGS): seeded random weights as the engine
  benchmark makes them (engine.validate.random_weights), a prompt of random tokens drawn as
  the benchmark draws them (torch.randint with a seeded CPU generator); the compared tokens are
  the implementation's own AR greedy tokens; the tree is the first DDTree round's with the
  oracle drafter (accuracy 0.8, seed 1) at block size 16, budget 64, as in the benchmark.
  `memory_needed` is what such a run holds (the CLI states it and refuses a run the machine
  cannot hold before any work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.filesize import decimal

import kdtr_format
from kdtr_format import CONFIGS, PRESETS, DDTreeConfig, ModelConfig

from .adapter import TorchAdapter
from .decode import ddtree_decode
from .diverge import Divergence, compare_ways
from .diverge_ways import Way, batch_way, chunk_way, decode_way, tree_way
from .drafters import OracleDrafter
from .validate import random_weights
from .validate.fixtures import fixture_weights

WAYS = ("chunk", "tree", "batch")
BENCH_DDTREE = DDTreeConfig(block_size=16, budget=64)


@dataclass
class Subject:
    """An implementation loaded with weights, a prompt, and (from a fixture) the tokens and trees to replay."""

    adapter: Any
    prompt: list[int]
    label: str
    tokens: list[int] | None = None                     # teacher-forced continuation, else greedy
    trees: dict[tuple[str, int], tuple[list[int], np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    router_bias: dict[int, np.ndarray] = field(default_factory=dict)
    fixture: str = ""                                   # from a fixture: its file name,
    prompt_name: str = ""                               # the prompt's name (`default_prompt`: not asked for),
    default_prompt: bool = False
    traces: dict[str, tuple[str, int]] = field(default_factory=dict)     # and every trace's prompt and rounds


def _router_bias(weights: dict[str, Any]) -> dict[int, np.ndarray]:
    suffix = ".moe.e_score_correction_bias"
    return {int(name.split(".")[1]): np.asarray(torch.as_tensor(w).float().cpu())
            for name, w in weights.items() if name.endswith(suffix)}


def from_fixture(path: str | Path, prompt: str | None, adapter: Any) -> Subject:
    """A model fixture's weights loaded into `adapter`, its prompt `prompt` (default: the longest)."""
    path = Path(path)
    with kdtr_format.open(path) as reader:
        metadata = reader.metadata
        if metadata.get("kind") != "model":
            raise ValueError(f"{path}: not a model fixture (kind {metadata.get('kind')!r})")
        cfg = kdtr_format.ModelConfig.from_dict(metadata["config"])
        names = [p["name"] for p in metadata["prompts"]]
        name = prompt or max(metadata["prompts"], key=lambda p: p["length"])["name"]
        if name not in names:
            raise ValueError(f"{path.name} has no prompt {name!r} (it has {', '.join(names)})")
        weights = fixture_weights(reader)
        adapter.load_weights(cfg, weights)
        tokens = np.asarray(reader[f"prompts/{name}/tokens"]).tolist()
        trees = {}
        for trace in metadata["traces"]:
            if trace["prompt"] != name:
                continue
            committed = np.asarray(reader[f"traces/{trace['name']}/tokens"]).tolist()
            for r in range(trace["rounds"]):
                rp = f"traces/{trace['name']}/rounds/{r}"
                start = int(np.asarray(reader[f"{rp}/start"]))
                context = tokens + committed[:start - len(tokens)]
                trees[trace["name"], r] = (context, np.asarray(reader[f"{rp}/tokens"]),
                                           np.asarray(reader[f"{rp}/parents"]), np.asarray(reader[f"{rp}/accepted"]))
        return Subject(adapter, tokens, f"{path.name} prompt {name}",
                       tokens=np.asarray(reader[f"prompts/{name}/ar/tokens"]).tolist(), trees=trees,
                       router_bias=_router_bias(weights), fixture=path.name, prompt_name=name,
                       default_prompt=prompt is None,
                       traces={t["name"]: (t["prompt"], t["rounds"]) for t in metadata["traces"]})


def named_config(name: str) -> ModelConfig:
    """A preset or kdtr_format.CONFIGS entry; ValueError naming the choices otherwise."""
    configs = {**PRESETS, **CONFIGS}
    if name not in configs:
        raise ValueError(f"unknown config {name!r}; configs are {', '.join(configs)}")
    return configs[name]


def from_config(name: str, adapter: TorchAdapter, seed: int, prompt_length: int, prompt_seed: int) -> Subject:
    """A named config with the benchmark's random weights in the adapter's dtype and device."""
    cfg = named_config(name)
    weights = random_weights(cfg, seed=seed, device=adapter.device, dtype=adapter.dtype)
    adapter.load_weights(cfg, weights)
    generator = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_length,), generator=generator).tolist()
    return Subject(adapter, prompt, f"{name} (random weights, seed {seed}; prompt of {prompt_length} tokens, "
                                    f"seed {prompt_seed})", router_bias=_router_bias(weights))


@dataclass(frozen=True)
class Memory:
    """What a --config run holds, in bytes: the weights in the compute dtype
    (kdtr_format.weight_bytes: the estimate `refgen generate --config-file` refuses by), the
    two float32 temporaries that make the largest of them (engine.validate.random_weights), both
    on the device; and the values both ways capture, on the host."""

    dtype: str
    weights: int
    making: int
    captures: int

    @property
    def device(self) -> int:
        return self.weights + self.making

    @property
    def total(self) -> int:
        return self.device + self.captures

    def __str__(self) -> str:
        return (f"about {decimal(self.total)} ({decimal(self.weights)} of weights in {self.dtype}, "
                f"{decimal(self.making)} to make the largest, {decimal(self.captures)} of captured values)")


def memory_needed(cfg: ModelConfig, dtype: str, prompt_length: int, tokens: int) -> Memory:
    """The Memory of a run on `cfg` in `dtype` ("float32", "bfloat16") over a prompt of
    `prompt_length` and `tokens` compared tokens (a tree way's verify: up to the benchmark's
    budget + 1 rows)."""
    itemsize = 2 if dtype == "bfloat16" else 4
    largest = max(math.prod(shape) for shape in kdtr_format.weight_shapes(cfg).values())
    d, heads, latent = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    moe_layers = sum(not cfg.is_dense_layer(i) for i in range(cfg.num_hidden_layers))
    # a captured row: per layer attn_input, attn_output, attn_residual, ffn_output, layer_output [D],
    # q_lat and o_lat [H, R], c_kv [R], k_pe [dr]; per MoE layer router scores (float32) and experts
    # (int64); the logits [V]
    per_row = (cfg.num_hidden_layers * itemsize * (5 * d + 2 * heads * latent + latent + cfg.qk_rope_head_dim)
               + moe_layers * (4 * cfg.n_routed_experts + 8 * cfg.num_experts_per_tok) + itemsize * cfg.vocab_size)
    rows = prompt_length + max(tokens, BENCH_DDTREE.budget + 1)
    return Memory(dtype, kdtr_format.weight_bytes(cfg, itemsize), 2 * 4 * largest, 2 * rows * per_row)


def run(subject: Subject, way: str, count: int, batch: int = 4,
        tree: tuple[str, int] | None = None) -> tuple[Way, Way, Divergence]:
    """AR decode against `way` ("chunk", "tree" or "batch") over `count` tokens (or the tree's path)."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {', '.join(WAYS)}, got {way!r}")
    adapter, prompt = subject.adapter, subject.prompt
    if way == "tree":
        context, tree_tokens, parents, path = _tree(subject, tree)
        decoded = decode_way(adapter, context, tree_tokens[path].tolist())
        other = tree_way(adapter, context, tree_tokens, parents, path)
        return decoded, other, compare_ways(decoded, other, subject.router_bias)
    tokens = subject.tokens[:count] if subject.tokens is not None else None
    decoded = decode_way(adapter, prompt, tokens, count)
    new = decoded.tokens[len(prompt):]
    if way == "chunk":
        other = chunk_way(adapter, prompt, new)
    else:
        if not isinstance(adapter, TorchAdapter):
            raise ValueError("the batch way needs the built-in engine (it batches the model itself, not an adapter)")
        generator = np.random.default_rng(0)
        vocab = adapter.model.cfg.vocab_size
        others = [generator.integers(0, vocab, size=max(1, len(prompt) // (b + 2))).tolist() for b in range(batch - 1)]
        steps = [generator.integers(0, vocab, size=len(new) + b).tolist() for b in range(batch - 1)]
        other = batch_way(adapter.model, [prompt, *others], [new, *steps])
    return decoded, other, compare_ways(decoded, other, subject.router_bias)


def _missing_round(subject: Subject, trace: str, round_: int) -> str:
    """Why --trace TRACE/ROUND names no round of this run's prompt, and which option would."""
    option = f"--trace {trace}/{round_}"
    if trace not in subject.traces:
        return f"{option}: {subject.fixture} has no trace {trace} (it has {', '.join(subject.traces)})"
    prompt, rounds = subject.traces[trace]
    if prompt != subject.prompt_name:
        default = " (the longest; the default)" if subject.default_prompt else ""
        return (f"{option}: trace {trace} replays prompt {prompt}, and this run's is {subject.prompt_name}{default}: "
                f"give --prompt {prompt}")
    return f"{option}: trace {trace} has " + ("round 0 only" if rounds == 1 else f"rounds 0 to {rounds - 1}")


def _tree(subject: Subject, pick: tuple[str, int] | None) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """(context, tree tokens, parents, compared path): a fixture trace round's, or one DDTree round's."""
    if subject.trees:
        if pick is None:
            return max(subject.trees.values(), key=lambda t: (len(t[3]), len(t[1])))
        if pick not in subject.trees:
            raise ValueError(_missing_round(subject, *pick))
        return subject.trees[pick]
    if subject.tokens is not None:
        raise ValueError("this fixture prompt has no trace to take a tree from")
    adapter = subject.adapter
    model = adapter.model
    truth = decode_way(adapter, subject.prompt, None, BENCH_DDTREE.block_size).tokens
    drafter = OracleDrafter([truth], model.cfg.vocab_size, 0.8, seed=1, device=model.device)
    result = ddtree_decode(model, drafter, [subject.prompt], BENCH_DDTREE, 2, stages=adapter.stages, record=True)
    first = result.requests[0].rounds[0]
    return (subject.prompt, first.tokens.cpu().numpy(), first.parents.cpu().numpy(), first.accepted.cpu().numpy())
