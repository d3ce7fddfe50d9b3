"""Every row `kdtree validate` can emit fails for a bug planted in an implementation.

PLANTS maps each row, (fixture kind, row name), to a planted bug: a broken adapter (for the
built-in engine's own rows, a patch of the engine), the fixtures it runs on, and every row it
fails. That is the row alone wherever a bug can stay out of the others; a row that follows
from another (target choices from verify logits, the committed tokens from accept) fails
beside it. The run's FAIL rows must be exactly those, so a row whose checks stop checking
fails its plant, and `test_every_row_has_a_planted_bug` holds PLANTS to the plan of the
committed fixtures in both dtypes, so a row added without a plant fails it.

- A row that compares a batch has a plant wrong only in a later request (request 1 or
  after), so a row that compared request 0 alone would pass it; a compaction row, one that
  writes one slot past the committed ones.
- The built-in engine's own rows are planted at the seams they check (its AR loop, its
  replay, its uniforms, its greedy choice, the invariant's decodes), all in one run: each
  plant reaches its own row only. Invariant mode's row has a run of its own.
- `--require`: a capability whose every row was skipped (fixtures without cases) fails its
  `capability` row, for every capability.

The model rows run on `small_model_fixture` (conftest.py); the kernel rows on the committed
kernel fixtures.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pytest
import torch

import engine.attention
import engine.decode
import engine.validate.engine_rows as engine_rows
import engine.validate.invariant as invariant
import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig
from engine.adapter import TorchAdapter
from engine.cache import KVCache
from engine.stages import TorchStages
from engine.validate import (CAPABILITIES, GOLDEN_DIR, METHODS_V2, REPO_ROOT, Status, Validation, load_impl, plan,
                             validate)
from engine.validate.corpus_checks import row_name
from engine.validate.engine_rows import ENGINE_AR, ENGINE_BITWISE, ENGINE_REPLAY, ENGINE_SAMPLING, ENGINE_TIES
from engine.validate.invariant import INVARIANT_ROWS
from engine.validate.protocol import CAPABILITIES as V1_CAPABILITIES
from engine.validate.protocol import protocol_version
from engine.validate.protocol_v2 import CAPABILITIES_V2, PerRequest, sizes
from engine.validate.regime import DTYPES
from engine.validate.runner import REQUIREMENTS
from refgen.fixtures import FixturePlan, TraceSpec, model_fixture, write_fixture

SHIFT = 1e-2                       # a constant added to logits: every decision the same, every value off


# ---- adapters ----

class Engine(PerRequest):
    """The built-in engine through protocol v1: one request at a time, numpy."""

    def __init__(self) -> None:
        super().__init__(TorchAdapter())


class Only:
    """`adapter` showing only the methods of `caps` (and no declaration), so that the rows of
    the other capabilities are skipped."""

    def __init__(self, adapter: Any, *caps: str) -> None:
        table = CAPABILITIES_V2 if protocol_version(adapter) == 2 else V1_CAPABILITIES
        self._adapter = adapter
        self._hidden = {"capabilities"} | {m for cap, methods in table.items() if cap not in caps for m in methods}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in self._hidden:
            raise AttributeError(name)
        return getattr(self._adapter, name)


# v1 (per request)

class PrefillShifted(Engine):
    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + SHIFT if start == 0 else logits


class StaleDecodeStep(Engine):
    """A decode fast path that kicks in on the third of consecutive one-token forwards (at
    starts s, s + 1, s + 2) and returns the previous one's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, np.ndarray]] = []

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        fast = [s for s, _ in self.steps[-2:]] == [start - 2, start - 1]
        stale = self.steps[-1][1] if fast else logits
        self.steps = self.steps + [(start, logits)] if len(tokens) == 1 else []
        return stale


class VerifyShifted(Engine):
    """Forwards of several tokens after the prompt (trees, restated paths) shifted."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + SHIFT if start > 0 and len(tokens) > 1 else logits


class TopTwoSwapped(Engine):
    """Every tree row's two largest logits swapped."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        if start > 0 and len(tokens) > 1:
            order = np.argsort(-logits, axis=1)[:, :2]
            rows = np.arange(len(logits))[:, None]
            logits[rows, order] = logits[rows, order[:, ::-1]]
        return logits


class LogitsAsLogprobs(Engine):
    """Top-k ids right, their log-probs the raw logits (no log-sum-exp)."""

    def topk_logprobs(self, draft_logits, k):
        _, ids = super().topk_logprobs(draft_logits, k)
        return np.take_along_axis(np.asarray(draft_logits, dtype=np.float32), ids, axis=1), ids


class ScoresOffByOneUlp(Engine):
    def build_tree(self, topk_lp, topk_id, budget, root):
        parents, tokens, depths, scores = super().build_tree(topk_lp, topk_id, budget, root)
        return parents, tokens, depths, np.nextafter(scores, -np.inf)


class IndexPositions(Engine):
    """Tree positions start + node index instead of start + depth."""

    def compile_tree(self, parents, depths, start):
        _, *rest = super().compile_tree(parents, depths, start)
        return start + np.arange(len(parents)), *rest


class NoSiblings(Engine):
    def compile_tree(self, parents, depths, start):
        positions, bits, first_child, next_sibling = super().compile_tree(parents, depths, start)
        return positions, bits, first_child, np.full_like(next_sibling, -1)


class WrongNextRoot(Engine):
    def accept(self, parents, tokens, choices):
        accepted, _ = super().accept(parents, tokens, choices)
        return accepted, int(choices[0])              # the root's choice, not the last accepted node's


class OneUniform(Engine):
    """Sampling that takes the root's uniform for every node."""

    def sample_accept(self, parents, tokens, logits, temperature, uniforms):
        return super().sample_accept(parents, tokens, logits, temperature, np.full_like(uniforms, uniforms[0]))


class OneSlotTooMany(Engine):
    """Compaction that also writes slot start + a (the next round's first slot) with the last moved row."""

    def compact(self, c_kv, k_pe, start, accepted):
        c_kv, k_pe = (np.array(a) for a in super().compact(c_kv, k_pe, start, accepted))
        end = start + len(accepted)
        if end < len(c_kv):
            c_kv[end], k_pe[end] = c_kv[end - 1], k_pe[end - 1]
        return c_kv, k_pe


class SecondKeyTile(Engine):
    """Attention off for a request whose cached context passes 64 keys (a second key tile):
    never request 0 of a verify_attention case (test_second_key_tile_is_wrong_only_in_later_requests)."""

    def attention(self, q_lat, q_pe, c_kv, k_pe, visibility, scale):
        o_lat = super().attention(q_lat, q_pe, c_kv, k_pe, visibility, scale)
        n, keys = np.asarray(visibility).shape
        return o_lat * 1.01 if keys - n > 64 else o_lat


class WrongExperts(Engine):
    """A model that reports (bf16 `intermediates`) other experts than it routed to."""

    def intermediates(self, tokens, positions, visibility, start):
        out = self.adapter.intermediates(tokens, positions, visibility, start)
        return {name: (value + 1) % self.adapter.model.cfg.n_routed_experts if name.endswith(".experts") else value
                for name, value in out.items()}


# v2 (batched), each wrong only for requests 1 and after

def later_rows(offsets: torch.Tensor) -> slice:
    """The ragged rows of requests 1 .. B-1."""
    return slice(int(offsets[1]), None)


class LaterPrefillShifted(TorchAdapter):
    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        logits = super().forward(tokens, positions, offsets, starts, visibility_bits)
        if bool((starts == 0).all()):
            logits[later_rows(offsets)] += SHIFT
        return logits


class LaterVerifyShifted(TorchAdapter):
    """The first verify after the prefill (start at the prompt's end) shifted, for requests 1 and after."""

    prompts: torch.Tensor | None = None              # the last prefill's prompt lengths

    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        logits = super().forward(tokens, positions, offsets, starts, visibility_bits)
        if bool((starts == 0).all()):
            self.prompts = sizes(offsets)
        elif self.prompts is not None and len(self.prompts) == len(starts):
            first = (starts == self.prompts) & (torch.arange(len(starts)) >= 1)
            logits[torch.repeat_interleave(first, sizes(offsets))] += SHIFT
        return logits


class LaterTopk(TorchAdapter):
    def topk_logprobs(self, draft_logits, k):
        lp, ids = super().topk_logprobs(draft_logits, k)
        lp[1:] += 1e-3
        return lp, ids


class LaterScores(TorchAdapter):
    def build_trees(self, topk_lp, topk_id, budgets, roots):
        node_offsets, parents, tokens, depths, scores = super().build_trees(topk_lp, topk_id, budgets, roots)
        later = later_rows(node_offsets)
        scores[later] = torch.nextafter(scores[later], torch.tensor(-torch.inf, dtype=scores.dtype))
        return node_offsets, parents, tokens, depths, scores


class LaterPositions(TorchAdapter):
    def compile_trees(self, parents, depths, node_offsets, starts):
        positions, *rest = super().compile_trees(parents, depths, node_offsets, starts)
        positions[later_rows(node_offsets)] += 1
        return positions, *rest


class LaterNextRoot(TorchAdapter):
    def accept(self, parents, tokens, choices, node_offsets):
        accepted, accept_offsets, next_roots = super().accept(parents, tokens, choices, node_offsets)
        next_roots[1:] += 1
        return accepted, accept_offsets, next_roots


class LaterSharedUniforms(TorchAdapter):
    """Sampling that reads every request's uniforms from request 0's rows."""

    def sample_accept(self, parents, tokens, logits, node_offsets, temperature, uniforms):
        request = torch.repeat_interleave(torch.arange(len(node_offsets) - 1), sizes(node_offsets))
        index = (torch.arange(len(parents)) - node_offsets[request]).clamp(max=int(node_offsets[1]) - 1)
        return super().sample_accept(parents, tokens, logits, node_offsets, temperature, uniforms[index])


class LaterPathIgnored(TorchAdapter):
    """Cache compaction that moves request 0's path only."""

    def compact_cache(self, starts, accepted, accept_offsets):
        first = int(accept_offsets[1])
        super().compact_cache(starts, accepted[:first], accept_offsets.clamp(max=first))


class LaterSlotTooMany(TorchAdapter):
    """Compaction that also writes, for requests 1 and after, slot start + a with the last moved row."""

    def compact(self, c_kv, k_pe, starts, accepted, accept_offsets):
        c_kv, k_pe = super().compact(c_kv, k_pe, starts, accepted, accept_offsets)
        for b in range(1, len(starts)):
            end = int(starts[b] + accept_offsets[b + 1] - accept_offsets[b])
            if end < c_kv.shape[1]:
                c_kv[b, end], k_pe[b, end] = c_kv[b, end - 1], k_pe[b, end - 1]
        return c_kv, k_pe


class LaterAttention(TorchAdapter):
    def attention(self, q_lat, q_pe, c_kv, k_pe, q_offsets, *rest):
        o_lat = super().attention(q_lat, q_pe, c_kv, k_pe, q_offsets, *rest)
        o_lat[later_rows(q_offsets)] *= 1.01
        return o_lat


class LaterPagedAttention(TorchAdapter):
    def paged_attention(self, q_lat, q_pe, c_kv, k_pe, block_table, q_offsets, *rest):
        o_lat = super().paged_attention(q_lat, q_pe, c_kv, k_pe, block_table, q_offsets, *rest)
        o_lat[later_rows(q_offsets)] *= 1.01
        return o_lat


class LaterPagedSlotTooMany(TorchAdapter):
    """Paged compaction that also writes, for requests 1 and after, slot start + a (through the
    request's table) with the last moved row."""

    def paged_compact(self, c_kv, k_pe, block_table, starts, accepted, accept_offsets):
        c_kv, k_pe = super().paged_compact(c_kv, k_pe, block_table, starts, accepted, accept_offsets)
        page = c_kv.shape[1]
        for b in range(1, len(starts)):
            end = int(starts[b] + accept_offsets[b + 1] - accept_offsets[b])
            (src, dst) = ((int(block_table[b, s // page]), s % page) for s in (end - 1, end))
            if dst[0] >= 0:
                for pool in (c_kv, k_pe):
                    pool[dst] = pool[src]
        return c_kv, k_pe


class NoWeights(Engine):
    """Every v1 method; over fixtures without cases only load_weights is called."""

    def load_weights(self, config, weights):
        pass


# ---- the built-in engine's seams ----

def one_token_more(decode: Callable[..., Any]) -> Callable[..., Any]:
    """`decode`, its last request committing one token past its max_new_tokens."""
    def decoded(*args, **kwargs):
        result = decode(*args, **kwargs)
        result.requests[-1].tokens.append(result.requests[-1].tokens[-1])
        return result
    return decoded


def reseeded(generator: torch.Generator, batch: int, width: int) -> torch.Tensor:
    """The engine's uniforms from a generator re-seeded with its initial seed at every draw."""
    generator.manual_seed(generator.initial_seed())
    return torch.rand(batch, width, generator=generator, dtype=torch.float64)


def ties_to_the_larger_id(stages: TorchStages, logits: torch.Tensor) -> torch.Tensor:
    return logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1)


def engine_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_rows, "ar_decode", one_token_more(engine_rows.ar_decode))
    monkeypatch.setattr(engine_rows, "ddtree_decode", one_token_more(engine_rows.ddtree_decode))
    monkeypatch.setattr(engine.decode, "_uniforms", reseeded)
    monkeypatch.setattr(TorchStages, "greedy_choices", ties_to_the_larger_id)
    monkeypatch.setattr(invariant, "ddtree_decode", one_token_more(invariant.ddtree_decode))


class SplitByRows(engine.attention.InvariantTorchAttention):
    """Invariant attention whose key sum is split in two halves, merged by their log-sum-exp,
    when the forward has more than one row: right to rounding, but not the same bits."""

    def __call__(self, q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
        if int(n_new.max()) <= 1:
            return super().__call__(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale)
        o_lat = torch.zeros_like(q_lat)
        for b, (start, count) in enumerate(zip(starts.tolist(), n_new.tolist())):
            for i in range(count):
                slots = torch.cat([torch.arange(start), start + new_visibility[b, i, :count].nonzero().flatten()])
                c, k = c_kv[b, slots].float(), k_pe[b, slots].float()
                scores = (q_lat[b, i].float() @ c.T + q_pe[b, i].float() @ k.T) * scale      # [H, S]
                half = max(1, len(slots) // 2)
                parts = [(torch.logsumexp(scores[:, h], -1), torch.softmax(scores[:, h], -1) @ c[h])
                         for h in (slice(0, half), slice(half, None)) if h.start < len(slots)]
                total = torch.logsumexp(torch.stack([lse for lse, _ in parts]), 0)
                o_lat[b, i] = sum(torch.exp(lse - total)[:, None] * o for lse, o in parts).to(o_lat.dtype)
        return o_lat


def split_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.attention, "invariant_torch_attention", SplitByRows())


# ---- the table ----

Row = tuple[str, str]                               # (fixture kind, row name)
# Invariant mode computes row by row: its plant runs on a model of one layer, one prompt, one trace.
ONE_LAYER = "one-layer.kdtr"
ONE_LAYER_PLAN = FixturePlan(prompt_lengths=(5,), ar_new_tokens=4, traces=(
    TraceSpec("t0", 0, "oracle", 0.9, DDTreeConfig(block_size=3, budget=4), 4),))
MODEL = "model"
RANDOM = "random weights"


@dataclass(frozen=True)
class Plant:
    """A planted bug: `make()` builds the broken adapter (None: the built-in engine, broken by
    `patch`); it runs over `fixtures` ("model": the small model fixture; "empty <kind>": a
    fixture of that kind without cases; "one layer": ONE_LAYER; else a committed fixture) with
    validate's `options`,
    judging only `sections` when given; `fails`: every row it fails."""

    fails: frozenset[Row]
    make: Callable[[], Any] | None
    fixtures: tuple[str, ...]
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    options: tuple[tuple[str, Any], ...] = (("require", "none"),)
    sections: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return " + ".join(sorted(f"{kind}::{row}" for kind, row in self.fails))


PLANTS: dict[Row, Plant] = {}


def plant(rows: Iterable[Row], make: Callable[[], Any] | None, *fixtures: str, also: Iterable[Row] = (),
          **fields: Any) -> None:
    """A plant for `rows` (each of them fails), failing the rows `also` too."""
    rows = list(rows)
    made = Plant(frozenset(rows) | frozenset(also), make, fixtures, **fields)
    PLANTS.update({row: made for row in rows})


def model(*names: str) -> list[Row]:
    return [(MODEL, name) for name in names]


# a model fixture, per request (protocol 1)
plant(model("prefill logits"), lambda: Only(PrefillShifted(), "model"), "model")
plant(model("AR tokens"), lambda: Only(StaleDecodeStep(), "model"), "model")
plant(model("top-k log-probs"), lambda: Only(LogitsAsLogprobs(), "topk"), "model")
plant(model("tree build"), lambda: Only(ScoresOffByOneUlp(), "tree"), "model")
plant(model("tree compile"), lambda: Only(IndexPositions(), "compile"), "model")
plant(model("verify logits"), lambda: Only(VerifyShifted(), "model"), "model")
plant(model("target choices"), lambda: Only(TopTwoSwapped(), "model"), "model", also=model("verify logits"))
plant(model("sampled choices"), lambda: Only(TopTwoSwapped(), "model", "sample_accept"), "model",
      also=model("verify logits", "target choices", "sampled DDTree tokens"))
plant(model("accept"), lambda: Only(WrongNextRoot(), "accept"), "model")
plant(model("sample accept"), lambda: Only(OneUniform(), "sample_accept"), "model")
plant(model("DDTree tokens"), lambda: Only(WrongNextRoot(), "model", "accept"), "model", also=model("accept"))
plant(model("sampled DDTree tokens"), lambda: Only(OneUniform(), "model", "sample_accept"), "model",
      also=model("sample accept", "sampled choices"))
plant(model("routing"), lambda: Only(WrongExperts(), "model"), "model",
      options=(("require", "none"), ("dtype", "bfloat16")))
# a model fixture, batched (protocol 2): wrong in later requests only
plant(model("batched prefill logits"), lambda: Only(LaterPrefillShifted(), "model"), "model")
plant(model("batched top-k log-probs"), lambda: Only(LaterTopk(), "topk"), "model")
plant(model("batched tree build"), lambda: Only(LaterScores(), "tree"), "model")
plant(model("batched tree compile"), lambda: Only(LaterPositions(), "compile"), "model")
plant(model("batched verify logits"), lambda: Only(LaterVerifyShifted(), "model"), "model")
plant(model("batched accept"), lambda: Only(LaterNextRoot(), "accept"), "model")
plant(model("batched sample accept"), lambda: Only(LaterSharedUniforms(), "sample_accept"), "model")
plant(model("batched cache compaction"), lambda: Only(LaterPathIgnored(), "model"), "model")
plant(model("batched DDTree tokens"), lambda: Only(LaterNextRoot(), "model", "accept"), "model",
      also=model("batched accept"))
# the built-in engine's own rows
plant(model(ENGINE_AR, ENGINE_REPLAY, ENGINE_SAMPLING, ENGINE_TIES, *INVARIANT_ROWS) +
      [(RANDOM, name) for name in INVARIANT_ROWS], None, "model", patch=engine_seams,
      sections=("tiny2.kdtr", "tiny (random weights)"))
plant(model(ENGINE_BITWISE), None, "one layer", patch=split_by_rows, options=(("invariant", True),),
      sections=(ONE_LAYER,))
# kernel cases
TREES, ACCEPTS = "kernels/tree_build.kdtr", "kernels/accept_compact.kdtr"
ATTENTION, PAGED = "kernels/verify_attention.kdtr", "kernels/paged_kv.kdtr"
plant([("tree_build", "top-k log-probs")], lambda: Only(LogitsAsLogprobs(), "topk"), TREES)
plant([("tree_build", "tree build")], lambda: Only(ScoresOffByOneUlp(), "tree"), TREES)
plant([("tree_build", "tree compile")], lambda: Only(NoSiblings(), "compile"), TREES)
plant([("tree_build", "batched top-k log-probs")], lambda: Only(LaterTopk(), "topk"), TREES)
plant([("tree_build", "batched tree build")], lambda: Only(LaterScores(), "tree"), TREES)
plant([("tree_build", "batched tree compile")], lambda: Only(LaterPositions(), "compile"), TREES)
plant([("accept_compact", "accept")], lambda: Only(WrongNextRoot(), "accept"), ACCEPTS)
plant([("accept_compact", "KV compaction")], lambda: Only(OneSlotTooMany(), "compact"), ACCEPTS)
plant([("accept_compact", "batched accept")], lambda: Only(LaterNextRoot(), "accept"), ACCEPTS)
plant([("accept_compact", "batched KV compaction")], lambda: Only(LaterSlotTooMany(), "compact"), ACCEPTS)
plant([("verify_attention", "verify attention (o_lat)")], lambda: Only(SecondKeyTile(), "attention"), ATTENTION)
plant([("verify_attention", "batched verify attention")], lambda: Only(LaterAttention(), "attention"), ATTENTION)
plant([("paged_kv", "paged verify attention")], lambda: Only(LaterPagedAttention(), "paged_attention"), PAGED)
plant([("paged_kv", "paged KV compaction")], lambda: Only(LaterPagedSlotTooMany(), "paged_compact"), PAGED)


def _broken_corpus() -> dict[str, Callable[[], Any]]:
    """docs/examples/corpus/broken_adapters.py's BROKEN, loaded as `--impl` loads it."""
    load_impl(f"{REPO_ROOT / 'docs' / 'examples' / 'corpus' / 'broken_adapters.py'}:NumpyAdapter")
    return sys.modules["kdtree_impl_broken_adapters"].BROKEN


def _corpus_plants() -> None:
    path = GOLDEN_DIR / "kernels" / "corpus.kdtr"
    if not path.exists():
        return
    broken = _broken_corpus()
    with kdtr_format.open(path) as reader:
        for case in reader.metadata["cases"]:
            plant([("corpus", row_name(case))], broken[case["name"]], "kernels/corpus.kdtr")


_corpus_plants()
# the run's own requirements: a required capability whose every row was skipped
V1_EMPTY = ("empty model", "empty tree_build", "empty accept_compact", "empty verify_attention")
for _cap in CAPABILITIES:
    _paged = not V1_CAPABILITIES[_cap]
    plant([(REQUIREMENTS, f"capability {_cap}")], TorchAdapter if _paged else NoWeights,
          *(("empty paged_kv",) if _paged else V1_EMPTY), options=(("require", _cap),))
plant([(REQUIREMENTS, "any check ran")], lambda: Only(Engine(), "attention"), ACCEPTS)


# ---- running them ----

def kind(directory: Path, section: str) -> str:
    if section == REQUIREMENTS:
        return REQUIREMENTS
    if section.endswith("(random weights)"):
        return RANDOM
    with kdtr_format.open(directory / section) as reader:
        return reader.metadata["kind"]


def empty_fixture(path: Path, fixture_kind: str) -> None:
    """A fixture of `fixture_kind` that holds no cases."""
    metadata: dict[str, Any] = {"kdtree_fixture": 1, "kind": fixture_kind, "cases": []}
    if fixture_kind == "model":
        metadata = {"kdtree_fixture": 1, "kind": "model", "preset": "tiny2", "config": PRESETS["tiny2"].to_dict(),
                    "tolerances": {}, "margin_threshold": 0.1, "prompts": [], "traces": []}
    kdtr_format.write(path, {}, metadata=metadata)


@pytest.fixture(scope="module")
def directory(small_model_fixture, tmp_path_factory) -> Callable[[tuple[str, ...]], Path]:
    """-> get(fixtures): a directory holding them (Plant.fixtures), made once."""
    made: dict[tuple[str, ...], Path] = {}

    def get(fixtures: tuple[str, ...]) -> Path:
        if fixtures not in made:
            root = tmp_path_factory.mktemp("plant")
            for name in fixtures:
                if name == "one layer":
                    cfg = dataclasses.replace(PRESETS["tiny2"], num_hidden_layers=1)
                    write_fixture(root / ONE_LAYER, model_fixture(cfg, "tiny2 (one layer)", plan=ONE_LAYER_PLAN,
                                                                  source="config-file", bf16_plan=None))
                    continue
                if name.startswith("empty "):
                    fixture_kind = name.removeprefix("empty ")
                    target = root / ("tiny2.kdtr" if fixture_kind == "model" else f"kernels/{fixture_kind}.kdtr")
                    target.parent.mkdir(exist_ok=True)
                    empty_fixture(target, fixture_kind)
                    continue
                source = small_model_fixture if name == "model" else GOLDEN_DIR / name
                if not source.exists():
                    pytest.skip(f"golden fixture {source} is absent (generate it with `refgen generate --all`)")
                target = root / ("tiny2.kdtr" if name == "model" else name)
                target.parent.mkdir(exist_ok=True)
                target.symlink_to(source)
            made[fixtures] = root
        return made[fixtures]
    return get


def failing(plant: Plant, fixtures: Path) -> set[Row]:
    """The rows of the plan (in `plant.sections`) that fail for the plant, case by case as the
    pytest plugin runs them."""
    options = dict(plant.options)
    validation = Validation(plant.make() if plant.make else None, fixtures, **options)
    cases = [c for c in plan(fixtures, options.get("dtype", "float32"))
             if plant.sections is None or c.section in plant.sections]
    return {(kind(fixtures, c.section), c.name) for c in cases if validation.check(c).status is Status.FAIL}


PLANTED = list(dict.fromkeys(PLANTS.values()))


@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_each_planted_bug_fails_exactly_its_rows(planted, directory, monkeypatch):
    if planted.patch is not None:
        planted.patch(monkeypatch)
    assert failing(planted, directory(planted.fixtures)) == planted.fails


def test_every_row_has_a_planted_bug():
    """Every row of the committed fixtures' plan, in every dtype, has a plant (and no plant is
    for a row validate cannot emit)."""
    rows = {(kind(GOLDEN_DIR, c.section), c.name) for dtype in DTYPES for c in plan(GOLDEN_DIR, dtype)}
    assert rows == set(PLANTS), {"no plant": sorted(rows - set(PLANTS)), "no such row": sorted(set(PLANTS) - rows)}


def test_the_adapter_guide_lists_every_row():
    """docs/adapter.md's table of rows names every row (a corpus row by its pattern, a capability
    row by `capability <name>`)."""
    guide = (REPO_ROOT / "docs" / "adapter.md").read_text()
    table = guide.split("### Every row, and a bug that fails it", 1)[1].split("\n## ", 1)[0]
    named = {(kind, name) for kind, name in PLANTS if kind not in ("corpus", REQUIREMENTS)}
    assert not [row for row in named if f"`{row[1]}`" not in table]
    assert "`corpus <case>: <its stages>`" in table and "`capability <name>`" in table and "`any check ran`" in table


# ---- what the plants rely on ----

@pytest.mark.parametrize("cap", list(CAPABILITIES))
def test_a_required_capability_whose_rows_were_all_skipped_is_unmet(cap, directory):
    """The plants of the `capability` rows: the adapter implements the capability, and every
    row that needs it is skipped (its fixtures hold no cases), so nothing exercised it."""
    (planted,) = [p for row, p in PLANTS.items() if row == (REQUIREMENTS, f"capability {cap}")]
    fixtures = directory(planted.fixtures)
    report = validate(planted.make(), fixtures, require=cap)
    needing = [c for c in report.checks if cap in c.needs and c.section != REQUIREMENTS]
    assert needing and all(c.status is Status.SKIPPED for c in needing), [c.text() for c in needing]
    (row,) = [c for c in report.checks if c.name == f"capability {cap}"]
    assert row.status is Status.FAIL and "no check of" in row.detail and "exercised it" in row.detail


def test_second_key_tile_is_wrong_only_in_later_requests():
    """SecondKeyTile's premise: in every verify_attention case request 0's context is at most 64
    keys, and some later request's is more."""
    path = GOLDEN_DIR / "kernels" / "verify_attention.kdtr"
    if not path.exists():
        pytest.skip(f"golden fixture {path} is absent (generate it with `refgen generate --all`)")
    with kdtr_format.open(path) as reader:
        contexts = [np.asarray(reader[f"cases/{c['name']}/context"]) for c in reader.metadata["cases"]]
    assert all(c[0] <= 64 for c in contexts) and any((c[1:] > 64).any() for c in contexts), contexts


def test_the_v2_methods_are_the_ones_only_hides():
    """Only hides a capability by its methods: the table it reads is the protocol's."""
    assert {m for methods in CAPABILITIES_V2.values() for m in methods} == set(METHODS_V2)


# ---- pages that are not a power of two ----

def power_of_two_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's paged cache with an in-page offset of `slot & (page - 1)`."""
    def slot_rows(cache, slots, requests=None):
        if requests is None:
            requests = torch.arange(slots.shape[0], device=slots.device)[:, None]
        page = cache.page_size
        return cache.block_table.long()[requests, slots // page] * page + (slots & (page - 1))
    monkeypatch.setattr(KVCache, "slot_rows", slot_rows)


@pytest.mark.parametrize("page_size", [3, 24])
def test_the_engine_passes_on_pages_that_are_not_a_power_of_two(small_model_fixture, page_size, builtin_decode_only):
    builtin_decode_only()
    report = validate(None, small_model_fixture, page_size=page_size, require="none")
    assert not report.failed, report.summary()
    assert f"pages of {page_size}" in report.implementation


def test_validate_page_size_3_catches_an_offset_right_only_for_powers_of_two(small_model_fixture, monkeypatch,
                                                                            builtin_decode_only):
    builtin_decode_only()
    power_of_two_offsets(monkeypatch)
    failed = {c.name for c in validate(None, small_model_fixture, page_size=3, require="none").checks
              if c.status is Status.FAIL}
    assert {"prefill logits", "verify logits", "engine AR decode (batched)", "batched prefill logits"} <= failed


def test_the_paged_rows_catch_an_offset_right_only_for_powers_of_two(directory, monkeypatch):
    """kernels/paged_kv.kdtr holds a case of 3-slot pages: `kdtree validate` alone catches it."""
    power_of_two_offsets(monkeypatch)
    report = validate(None, directory((PAGED,)) / PAGED, require="none")
    (row,) = [c for c in report.checks if c.status is Status.FAIL]
    assert row.name == "paged KV compaction" and row.detail.endswith("(case compact_tiny2_page3)"), row.text()
