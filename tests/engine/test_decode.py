"""engine.decode and engine.drafters: the DDTree == AR invariant, batch independence,
replay of the golden traces, stop tokens, sampling, metrics and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kdtr_format
from kdtr_format import PRESETS, ConfigError, DDTreeConfig
from engine import metrics
from engine.decode import ar_decode, ddtree_decode
from engine.drafters import LayerSkipDrafter, OracleDrafter, RandomDrafter, ReplayDrafter
from engine.validate import Status, compare_tokens

# Margin below which a DDTree/AR divergence is a near-tie of float32 rounding, not a bug
# (the logits of these tiny models spread over a few units).
NEAR_TIE = 1e-4


def make_drafter(kind: str, case, prompts, ar_tokens):
    cfg = case.cfg
    if kind == "oracle":
        return OracleDrafter([list(p) + t for p, t in zip(prompts, ar_tokens)], cfg.vocab_size, 0.7, seed=3)
    if kind == "random":
        return RandomDrafter(cfg.vocab_size, seed=4)
    return LayerSkipDrafter(cfg, case.weights, 2)


def assert_same_as_ar(result, ar) -> None:
    """Every request's DDTree tokens equal its AR tokens, or differ only at a near-tie."""
    for b, (got, want) in enumerate(zip(result.requests, ar.requests)):
        check = compare_tokens("invariant", "tokens", got.tokens, want.tokens, want.margins, NEAR_TIE, f"request {b}")
        assert check.status in (Status.EXACT, Status.NEAR_TIE), check.detail


TINY_VOCAB = PRESETS["tiny"].vocab_size


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3),
       budget=st.sampled_from([0, 1, 3, 24, 40]),
       block_size=st.sampled_from([1, 2, 4, 7, 16]),
       drafter=st.sampled_from(["oracle", "random", "layerskip"]))
@example(prompts=[[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]], budget=40, block_size=16, drafter="oracle")    # deep trees
@example(prompts=[[8, 8, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11], [5]], budget=24, block_size=4, drafter="oracle")
def test_ddtree_greedy_equals_ar(model_zoo, prompts, budget, block_size, drafter):
    case = model_zoo.get("tiny")
    model = case.engine()
    ar = ar_decode(model, prompts, 10)
    result = ddtree_decode(model, make_drafter(drafter, case, prompts, ar.tokens), prompts,
                           DDTreeConfig(block_size=block_size, budget=budget), 10)
    assert_same_as_ar(result, ar)
    assert result.metrics.target_forwards <= ar.metrics.target_forwards


def test_ddtree_greedy_equals_ar_where_accepted_nodes_sit_off_the_chain(model_zoo):
    """Deep trees whose accepted paths hold siblings: nodes whose index is not their depth, so a
    position taken from the node index (or any mix-up of index and depth) changes the tokens."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [8, 8, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11]]
    ar = ar_decode(model, prompts, 24)
    drafter = OracleDrafter([p + t for p, t in zip(prompts, ar.tokens)], case.cfg.vocab_size, 0.7, seed=3)
    result = ddtree_decode(model, drafter, prompts, DDTreeConfig(block_size=16, budget=40), 24, record=True)
    assert_same_as_ar(result, ar)
    rounds = [r for request in result.requests for r in request.rounds]
    off_chain = [r for r in rounds if (r.accepted != torch.arange(len(r.accepted))).any()]
    assert len(off_chain) >= 3, "the case must accept nodes whose index differs from their depth"
    assert max(len(r.accepted) for r in rounds) >= 6, "the case must accept deep paths"


@pytest.mark.parametrize("preset", ["tiny2"])
def test_invariant_other_presets(model_zoo, preset):
    case = model_zoo.get(preset)
    model = case.engine()
    prompts = [[5, 9, 2, 7], [1, 3, 3, 8, 2, 6, 4, 11, 20]]
    ar = ar_decode(model, prompts, 8)
    for kind in ("oracle", "layerskip"):
        drafter = make_drafter(kind, case, prompts, ar.tokens) if kind == "oracle" else \
            LayerSkipDrafter(case.cfg, case.weights, 1)
        assert_same_as_ar(ddtree_decode(model, drafter, prompts, DDTreeConfig(5, 10), 8), ar)


def test_divergence_classifier():
    """A differing token is a near-tie only where the reference's margin is below the threshold."""
    want, margins = [4, 5, 6, 7], [2.0, 1e-6, 3.0, 3.0]
    assert compare_tokens("s", "t", [4, 5, 6, 7], want, margins, 1e-4).status is Status.EXACT
    near = compare_tokens("s", "t", [4, 9, 6, 7], want, margins, 1e-4)
    assert near.status is Status.NEAR_TIE and near.margin == 1e-6 and "at 1" in near.detail
    bug = compare_tokens("s", "t", [4, 5, 6, 1], want, margins, 1e-4)
    assert bug.status is Status.FAIL and bug.margin == 3.0
    # a near-tie and a real bug in one sequence: the bug decides
    assert compare_tokens("s", "t", [4, 9, 6, 1], want, margins, 1e-4).status is Status.FAIL


@pytest.mark.parametrize("kind", ["oracle", "random", "layerskip"])
def test_batch_independence(model_zoo, kind):
    """A request decodes the same tokens, in the same rounds, alone and in a mixed batch."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11]]
    ar = ar_decode(model, prompts, 12)
    ddtree = DDTreeConfig(block_size=4, budget=9)
    together = ddtree_decode(model, make_drafter(kind, case, prompts, ar.tokens), prompts, ddtree, 12,
                             budgets=[9, 2, 30])
    for b, prompt in enumerate(prompts):
        alone = ar_decode(model, [prompt], 12)
        assert alone.tokens[0] == ar.tokens[b]
        single = ddtree_decode(model, make_drafter(kind, case, [prompt], [ar.tokens[b]]), [prompt], ddtree, 12,
                               budgets=[[9, 2, 30][b]])
        assert single.tokens[0] == together.tokens[b]
        assert single.requests[0].acceptance_lengths == together.requests[b].acceptance_lengths


def test_replay_golden_trace_rounds(golden):
    """The engine's decode with the trace's own drafts reproduces every round exactly."""
    path = golden / "tiny.kdtr"
    with kdtr_format.open(path) as f:
        from engine.model import Transformer
        model = Transformer.from_fixture(path)
        traces = [t for t in f.metadata["traces"] if t["ddtree"]["temperature"] == 0]
        assert traces
        for t in traces:
            prefix = f"traces/{t['name']}"
            drafts = {int(f[f"{prefix}/rounds/{r}/start"]): f[f"{prefix}/rounds/{r}/draft_logits"]
                      for r in range(t["rounds"])}
            result = ddtree_decode(model, ReplayDrafter([drafts], model.cfg.vocab_size),
                                   [f[f"prompts/{t['prompt']}/tokens"]], DDTreeConfig.from_dict(t["ddtree"]),
                                   t["max_new_tokens"], record=True)
            request = result.requests[0]
            assert request.tokens == f[f"{prefix}/tokens"].tolist()
            assert request.acceptance_lengths == f[f"{prefix}/acceptance_lengths"].tolist()
            assert request.target_forwards == int(f[f"{prefix}/target_forwards"])
            assert len(request.rounds) == t["rounds"]
            for r, got in enumerate(request.rounds):
                rp = f"{prefix}/rounds/{r}"
                assert got.start == int(f[f"{rp}/start"]) and got.root == int(f[f"{rp}/root"])
                for name in ("topk_id", "parents", "tokens", "depths", "scores", "choices", "accepted"):
                    np.testing.assert_array_equal(getattr(got, name).numpy(), f[f"{rp}/{name}"],
                                                  err_msg=f"{t['name']} round {r} {name}")
                assert got.next_root == int(f[f"{rp}/next_root"])


def test_oracle_at_full_accuracy_accepts_whole_chains(model_zoo):
    """accuracy 1: the true continuation tops every depth, so a round commits L + 1 tokens."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompt = [10, 20, 30, 40]
    ar = ar_decode(model, [prompt], 21)
    drafter = OracleDrafter([prompt + ar.tokens[0]], case.cfg.vocab_size, accuracy=1.0, seed=0)
    result = ddtree_decode(model, drafter, [prompt], DDTreeConfig(block_size=5, budget=8), 21)
    assert result.tokens == ar.tokens
    assert result.requests[0].acceptance_lengths == [5, 5, 5, 5]
    assert result.metrics.target_forwards == 5


def test_a_calibrated_oracle_puts_its_hit_rate_into_the_tree(model_zoo):
    """Calibrated (confidence None), the true token's probability is the accuracy: at accuracy 1
    a 16-deep block under a budget of 64 commits whole chains; a fixed margin of 4 over noise
    gives the truth so little probability that the tree spends its budget on siblings."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompt = [10, 20, 30, 40]
    ar = ar_decode(model, [prompt], 48)
    lengths = {}
    for confidence in (None, 4.0):
        drafter = OracleDrafter([prompt + ar.tokens[0]], case.cfg.vocab_size, 1.0, seed=0, confidence=confidence)
        result = ddtree_decode(model, drafter, [prompt], DDTreeConfig(block_size=16, budget=64), 48)
        assert result.tokens == ar.tokens
        lengths[confidence] = result.requests[0].acceptance_lengths
    assert lengths[None] == [16, 16, 16]
    assert max(lengths[4.0]) < 16


def test_layerskip_with_every_layer_drafts_the_target_chain(model_zoo):
    """All layers: the drafter's greedy chain is the target's own AR continuation, round
    after round (this holds only if its cache reuse, positions and greedy steps are right)."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompts = [[7, 1, 7, 2, 9], [4, 4]]
    depth = 5
    ar = ar_decode(model, prompts, 16).tokens
    drafter = LayerSkipDrafter(case.cfg, case.weights, case.cfg.num_hidden_layers)
    for committed in (1, 4, 5, 9):          # growing contexts: the drafter reuses its cache
        contexts = [torch.tensor(p + t[:committed - 1]) for p, t in zip(prompts, ar)]
        roots = torch.tensor([t[committed - 1] for t in ar])
        logits = drafter.draft(contexts, roots, depth)
        assert logits.shape == (2, depth, case.cfg.vocab_size)
        for b in range(2):
            assert logits[b].argmax(-1).tolist() == ar[b][committed:committed + depth], (committed, b)


def test_stop_tokens_truncate_both_loops(model_zoo):
    case = model_zoo.get("tiny")
    model = case.engine()
    prompt = [1, 2, 3, 4, 5, 6]
    full = ar_decode(model, [prompt], 16).tokens[0]
    stop = full[6]
    expected = full[:full.index(stop) + 1]
    assert ar_decode(model, [prompt], 16, stop_tokens=[stop]).tokens[0] == expected
    drafter = OracleDrafter([prompt + full], case.cfg.vocab_size, 0.9, seed=1)
    assert ddtree_decode(model, drafter, [prompt], DDTreeConfig(6, 12), 16, stop_tokens=[stop]).tokens[0] == expected


def test_sampling_with_root_only_trees_is_ar_sampling(model_zoo):
    """Block size 1: a DDTree round is one sampled AR step drawing the same uniform."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompts = [[9, 8, 7], [1, 2, 3, 4, 5]]
    ar = ar_decode(model, prompts, 12, temperature=0.8, generator=torch.Generator().manual_seed(7))
    dd = ddtree_decode(model, None, prompts, DDTreeConfig(1, 5, temperature=0.8), 12,
                       generator=torch.Generator().manual_seed(7))
    assert dd.tokens == ar.tokens
    greedy = ar_decode(model, prompts, 12).tokens
    assert ar.tokens != greedy           # the sampled run really sampled


def test_sampling_is_reproducible_from_uniforms(model_zoo):
    case = model_zoo.get("tiny")
    model = case.engine()
    drafter = RandomDrafter(case.cfg.vocab_size, seed=2)
    ddtree = DDTreeConfig(4, 8, temperature=1.0)
    runs = [ddtree_decode(model, drafter, [[5, 6, 7]], ddtree, 10, generator=torch.Generator().manual_seed(11))
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens


def test_metrics(model_zoo):
    case = model_zoo.get("tiny")
    model = case.engine()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ar = ar_decode(model, prompts, 9)
    assert ar.metrics.tokens == 18 and ar.metrics.target_forwards == 9 and ar.metrics.mean_acceptance == 1.0
    assert all(r.target_forwards == 9 for r in ar.requests)
    drafter = OracleDrafter([p + t for p, t in zip(prompts, ar.tokens)], case.cfg.vocab_size, 1.0)
    dd = ddtree_decode(model, drafter, prompts, DDTreeConfig(4, 6), 9)
    m = dd.metrics
    assert m.target_forwards == m.rounds + 1 == 3            # 1 + 4 + 4 = 9 tokens
    assert [r.acceptance_lengths for r in dd.requests] == [[4, 4], [4, 4]]
    assert m.mean_acceptance == 4.0
    assert m.acceptance_histogram().tolist() == [0, 0, 0, 0, 4]
    assert all(m.stage_seconds[s] > 0 for s in ("prefill", "draft", "build", "compile", "verify", "accept",
                                                  "compact", "host"))
    assert ar.metrics.stage_seconds["host"] > 0


def test_a_round_charges_the_time_no_stage_took_to_host(monkeypatch):
    """Round from t = 0 to 10 with a verify stage from 1 to 3 and an accept from 4 to 5: verify
    2, accept 1, host the other 7; a second round adds to each."""
    clock = iter([0.0, 1.0, 3.0, 4.0, 5.0, 10.0, 20.0, 21.0, 22.0, 24.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = metrics.StageTimer("cpu")
    for _ in range(2):
        with timer.round():
            with timer("verify"):
                pass
            if timer.seconds["accept"] == 0:
                with timer("accept"):
                    pass
    assert (timer.seconds["verify"], timer.seconds["accept"], timer.seconds["host"]) == (3.0, 1.0, 10.0)


def test_bad_input(model_zoo):
    case = model_zoo.get("tiny")
    model = case.engine()
    cfg = case.cfg
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        ar_decode(model, [[1], []], 4)
    with pytest.raises(ValueError, match="outside"):
        ar_decode(model, [[1, cfg.vocab_size]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ar_decode(model, [[1]], 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ar_decode(model, [[1] * cfg.max_position_embeddings], 4)
    with pytest.raises(ValueError, match="budgets"):
        ddtree_decode(model, RandomDrafter(cfg.vocab_size), [[1]], DDTreeConfig(3, 4), 4, budgets=[-1])
    with pytest.raises(ConfigError, match="budget"):
        DDTreeConfig(3, -1)
    with pytest.raises(ValueError, match="needs a drafter"):
        ddtree_decode(model, None, [[1]], DDTreeConfig(3, 4), 4)
    with pytest.raises(ValueError, match="generator or per-round uniforms"):
        ddtree_decode(model, None, [[1]], DDTreeConfig(1, 4, temperature=1.0), 4)
    with pytest.raises(ValueError, match="accuracy"):
        OracleDrafter([[1]], cfg.vocab_size, accuracy=1.5)
    with pytest.raises(ValueError, match="num_layers"):
        LayerSkipDrafter(cfg, case.weights, cfg.num_hidden_layers + 1)


@pytest.mark.parametrize("loop", ["ar", "ddtree"])
def test_sampled_tokens_follow_the_target_distribution(model_zoo, loop):
    """512 independent requests of one prompt: how often the second token is the target's
    argmax given the first must match the target's own probability of it (within 4.5 sigma).
    A DDTree that favoured drafted tokens (the oracle drafts the greedy chain) fails this."""
    case = model_zoo.get("tiny")
    model = case.engine()
    prompt, batch, temperature = [11, 22, 33, 44, 55, 66], 512, 1.0
    greedy = ar_decode(model, [prompt], 4).tokens[0]
    generator = torch.Generator().manual_seed(5)
    if loop == "ar":
        result = ar_decode(model, [prompt] * batch, 2, temperature=temperature, generator=generator)
    else:
        drafter = OracleDrafter([prompt + greedy] * batch, case.cfg.vocab_size, accuracy=1.0)
        result = ddtree_decode(model, drafter, [prompt] * batch, DDTreeConfig(4, 8, temperature=temperature), 2,
                               generator=generator)
    first, second = torch.tensor(result.tokens).T
    m = len(prompt)
    tokens = torch.cat([torch.tensor(prompt).expand(batch, m), first[:, None]], dim=1)
    logits = model.forward(tokens, torch.arange(m + 1).expand(batch, m + 1),
                           torch.ones(m + 1, m + 1, dtype=torch.bool).tril().expand(batch, m + 1, m + 1),
                           torch.full((batch,), m + 1), torch.zeros(batch, dtype=torch.int64),
                           model.new_cache(batch, m + 1))[:, -1]
    p = torch.softmax(logits.double() / temperature, dim=-1)
    top_p = p.max(dim=-1).values
    observed = float((second == p.argmax(dim=-1)).sum())
    expected, sigma = float(top_p.sum()), float((top_p * (1 - top_p)).sum().sqrt())
    assert 0.05 < expected / batch < 0.95, "the statistic needs a target that is neither flat nor certain"
    assert abs(observed - expected) < 4.5 * sigma + 1, (observed, expected, sigma)
