"""The divergence finder: a planted bug is headlined as the first divergence beyond the noise
its compute dtype allows, whatever rounding differs before it (as cuBLAS, or another CPU's
kernels, make q_lat differ between row counts: simulated here by a q_lat that is off by a few
ulps with M > 1), and a correct engine's report headlines nothing; in the invariant model, where
nothing else depends on the call, planted row-count- and batch-dependent reductions are named as
the first op that is not invariant, and called rounding; identical ways report no divergence;
nondeterminism, expert flips and adapters that report a subset of the points are handled; a
--config run states the memory it needs and is refused beyond what the machine has; the CLI."""

from __future__ import annotations

import inspect
import json

import ml_dtypes
import numpy as np
import pytest
import torch

import engine.cli.diverge_cmd
import engine.diverge_run
import engine.model
import kdtr_format
from engine.adapter import TorchAdapter
from engine.attention import torch_attention, visible_slots
from engine.capture import capturing, to_numpy
from engine.diverge import OPS, Noise, compare_ways, ulps_at_scale
from engine.diverge_run import from_fixture, memory_needed, run
from engine.diverge_ways import Way, batch_way, chunk_way, decode_way, tree_visibility, tree_way
from engine.validate import random_weights
from engine.validate.door.protocol_v2 import PerRequest
from engine.weights import load_fixture_weights
from kdtr_format.precision import FLOAT32_LOGIT_ATOL, FLOAT32_LOGIT_RTOL, bf16_bounds
from kdtr_format import CONFIGS, PRESETS
from refgen.weights import weight_shapes as refgen_weight_shapes

from cli_run import run_main

PROMPT = list(range(3, 15))
NEW = [5, 77, 300, 12, 9, 640]


@pytest.fixture(scope="module")
def tiny(golden):
    """tiny's fixture weights (layer 0 dense, layers 1-3 MoE)."""
    cfg, weights = load_fixture_weights(golden / "tiny.kdtr")
    return cfg, {name: w.numpy() for name, w in weights.items()}


def engine_adapter(tiny, dtype: str = "bfloat16", attention=None, invariant: bool = False) -> TorchAdapter:
    adapter = TorchAdapter("cpu", invariant=invariant)
    adapter.set_dtype(dtype)
    if attention is not None:
        adapter.attention_backend = attention
    adapter.load_weights(*tiny)
    return adapter


class SplitKeys:
    """A planted attention backend: when `when(q_lat)` holds, the weighted sum over the keys runs
    in two halves, each rounded to the compute dtype before they are added (a split-K plan chosen
    by the shape of the call: rounding, not a bug); otherwise the engine's own. It is its own
    invariant form, so that it can be planted into the invariant model."""

    def __init__(self, when) -> None:
        self.when = when

    def __call__(self, q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
        if not self.when(q_lat):
            return torch_attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale)
        slots = int((starts + n_new).max())
        c, k = c_kv[:, :slots].float(), k_pe[:, :slots].float()
        scores = (torch.einsum("bnhr,btr->bnht", q_lat.float(), c)
                  + torch.einsum("bnhd,btd->bnht", q_pe.float(), k)) * scale
        visible = visible_slots(starts, n_new, new_visibility, slots)[:, :, None, :]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        half = slots // 2
        parts = [torch.einsum("bnht,btr->bnhr", probs[..., keys], c[:, keys]).to(q_lat.dtype).float()
                 for keys in (slice(0, half), slice(half, slots))]
        return (parts[0] + parts[1]).to(q_lat.dtype)

    def invariant_form(self) -> "SplitKeys":
        return self


split_keys_when_many_rows = SplitKeys(lambda q_lat: q_lat.shape[1] > 1)     # depends on M
split_keys_when_batched = SplitKeys(lambda q_lat: q_lat.shape[0] > 1)       # depends on the batch


def mask_bug(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
    """A planted mask bug: with more than one new row, every new row sees every new token."""
    if q_lat.shape[1] > 1:
        new_visibility = torch.ones_like(new_visibility)
    return torch_attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale)


def plant_ffn_bug(monkeypatch) -> None:
    """A planted FFN bug: with more than one row, the down projection loses its second partial sum."""
    real = engine.model.swiglu

    def swiglu(x, w_gate, w_up, w_down):
        if x.shape[0] == 1:
            return real(x, w_gate, w_up, w_down)
        hidden = torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)
        half = hidden.shape[1] // 2
        return hidden[:, :half] @ w_down[:, :half].T

    monkeypatch.setattr(engine.model, "swiglu", swiglu)


def plant_row_count_noise(monkeypatch, ulps: int) -> None:
    """What cuBLAS (or another CPU's bf16 kernels) does to the query projection: another kernel
    for M > 1 rows, so each value of q_lat comes out up to `ulps` of its own ulps off the one-row
    result (a float32-accumulating bf16 kernel is off by one at most); the same bits for the same
    M (seeded by M), as a deterministic kernel gives."""
    real = engine.model.Block.attention_in

    def attention_in(self, x, cos, sin):
        h, q_lat, *rest = real(self, x, cos, sin)
        if x.shape[0] > 1:
            wide = q_lat.float()
            ulp = torch.exp2(torch.floor(torch.log2(wide.abs()))) * torch.finfo(q_lat.dtype).eps
            steps = torch.randint(-ulps, ulps + 1, q_lat.shape, generator=torch.Generator().manual_seed(x.shape[0]))
            q_lat = (wide + steps * ulp.nan_to_num(0.0, posinf=0.0, neginf=0.0)).to(q_lat.dtype)
        return (h, q_lat, *rest)

    monkeypatch.setattr(engine.model.Block, "attention_in", attention_in)


ROUNDING_ULPS = {"float32": 3, "bfloat16": 1}    # a reordered float32 reduction; a bf16 output rounded once
NOISE_IDS = ["this machine's rounding", "q_lat off by rounding with M > 1"]


def test_ulps_at_scale():
    one = np.array([[1.0, 0.001]], dtype=ml_dtypes.bfloat16)
    next_up = np.array([[1.0078125, 0.001]], dtype=ml_dtypes.bfloat16)        # 1 + 2^-7: one bf16 ulp
    assert ulps_at_scale(one, next_up).tolist() == [1.0]
    small = np.array([[1.0, 0.0]], dtype=np.float32)
    moved = np.array([[1.0, 2 ** -24]], dtype=np.float32)                      # half an ulp of the row's 1.0
    assert ulps_at_scale(small, moved).tolist() == [0.5]
    assert ulps_at_scale(one, one).tolist() == [0.0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_noise_is_twice_the_regimes_tolerance_at_the_rows_scale(dtype):
    """Two ways that each err by up to the regime's logits tolerance differ by up to twice it: atol
    relative to the row's rms, growing like sqrt(depth) (the bf16 error model's law); rtol of the
    row's largest magnitude."""
    bounds = bf16_bounds(1.0, 1, 0.0)
    atol, rtol = ((bounds.logits_atol, bounds.logits_rtol) if dtype == "bfloat16" else
                  (FLOAT32_LOGIT_ATOL, FLOAT32_LOGIT_RTOL))
    noise = Noise.of(dtype)
    row = np.array([[3.0, -4.0, 0.0, 0.0]])                                     # rms 2.5, largest 4
    bound = 2 * (atol * 2.5 * 2.0 + rtol * 4.0)                                 # at depth 4
    assert noise.ratios(row, row - [[0.999 * bound, 0, 0, 0]], depth=4)[0] < 1 < \
        noise.ratios(row, row - [[1.001 * bound, 0, 0, 0]], depth=4)[0]
    assert noise.ratios(row, row, depth=1).tolist() == [0.0]
    assert noise.ratios(row, np.where(row == 3.0, np.nan, row), depth=1).tolist() == [np.inf]    # a NaN in one way


def test_tree_visibility():
    visibility = tree_visibility([-1, 0, 0, 1, 3])
    assert visibility.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                   [1, 1, 0, 1, 1]]


def test_identical_ways_report_no_divergence(tiny):
    adapter = engine_adapter(tiny)
    decoded = decode_way(adapter, PROMPT, NEW)
    d = compare_ways(decoded, decode_way(adapter, PROMPT, NEW))
    assert d.first is None and d.headline is None and not any(p.tokens for p in d.points)
    assert d.explanation[0].startswith("no divergence: all")
    assert len(d.decisions) == 1 + len(NEW) and all(c.choice_a == c.choice_b for c in d.decisions)
    last_prompt_row = np.sort(np.asarray(decoded.values["logits"][len(PROMPT) - 1], dtype=np.float64))
    assert d.decisions[0].margin_a == last_prompt_row[-1] - last_prompt_row[-2]


def test_capture_rows_belong_to_their_request(tiny):
    model = engine_adapter(tiny).model
    n_new = [3, 5]
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    causal = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    with capturing(model, n_new, request=1) as captured:
        logits = model.forward(tokens, torch.arange(5).expand(2, 5), causal, torch.tensor(n_new),
                               torch.zeros(2, dtype=torch.int64), model.new_cache(2, 5))
    values = captured.values
    assert values["logits"].dtype == ml_dtypes.bfloat16                 # the head's bits, in the model's dtype
    assert np.array_equal(np.asarray(values["logits"], dtype=np.float32), logits[1, :5].numpy())
    normed = engine.model.rms_norm(model.embed[tokens[1]], model.layers[0].input_norm, model.cfg.rms_norm_eps)
    assert np.array_equal(to_numpy(normed), values["layers.0.attn_input"])
    assert values["layers.1.experts"].shape == (5, 2) and captured.expert_counts[1].sum() == 2 * sum(n_new)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_batch_invariant_engine_no_way_diverges(tiny, dtype):
    """Batch-invariant mode: every point bitwise equal between AR decode and a chunk, a tree and a
    batch (the finder's induction)."""
    adapter = engine_adapter(tiny, dtype, invariant=True)
    decoded = decode_way(adapter, PROMPT, NEW)
    parents, tree, path = [-1, 0, 0, 1], np.array([NEW[0], NEW[1], 77, NEW[2]]), [0, 1, 3]
    ways = [(decoded, chunk_way(adapter, PROMPT, NEW)),
            (decode_way(adapter, PROMPT, tree[path].tolist()), tree_way(adapter, PROMPT, tree, parents, path)),
            (decoded, batch_way(adapter.model, [PROMPT, [1, 2, 3], list(range(40, 60))], [NEW, [4, 5], [6] * 9]))]
    assert all(compare_ways(a, b).first is None for a, b in ways)


# ---- planted bugs: headlined beyond the noise, whatever rounds differently before them ----

@pytest.mark.parametrize("noise", [False, True], ids=NOISE_IDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bug, point", [("mask", "o_lat"), ("ffn", "ffn_output")])
def test_a_planted_bug_is_headlined_beyond_the_rounding_before_it(tiny, monkeypatch, bug, point, dtype, noise):
    if noise:
        plant_row_count_noise(monkeypatch, ROUNDING_ULPS[dtype])
    if bug == "ffn":
        plant_ffn_bug(monkeypatch)
    adapter = engine_adapter(tiny, dtype, attention=mask_bug if bug == "mask" else None)
    d = compare_ways(decode_way(adapter, PROMPT, NEW), chunk_way(adapter, PROMPT, NEW))
    assert (d.headline.layer, d.headline.point) == (0, point), d.explanation
    assert d.headline.noise_ratio > 1 and d.headline.beyond
    assert d.explanation[0] == f"first divergence beyond {dtype} noise: layer 0 {point} ({OPS[point]})"
    before = [p for p in d.points[:d.points.index(d.headline)] if p.tokens]
    assert all(p.noise_ratio <= 1 and not p.beyond for p in before)       # rounding, named as such
    if noise:
        assert (d.first.layer, d.first.point) == (0, "q_lat") and d.first in before
        assert any(line.startswith("within noise before it: layer 0 q_lat") for line in d.explanation), \
            d.explanation


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_engine_headlines_nothing_beyond_noise(golden, tiny, monkeypatch, dtype):
    """This machine's rounding, and on top of it the simulated cuBLAS's at q_lat."""
    plant_row_count_noise(monkeypatch, ROUNDING_ULPS[dtype])
    subject = from_fixture((golden / "tiny.kdtr"), None, engine_adapter(tiny, dtype))
    for way in ("chunk", "tree", "batch"):
        _, _, d = run(subject, way, 6)
        assert d.headline is None, (way, d.explanation)
        assert (d.first.layer, d.first.point) == (0, "q_lat"), (way, d.explanation)
        assert d.explanation[0].startswith(f"no divergence beyond {dtype} noise"), d.explanation
        assert d.explanation[1].startswith("first bitwise divergence: layer 0 q_lat"), d.explanation


def flipped_ways(scores_differ: bool) -> tuple[Way, Way]:
    """Two ways of 3 tokens through a MoE layer 0 and layer 1's first point, token 1 routed to
    another expert in the second way (its router scores one ulp apart, or bitwise equal); its
    FFN output, and layer 1 of tokens 1 and 2, then differ far beyond rounding."""
    rng = np.random.default_rng(0)
    values = {key: rng.standard_normal((3, 8)).astype(np.float32)
              for key in ("layers.0.router_scores", "layers.0.ffn_output", "layers.1.attn_input")}
    values["layers.0.experts"] = np.array([[0, 1], [2, 3], [4, 5]])
    other = {key: value.copy() for key, value in values.items()}
    if scores_differ:
        other["layers.0.router_scores"][1, 0] = np.nextafter(values["layers.0.router_scores"][1, 0], np.float32(9))
    other["layers.0.experts"][1] = [2, 4]
    other["layers.0.ffn_output"][1] += 1
    other["layers.1.attn_input"][1:] += 1
    return tuple(Way(label, 0, [7, 8, 9], [0, 1, 2], [rows] * 3, [1] * 3, [1, 2, 3], [3] * 3, v)
                 for label, rows, v in (("AR decode", 1, values), ("chunk", 3, other)))


def test_an_expert_flip_of_rounding_reaches_later_rows_and_is_no_headline():
    d = compare_ways(*flipped_ways(scores_differ=True))
    verdicts = {p.key: (p.verdict, p.reached) for p in d.points if p.tokens}
    assert verdicts == {"layers.0.router_scores": ("rounding", []), "layers.0.experts": ("routing near-tie", []),
                        "layers.0.ffn_output": ("reached by a flip", [1]),
                        "layers.1.attn_input": ("reached by a flip", [1, 2])}
    assert d.headline is None and d.explanation[0].startswith("no divergence beyond float32 noise")


def test_an_expert_flip_with_equal_router_scores_is_the_headline():
    d = compare_ways(*flipped_ways(scores_differ=False))
    assert d.headline.key == "layers.0.experts" and d.headline.beyond == [1] and d.headline.inputs_agree
    assert d.explanation[0].startswith("first divergence beyond float32 noise: layer 0 experts")


# ---- planted into the invariant model: the first op that is not invariant, named as rounding ----

def test_planted_row_count_dependent_reduction_is_named(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_many_rows, invariant=True)
    decoded = decode_way(adapter, PROMPT, NEW)
    d = compare_ways(decoded, chunk_way(adapter, PROMPT, NEW))
    assert (d.first.layer, d.first.point) == (0, "o_lat") and d.first.inputs_agree
    assert d.first.tokens == list(range(len(PROMPT), len(PROMPT) + len(NEW)))    # the prompt's prefill agrees
    assert d.first.dtype == "bfloat16" and d.first.max_ulps >= 1
    assert d.headline is None and d.first.noise_ratio <= 1                      # a split reduction rounds
    assert d.explanation[0].startswith("no divergence beyond bfloat16 noise")
    assert d.explanation[1] == f"first bitwise divergence: layer 0 o_lat ({OPS['o_lat']})"
    assert "M = 1" in d.explanation[2] and f"M = {len(NEW)}" in d.explanation[2]
    assert any(line.startswith("keys: ") for line in d.explanation)
    assert not any(p.inputs_agree for p in d.points if p.tokens and p is not d.first)   # consequences only


def test_tree_way_compares_the_path_rows(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_many_rows, invariant=True)
    parents, tokens, path = [-1, 0, 0, 1, 2, 3], np.array([7, 70, 71, 700, 710, 1000]), [0, 1, 3, 5]
    tree = tree_way(adapter, PROMPT, tokens, parents, path)
    assert tree.positions[len(PROMPT):] == [12, 13, 14, 15] and tree.rows[-1] == 6
    d = compare_ways(decode_way(adapter, PROMPT, tokens[path].tolist()), tree)
    assert (d.first.layer, d.first.point) == (0, "o_lat")


def test_batch_way_names_a_batch_dependent_op_the_chunk_way_cannot_see(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_batched, invariant=True)
    decoded = decode_way(adapter, PROMPT, NEW)
    assert compare_ways(decoded, chunk_way(adapter, PROMPT, NEW)).first is None
    batched = batch_way(adapter.model, [PROMPT, [1, 2, 3], list(range(40, 50))], [NEW, [4, 5], [6] * 7])
    assert batched.batch[0] == 3 and batched.rows[0] == len(PROMPT)
    d = compare_ways(decoded, batched)
    assert (d.first.layer, d.first.point) == (0, "o_lat") and min(d.first.tokens) < len(PROMPT)  # prefill rows too


def test_nondeterminism_is_called_so(tiny):
    generator = torch.Generator().manual_seed(0)

    def noisy(*args):
        out = torch_attention(*args)
        return out + (torch.rand(out.shape, generator=generator) < 0.01).to(out.dtype) * 2 ** -6

    adapter = engine_adapter(tiny, attention=noisy)
    d = compare_ways(decode_way(adapter, PROMPT, NEW), decode_way(adapter, PROMPT, NEW))
    assert d.first.point == "o_lat" and any("not deterministic" in line for line in d.explanation)


def test_expert_flips_name_the_experts_and_the_gap(tiny, monkeypatch):
    real = engine.model.route

    def steer_when_many_rows(cfg, x, gate, bias):
        steered = bias + (1.0 if x.shape[0] > 1 else 0.0) * (torch.arange(len(bias)) == 5)
        return real(cfg, x, gate, steered)

    monkeypatch.setattr(engine.model, "route", steer_when_many_rows)
    adapter = engine_adapter(tiny, "float32")
    bias = {layer: tiny[1][f"layers.{layer}.moe.e_score_correction_bias"] for layer in (1, 2, 3)}
    d = compare_ways(decode_way(adapter, PROMPT, NEW), chunk_way(adapter, PROMPT, NEW), bias)
    assert d.flips and all(5 in f.experts_b and 5 not in f.experts_a for f in d.flips)
    assert all(f.gap is not None and f.gap > 0 for f in d.flips)
    assert any("flip downstream" in line for line in d.explanation)


class LayerOutputsOnly:
    """An adapter reporting only each layer's output and the logits."""

    def __init__(self, inner: TorchAdapter) -> None:
        self.inner = PerRequest(inner)
        self.reset, self.forward = self.inner.reset, self.inner.forward

    def intermediates(self, tokens, positions, visibility, start):
        out = self.inner.intermediates(tokens, positions, visibility, start)
        return {k: v for k, v in out.items() if k == "logits" or k.endswith(".layer_output")}


def test_an_adapter_with_a_subset_of_points(tiny):
    adapter = LayerOutputsOnly(engine_adapter(tiny, attention=split_keys_when_many_rows, invariant=True))
    d = compare_ways(decode_way(adapter, PROMPT, NEW), chunk_way(adapter, PROMPT, NEW))
    assert (d.first.layer, d.first.point) == (0, "layer_output") and d.first.inputs_agree
    assert [p.key for p in d.points] == [f"layers.{i}.layer_output" for i in range(4)] + ["logits"]


def test_run_from_a_fixture_tree(golden, tiny):
    subject = from_fixture((golden / "tiny.kdtr"), "p0", engine_adapter(tiny))
    a, b, d = run(subject, "tree", 0)
    assert b.label.startswith("tree verify") and len(a.tokens) == len(b.tokens) > a.prompt_length + 1


# ---- memory ----

@pytest.mark.parametrize("name", [*PRESETS, *CONFIGS])
def test_the_weights_estimate_is_what_refgen_and_the_engine_make(name):
    """One estimate (kdtr_format.weight_bytes) sizes `refgen generate --config-file` and
    `kdtree diverge --config`: refgen's own weight table agrees with it, and so do the bf16
    weights the engine makes (the small presets)."""
    cfg = {**PRESETS, **CONFIGS}[name]
    assert kdtr_format.weight_bytes(cfg, 4) == 4 * sum(int(np.prod(s)) for s in refgen_weight_shapes(cfg).values())
    need = memory_needed(cfg, "bfloat16", prompt_length=64, tokens=16)
    if name in ("tiny", "tiny2"):
        assert need.weights == sum(w.nbytes for w in random_weights(cfg, dtype=torch.bfloat16).values())
    assert need.total > need.device > need.weights > 0


def planted_module(tmp_path) -> str:
    """An --impl file: the built-in engine with the mask bug planted."""
    path = tmp_path / "planted.py"
    path.write_text("import torch\nfrom engine.adapter import TorchAdapter\n"
                    "from engine.attention import torch_attention\n\n\n"
                    f"{inspect.getsource(mask_bug)}\n\n"
                    "def make():\n    adapter = TorchAdapter('cpu')\n    adapter.attention_backend = mask_bug\n"
                    "    return adapter\n")
    return f"{path}:make"


def test_cli_headlines_a_planted_bug_and_writes_json(golden, tmp_path, capsys):
    report = tmp_path / "d.json"
    code, out, _ = run_main(["diverge", "--fixture", str((golden / "tiny.kdtr")), "--tokens", "6",
                             "--impl", planted_module(tmp_path), "--json", str(report)], capsys)
    finding = json.loads(report.read_text())
    assert code == 1 and "first divergence beyond float32 noise: layer 0 o_lat" in out, out
    assert finding["headline"]["point"] == "o_lat" and finding["headline"]["noise_ratio"] > 1
    assert finding["dtype"] == "float32"


def test_cli_states_the_memory_a_config_needs_and_refuses_beyond_what_is_available(capsys, monkeypatch):
    need = memory_needed(PRESETS["tiny"], "float32", prompt_length=64, tokens=16).total
    monkeypatch.setattr(engine.cli.diverge_cmd, "_free_bytes", lambda device: need - 1)
    code, out, err = run_main(["diverge", "--config", "tiny"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("kdtree: error: --config tiny needs about ") and "available on cpu" in lines[0]
    monkeypatch.setattr(engine.cli.diverge_cmd, "_free_bytes", lambda device: need)
    code, out, err = run_main(["diverge", "--config", "tiny", "--tokens", "2"], capsys)
    assert code in (0, 1) and "kdtree diverge: tiny" in out
    assert err.startswith("kdtree: note: --config tiny needs about "), err


@pytest.mark.parametrize("exc", [RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                              "22548578304 bytes. Error code 12 (Cannot allocate memory)"),
                                 torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 21.00 GiB"),
                                 MemoryError()], ids=["cpu", "cuda", "numpy"])
def test_cli_running_out_of_memory_is_one_line_not_an_internal_error(capsys, monkeypatch, exc):
    def out_of_memory(*args, **kwargs):
        raise exc

    monkeypatch.setattr(engine.diverge_run, "run", out_of_memory)
    code, _, err = run_main(["diverge", "--config", "tiny"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("kdtree: error: ran out of memory on cpu") and \
        "internal error" not in err, err


@pytest.mark.parametrize("args, message", [
    (["diverge"], "exactly one of --fixture PATH and --config NAME"),
    (["diverge", "--config", "nope"], "unknown config 'nope'"),
    (["diverge", "--config", "tiny", "--prompt", "p0"], "--prompt names a fixture's prompt"),
    (["diverge", "--fixture", "/no/such.kdtr"], "does not exist"),
    (["diverge", "--config", "tiny", "--trace", "t1"], "expected TRACE/ROUND"),
    (["diverge", "--config", "tiny", "--way", "sideways"], "sideways"),
    (["diverge", "--config", "tiny", "--impl", "no_such_module_xyz:make"], "cannot import"),
    (["diverge", "--fixture", "KERNEL"], "not a model fixture"),
    (["diverge", "--fixture", "TINY", "--prompt", "p9"], "has no prompt 'p9'"),
    (["diverge", "--config", "kimi-k2-full", "--dtype", "bfloat16"], "needs about 2."),      # TB: no machine has it
    (["diverge", "--fixture", "TINY", "--way", "tree", "--trace", "t6/0"],
     "--trace t6/0: trace t6 replays prompt p0, and this run's is p2 (the longest; the default): give --prompt p0"),
    (["diverge", "--fixture", "TINY", "--way", "tree", "--trace", "t99/0"], "--trace t99/0: tiny.kdtr has no trace t99"),
    (["diverge", "--fixture", "TINY", "--way", "tree", "--prompt", "p0", "--trace", "t6/7"],
     "--trace t6/7: trace t6 has round 0 only"),
])
def test_cli_bad_input_is_one_line(golden, capsys, args, message):
    args = [(golden / "kernels/tree_build.kdtr").as_posix() if a == "KERNEL" else
            (golden / "tiny.kdtr").as_posix() if a == "TINY" else a for a in args]
    code, _, err = run_main(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("kdtree: error: ") and message in lines[0], err
