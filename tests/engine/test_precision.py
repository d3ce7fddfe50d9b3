"""The bf16 track: the error model still bounds the engine, the bounds keep their promises,
the bf16 cases hold what the engine loads, rounding is within tolerance or a near-tie while
planted bugs FAIL, and every row names its regime."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import engine.model
import kdtr_format
from kdtr_format import PRESETS
from kdtr_format.precision import BF16_LOGIT_ERROR, BF16_ROUTING_GAP_ERROR, bf16_bounds
from engine.adapter import TorchAdapter
from engine.validate import Check, Status, capabilities, validate
from engine.validate.rows.model import model_fixture_checks
from engine.validate.run.runner import stamped
from engine.validate.judging.regime import Regime, RoutingWatch, reached_rows
from engine.validate.door.protocol_v2 import PerRequest, sizes
from refgen.files import write_fixture
from refgen.fixtures import FixturePlan, model_fixture
from refgen.regen import LOGITS, tensor_drift, tolerance_of

import bf16_error_model

from .test_cli import run_main
from .test_validate import fixture_dir


def bf16_checks(golden: Path, adapter, name: str = "tiny2.kdtr", builtin: bool = False) -> dict[str, Check]:
    """The bf16 regime's rows of one golden model fixture through `adapter`, by check name, as the
    runner reports them."""
    adapter.set_dtype("bfloat16")
    path = golden / name
    with kdtr_format.open(path) as reader:
        checks = model_fixture_checks(adapter, capabilities(adapter), reader, path.name, builtin, "bfloat16")
    return {c.name: c for c in stamped(checks, "exact")}


# ---------------------------------------------------------------------------- the error model

@pytest.mark.parametrize("preset, layers", [("tiny", 2), ("tiny2", 1)])
def test_the_measured_error_model_still_bounds_the_engine(preset, layers):
    """A small rerun of tests/bf16_error_model.py: the engine's bf16 errors stay under the bounds
    kdtr_format.precision was fitted to (a less precise bf16 path fails here)."""
    m = bf16_error_model.measure(preset, layers, seeds=2, length=16)
    assert m.rows > 10 and m.gaps > 10                                # enough rows counted to mean something
    assert 0 < m.logit_error <= BF16_LOGIT_ERROR * math.sqrt(layers)
    assert 0 < m.gap_error <= BF16_ROUTING_GAP_ERROR


@settings(max_examples=200, deadline=None)
@given(scale=st.floats(0.1, 30), layers=st.integers(1, 64), top1=st.floats(-50, 50), excess=st.floats(0, 50))
def test_a_margin_above_the_threshold_survives_any_error_within_tolerance(scale, layers, top1, excess):
    """Top-1 pushed down and top-2 pushed up by their whole tolerance still keep their order,
    wherever both lie within the largest logit the bounds were made for."""
    largest = abs(top1) + excess
    b = bf16_bounds(scale, layers, largest)
    top2 = top1 - b.margin_threshold
    assume(abs(top2) <= largest)
    worst_top1 = top1 - (b.logits_atol + b.logits_rtol * abs(top1))
    worst_top2 = top2 + (b.logits_atol + b.logits_rtol * abs(top2))
    assert worst_top1 >= worst_top2 - 1e-9 * max(1.0, abs(top1))


# ---------------------------------------------------------------------------- the bf16 cases

def test_bf16_cases_hold_the_weights_the_engine_loads(golden):
    """bf16/weights are the float32 weights as torch rounds them to bfloat16 (an outside rounding)."""
    with kdtr_format.open(golden / "tiny2.kdtr") as reader:
        assert reader.metadata["bf16"]["weights_dtype"] == "bfloat16"
        for name in reader.names("weights/"):
            rounded = torch.from_numpy(np.array(reader[name])).to(torch.bfloat16).view(torch.int16).numpy()
            stored = np.asarray(reader["bf16/" + name])
            assert stored.dtype == ml_dtypes.bfloat16 and np.array_equal(stored.view(np.int16), rounded), name


def test_bf16_cases_are_the_reference_on_the_rounded_weights(golden):
    from refgen.model import KVCache, Model, route
    with kdtr_format.open(golden / "tiny2.kdtr") as reader:
        cfg = kdtr_format.ModelConfig.from_dict(reader.metadata["config"])
        weights = {n[len("bf16/weights/"):]: np.asarray(reader[n]) for n in reader.names("bf16/weights/")}
        inputs = {}
        model = Model(cfg, weights, capture=lambda name, layer, y: inputs.__setitem__(layer, y))
        tokens = np.asarray(reader["bf16/prompts/p0/tokens"])
        logits = model.prefill(tokens, KVCache.new(cfg, len(tokens)))
        committed = np.asarray(reader["bf16/prompts/p0/prefill_logits"])
        assert tensor_drift(committed, logits, tolerance_of(LOGITS, committed, reader.metadata["logit_scale"])) is None
        # the AR decisions' rows: those of one causal prefill of the prompt and its AR tokens
        ar_tokens = np.asarray(reader["bf16/prompts/p0/ar/tokens"])
        sequence = np.concatenate([tokens, ar_tokens[:-1]])
        model.prefill(sequence, KVCache.new(cfg, len(sequence)))
        rows = {"prompts/p0": slice(0, len(tokens)), "prompts/p0/ar": slice(len(tokens) - 1, len(sequence))}
        for where, selected in rows.items():
            experts = np.asarray(reader[f"bf16/{where}/router_experts"])
            for j in range(cfg.num_hidden_layers):               # tiny2: every layer is MoE
                gate, bias = (weights[f"layers.{j}.moe.{k}"] for k in ("gate", "e_score_correction_bias"))
                chosen = np.sort(route(cfg, inputs[j][selected], gate, bias)[0], axis=1)
                np.testing.assert_array_equal(chosen, experts[:, j], err_msg=where)


# ---------------------------------------------------------------------------- rounding vs bugs

def test_the_builtin_engine_passes_in_bf16_with_every_row_named(golden):
    checks = bf16_checks(golden, PerRequest(TorchAdapter()), builtin=True)
    assert not [c for c in checks.values() if c.status is Status.FAIL], checks
    for name in ("prefill logits", "verify logits"):            # rounding, or rows a routing flip reached
        row = checks[name]
        assert row.regime.startswith("bf16:") and row.status in (Status.WITHIN, Status.NEAR_TIE)
        assert row.status is Status.WITHIN or "reached by a routing flip" in row.detail
    assert checks["routing"].status in (Status.EXACT, Status.NEAR_TIE) and "routing near-tie" in checks["routing"].regime
    assert all(c.regime for c in checks.values() if c.status is not Status.SKIPPED)


class LateRope(TorchAdapter):
    """Planted: a new token's rotary position one too far whenever it follows cached tokens."""

    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        late = (starts > 0).long().repeat_interleave(sizes(offsets))
        return super().forward(tokens, positions + late, offsets, starts, visibility_bits)


class SlotPositions(TorchAdapter):
    """Planted: tree tokens at their slot (start + i) instead of start + depth."""

    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        first = offsets[:-1].repeat_interleave(sizes(offsets))
        slots = starts.repeat_interleave(sizes(offsets)) + torch.arange(len(tokens)) - first
        return super().forward(tokens, slots, offsets, starts, visibility_bits)


@pytest.mark.parametrize("adapter", [LateRope, SlotPositions])
def test_a_planted_position_bug_still_fails_in_bf16(golden, adapter):
    checks = bf16_checks(golden, PerRequest(adapter()))
    assert checks["verify logits"].status is Status.FAIL and checks["verify logits"].regime.startswith("bf16:")
    assert checks["verify logits"].error > 2 * checks["verify logits"].tolerance


def test_a_planted_routing_bug_fails_the_routing_row(golden, monkeypatch):
    real = engine.model.route

    def no_bias(cfg, x, gate, bias):                       # the correction bias forgotten in selection
        return real(cfg, x, gate, torch.zeros_like(bias))

    monkeypatch.setattr(engine.model, "route", no_bias)
    checks = bf16_checks(golden, PerRequest(TorchAdapter()))
    assert checks["routing"].status is Status.FAIL and "vs threshold" in checks["routing"].detail


class NoExperts(TorchAdapter):
    """An adapter that reports no intermediates: routing is judged blind."""

    intermediates = None


def test_without_reported_experts_the_rows_a_near_tie_reaches_are_judged_apart(golden):
    checks = bf16_checks(golden, PerRequest(NoExperts()))
    assert checks["routing"].status is Status.SKIPPED and "reports no experts" in checks["routing"].detail
    assert not [c for c in checks.values() if c.status is Status.FAIL]
    assert "reached by a routing flip" in checks["verify logits"].detail


def test_a_fixture_without_bf16_cases_is_skipped_not_failed(tmp_path):
    plan = FixturePlan(prompt_lengths=(4,), ar_new_tokens=3, traces=())
    path = tmp_path / "old.kdtr"
    write_fixture(path, model_fixture(PRESETS["tiny2"], "tiny2", plan=plan, bf16_plan=None))
    adapter = PerRequest(TorchAdapter())
    adapter.set_dtype("bfloat16")
    with kdtr_format.open(path) as reader:
        (row,) = model_fixture_checks(adapter, capabilities(adapter), reader, path.name, False, "bfloat16")
    assert row.status is Status.SKIPPED and "no bfloat16 cases" in row.detail


# ---------------------------------------------------------------------------- the regime's rules

@pytest.fixture(scope="module")
def bf16_regime(golden) -> Regime:
    with kdtr_format.open(golden / "tiny2.kdtr") as reader:
        return Regime.of(reader.metadata, "bfloat16")


def test_rows_a_flip_reaches_are_near_ties_the_others_fail(bf16_regime):
    regime = bf16_regime
    atol = regime.tolerances["logits"]["atol"]
    expected = np.zeros((3, 5))
    off_row_1 = expected.copy()
    off_row_1[1, 2] = 10 * atol
    reached = np.array([False, True, False])
    assert regime.close("s", "x", off_row_1, expected, "logits", "", reached=reached).status is Status.NEAR_TIE
    assert regime.close("s", "x", off_row_1, expected, "logits", "", reached=~reached).status is Status.FAIL
    assert regime.close("s", "x", off_row_1, expected, "logits", "").status is Status.FAIL
    within = regime.close("s", "x", expected + atol / 2, expected, "logits", "", reached=reached)
    assert within.status is Status.WITHIN and "1 of 3 rows reached" in within.detail
    assert within.regime == f"bf16: atol {atol:.2g} + rtol 0.0078|x|"


def test_only_the_first_divergence_of_a_sequence_is_judged(bf16_regime):
    regime = bf16_regime
    wide = 10 * regime.margin_threshold
    margins = [wide, regime.margin_threshold / 2, wide, wide]
    # the first divergence at a near-tie, the later ones follow another prefix
    assert regime.tokens("s", "x", [1, 9, 9, 9], [1, 2, 3, 4], margins, "", sequence=True).status is Status.NEAR_TIE
    assert regime.tokens("s", "x", [1, 9, 9, 9], [1, 2, 3, 4], margins, "").status is Status.FAIL
    assert regime.tokens("s", "x", [9, 2, 3, 4], [1, 2, 3, 4], margins, "").status is Status.FAIL
    tied = np.array([True, False, False, False])
    assert regime.tokens("s", "x", [9, 2, 3, 4], [1, 2, 3, 4], margins, "", reached=tied).status is Status.NEAR_TIE


def test_a_flip_reaches_the_tokens_that_see_it_and_the_cache():
    causal = np.tri(4, dtype=bool)
    reach = np.array([True, False])                          # MoE layers: one below the last, the last
    suspects = np.zeros((4, 2), dtype=bool)
    suspects[1, 1] = True                                    # a flip at the last layer: row 1 only
    reached, taints = reached_rows(suspects, reach, causal, False)
    assert reached.tolist() == [False, True, False, False] and not taints.any()
    suspects[2, 0] = True                                    # below the last: rows 2 and 3 (they see row 2)
    reached, taints = reached_rows(suspects, reach, causal, False)
    assert reached.tolist() == [False, True, True, True] and taints.tolist() == [False, False, True, True]
    assert reached_rows(np.zeros((4, 2), dtype=bool), reach, causal, True)[0].all()


def test_a_flip_that_follows_an_earlier_flip_is_not_blamed(bf16_regime):
    cfg = PRESETS["tiny2"]                                   # MoE layers 0, 1, 2
    watch = RoutingWatch(bf16_regime, cfg, exact=True)
    reference = np.tile(np.arange(3), (2, 3, 1))             # [rows, layers, k]
    margins = np.full((2, 3), 1.0)                           # every decision wide
    margins[0, 0] = 1e-4                                     # but row 0 at layer 0
    chosen = {f"layers.{i}.experts": reference[:, i].copy() for i in range(3)}
    chosen["layers.0.experts"][0] = [0, 1, 5]                # row 0 flips at its near-tie
    chosen["layers.2.experts"][1] = [0, 1, 7]                # row 1 later: it sees row 0
    watch._flips(chosen, reference, margins, np.tri(2, dtype=bool), "here")
    assert [f.status for f in watch.flips] == [Status.NEAR_TIE, Status.NEAR_TIE]
    watch.flips.clear()
    chosen["layers.0.experts"][0] = reference[0, 0]          # without the first flip the second is a bug
    watch._flips(chosen, reference, margins, np.tri(2, dtype=bool), "here")
    assert [f.status for f in watch.flips] == [Status.FAIL]


class Scripted:
    """An adapter whose `intermediates` reports the experts it was given, one forward at a time."""

    def __init__(self, experts: list[np.ndarray]) -> None:
        self.experts = iter(experts)

    def intermediates(self, tokens, positions, visibility, start):
        chosen = next(self.experts)
        return {"logits": np.zeros((len(tokens), 4)), **{f"layers.{i}.experts": chosen[:, i] for i in range(3)}}


def test_a_verify_leaves_the_cache_as_the_restated_path_leaves_it(bf16_regime):
    """A flip inside a verify reaches its tree, not the next forward (the accepted path is restated);
    a flip in a committed forward reaches every later row through the cached keys."""
    reference = np.tile(np.arange(3), (2, 3, 1))
    flipped = reference.copy()
    flipped[0, 0] = [0, 1, 9]                                # row 0, MoE layer 0 (below the last)
    margins = np.full((2, 3), 1e-4)                          # near-ties: rounding, not bugs
    watch = RoutingWatch(bf16_regime, PRESETS["tiny2"], exact=True)
    adapter = Scripted([flipped, reference, flipped, reference])
    tree = np.ones((2, 2), dtype=bool)

    def forward(commit: bool) -> list[bool]:
        return watch.forward(adapter, np.zeros(2), np.zeros(2), tree, 0, (reference, margins), "here", commit)[1].tolist()

    assert forward(commit=False) == [True, True]
    assert forward(commit=True) == [False, False]
    assert forward(commit=True) == [True, True]
    assert forward(commit=True) == [True, True]             # through the cache
    assert [f.status for f in watch.flips] == [Status.NEAR_TIE, Status.NEAR_TIE]


# ---------------------------------------------------------------------------- the CLI and the runner

class StagesInBf16:
    """Accept and compaction through the built-in engine; it accepts being told bfloat16."""

    name = "stages in bf16"

    def __init__(self) -> None:
        self.engine, self.dtype = PerRequest(TorchAdapter()), None

    def set_dtype(self, dtype):
        self.dtype = dtype

    def accept(self, parents, tokens, choices):
        return self.engine.accept(parents, tokens, choices)


def test_the_runner_tells_the_adapter_its_dtype_and_names_regimes(golden, tmp_path):
    adapter = StagesInBf16()
    report = validate(adapter, fixture_dir(golden, tmp_path, "kernels/accept_compact.kdtr"), dtype="bfloat16")
    assert adapter.dtype == "bfloat16" and not report.failed
    assert {c.regime for c in report.checks if c.status is not Status.SKIPPED} == {"exact"}


def test_cli_bf16_with_an_adapter_that_cannot_be_told_is_one_line(golden, tmp_path, capsys):
    directory = fixture_dir(golden, tmp_path, "tiny2.kdtr")
    code, _, err = run_main(["validate", "--dtype", "bfloat16", "--fixtures", str(directory),
                             "--impl", "docs/examples/numpy_adapter.py:NumpyAdapter"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no set_dtype method" in lines[0], err


def test_cli_bad_dtype_is_a_usage_error(capsys):
    code, _, err = run_main(["validate", "--dtype", "float16"], capsys)
    assert code == 2 and "float16" in err


def test_cli_report_json_carries_the_regime(golden, tmp_path, capsys):
    directory = fixture_dir(golden, tmp_path / "fixtures", "kernels/accept_compact.kdtr")
    adapter = tmp_path / "bf16_stages.py"
    adapter.write_text("from engine.adapter import TorchAdapter\nfrom engine.validate.protocol_v2 import PerRequest, sizes\n\n"
                       "class Stages:\n"
                       "    def set_dtype(self, dtype):\n        assert dtype == 'bfloat16'\n"
                       "    def accept(self, parents, tokens, choices):\n"
                       "        return PerRequest(TorchAdapter()).accept(parents, tokens, choices)\n")
    report = tmp_path / "r.json"
    code, out, _ = run_main(["validate", "--fixtures", str(directory), "--dtype", "bfloat16", "--json", str(report),
                             "--impl", f"{adapter}:Stages"], capsys)
    assert code == 0 and "[exact]" in out
    assert {c["regime"] for c in json.loads(report.read_text())["checks"] if c["status"] != "skipped"} == {"exact"}


class Bf16Attention:
    """An attention backend that computes as a bf16 tensor-core kernel does: bf16 operands
    with float32 accumulation (a product of two bf16 values is exact in float32), a float32
    softmax, P rounded to bf16 for P V, the output rounded to bf16."""

    def bind(self, starts, n_new, new_visibility, num_slots):
        from engine.attention import visible_slots

        visible = visible_slots(starts, n_new, new_visibility, num_slots)[:, :, None, :]     # [B, N, 1, T]
        bf16 = lambda x: x.to(torch.bfloat16).float()                                       # noqa: E731

        def attend(q_lat, q_pe, c_kv, k_pe, scale):
            scores = (torch.einsum("bnhr,btr->bnht", bf16(q_lat), bf16(c_kv))
                      + torch.einsum("bnhd,btd->bnht", bf16(q_pe), bf16(k_pe))) * scale
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
            return bf16(torch.einsum("bnht,btr->bnhr", bf16(probs), bf16(c_kv))).to(q_lat.dtype)
        return attend


def attention_rows(report) -> dict[str, Check]:
    return {c.name: c for c in report.checks if "verify attention" in c.name}


def test_a_bf16_attention_kernel_is_judged_on_its_arithmetic_not_its_inputs_rounding(golden, tmp_path):
    """Under --dtype bfloat16 the attention rows (per request, batched, paged) hand the inputs
    rounded to bf16 and compare with the reference on those inputs: a kernel computing in bf16
    passes them, while the same kernel fails the float32 rule (so the adapter really is bf16)."""
    directory = fixture_dir(golden, tmp_path, "kernels/verify_attention.kdtr", "kernels/paged_kv.kdtr")
    adapter = TorchAdapter()
    adapter.attention_backend = Bf16Attention()
    rows = attention_rows(validate(adapter, directory, dtype="bfloat16"))
    assert set(rows) == {"verify attention (o_lat)", "batched verify attention", "paged verify attention"}
    assert all(c.status is Status.WITHIN and "rounded to bf16" in c.regime for c in rows.values()), rows
    assert all(c.status is Status.FAIL for c in attention_rows(validate(adapter, directory)).values())
