"""Golden fixture files: model fixtures, and what every fixture file shares.

A model fixture (docs/fixtures.md, "Model fixtures") holds one config's
weights, three prompts with their prefill logits and AR greedy output, DDTree
traces for a few (drafter, budget, block size, temperature) settings with every
round's tensors (sampled traces with the uniform of every decision), and the
adversarial sampling cases (refgen.sample_cases). `FixturePlan` says which;
`DEFAULT_PLAN` is what refgen commits. A fixture whose greedy DDTree tokens
differ from its AR tokens is never written (`FixtureError`).

Near ties. Exact token comparison is fair only away from ties, so:

- every greedy decision (each AR token, and the target's choice at every node
  of every verified tree) has a top-1 minus top-2 logit margin >=
  `margin_threshold` = MARGIN_REL x `logit_scale` (the standard deviation of a
  probe prompt's prefill logits); a prompt whose AR run breaks this is redrawn
  from its next sub-seed, a drafter seed whose trees do, likewise;
- every sampled decision (the first token and every node of a sampled trace)
  has a margin (refgen.ddtree.sample_margins: 4 T times the distance from its
  uniform to the nearer end of the chosen token's CDF interval, in logit units
  like a greedy margin) >= `margin_threshold`: a uniform nearer a boundary is
  drawn again (refgen.decode.ddtree_decode's margin_floor), and a (drafter,
  uniforms) seed pair that still breaks it is redrawn;
- within every draft's top K + 1 log-probs, two adjacent values are either
  exactly equal (the tie rule orders them; every implementation agrees) or at
  least TOPK_GAP_MIN apart; a drafter seed that breaks this is redrawn.

The final seeds, the smallest margin and the smallest gap are in the metadata.

Shared by every fixture kind (refgen/kernel_cases.py too): `Fixture`, provenance
(`generator_info`) and sub-seeds. Files are refgen.files' job; when a regeneration
is the committed fixture, refgen.regen's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from kdtr_format import DDTreeConfig, ModelConfig

from kdtr_format.precision import FLOAT32_LOGIT_ATOL, FLOAT32_LOGIT_RTOL, bf16_bounds

from . import __version__
from .bf16 import bf16_weights, routing_tensors
from .decode import ARResult, Round, ar_greedy, ddtree_decode
from .drafters import OracleDrafter, RandomDrafter, TargetDrafter
from .model import KVCache, Model
from .sample_cases import sample_cases
from .weights import init_weights

FIXTURE_FORMAT = 1
GOLDEN_PRESETS = ("tiny", "tiny2")   # committed; kimi-k2's weights (275 MB) are generated on demand
MARGIN_REL = 1e-3                    # margin_threshold = MARGIN_REL * logit_scale
TOPK_GAP_MIN = 1e-5                  # ~10 float32 ulps of a log-prob in [-16, -8]
MAX_DRAWS = 32                       # redraws of a prompt or drafter seed before giving up
PROBE_LENGTH = 16                    # the probe prompt that measures logit_scale

# Sub-seed streams (see `sub_seed`).
_PROBE, _PROMPT, _DRAFTER, _UNIFORMS = 0, 1, 2, 3

Progress = Callable[[int], None]     # called with the number of steps just finished


class FixtureError(ValueError):
    """A fixture that cannot be generated as asked (broken invariant, impossible plan)."""


def sub_seed(seed: int, stream: int, index: int, draw: int) -> int:
    """A 32-bit seed for one draw of one item of a stream, from the fixture seed
    (numpy's SeedSequence, identical on every platform)."""
    return int(np.random.SeedSequence([seed, stream, index, draw]).generate_state(1)[0])


def generator_info(seed: int) -> dict[str, Any]:
    return {"name": "refgen", "version": __version__, "numpy": np.__version__, "seed": seed}


def _scalar(value: int) -> np.ndarray:
    return np.array(value, dtype=np.int64)


# ---------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class TraceSpec:
    """One DDTree trace: a prompt (index into the plan's prompts), a drafter
    ("oracle" with an accuracy, "random", or "target": the target's own greedy
    chain), a DDTree setting (temperature > 0: sampled), a length."""

    name: str
    prompt: int
    drafter: str
    accuracy: float | None
    ddtree: DDTreeConfig
    max_new_tokens: int


@dataclass(frozen=True)
class FixturePlan:
    """Prompt lengths (named p0, p1, ...), AR tokens per prompt, and the traces."""

    prompt_lengths: tuple[int, ...]
    ar_new_tokens: int
    traces: tuple[TraceSpec, ...]

    @property
    def steps(self) -> int:
        """Progress steps of one fixture: the weights, each prompt's AR run, each trace."""
        return 1 + len(self.prompt_lengths) + len(self.traces)

    def positions_needed(self) -> int:
        """The largest position any forward of this plan uses, plus one."""
        longest = max(self.prompt_lengths) + self.ar_new_tokens
        return longest + max((t.ddtree.depth for t in self.traces), default=0)


DEFAULT_PLAN = FixturePlan(
    prompt_lengths=(5, 12, 27),
    ar_new_tokens=16,
    traces=(
        TraceSpec("t0", 0, "oracle", 0.9, DDTreeConfig(block_size=4, budget=8), 16),
        TraceSpec("t1", 1, "oracle", 0.6, DDTreeConfig(block_size=6, budget=20), 12),
        TraceSpec("t2", 2, "random", None, DDTreeConfig(block_size=3, budget=6), 10),
        TraceSpec("t3", 0, "oracle", 0.9, DDTreeConfig(block_size=4, budget=0), 8),
        TraceSpec("t4", 1, "oracle", 0.9, DDTreeConfig(block_size=8, budget=1), 10),
        # L = 0: a budget larger than the tree can ever fill (root only).
        TraceSpec("t5", 2, "oracle", 0.9, DDTreeConfig(block_size=1, budget=64), 6),
        # The paper's block size, with the drafter always right at top-1.
        TraceSpec("t6", 0, "oracle", 1.0, DDTreeConfig(block_size=16, budget=24), 12),
        # Sampled, drafted by the target itself (so that rounds accept several tokens and siblings);
        # one block size and temperature, so that the engine replays the three in one batch.
        TraceSpec("t7", 0, "target", None, DDTreeConfig(block_size=4, budget=10, temperature=0.6), 12),
        TraceSpec("t8", 1, "target", None, DDTreeConfig(block_size=4, budget=16, temperature=0.6), 10),
        TraceSpec("t9", 2, "target", None, DDTreeConfig(block_size=4, budget=6, temperature=0.6), 8),
    ),
)


# The bf16 cases (docs/fixtures.md "bf16 cases"): short prompts, so that many rows are out of
# reach of every routing near-tie and checked at the rounding tolerance.
BF16_PLAN = FixturePlan(
    prompt_lengths=(4, 7, 10),
    ar_new_tokens=10,
    traces=(
        TraceSpec("t0", 0, "oracle", 0.9, DDTreeConfig(block_size=4, budget=8), 10),
        TraceSpec("t1", 1, "oracle", 0.6, DDTreeConfig(block_size=6, budget=16), 8),
        TraceSpec("t2", 2, "random", None, DDTreeConfig(block_size=3, budget=6), 6),
        TraceSpec("t3", 0, "oracle", 1.0, DDTreeConfig(block_size=8, budget=12), 10),
    ),
)


def tolerances(logit_scale: float) -> dict[str, Any]:
    """Per tensor kind (docs/fixtures.md), for float32 engines:
    |actual - expected| <= atol + rtol * |expected|.

    logits: prefill_logits, verify_logits (margin_threshold exceeds twice the
    float32 tolerance, so an error inside it cannot flip a decision above the
    threshold); logprobs: topk_lp; scores: tree scores (bit-exact when built from
    the fixture's topk_lp; the tolerance covers top-k recomputed from draft logits).
    The logits tolerances, float32 and the bf16 cases', are kdtr_format.precision's.
    """
    return {"logits": {"rtol": FLOAT32_LOGIT_RTOL, "atol": FLOAT32_LOGIT_ATOL * logit_scale},
            "logprobs": {"rtol": 0.0, "atol": 1e-5},
            "scores": {"rtol": 0.0, "atol": 1e-4}}


# ---------------------------------------------------------------------------- near-tie measures

def topk_gaps(logits: np.ndarray, k: int) -> tuple[float | None, float | None]:
    """logits [L, V] -> (smallest nonzero gap between adjacent ranks of a row's top K,
    smallest nonzero gap between its K-th and (K+1)-th value), K = min(k, V); None
    where there is no such pair. Gaps of logits equal those of their log-probs."""
    L, V = logits.shape
    K = min(k, V)
    if L == 0 or K == 0:
        return None, None
    width = min(K + 1, V)
    x = -np.asarray(logits, dtype=np.float64)
    top = -np.sort(np.partition(x, width - 1, axis=1)[:, :width], axis=1)   # [L, width] descending
    gaps = top[:, :-1] - top[:, 1:]
    return _smallest_nonzero(gaps[:, :K - 1]), _smallest_nonzero(gaps[:, K - 1:])


def _smallest_nonzero(values: np.ndarray) -> float | None:
    values = values[values > 0]
    return float(values.min()) if values.size else None


def _smallest(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _gap_ok(gap: float | None) -> bool:
    return gap is None or gap >= TOPK_GAP_MIN


# ---------------------------------------------------------------------------- model fixtures

@dataclass
class Fixture:
    """A fixture in memory: tensors by name and metadata (content_hash added on write)."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]


@dataclass
class _Block:
    """One prompt's share of a model fixture."""

    tensors: dict[str, np.ndarray]
    prompt: dict[str, Any]
    traces: list[dict[str, Any]]
    min_margin: float


def check_plan(cfg: ModelConfig, plan: FixturePlan) -> None:
    """FixtureError naming the config field that cannot hold `plan`."""
    if plan.positions_needed() > cfg.max_position_embeddings:
        raise FixtureError(f"max_position_embeddings: the fixture plan needs positions up to "
                           f"{plan.positions_needed()}, the config allows {cfg.max_position_embeddings}")


def model_steps(plan: FixturePlan, bf16_plan: FixturePlan | None = BF16_PLAN) -> int:
    """Progress steps of `model_fixture` with these plans: each plan's (FixturePlan.steps), and the bf16
    cases' routing of each prompt."""
    return plan.steps + (bf16_plan.steps + len(bf16_plan.prompt_lengths) if bf16_plan is not None else 0)


def model_fixture(cfg: ModelConfig, preset: str, seed: int = 0, plan: FixturePlan = DEFAULT_PLAN,
                  progress: Progress | None = None, source: str = "preset",
                  weights: Mapping[str, np.ndarray] | None = None,
                  bf16_plan: FixturePlan | None = BF16_PLAN) -> Fixture:
    """The model fixture of `cfg` named `preset` from `seed`: weights, prompts, AR
    runs and DDTree traces as docs/fixtures.md lays them out, and the bf16 cases
    (`bf16/...`: `bf16_plan` on the same weights rounded to bf16; None: none). `source`
    says where the config came from: "preset" (kdtr_format.PRESETS), "config-file", or
    "checkpoint" (then `weights` are the checkpoint's, else `init_weights(cfg, seed)`)."""
    step = progress or (lambda steps: None)
    check_plan(cfg, plan)
    if bf16_plan is not None:
        check_plan(cfg, bf16_plan)
    weights = init_weights(cfg, seed) if weights is None else weights
    tensors, metadata = _cases(cfg, weights, seed, plan, step)
    cases, metadata["sample_cases"] = sample_cases(cfg.vocab_size)
    tensors.update(cases)
    if bf16_plan is not None:
        bf16_tensors, bf16_metadata = _cases(cfg, bf16_weights(weights), seed, bf16_plan, step, bf16=True)
        tensors.update({f"bf16/{name}": array for name, array in bf16_tensors.items()})
        metadata["bf16"] = {"weights_dtype": "bfloat16", **bf16_metadata}
    metadata = {
        "kdtree_fixture": FIXTURE_FORMAT,
        "kind": "model",
        "preset": preset,
        "source": source,
        "config": cfg.to_dict(),
        "generator": generator_info(seed),
        **metadata,
    }
    return Fixture(tensors, metadata)


def _cases(cfg: ModelConfig, weights: Mapping[str, np.ndarray], seed: int, plan: FixturePlan, step: Progress,
           bf16: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One set of cases on `weights`: tensors and metadata (docs/fixtures.md). bf16 adds the
    reference's routing of every compared row and the bf16 bounds (kdtr_format.precision)."""
    model = Model(cfg, weights)
    probe = np.random.default_rng(sub_seed(seed, _PROBE, 0, 0)).integers(
        0, cfg.vocab_size, size=PROBE_LENGTH, dtype=np.int64)
    logit_scale = float(np.std(model.prefill(probe, KVCache.new(cfg, PROBE_LENGTH))))
    threshold = MARGIN_REL * logit_scale
    step(1)

    tensors = {f"weights/{name}": array for name, array in weights.items()}
    prompts, traces, margins = [], [], []
    for index in range(len(plan.prompt_lengths)):
        block = _prompt_block(model, plan, seed, index, threshold, step)
        tensors.update(block.tensors)
        prompts.append(block.prompt)
        traces.extend(block.traces)
        margins.append(block.min_margin)

    metadata = {
        "tolerances": tolerances(logit_scale),
        "logit_scale": logit_scale,
        "margin_threshold": threshold,
        "min_margin": min(margins),
        "topk_gap_threshold": TOPK_GAP_MIN,
        "min_topk_gap": _smallest(*(t["min_topk_gap"] for t in traces),
                                  *(t["min_topk_boundary_gap"] for t in traces)),
        "prompts": prompts,
        "traces": sorted(traces, key=lambda t: t["name"]),
    }
    if bf16:
        for p in prompts:
            tensors.update(routing_tensors(model, tensors, p["name"], [t for t in traces if t["prompt"] == p["name"]]))
            step(1)
        metadata.update(_bf16_bounds(cfg, tensors, logit_scale))
    return tensors, metadata


def _bf16_bounds(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], logit_scale: float) -> dict[str, Any]:
    """The bf16 cases' tolerances and thresholds, and how many of their routing decisions are near-ties."""
    logits = [t for name, t in tensors.items() if name.endswith(("prefill_logits", "verify_logits"))]
    bounds = bf16_bounds(logit_scale, cfg.num_hidden_layers, max(float(np.abs(t).max()) for t in logits))
    margins = np.concatenate([t.reshape(-1) for name, t in tensors.items() if name.endswith("router_margins")])
    return {"tolerances_bf16": {**tolerances(logit_scale),
                                "logits": {"rtol": bounds.logits_rtol, "atol": bounds.logits_atol}},
            "bf16_margin_threshold": bounds.margin_threshold,
            "routing_threshold": bounds.routing_threshold,
            "routing_decisions": len(margins),
            "routing_near_ties": int((margins < bounds.routing_threshold).sum())}


def _prompt_block(model: Model, plan: FixturePlan, seed: int, index: int, threshold: float,
                  step: Progress) -> _Block:
    """Prompt `index`: drawn, run AR and its traces; redrawn while a margin is too small."""
    V = model.cfg.vocab_size
    for draw in range(MAX_DRAWS):
        prompt_seed = sub_seed(seed, _PROMPT, index, draw)
        prompt = np.random.default_rng(prompt_seed).integers(
            0, V, size=plan.prompt_lengths[index], dtype=np.int64)
        block = _prompt_block_once(model, plan, seed, index, prompt, threshold)
        if block is None:
            continue
        block.prompt.update(seed=prompt_seed, draw=draw)
        step(1 + len(block.traces))
        return block
    raise FixtureError(f"prompt p{index}: no draw out of {MAX_DRAWS} keeps every greedy margin "
                       f"above {threshold:.3g}")


def _prompt_block_once(model: Model, plan: FixturePlan, seed: int, index: int, prompt: np.ndarray,
                       threshold: float) -> _Block | None:
    """One draw of prompt `index`; None when an AR margin is below the threshold."""
    name = f"p{index}"
    ar = ar_greedy(model, prompt, plan.ar_new_tokens)
    if ar.margins.min(initial=np.inf) < threshold:
        return None
    tensors = {f"prompts/{name}/tokens": prompt,
               f"prompts/{name}/prefill_logits": ar.prefill_logits,
               f"prompts/{name}/ar/tokens": ar.tokens,
               f"prompts/{name}/ar/margins": ar.margins,
               f"prompts/{name}/ar/target_forwards": _scalar(ar.target_forwards)}
    traces, margins = [], [float(ar.margins.min(initial=np.inf))]
    for trace_index, spec in enumerate(plan.traces):
        if spec.prompt != index:
            continue
        trace_tensors, meta = _trace(model, prompt, ar, spec, seed, trace_index, threshold)
        tensors.update(trace_tensors)
        traces.append(meta)
        margins.append(meta["min_margin"])
    return _Block(tensors, {"name": name, "length": len(prompt)}, traces, min(margins))


def _drafter(spec: TraceSpec, model: Model, prompt: np.ndarray, ar: ARResult,
             drafter_seed: int) -> OracleDrafter | RandomDrafter | TargetDrafter:
    vocab_size = model.cfg.vocab_size
    if spec.drafter == "oracle":
        return OracleDrafter(np.concatenate([prompt, ar.tokens]), vocab_size, spec.accuracy,
                             drafter_seed)
    if spec.drafter == "random":
        return RandomDrafter(vocab_size, drafter_seed)
    if spec.drafter == "target":
        return TargetDrafter(model)
    raise FixtureError(f"trace {spec.name}: unknown drafter {spec.drafter!r} (oracle, random, target)")


def _trace(model: Model, prompt: np.ndarray, ar: ARResult, spec: TraceSpec, seed: int,
           trace_index: int, threshold: float) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One DDTree trace; the drafter seed (and for a sampled trace the uniforms seed) is
    redrawn while a decision's margin or a top-k gap is too small."""
    if spec.max_new_tokens > len(ar.tokens):
        raise FixtureError(f"trace {spec.name}: max_new_tokens {spec.max_new_tokens} exceeds the "
                           f"{len(ar.tokens)} AR tokens it is checked against")
    sampled = spec.ddtree.temperature > 0
    for draw in range(MAX_DRAWS):
        drafter_seed = sub_seed(seed, _DRAFTER, trace_index, draw)
        uniforms_seed = sub_seed(seed, _UNIFORMS, trace_index, draw) if sampled else None
        drafter = _drafter(spec, model, prompt, ar, drafter_seed)
        result = ddtree_decode(model, drafter, prompt, spec.ddtree, spec.max_new_tokens,
                               uniforms_seed=uniforms_seed, margin_floor=threshold if sampled else 0.0)
        expected = ar.tokens[:spec.max_new_tokens]
        if not sampled and not np.array_equal(result.tokens, expected):
            raise FixtureError(f"trace {spec.name}: DDTree tokens {result.tokens.tolist()} differ "
                               f"from AR tokens {expected.tolist()}; refusing to write a fixture "
                               "that breaks the invariant")
        node_margin = min((float(r.margins.min()) for r in result.rounds), default=np.inf)
        token_margin = float(result.margins.min(initial=np.inf) if sampled else
                             ar.margins[:spec.max_new_tokens].min())
        gaps = [topk_gaps(r.draft_logits, spec.ddtree.budget) for r in result.rounds]
        if min(node_margin, token_margin) >= threshold and all(_gap_ok(a) and _gap_ok(b) for a, b in gaps):
            break
    else:
        raise FixtureError(f"trace {spec.name}: no drafter seed out of {MAX_DRAWS} keeps every "
                           f"decision's margin above {threshold:.3g} and every top-k gap above "
                           f"{TOPK_GAP_MIN}")

    prefix = f"traces/{spec.name}"
    tensors = {f"{prefix}/tokens": result.tokens,
               f"{prefix}/target_forwards": _scalar(result.target_forwards),
               f"{prefix}/acceptance_lengths": result.acceptance_lengths}
    if sampled:
        tensors.update({f"{prefix}/margins": result.margins,
                        f"{prefix}/prefill_uniform": np.array(result.prefill_uniform, dtype=np.float64)})
    for r, round_ in enumerate(result.rounds):
        tensors.update(_round_tensors(f"{prefix}/rounds/{r}", round_))
    drafter_meta = {"kind": spec.drafter, "seed": drafter_seed, "draw": draw}
    if spec.accuracy is not None:
        drafter_meta["accuracy"] = spec.accuracy
    meta = {
        "name": spec.name,
        "prompt": f"p{spec.prompt}",
        "drafter": drafter_meta,
        "ddtree": spec.ddtree.to_dict(),
        "max_new_tokens": spec.max_new_tokens,
        "rounds": len(result.rounds),
        "target_forwards": result.target_forwards,
        "ar_target_forwards": spec.max_new_tokens,       # prefill + one per token after the first
        "non_prefix_rounds": sum(int(not np.array_equal(r.accepted, np.arange(len(r.accepted))))
                                 for r in result.rounds),
        "min_margin": min(node_margin, token_margin),
        "min_topk_gap": _smallest(*(adjacent for adjacent, _ in gaps)),
        "min_topk_boundary_gap": _smallest(*(boundary for _, boundary in gaps)),
    }
    if sampled:
        meta["uniforms_seed"] = uniforms_seed
    return tensors, meta


def _round_tensors(prefix: str, r: Round) -> dict[str, np.ndarray]:
    """One round's tensors, named as docs/fixtures.md."""
    tree, compiled = r.tree, r.compiled
    tensors = {"start": _scalar(r.start), "root": _scalar(r.root),
               "draft_logits": r.draft_logits, "topk_lp": r.topk_lp, "topk_id": r.topk_id,
               "parents": tree.parents, "tokens": tree.tokens, "depths": tree.depths,
               "ranks": tree.ranks, "scores": tree.scores, "positions": compiled.positions,
               "visibility_bits": compiled.visibility_bits, "verify_logits": r.verify_logits,
               "choices": r.choices, "margins": r.margins, "accepted": r.accepted,
               "next_root": _scalar(r.next_root), "compaction_src": r.compaction_src}
    if r.uniforms is not None:
        tensors["uniforms"] = r.uniforms
    return {f"{prefix}/{name}": array for name, array in tensors.items()}
