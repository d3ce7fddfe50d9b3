"""The divergence finder: planted row-count- and batch-dependent bugs are named by op, layer,
token and ulps; identical ways report no divergence; nondeterminism, expert flips and
adapters that report a subset of the points are handled; the CLI."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

import engine.model
from engine.adapter import TorchAdapter
from engine.validate.protocol_v2 import PerRequest
from engine.attention import torch_attention, visible_slots
from engine.capture import capturing, to_numpy
from engine.diverge import (batch_way, chunk_way, compare_ways, decode_way, tree_visibility, tree_way,
                            ulps_at_scale)
from engine.diverge_run import from_fixture, run
from engine.weights import load_fixture_weights

from .test_cli import run_main

PROMPT = list(range(3, 15))
NEW = [5, 77, 300, 12, 9, 640]


@pytest.fixture(scope="module")
def tiny(golden):
    """tiny's fixture weights (layer 0 dense, layers 1-3 MoE)."""
    cfg, weights = load_fixture_weights(golden / "tiny.kdtr")
    return cfg, {name: w.numpy() for name, w in weights.items()}


def engine_adapter(tiny, dtype: str = "bfloat16", attention=None) -> TorchAdapter:
    adapter = TorchAdapter("cpu")
    adapter.set_dtype(dtype)
    if attention is not None:
        adapter.attention_backend = attention
    adapter.load_weights(*tiny)
    return adapter


def split_k_attention(when):
    """A planted attention backend: when `when(q_lat)` holds, the weighted sum over the keys runs
    in two halves, each rounded to the compute dtype before they are added (a split-K plan chosen
    by the shape of the call); otherwise the engine's own."""
    def attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
        if not when(q_lat):
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
    return attention


split_keys_when_many_rows = split_k_attention(lambda q_lat: q_lat.shape[1] > 1)     # depends on M
split_keys_when_batched = split_k_attention(lambda q_lat: q_lat.shape[0] > 1)       # depends on the batch


def test_ulps_at_scale():
    one = np.array([[1.0, 0.001]], dtype=ml_dtypes.bfloat16)
    next_up = np.array([[1.0078125, 0.001]], dtype=ml_dtypes.bfloat16)        # 1 + 2^-7: one bf16 ulp
    assert ulps_at_scale(one, next_up).tolist() == [1.0]
    small = np.array([[1.0, 0.0]], dtype=np.float32)
    moved = np.array([[1.0, 2 ** -24]], dtype=np.float32)                      # half an ulp of the row's 1.0
    assert ulps_at_scale(small, moved).tolist() == [0.5]
    assert ulps_at_scale(one, one).tolist() == [0.0]


def test_tree_visibility():
    visibility = tree_visibility([-1, 0, 0, 1, 3])
    assert visibility.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                   [1, 1, 0, 1, 1]]


def test_identical_ways_report_no_divergence(tiny):
    adapter = engine_adapter(tiny)
    decoded = decode_way(adapter, PROMPT, NEW)
    d = compare_ways(decoded, decode_way(adapter, PROMPT, NEW))
    assert d.first is None and not any(p.tokens for p in d.points)
    assert d.explanation[0].startswith("no divergence")
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
    batch (the finder's induction); the default mode differs somewhere in the same runs."""
    for invariant in (True, False):
        adapter = TorchAdapter("cpu", invariant=invariant)
        adapter.set_dtype(dtype)
        adapter.load_weights(*tiny)
        decoded = decode_way(adapter, PROMPT, NEW)
        parents, tree, path = [-1, 0, 0, 1], np.array([NEW[0], NEW[1], 77, NEW[2]]), [0, 1, 3]
        ways = [(decoded, chunk_way(adapter, PROMPT, NEW)),
                (decode_way(adapter, PROMPT, tree[path].tolist()), tree_way(adapter, PROMPT, tree, parents, path)),
                (decoded, batch_way(adapter.model, [PROMPT, [1, 2, 3], list(range(40, 60))], [NEW, [4, 5], [6] * 9]))]
        firsts = [compare_ways(a, b).first for a, b in ways]
        assert all(first is None for first in firsts) if invariant else any(firsts)


def test_planted_row_count_dependent_reduction_is_named(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_many_rows)
    decoded = decode_way(adapter, PROMPT, NEW)
    d = compare_ways(decoded, chunk_way(adapter, PROMPT, NEW))
    assert (d.first.layer, d.first.point) == (0, "o_lat") and d.first.inputs_agree
    assert d.first.tokens == list(range(len(PROMPT), len(PROMPT) + len(NEW)))    # the prompt's prefill agrees
    assert d.first.dtype == "bfloat16" and d.first.max_ulps >= 1
    assert "M = 1" in d.explanation[1] and f"M = {len(NEW)}" in d.explanation[1]
    assert any(line.startswith("keys: ") for line in d.explanation)
    assert not any(p.inputs_agree for p in d.points if p.tokens and p is not d.first)   # consequences only
    # the same engine without the plant: the first divergence is elsewhere (the float32 router)
    clean = engine_adapter(tiny)
    baseline = compare_ways(decode_way(clean, PROMPT, NEW), chunk_way(clean, PROMPT, NEW))
    assert (baseline.first.layer, baseline.first.point) != (0, "o_lat")


def test_planted_dense_mlp_split_is_named_with_its_rows(tiny, monkeypatch):
    real = engine.model.swiglu

    def split_down_projection(x, w_gate, w_up, w_down):
        if x.shape[0] == 1:
            return real(x, w_gate, w_up, w_down)
        hidden = torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)
        half = hidden.shape[1] // 2
        return hidden[:, :half] @ w_down[:, :half].T + hidden[:, half:] @ w_down[:, half:].T

    monkeypatch.setattr(engine.model, "swiglu", split_down_projection)
    adapter = engine_adapter(tiny)
    d = compare_ways(decode_way(adapter, PROMPT, NEW), chunk_way(adapter, PROMPT, NEW))
    assert (d.first.layer, d.first.point) == (0, "ffn_output")


def test_tree_way_compares_the_path_rows(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_many_rows)
    parents, tokens, path = [-1, 0, 0, 1, 2, 3], np.array([7, 70, 71, 700, 710, 1000]), [0, 1, 3, 5]
    tree = tree_way(adapter, PROMPT, tokens, parents, path)
    assert tree.positions[len(PROMPT):] == [12, 13, 14, 15] and tree.rows[-1] == 6
    d = compare_ways(decode_way(adapter, PROMPT, tokens[path].tolist()), tree)
    assert (d.first.layer, d.first.point) == (0, "o_lat")


def test_batch_way_names_a_batch_dependent_op_the_chunk_way_cannot_see(tiny):
    adapter = engine_adapter(tiny, attention=split_keys_when_batched)
    decoded = decode_way(adapter, PROMPT, NEW)
    chunk = compare_ways(decoded, chunk_way(adapter, PROMPT, NEW))
    assert (chunk.first.layer, chunk.first.point) != (0, "o_lat")
    batched = batch_way(adapter.model, [PROMPT, [1, 2, 3], list(range(40, 60))], [NEW, [4, 5], [6] * 9])
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
    assert d.first.point == "o_lat" and "not deterministic" in d.explanation[1]


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
    adapter = LayerOutputsOnly(engine_adapter(tiny, attention=split_keys_when_many_rows))
    d = compare_ways(decode_way(adapter, PROMPT, NEW), chunk_way(adapter, PROMPT, NEW))
    assert (d.first.layer, d.first.point) == (0, "layer_output") and d.first.inputs_agree
    assert [p.key for p in d.points] == [f"layers.{i}.layer_output" for i in range(4)] + ["logits"]


def test_run_from_a_fixture_tree(golden, tiny):
    subject = from_fixture(golden / "tiny.kdtr", "p0", engine_adapter(tiny))
    a, b, d = run(subject, "tree", 0)
    assert b.label.startswith("tree verify") and len(a.tokens) == len(b.tokens) > a.prompt_length + 1


def test_cli_reports_and_writes_json(golden, tmp_path, capsys):
    path = golden / "tiny.kdtr"
    report = tmp_path / "d.json"
    code, out, _ = run_main(["diverge", "--fixture", str(path), "--dtype", "bfloat16", "--tokens", "6",
                             "--json", str(report)], capsys)
    first = json.loads(report.read_text())["first"]
    assert code == 1 and "first divergence: layer" in out
    assert first["point"] in out and first["inputs_agree"] is True


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
])
def test_cli_bad_input_is_one_line(golden, capsys, args, message):
    args = [(golden / "kernels/tree_build.kdtr").as_posix() if a == "KERNEL" else
            (golden / "tiny.kdtr").as_posix() if a == "TINY" else a for a in args]
    code, _, err = run_main(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("kdtree: error: ") and message in lines[0], err
