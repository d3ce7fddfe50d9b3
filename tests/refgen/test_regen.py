"""refgen.regen, what a regeneration may move: every float of the committed fixtures has a
quantity; a regeneration passes however its floats round, under every OpenBLAS kernel this
CPU runs too; a real bug fails: a logit or a margin off by 1e-9 of the logit scale (a margin
judged on the logit scale, never relative to itself), a float32 value off by two ulps, one
integer changed, a seeded tensor's checksum changed, a float no rule names."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import kdtr_format
from kdtr_format import PRESETS
from refgen.files import content_hash, write_fixture
from refgen.fixtures import model_fixture
from refgen.kernel_cases import kernel_fixture
from refgen.regen import compare, metadata_drift, tensor_drift

REPO = Path(__file__).resolve().parents[2]
COMMITTED = ("tiny.kdtr", "tiny2.kdtr", "kernels/tree_build.kdtr", "kernels/verify_attention.kdtr",
             "kernels/accept_compact.kdtr", "kernels/paged_kv.kdtr", "kernels/corpus.kdtr")


class Loaded:
    """A fixture in memory, read as a KDTR reader is (metadata, names(), [name])."""

    def __init__(self, metadata: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        self.metadata, self.tensors = metadata, tensors

    @classmethod
    def read(cls, path: Path) -> "Loaded":
        with kdtr_format.open(path) as reader:
            return cls(reader.metadata, {name: np.array(reader[name]) for name in reader.names()})

    def names(self) -> list[str]:
        return list(self.tensors)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def changed(self, name: str, change: Callable[[np.ndarray], None]) -> "Loaded":
        """A copy with tensor `name` changed in place by `change`."""
        tensors = dict(self.tensors)
        tensors[name] = tensors[name].copy()
        change(tensors[name])
        return Loaded(self.metadata, tensors)

    def with_metadata(self, change: Callable[[dict], None]) -> "Loaded":
        metadata = copy.deepcopy(self.metadata)
        change(metadata)
        return Loaded(metadata, self.tensors)


@pytest.fixture(scope="module")
def tiny2(committed_golden: Path, tmp_path_factory) -> tuple[Loaded, Loaded]:
    """(tiny2 as committed, tiny2 regenerated on this machine), both slim."""
    path = tmp_path_factory.mktemp("regen") / "tiny2.kdtr"
    write_fixture(path, model_fixture(PRESETS["tiny2"], "tiny2"), slim=True)
    return Loaded.read(committed_golden / "tiny2.kdtr"), Loaded.read(path)


def add(where: tuple[int, ...], amount: float) -> Callable[[np.ndarray], None]:
    def change(array: np.ndarray) -> None:
        array[where] += amount
    return change


def ulps(where: tuple[int, ...], count: int) -> Callable[[np.ndarray], None]:
    def change(array: np.ndarray) -> None:
        for _ in range(count):
            array[where] = np.nextafter(array[where], np.inf, dtype=array.dtype)
    return change


# ---------------------------------------------------------------------------- the committed files

@pytest.mark.parametrize("relative", COMMITTED)
def test_every_float_of_a_committed_fixture_has_a_rule(committed_golden, relative):
    committed = Loaded.read(committed_golden / relative)
    assert compare(committed, committed) == []


def test_a_regeneration_passes(tiny2):
    committed, regenerated = tiny2
    assert compare(committed, regenerated) == []


# ---------------------------------------------------------------------------- planted bugs

LOGIT = "prompts/p0/prefill_logits"
MARGIN = "traces/t0/rounds/0/margins"


@pytest.mark.parametrize("name, change_of_scale, drifts", [
    (LOGIT, 1e-9, True), (LOGIT, 1e-13, False),
    (MARGIN, 1e-9, True), (MARGIN, 1e-12, False),
    ("bf16/prompts/p0/prefill_logits", 1e-9, True), ("prompts/p1/ar/margins", 1e-9, True),
], ids=["logit-1e-9", "logit-1e-13", "margin-1e-9", "margin-1e-12", "bf16-logit-1e-9", "ar-margin-1e-9"])
def test_logits_and_margins_are_judged_on_the_logit_scale(tiny2, name, change_of_scale, drifts):
    committed, regenerated = tiny2
    amount = change_of_scale * committed.metadata["logit_scale"]
    problems = compare(committed, regenerated.changed(name, add((0,) * regenerated[name].ndim, amount)))
    assert bool(problems) == drifts, problems
    if drifts:
        assert len(problems) == 1 and problems[0].startswith(f"{name}: 1 of ")


def test_a_margin_is_not_judged_relative_to_itself(tiny2):
    """A margin moved by 1e-12 of the logit scale moves by far more than 1e-12 of itself
    (what the old rule demanded), and a regeneration may move it so."""
    committed, regenerated = tiny2
    amount = 1e-12 * committed.metadata["logit_scale"]
    smallest = np.unravel_index(np.argmin(regenerated[MARGIN]), regenerated[MARGIN].shape)
    assert amount / regenerated[MARGIN][smallest] > 1e-11
    assert compare(committed, regenerated.changed(MARGIN, add(smallest, amount))) == []


@pytest.mark.parametrize("name, change, drifts", [
    ("traces/t7/rounds/0/draft_logits", ulps((0, 0), 1), False),      # float32: one rounding flip allowed
    ("traces/t7/rounds/0/draft_logits", ulps((0, 0), 2), True),
    ("traces/t0/rounds/0/topk_lp", ulps((0, 0), 2), True),
    ("traces/t0/rounds/0/scores", add((1,), 1e-9), True),
    ("bf16/prompts/p0/router_margins", add((0, 0), 1e-9), True),
    ("traces/t0/rounds/0/parents", add((1,), 1), True),
    ("prompts/p0/ar/tokens", add((2,), 1), True),
    ("traces/t7/rounds/0/uniforms", ulps((1,), 1), True),               # drawn: exact
    ("sample_cases/u_max/uniforms", ulps((0,), 1), True),
])
def test_every_other_quantity_drifts_when_changed_beyond_its_rounding(tiny2, name, change, drifts):
    committed, regenerated = tiny2
    problems = compare(committed, regenerated.changed(name, change))
    assert bool(problems) == drifts, problems
    if drifts:
        assert len(problems) == 1 and problems[0].startswith(f"{name}:"), problems


@pytest.mark.parametrize("key, change, drifts", [
    ("min_margin", lambda m, s: m["traces"][0].__setitem__("min_margin", m["traces"][0]["min_margin"] + 1e-9 * s),
     True),
    ("min_margin", lambda m, s: m["traces"][0].__setitem__("min_margin", m["traces"][0]["min_margin"] + 1e-13 * s),
     False),
    ("logit_scale", lambda m, s: m.__setitem__("logit_scale", s * (1 + 1e-9)), True),
    ("logit_scale", lambda m, s: m.__setitem__("logit_scale", s * (1 + 1e-13)), False),
    ("rounds", lambda m, s: m["traces"][0].__setitem__("rounds", m["traces"][0]["rounds"] + 1), True),
    ("seed", lambda m, s: m["generator"].__setitem__("seed", 1), True),
    ("numpy", lambda m, s: m["generator"].__setitem__("numpy", "0.0"), False),          # provenance
    ("sha256", lambda m, s: m["seeded_tensors"]["weights/norm"].__setitem__("sha256", "0" * 64), True),
    ("no rule", lambda m, s: m.__setitem__("novel", 0.5), True),
])
def test_metadata_floats_follow_their_rules(tiny2, key, change, drifts):
    committed, regenerated = tiny2
    scale = committed.metadata["logit_scale"]
    problems = compare(committed.with_metadata(lambda m: change(m, scale)),
                       regenerated.with_metadata(lambda m: change(m, scale)) if key == "no rule" else regenerated)
    assert bool(problems) == drifts, problems
    if key == "sha256":
        assert len(problems) == 1 and problems[0].startswith("weights/norm: the seeded tensor regenerates as")
    if key == "no rule":
        assert problems == ["metadata.novel: a float with no regeneration rule (refgen/regen.py METADATA_RULES)"]


def test_a_float_tensor_no_rule_names_is_reported(tiny2):
    committed, regenerated = tiny2
    novel = {"novel/values": np.ones(3)}
    problems = compare(Loaded(committed.metadata, {**committed.tensors, **novel}),
                       Loaded(regenerated.metadata, {**regenerated.tensors, **novel}))
    assert problems == ["novel/values: a float64 tensor with no regeneration rule (refgen/regen.py TENSOR_RULES)"]


@pytest.mark.parametrize("name, change, drifts", [
    ("cases/tiny_ragged/o_lat", ulps((3, 0, 5), 1), False),
    ("cases/tiny_ragged/o_lat", ulps((3, 0, 5), 2), True),
    ("cases/k2_ragged/lse", add((2, 7), 1e-13), False),
    ("cases/k2_ragged/lse", add((2, 7), 1e-9), True),
    ("cases/k2_ragged/visibility_bits", add((0, 0), 1), True),
])
def test_kernel_outputs_are_judged_on_their_own_scale(committed_golden, name, change, drifts):
    committed = Loaded.read(committed_golden / "kernels/verify_attention.kdtr")
    regenerated = kernel_fixture("verify_attention")
    seeded = committed.metadata["seeded_tensors"]
    fresh = Loaded(committed.metadata, {n: t for n, t in regenerated.tensors.items() if n not in seeded})
    assert compare(committed, fresh) == []
    problems = compare(committed, fresh.changed(name, change))
    assert bool(problems) == drifts, problems


@pytest.mark.parametrize("expected, actual, tolerance, drifts", [
    (np.array([1.0, -2.0]), np.array([1.0, -2.0 + 5e-12]), 1e-11, False),
    (np.array([1.0, -2.0]), np.array([1.0, -2.0 + 5e-11]), 1e-11, True),
    (np.array([1.0, -2.0]), np.array([1.0, np.nextafter(-2.0, 0)]), None, True),      # exact
    (np.array([np.nan, np.inf, 1.0]), np.array([np.nan, np.inf, 1.0]), 1e-11, False),
    (np.array([np.inf, 1.0]), np.array([-np.inf, 1.0]), 1e-11, True),
    (np.array([3, 4], dtype=np.int64), np.array([3, 5], dtype=np.int64), None, True),
    (np.array(7), np.array(7), None, False),
    (np.zeros((2, 3), np.uint32), np.zeros((3, 2), np.uint32), None, True),
    (np.zeros(3, np.float32), np.zeros(3, np.float64), 1.0, True),
])
def test_tensor_drift_rule(expected, actual, tolerance, drifts):
    assert (tensor_drift(expected, actual, tolerance) is not None) == drifts


def test_metadata_drift_ignores_only_provenance():
    base = {"generator": {"name": "refgen", "version": "1", "numpy": "2.0", "seed": 0},
            "min_margin": 0.5, "traces": [{"rounds": 3}], "content_hash": "a"}
    same = {**base, "generator": {**base["generator"], "version": "2", "numpy": "2.1"}, "content_hash": "b",
            "min_margin": 0.5 + 1e-13}
    assert metadata_drift(base, same, "metadata", logit_scale=1.0) == []
    for changed in ({**base, "generator": {**base["generator"], "seed": 1}}, {**base, "traces": [{"rounds": 4}]},
                    {**base, "min_margin": 0.6}, {**base, "extra": 1}):
        assert len(metadata_drift(base, changed, "metadata", logit_scale=1.0)) == 1


def test_verify_fails_a_logit_off_by_1e9_of_the_logit_scale(committed_golden, refgen_cli, tmp_path):
    """The planted bug through the command: one prefill logit of the committed tiny2 moved."""
    path = tmp_path / "tiny2.kdtr"
    planted = Loaded.read(committed_golden / "tiny2.kdtr")
    planted = planted.changed(LOGIT, add((1, 2), 1e-9 * planted.metadata["logit_scale"]))
    metadata = {**planted.metadata, "content_hash": content_hash(planted.metadata, planted.tensors)}
    kdtr_format.write(path, planted.tensors, metadata)
    result = refgen_cli("verify", path)
    assert result.exit_code == 1, result.output
    drift = [line.strip() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert len(drift) == 1 and drift[0].startswith(f"{LOGIT}: 1 of ") and "worst at [1, 2]" in drift[0]


# ---------------------------------------------------------------------------- every BLAS kernel

CORE_FLAGS = {"Haswell": ("avx2", "fma"), "SkylakeX": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
              "Zen": ("avx2", "fma")}
CORE_NAMES = {"Haswell": ("Haswell",), "SkylakeX": ("SkylakeX",), "Zen": ("Zen", "Haswell")}   # Zen: Haswell's kernels


def _openblas_cores() -> list[str]:
    """The OpenBLAS core types this machine runs (pytest.skip when numpy's BLAS is not OpenBLAS)."""
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    if "openblas" not in blas.lower():
        pytest.skip(f"numpy's BLAS is {blas}, not OpenBLAS: OPENBLAS_CORETYPE picks nothing")
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        pytest.skip("no x86 /proc/cpuinfo to tell which OpenBLAS core types this CPU runs")
    cores = [core for core, needs in CORE_FLAGS.items() if flags >= set(needs)]
    if not cores:
        pytest.skip("this CPU runs none of the OpenBLAS core types Haswell, SkylakeX, Zen")
    return cores


def test_the_regeneration_passes_under_every_openblas_kernel(committed_golden):
    """tiny2 (logits, margins, routing margins, log-probs, scores, drawn values, the bf16 cases)
    and the verify attention cases (attention outputs, log-sum-exp), regenerated under each
    core type at once; the default core type runs in test_cli.py. About 10 s of CPU."""
    paths = [committed_golden / "tiny2.kdtr", committed_golden / "kernels/verify_attention.kdtr"]
    runs = {}
    for core in _openblas_cores():
        env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_CORETYPE": core, "OPENBLAS_VERBOSE": "2"}
        runs[core] = subprocess.Popen([sys.executable, "-m", "refgen", "verify", *map(str, paths)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for core, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, f"OPENBLAS_CORETYPE={core}:\n{stdout}{stderr}"
        used = re.findall(r"^Core: (\w+)", stderr, re.M)
        assert used and used[0] in CORE_NAMES[core], f"OPENBLAS_CORETYPE={core} ran {used}"
        assert "passed: 2 of 2" in stdout


@pytest.mark.parametrize("committed, regenerated", [
    (1, True), (True, 1), (0, False), (False, 0),           # a bool where an int is stored, and back
    (1.0, 1), (3, 3.0),                                      # an int where a float is stored, and back
    (1.0, True),
])
def test_metadata_of_another_type_drifts_though_it_compares_equal(committed, regenerated):
    """Equal values of another type (True == 1 == 1.0 in Python) are a change of the fixture: in
    a key of exact values (config.*) and in a float with a tolerance (margin_threshold, judged
    on itself)."""
    def metadata(value):
        return {"generator": {"seed": 0}, "config": {"n_group": value}, "margin_threshold": value}

    assert metadata_drift(metadata(committed), metadata(regenerated), "metadata", logit_scale=1.0) == \
        [f"metadata.{key}: committed {committed!r}, regenerated {regenerated!r}"
         for key in ("config.n_group", "margin_threshold")]
    assert metadata_drift(metadata(committed), metadata(committed), "metadata", logit_scale=1.0) == []


def test_a_fixture_whose_metadata_changes_type_fails_verify(tiny2):
    """refgen verify's comparison of whole fixtures: a trace's round count regenerated as a bool
    of the same truth, the margin threshold as an int of the same value."""
    committed, regenerated = tiny2
    rounds = committed.metadata["traces"][0]["rounds"]
    threshold = committed.metadata["margin_threshold"]
    problems = compare(committed.with_metadata(lambda m: m["traces"][0].__setitem__("rounds", 1)),
                       regenerated.with_metadata(lambda m: m["traces"][0].__setitem__("rounds", True)))
    assert problems == ["metadata.traces[0].rounds: committed 1, regenerated True"], (rounds, problems)
    as_int = float(round(threshold))
    problems = compare(committed.with_metadata(lambda m: m.__setitem__("margin_threshold", as_int)),
                       regenerated.with_metadata(lambda m: m.__setitem__("margin_threshold", int(as_int))))
    assert problems == [f"metadata.margin_threshold: committed {as_int!r}, regenerated {int(as_int)!r}"]


@pytest.mark.parametrize("expected, actual", [
    (np.array([1, 0], np.int64), np.array([True, False])),
    (np.array([1.0, 0.0], np.float32), np.array([1, 0], np.int32)),
])
def test_a_tensor_of_equal_values_and_another_kind_drifts(expected, actual):
    assert tensor_drift(expected, actual, None) is not None
    assert tensor_drift(expected, actual, 1.0) is not None
