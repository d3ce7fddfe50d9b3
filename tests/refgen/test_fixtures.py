"""The committed golden fixtures agree with their own contents, re-derived here
independently of refgen (ancestor walks, bit packing, the accept walk,
attention in float64); refgen's near-tie redraws and invariant refusal work;
and a bug planted in the reference shows up as drift against the goldens."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kdtr_format
import refgen.fixtures
import refgen.kernel_cases
import refgen.model
from kdtr_format import PRESETS, DDTreeConfig
from refgen.files import stored_hash_problem, write_fixture
from refgen.fixtures import FixtureError, FixturePlan, TraceSpec, model_fixture
from refgen.regen import LSE, compare, tensor_drift, tolerance_of
from refgen.kernel_cases import kernel_fixture

MODEL_FIXTURES = ("tiny", "tiny2")
KERNEL_FIXTURES = ("tree_build", "verify_attention", "accept_compact", "paged_kv")
ALL_FIXTURES = [f"{name}.kdtr" for name in MODEL_FIXTURES] + [f"kernels/{k}.kdtr" for k in KERNEL_FIXTURES]


# ---------------------------------------------------------------------------- independent derivations

def ancestor_visibility(parents: np.ndarray) -> np.ndarray:
    """bool [n+1, n+1]: row i sees i and every ancestor, by walking up."""
    size = len(parents)
    visibility = np.zeros((size, size), dtype=bool)
    for i in range(size):
        j = i
        while j != -1:
            visibility[i, j] = True
            j = parents[j]
    return visibility


def pack_rows(visibility: np.ndarray) -> np.ndarray:
    """bool [rows, cols] -> uint32 [rows, ceil(cols/32)], bit j % 32 of word j // 32."""
    rows, cols = visibility.shape
    words = np.zeros((rows, -(-cols // 32)), dtype=np.uint64)
    for i, j in zip(*np.nonzero(visibility)):
        words[i, j // 32] |= np.uint64(1 << (j % 32))
    return words.astype(np.uint32)


def walk(parents: np.ndarray, tokens: np.ndarray, choices: np.ndarray) -> tuple[list[int], int]:
    """The accept walk: follow the child whose token is the current node's choice."""
    path = [0]
    while True:
        child = [j for j in range(1, len(parents)) if parents[j] == path[-1] and tokens[j] == choices[path[-1]]]
        if not child:
            return path, int(choices[path[-1]])
        path.append(child[0])


def check_topk(draft: np.ndarray, topk_lp: np.ndarray, topk_id: np.ndarray) -> None:
    """Top-k of float32-rounded float64 log-probs: descending, equal values by smaller id."""
    x = draft.astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    lp = (x - peak - np.log(np.exp(x - peak).sum(axis=1, keepdims=True))).astype(np.float32)
    ids = np.broadcast_to(np.arange(x.shape[1]), x.shape)
    order = np.lexsort((ids, -lp), axis=1)[:, :topk_id.shape[1]]
    np.testing.assert_array_equal(topk_id, order)
    np.testing.assert_allclose(topk_lp, np.take_along_axis(lp, order, axis=1), rtol=0, atol=1e-6)


def inverse_cdf(logits: np.ndarray, temperature: float, u: float) -> tuple[int, float]:
    """One sampled decision, re-derived: (the first id whose cumulative softmax(logits / T) exceeds
    u, capped at the last id of nonzero probability; 4 T times u's distance to that id's interval)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    cdf = np.cumsum(p / p.sum())
    above = np.flatnonzero(cdf > u)
    c = int(above[0]) if above.size else int(np.flatnonzero(p > 0)[-1])
    low = cdf[c - 1] if c > 0 else 0.0
    return c, 4 * temperature * max(min(u - low, cdf[c] - u), 0.0)


def top2_gap(logits: np.ndarray) -> np.ndarray:
    ordered = np.sort(logits, axis=-1)
    return ordered[..., -1] - ordered[..., -2]


def check_tree(parents, tokens, depths, ranks, scores, topk_lp, topk_id, budget, start, positions,
               visibility_bits) -> None:
    """A built tree against its top-k: shape, pop rule invariants, encodings."""
    L, K = topk_lp.shape
    possible = sum(K ** d for d in range(1, L + 1))
    assert len(parents) == min(budget, possible) + 1
    assert parents[0] == -1 and depths[0] == 0 and scores[0] == 0.0
    for i in range(1, len(parents)):
        p, d, r = parents[i], depths[i], ranks[i]
        assert 0 <= p < i and d == depths[p] + 1
        assert tokens[i] == topk_id[d - 1, r]
        assert scores[i] == scores[p] + np.float64(topk_lp[d - 1, r])      # exactly
    siblings = {}
    for i in range(1, len(parents)):
        assert (parents[i], tokens[i]) not in siblings
        siblings[(parents[i], tokens[i])] = i
    np.testing.assert_array_equal(positions, start + depths)
    np.testing.assert_array_equal(visibility_bits, pack_rows(ancestor_visibility(parents)))


def assert_regenerates(committed: np.ndarray, row: int, recomputed: np.ndarray) -> None:
    """Row `row` of a committed log-sum-exp tensor, recomputed here: within what a regeneration
    allows (refgen.regen: REGEN_REL of the tensor's largest value)."""
    committed = np.asarray(committed)
    assert tensor_drift(committed[row], recomputed, tolerance_of(LSE, committed, None)) is None


def documented_hash(metadata: dict, reader: kdtr_format.Reader) -> str:
    """docs/fixtures.md's content_hash, computed here from the rule as written."""
    digest = hashlib.sha256()
    body = {k: v for k, v in metadata.items() if k != "content_hash"}
    digest.update(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    for name in sorted(reader.names(), key=lambda n: n.encode()):
        digest.update(np.ascontiguousarray(reader[name]).tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- every file

@pytest.mark.parametrize("relative", ALL_FIXTURES)
def test_content_hash_matches_the_documented_rule(committed_golden, golden, relative):
    for directory in (committed_golden, golden):                      # slim as committed, and full
        with kdtr_format.open(directory / relative) as reader:
            reader.verify()
            meta = reader.metadata
            assert meta["kdtree_fixture"] == 1
            assert meta["content_hash"] == documented_hash(meta, reader)
            assert stored_hash_problem(reader) is None
            assert set(meta["generator"]) == {"name", "version", "numpy", "seed"}


# ---------------------------------------------------------------------------- model fixtures

@pytest.mark.parametrize("preset", MODEL_FIXTURES)
def test_model_fixture_matches_its_preset_and_margins(open_golden, preset):
    f = open_golden(f"{preset}.kdtr")
    meta = f.metadata
    assert meta["kind"] == "model" and meta["source"] == "preset"
    assert meta["config"] == PRESETS[preset].to_dict()
    threshold = meta["margin_threshold"]
    assert threshold == pytest.approx(1e-3 * meta["logit_scale"])
    decisions = []
    for p in meta["prompts"]:
        prefix = f"prompts/{p['name']}"
        tokens, ar_tokens, margins = f[f"{prefix}/tokens"], f[f"{prefix}/ar/tokens"], f[f"{prefix}/ar/margins"]
        prefill = f[f"{prefix}/prefill_logits"]
        assert len(tokens) == p["length"] and prefill.shape == (p["length"], PRESETS[preset].vocab_size)
        assert ar_tokens[0] == np.argmax(prefill[-1])
        assert margins[0] == pytest.approx(top2_gap(prefill[-1]), rel=1e-12)
        assert f[f"{prefix}/ar/target_forwards"] == len(ar_tokens)
        decisions.extend(margins)
    for t in meta["traces"]:
        for r in range(t["rounds"]):
            rp = f"traces/{t['name']}/rounds/{r}"
            decisions.extend(f[f"{rp}/margins"])
    assert min(decisions) >= threshold
    assert meta["min_margin"] == pytest.approx(min(decisions), rel=1e-12)
    kinds = {"logits", "logprobs", "scores"}
    assert set(meta["tolerances"]) == kinds and set(meta["bf16"]["tolerances_bf16"]) == kinds


@pytest.mark.parametrize("preset", MODEL_FIXTURES)
def test_model_fixture_traces_are_self_consistent(open_golden, preset):
    f = open_golden(f"{preset}.kdtr")
    meta = f.metadata
    V = meta["config"]["vocab_size"]
    threshold = meta["margin_threshold"]
    prompts = {p["name"]: p for p in meta["prompts"]}
    covered = {"budget0": False, "budget1": False, "unfillable": False, "non_prefix": False, "random": False,
               "sampled": False, "sampled_non_prefix": False, "sampled_multi_token": False}
    for t in meta["traces"]:
        ddtree = DDTreeConfig.from_dict(t["ddtree"])
        L, budget, K, T = ddtree.depth, ddtree.budget, min(ddtree.budget, V), ddtree.temperature
        prefix = f"traces/{t['name']}"
        ar_tokens = f[f"prompts/{t['prompt']}/ar/tokens"]
        tokens = f[f"{prefix}/tokens"]
        assert f[f"{prefix}/target_forwards"] == 1 + t["rounds"] == t["target_forwards"]
        start = prompts[t["prompt"]]["length"]
        if T == 0:
            np.testing.assert_array_equal(tokens, ar_tokens[:t["max_new_tokens"]])        # the invariant
            root, margins = ar_tokens[0], [None]
        else:
            last = f[f"prompts/{t['prompt']}/prefill_logits"][-1]
            root, margin = inverse_cdf(last, T, float(f[f"{prefix}/prefill_uniform"]))
            margins = [margin]
        committed = [root]
        for r in range(t["rounds"]):
            def g(name: str) -> np.ndarray:
                return f[f"{prefix}/rounds/{r}/{name}"]

            assert g("start") == start and g("root") == root
            draft, topk_lp, topk_id = g("draft_logits"), g("topk_lp"), g("topk_id")
            assert draft.shape == (L, V) and draft.dtype == np.float32 and topk_lp.shape == (L, K)
            check_topk(draft, topk_lp, topk_id)
            parents, tree_tokens = g("parents"), g("tokens")
            assert tree_tokens[0] == root
            check_tree(parents, tree_tokens, g("depths"), g("ranks"), g("scores"), topk_lp, topk_id,
                       budget, start, g("positions"), g("visibility_bits"))
            verify_logits = g("verify_logits")
            assert verify_logits.shape == (len(parents), V)
            if T == 0:
                np.testing.assert_array_equal(g("choices"), np.argmax(verify_logits, axis=1))
                np.testing.assert_allclose(g("margins"), top2_gap(verify_logits), rtol=1e-12)
            else:
                uniforms = g("uniforms")
                assert uniforms.shape == (len(parents),) and ((0 <= uniforms) & (uniforms < 1)).all()
                sampled = [inverse_cdf(row, T, u) for row, u in zip(verify_logits, uniforms)]
                np.testing.assert_array_equal(g("choices"), [c for c, _ in sampled])
                np.testing.assert_allclose(g("margins"), [m for _, m in sampled], rtol=1e-6, atol=1e-12)
                assert g("margins").min() >= threshold
            path, next_root = walk(parents, tree_tokens, g("choices"))
            np.testing.assert_array_equal(g("accepted"), path)
            assert g("next_root") == next_root
            np.testing.assert_array_equal(g("compaction_src"), start + np.array(path))
            assert f[f"{prefix}/acceptance_lengths"][r] == len(path)
            covered["non_prefix"] |= path != list(range(len(path)))
            covered["sampled_non_prefix"] |= T > 0 and path != list(range(len(path)))
            covered["sampled_multi_token"] |= T > 0 and len(path) > 2
            committed += [*tree_tokens[path[1:]], next_root]
            margins += list(g("margins")[path])
            start, root = start + len(path), next_root
        np.testing.assert_array_equal(committed[:len(tokens)], tokens)
        assert len(committed) >= len(tokens)
        if T > 0:
            np.testing.assert_allclose(f[f"{prefix}/margins"], margins[:len(tokens)], rtol=1e-6, atol=1e-12)
            assert not np.array_equal(tokens, ar_tokens[:len(tokens)])     # it really sampled
        covered["budget0"] |= budget == 0
        covered["budget1"] |= budget == 1
        covered["unfillable"] |= budget > sum(K ** d for d in range(1, L + 1))
        covered["random"] |= t["drafter"]["kind"] == "random"
        covered["sampled"] |= T > 0
    assert all(covered.values()), covered


# The adversarial sampling cases, by hand: the root's choice, the accepted path, the next root.
SAMPLE_CASES_EXPECTED = {
    "u_zero": (1, [0, 2], 5),          # u = 0: token 0 has p = 0; the first token of p > 0 is 1 (node 2)
    "u_boundary": (9, [0, 4], 11),     # u = cdf[2] = 0.5: cdf > u strictly, so 9 (10 has p = 0); then 11
    "u_max": (9, [0, 4], 3),           # u = 1 - 2^-53 >= the rounded cdf of 10 x 1/10: the last p > 0, 9
}


@pytest.mark.parametrize("preset", MODEL_FIXTURES)
def test_adversarial_sampling_cases(open_golden, preset):
    f = open_golden(f"{preset}.kdtr")
    cases = {c["name"]: c for c in f.metadata["sample_cases"]}
    assert set(cases) == set(SAMPLE_CASES_EXPECTED)
    for name, (root_choice, accepted, next_root) in SAMPLE_CASES_EXPECTED.items():
        def g(tensor: str) -> np.ndarray:
            return f[f"sample_cases/{name}/{tensor}"]

        logits, uniforms, choices = g("logits"), g("uniforms"), g("choices")
        assert logits.dtype == np.float64 and logits.shape == (len(g("parents")), f.metadata["config"]["vocab_size"])
        assert choices[0] == root_choice and g("accepted").tolist() == accepted and g("next_root") == next_root
        assert np.isfinite(logits[np.arange(len(choices)), choices]).all()      # never a token of probability 0
        assert choices.tolist() == [inverse_cdf(row, cases[name]["temperature"], u)[0]
                                    for row, u in zip(logits, uniforms)]
    assert f["sample_cases/u_zero/uniforms"][0] == 0.0
    assert f["sample_cases/u_max/uniforms"][0] == 1.0 - 2.0 ** -53
    assert not np.isfinite(f["sample_cases/u_zero/logits"][0, 0])              # token 0: probability 0
    assert f["sample_cases/u_zero/tokens"][1] == 0                               # ... and a child of the root


# ---------------------------------------------------------------------------- kernel cases

def eagle_lists(parents: np.ndarray) -> tuple[list[int], list[int]]:
    """(first_child, next_sibling): the smallest child, the next larger index under the same parent."""
    size = range(len(parents))
    first_child = [next((j for j in size if j > 0 and parents[j] == i), -1) for i in size]
    next_sibling = [next((j for j in size if j > i and parents[j] == parents[i]), -1) if i else -1 for i in size]
    return first_child, next_sibling


def test_tree_build_cases(open_golden):
    f = open_golden("kernels/tree_build.kdtr")
    for case in f.metadata["cases"]:
        def g(name: str) -> np.ndarray:
            return f[f"cases/{case['name']}/{name}"]

        parents = g("parents")
        assert g("tokens")[0] == -1 and case["nodes"] == len(parents)
        check_tree(parents, g("tokens"), g("depths"), g("ranks"), g("scores"), g("topk_lp"), g("topk_id"),
                   case["budget"], case["start"], g("positions"), g("visibility_bits"))
        first_child, next_sibling = eagle_lists(parents)
        np.testing.assert_array_equal(g("first_child"), first_child)
        np.testing.assert_array_equal(g("next_sibling"), next_sibling)
        if case["logits"] != "hand":
            assert g("draft_logits").shape == (case["depth"], case["vocab"])
            assert case["k"] == min(case["budget"], case["vocab"])
            check_topk(g("draft_logits"), g("topk_lp"), g("topk_id"))
    by_name = {c["name"]: c for c in f.metadata["cases"]}
    assert by_name["budget0"]["nodes"] == 1 and by_name["budget1"]["nodes"] == 2
    assert by_name["beyond_possible"]["nodes"] == 1 + 3 + 9 + 27
    assert by_name["k_capped"]["k"] == 5 and by_name["depth0"]["nodes"] == 1
    assert f["cases/random_l15/visibility_bits"].shape[1] == 4


def test_verify_attention_cases_match_float64_attention(open_golden):
    f = open_golden("kernels/verify_attention.kdtr")
    for case in f.metadata["cases"]:
        def g(name: str) -> np.ndarray:
            return f[f"cases/{case['name']}/{name}"]

        context, sizes, q_offsets, kv_offsets, bits = (g(n) for n in ("context", "tree_sizes", "q_offsets",
                                                                      "kv_offsets", "visibility_bits"))
        for suffix, rounding in (("", lambda x: x), ("_bf16", bf16_values)):
            q_lat, q_pe, c_kv, k_pe = (rounding(g(n)).astype(np.float64) for n in ("q_lat", "q_pe", "c_kv", "k_pe"))
            assert q_lat.shape[1:] == (case["heads"], case["kv_lora_rank"])
            read = np.zeros(len(c_kv), dtype=bool)
            for b in range(case["batch"]):
                keys = slice(kv_offsets[b], kv_offsets[b] + context[b] + sizes[b])
                read[keys] = True
                for i in range(sizes[b]):
                    t = q_offsets[b] + i
                    row = [(int(bits[t, j // 32]) >> (j % 32)) & 1 for j in range(32 * bits.shape[1])]
                    assert row[i] == 1 and row[0] == 1 and not any(row[sizes[b]:])
                    visible = np.concatenate([np.ones(context[b], dtype=bool), np.array(row[:sizes[b]], dtype=bool)])
                    scores = (np.einsum("hr,sr->hs", q_lat[t], c_kv[keys]) +
                              np.einsum("hr,sr->hs", q_pe[t], k_pe[keys]))[:, visible] * case["scale"]
                    peak = scores.max(axis=1, keepdims=True)
                    weights = np.exp(scores - peak)
                    lse = peak[:, 0] + np.log(weights.sum(axis=1))
                    o = (weights / weights.sum(axis=1, keepdims=True)) @ c_kv[keys][visible]
                    assert_regenerates(g("lse" + suffix), t, lse)
                    np.testing.assert_allclose(g("o_lat" + suffix)[t], o, rtol=1e-6, atol=1e-6)
            assert (g("c_kv")[~read] == refgen.kernel_cases.JUNK).all()
    dims = {(c["heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]) for c in f.metadata["cases"]}
    assert (64, 512, 64) in dims


def bf16_values(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 values (ties to even), as float32."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def paged_rows(pool: np.ndarray, table_row: np.ndarray, length: int) -> np.ndarray:
    """pool [P, page, w], one request's block-table row -> its logical rows [length, w]."""
    page = pool.shape[1]
    return np.stack([pool[table_row[s // page], s % page] for s in range(length)])


def paged_cases(f, op: str) -> list[dict]:
    return [case for case in f.metadata["cases"] if case["op"] == op]


def check_paging(case: dict, table: np.ndarray, lengths: list[int], sharer_starts: list[int]) -> set[int]:
    """Block-table structure: each request holds exactly its pages, -1 past them, pages out of
    order, shared pages only between requests 0 and 1 and only below both starts -> the pages held."""
    page = case["page_size"]
    held: dict[int, list[tuple[int, int]]] = {}
    for b, length in enumerate(lengths):
        count = -(-length // page)
        assert (table[b, :count] >= 0).all() and (table[b, count:] == -1).all()
        for j, p in enumerate(table[b, :count].tolist()):
            held.setdefault(p, []).append((b, j))
    shared = sorted(p for p, owners in held.items() if len(owners) > 1)
    assert shared == case["shared_pages"]
    for p in shared:
        owners = held[p]
        assert [b for b, _ in owners] == [0, 1] and owners[0][1] == owners[1][1]
        assert (owners[0][1] + 1) * page <= min(sharer_starts)           # context slots only
    assert any((np.diff(table[b][table[b] >= 0]) < 0).any() for b in range(len(lengths)))    # out of order
    return set(held)


def test_paged_attention_cases_match_float64_attention_through_the_block_table(open_golden):
    f = open_golden("kernels/paged_kv.kdtr")
    cases = paged_cases(f, "attention")
    assert {c["page_size"] for c in cases} == {1, 3, 16, 64}
    for case in cases:
        def g(name: str) -> np.ndarray:
            return f[f"cases/{case['name']}/{name}"]

        c_pool, k_pool, table = g("c_kv_pages"), g("k_pe_pages"), g("block_table")
        context, sizes, q_offsets, bits = (g(n) for n in ("context", "tree_sizes", "q_offsets", "visibility_bits"))
        lengths = (context + sizes).tolist()
        held = check_paging(case, table, lengths, context[:2].tolist())
        if case["shared_pages"]:
            assert case["batch"] >= 2
        read = np.zeros(c_pool.shape[:2], dtype=bool)
        for b, length in enumerate(lengths):
            for s in range(length):
                read[table[b, s // case["page_size"]], s % case["page_size"]] = True
            for suffix, rounding in (("", lambda x: x), ("_bf16", bf16_values)):
                c_kv, k_pe = (rounding(paged_rows(pool, table[b], length)).astype(np.float64)
                              for pool in (c_pool, k_pool))
                q_lat, q_pe = (rounding(g(n)).astype(np.float64) for n in ("q_lat", "q_pe"))
                for i in range(sizes[b]):
                    t = q_offsets[b] + i
                    row = [(int(bits[t, j // 32]) >> (j % 32)) & 1 for j in range(32 * bits.shape[1])]
                    visible = np.concatenate([np.ones(context[b], dtype=bool), np.array(row[:sizes[b]], dtype=bool)])
                    scores = (np.einsum("hr,sr->hs", q_lat[t], c_kv)
                              + np.einsum("hr,sr->hs", q_pe[t], k_pe))[:, visible] * case["scale"]
                    peak = scores.max(axis=1, keepdims=True)
                    weights = np.exp(scores - peak)
                    assert_regenerates(g("lse" + suffix), t, peak[:, 0] + np.log(weights.sum(axis=1)))
                    np.testing.assert_allclose(g("o_lat" + suffix)[t],
                                               (weights / weights.sum(axis=1, keepdims=True)) @ c_kv[visible],
                                               rtol=1e-6, atol=1e-6)
        assert (c_pool[~read] == refgen.kernel_cases.JUNK).all() and (k_pool[~read] == refgen.kernel_cases.JUNK).all()
        assert len(held) < c_pool.shape[0]                                  # spare pages nobody holds


def test_paged_compaction_cases_move_only_the_requests_own_slots(open_golden):
    f = open_golden("kernels/paged_kv.kdtr")
    cases = paged_cases(f, "compact")
    assert {c["page_size"] for c in cases} == {1, 3, 16, 64} and all(c["shared_pages"] for c in cases)
    prefixes = set()
    for case in cases:
        def g(name: str) -> np.ndarray:
            return f[f"cases/{case['name']}/{name}"]

        table, starts, accepted, offsets = g("block_table"), g("starts"), g("accepted"), g("accept_offsets")
        lengths = [int(s) + n for s, n in zip(starts, case["nodes"])]
        check_paging(case, table, lengths, starts[:2].tolist())
        page = case["page_size"]
        for name in ("c_kv", "k_pe"):
            expected = g(f"{name}_pages").copy()
            for b in range(case["batch"]):
                path = accepted[offsets[b]:offsets[b + 1]].tolist()
                assert path[0] == 0 and path == sorted(set(path))
                prefixes.add(path == list(range(len(path))))
                for k, node in enumerate(path):
                    dst, src = starts[b] + k, starts[b] + node
                    expected[table[b, dst // page], dst % page] = expected[table[b, src // page], src % page]
            np.testing.assert_array_equal(g(f"{name}_after"), expected)
        after = g("c_kv_after")
        for p in case["shared_pages"] + sorted(set(range(after.shape[0])) - set(table[table >= 0].tolist())):
            np.testing.assert_array_equal(after[p], g("c_kv_pages")[p])
    assert prefixes == {True, False}


def test_accept_compact_cases(open_golden):
    f = open_golden("kernels/accept_compact.kdtr")
    prefixes = set()
    for case in f.metadata["cases"]:
        def g(name: str) -> np.ndarray:
            return f[f"cases/{case['name']}/{name}"]

        path, next_root = walk(g("parents"), g("tokens"), g("choices"))
        np.testing.assert_array_equal(g("accepted"), path)
        assert g("next_root") == next_root
        for cache in ("c_kv", "k_pe"):
            expected = g(cache).copy()
            start = case["start"]
            for k, node in enumerate(path):
                expected[start + k] = expected[start + node]
            np.testing.assert_array_equal(g(f"{cache}_after"), expected)
        prefixes.add(case["prefix"])
    assert prefixes == {True, False}
    assert list(f["cases/non_prefix/accepted"]) == [0, 2, 5]


# ---------------------------------------------------------------------------- generator behaviour

SMALL_PLAN = FixturePlan(prompt_lengths=(6,), ar_new_tokens=4,
                         traces=(TraceSpec("t0", 0, "oracle", 0.9, DDTreeConfig(block_size=3, budget=4), 4),))


AR_ONLY = FixturePlan(prompt_lengths=(6,), ar_new_tokens=4, traces=())


def smallest_margins(fixture) -> tuple[float, float]:
    """(smallest AR margin, smallest tree-node margin) of a SMALL_PLAN fixture."""
    tree = [v.min() for k, v in fixture.tensors.items() if k.startswith("traces/") and k.endswith("/margins")]
    return fixture.tensors["prompts/p0/ar/margins"].min(), min(tree, default=np.inf)


def test_a_prompt_whose_margin_is_too_small_is_redrawn(monkeypatch):
    cfg = PRESETS["tiny2"]
    first = model_fixture(cfg, "tiny2", seed=5, plan=AR_ONLY, bf16_plan=None)
    assert first.metadata["prompts"][0]["draw"] == 0
    # Demand a margin just above what draw 0 reached: draw 0 is refused, a later draw kept.
    ar_margin, _ = smallest_margins(first)
    monkeypatch.setattr(refgen.fixtures, "MARGIN_REL", ar_margin * 1.0001 / first.metadata["logit_scale"])
    redrawn = model_fixture(cfg, "tiny2", seed=5, plan=AR_ONLY, bf16_plan=None).metadata
    assert redrawn["prompts"][0]["draw"] >= 1
    assert redrawn["prompts"][0]["seed"] != first.metadata["prompts"][0]["seed"]
    assert redrawn["min_margin"] >= redrawn["margin_threshold"] > ar_margin


def test_a_drafter_whose_tree_has_a_near_tie_is_redrawn(monkeypatch):
    cfg = PRESETS["tiny2"]
    first = model_fixture(cfg, "tiny2", seed=3, plan=SMALL_PLAN, bf16_plan=None)
    ar_margin, tree_margin = smallest_margins(first)
    assert tree_margin < ar_margin            # seed 3: an off-path node is the closest call
    monkeypatch.setattr(refgen.fixtures, "MARGIN_REL", tree_margin * 1.0001 / first.metadata["logit_scale"])
    redrawn = model_fixture(cfg, "tiny2", seed=3, plan=SMALL_PLAN, bf16_plan=None).metadata
    assert redrawn["prompts"][0]["draw"] == 0 and redrawn["traces"][0]["drafter"]["draw"] >= 1
    assert redrawn["min_margin"] >= redrawn["margin_threshold"] > tree_margin


def test_impossible_margins_and_gaps_end_in_a_clear_error(monkeypatch):
    monkeypatch.setattr(refgen.fixtures, "MAX_DRAWS", 2)
    with monkeypatch.context() as mp:
        mp.setattr(refgen.fixtures, "MARGIN_REL", 1e6)
        with pytest.raises(FixtureError, match="prompt p0: no draw out of 2"):
            model_fixture(PRESETS["tiny2"], "tiny2", plan=SMALL_PLAN, bf16_plan=None)
    monkeypatch.setattr(refgen.fixtures, "TOPK_GAP_MIN", 1e3)
    with pytest.raises(FixtureError, match="trace t0: no drafter seed"):
        model_fixture(PRESETS["tiny2"], "tiny2", plan=SMALL_PLAN, bf16_plan=None)


def test_a_trace_that_breaks_the_invariant_is_refused(monkeypatch):
    real = refgen.fixtures.ddtree_decode

    def off_by_one(*args, **kwargs):
        result = real(*args, **kwargs)
        result.tokens[-1] = (result.tokens[-1] + 1) % PRESETS["tiny2"].vocab_size
        return result

    monkeypatch.setattr(refgen.fixtures, "ddtree_decode", off_by_one)
    with pytest.raises(FixtureError, match="trace t0: DDTree tokens .* refusing"):
        model_fixture(PRESETS["tiny2"], "tiny2", plan=SMALL_PLAN, bf16_plan=None)


def test_a_plan_beyond_max_position_embeddings_names_the_field():
    plan = FixturePlan(prompt_lengths=(600,), ar_new_tokens=4, traces=())
    with pytest.raises(FixtureError, match="max_position_embeddings"):
        model_fixture(PRESETS["tiny2"], "tiny2", plan=plan, bf16_plan=None)


# ---------------------------------------------------------------------------- planted bugs

def regenerate_and_compare(fixture, committed_path: Path, tmp_path: Path) -> list[str]:
    write_fixture(tmp_path / "regenerated.kdtr", fixture)
    with kdtr_format.open(committed_path) as committed, \
            kdtr_format.open(tmp_path / "regenerated.kdtr") as regenerated:
        return compare(committed, regenerated)


def test_planted_routing_bug_drifts_from_the_golden_logits(committed_golden, tmp_path, monkeypatch):
    """Dropping routed_scaling_factor in route changes every MoE layer's output."""
    ar_only = FixturePlan(prompt_lengths=(5,), ar_new_tokens=2, traces=())   # p0 as committed, shorter

    def drift() -> list[str]:
        fixture = model_fixture(PRESETS["tiny"], "tiny", plan=ar_only, bf16_plan=None)
        return regenerate_and_compare(fixture, committed_golden / "tiny.kdtr", tmp_path)

    drift_line = "prompts/p0/prefill_logits:"
    assert not any(line.startswith(drift_line) for line in drift())

    real_route = refgen.model.route

    def unscaled_route(cfg, x, gate, bias):
        idx, weight = real_route(cfg, x, gate, bias)
        return idx, weight / cfg.routed_scaling_factor

    monkeypatch.setattr(refgen.model, "route", unscaled_route)
    planted = drift()
    assert any(line.startswith(drift_line) and "drift beyond" in line for line in planted), planted


def test_planted_sibling_score_bug_drifts_from_the_golden_trees(committed_golden, tmp_path, monkeypatch):
    """Scoring every sibling with the first sibling's log-prob changes scores and shapes."""
    committed = committed_golden / "kernels/tree_build.kdtr"
    assert regenerate_and_compare(kernel_fixture("tree_build"), committed, tmp_path) == []
    real_build = refgen.kernel_cases.build_tree

    def first_sibling_scores(topk_lp, topk_id, budget):
        return real_build(np.repeat(topk_lp[:, :1], topk_lp.shape[1], axis=1), topk_id, budget)

    monkeypatch.setattr(refgen.kernel_cases, "build_tree", first_sibling_scores)
    planted = regenerate_and_compare(kernel_fixture("tree_build"), committed, tmp_path)
    assert any(line.startswith("cases/random/scores:") for line in planted), planted
    assert any(line.startswith("cases/random/parents:") for line in planted), planted


def test_regeneration_is_deterministic_in_memory():
    a, b = kernel_fixture("accept_compact", seed=3), kernel_fixture("accept_compact", seed=3)
    assert a.metadata == b.metadata and a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].tobytes() == b.tensors[name].tobytes(), name
    assert kernel_fixture("accept_compact", seed=4).tensors["cases/random_b16/c_kv"].tobytes() != \
        a.tensors["cases/random_b16/c_kv"].tobytes()
