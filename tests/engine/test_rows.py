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

The plants themselves are in tests/planted_adapters.py. The model rows run on
`small_model_fixture` (conftest.py); the kernel rows on the committed kernel fixtures.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pytest

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig
from engine.adapter import TorchAdapter
from engine.validate import CAPABILITIES, GOLDEN_DIR, REPO_ROOT, Status, Validation, load_impl, plan, validate
from engine.validate.rows.corpus import row_name
from engine.validate.rows.engine import ENGINE_AR, ENGINE_BITWISE, ENGINE_REPLAY, ENGINE_SAMPLING, ENGINE_TIES
from engine.validate.rows.invariant import INVARIANT_ROWS
from engine.validate.door.protocol import CAPABILITIES as V1_CAPABILITIES
from engine.validate.judging.regime import DTYPES
from engine.validate.reports.report import REQUIREMENTS
from planted_adapters import (Engine, IndexPositions, LaterAttention, LaterNextRoot, LaterPagedAttention,
                              LaterPagedSlotTooMany, LaterPathIgnored, LaterPositions, LaterPrefillShifted,
                              LaterScores, LaterSharedUniforms, LaterSlotTooMany, LaterTopk, LaterVerifyShifted,
                              LogitsAsLogprobs, NoSiblings, NoWeights, OneSlotTooMany, OneUniform, Only,
                              PrefillShifted, ScoresOffByOneUlp, SecondKeyTile, StaleDecodeStep, TopTwoSwapped,
                              VerifyShifted, WrongExperts, WrongNextRoot, engine_seams, power_of_two_offsets,
                              split_by_rows)
from refgen.files import write_fixture
from refgen.fixtures import FixturePlan, TraceSpec, model_fixture

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
    path = GOLDEN_DIR / "kernels" / "corpus.kdtr"            # metadata only: the committed file serves
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
def directory(small_model_fixture, golden, tmp_path_factory) -> Callable[[tuple[str, ...]], Path]:
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
                source = small_model_fixture if name == "model" else golden / name
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


def test_every_row_has_a_planted_bug(golden):
    """Every row of the committed fixtures' plan, in every dtype, has a plant (and no plant is
    for a row validate cannot emit)."""
    rows = {(kind(golden, c.section), c.name) for dtype in DTYPES for c in plan(golden, dtype)}
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


def test_second_key_tile_is_wrong_only_in_later_requests(golden):
    """SecondKeyTile's premise: in every verify_attention case request 0's context is at most 64
    keys, and some later request's is more."""
    with kdtr_format.open(golden / "kernels" / "verify_attention.kdtr") as reader:
        contexts = [np.asarray(reader[f"cases/{c['name']}/context"]) for c in reader.metadata["cases"]]
    assert all(c[0] <= 64 for c in contexts) and any((c[1:] > 64).any() for c in contexts), contexts


# ---- pages that are not a power of two ----

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
