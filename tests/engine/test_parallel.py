"""Tensor- and expert-parallel sharding (engine/parallel, docs/tensor-parallel.md) on the CPU with gloo.

The ranks are local processes, one `Gang` per world size (2 and 4) shared by the module's tests;
a rank job is a module-level function job(world, ...) whose result comes back to the test, which
compares it with the single-device engine computed here:

- the weight split (every weight's shards reassemble it) and `World.part`;
- logits equal to single-device logits within float32 reduction tolerance (tiny; tiny2, whose 3
  heads and 777 ids split unevenly, one rank holding no head at world size 4), both MoE
  dispatches; every rank holds the same bits;
- greedy AR tokens equal single-device tokens, DDTree == AR, a request alone == in a batch;
- vocab ties across rank boundaries go to the smaller id, through the gather the forward uses;
- an expert whose tokens all live on another rank (routing steered onto the last rank's experts);
- invariant mode: a token's logits bitwise the same alone and in a batch, DDTree == AR with the
  same margins (world size 4 is where the backend's own all-reduce order would break it);
- sharded validate passes at world sizes 2 and 4 on a small fixture generated here, its row of
  greedy ties across shard boundaries included (a planted argmax whose ties go to the larger id
  fails it);
- a failing or dying rank is reported, never a hang; `kdtree validate --tp`, spawned and
  under a torchrun environment, and its bad input.
- NCCL: world size 1 on one GPU (kimi-k2: K2's attention dims), TP-2 validate on two GPUs
  (skipped without them).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.decode import ar_decode, ddtree_decode
from engine.drafters import OracleDrafter
from engine.model import Transformer
from engine.parallel import Gang, World, shard_weights, weight_split
from engine.stages import TorchStages, top2_margins
from engine.validate.rows.engine import ENGINE_TIES
from kdtr_format import PRESETS, DDTreeConfig
from refgen.files import write_fixture
from refgen.fixtures import FixturePlan, TraceSpec, model_fixture
from refgen.weights import init_weights

SEED = 1234
SIZES = (2, 4)
CUDA_GPUS = torch.cuda.device_count()
SMALL_PLAN = FixturePlan(prompt_lengths=(6,), ar_new_tokens=8, traces=(
    TraceSpec("t0", 0, "oracle", 0.8, DDTreeConfig(block_size=4, budget=6), 8),
    TraceSpec("t1", 0, "target", None, DDTreeConfig(block_size=3, budget=4, temperature=0.6), 6)))
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2]              # the verified tree of `forwards`
_BUILT: dict = {}                                  # weights and engines of this process (a rank's, across jobs)


@pytest.fixture(scope="module")
def gangs():
    """-> get(size): the module's Gang of `size` CPU ranks, spawned on first use."""
    spawned: dict[int, Gang] = {}

    def get(size: int) -> Gang:
        if size not in spawned or not spawned[size].running:
            spawned[size] = Gang(size, "cpu")
        return spawned[size]
    yield get
    for gang in spawned.values():
        gang.close()


@pytest.fixture(scope="module")
def small_fixture(tmp_path_factory) -> Path:
    """A tiny2 model fixture with one prompt and two traces (one greedy, one sampled)."""
    path = tmp_path_factory.mktemp("parallel") / "tiny2-small.kdtr"
    write_fixture(path, model_fixture(PRESETS["tiny2"], "tiny2", seed=0, plan=SMALL_PLAN))
    return path


# ---------------------------------------------------------------------------- shared by ranks and tests

def weights(name: str) -> dict[str, np.ndarray]:
    if ("weights", name) not in _BUILT:
        _BUILT["weights", name] = init_weights(PRESETS[name], SEED)
    return _BUILT["weights", name]


def engine(world: World | None, name: str, **options) -> Transformer:
    """The Transformer of `name`'s seeded weights, sharded over `world` (None: one device), built once."""
    key = ("engine", name, world.size if world else 0, tuple(sorted(options.items())))
    if key not in _BUILT:
        _BUILT[key] = Transformer(PRESETS[name], weights(name), world=world, **options)
    return _BUILT[key]


def forwards(model: Transformer) -> list[np.ndarray]:
    """A ragged prefill of two requests (7 and 4 tokens), then a verify of a 7-node tree under
    each -> the real rows' logits: [7, V], [4, V], [7, V], [7, V]."""
    vocab, tree = model.cfg.vocab_size, len(TREE_PARENTS)
    rng = np.random.default_rng(7)
    depth, seen = [0] * tree, torch.eye(tree, dtype=torch.bool)
    for i in range(1, tree):
        depth[i] = depth[TREE_PARENTS[i]] + 1
        seen[i] |= seen[TREE_PARENTS[i]]
    lengths = torch.tensor([7, 4])
    calls = [(rng.integers(0, vocab, (2, 7)), torch.arange(7).expand(2, 7),
              torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7), lengths, torch.zeros(2, dtype=torch.int64)),
             (rng.integers(0, vocab, (2, tree)), lengths[:, None] + torch.tensor(depth), seen.expand(2, tree, tree),
              torch.tensor([tree, tree]), lengths)]
    cache = model.new_cache(2, 16)
    prefill, verify = (model.forward(*(torch.as_tensor(t).to(model.device) for t in call), cache).cpu()
                       for call in calls)
    return [prefill[0, :7].numpy(), prefill[1, :4].numpy(), verify[0].numpy(), verify[1].numpy()]


def assert_close_to_single_device(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Within float32 reduction tolerance (1e-5 of the logits' largest magnitude), the same argmax."""
    for g, w in zip(got, want):
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
        assert (g.argmax(-1) == w.argmax(-1)).all()


def assert_ranks_agree(results: list) -> None:
    """Every rank returned the same bits (the replicated activations and logits stay identical)."""
    first = results[0]
    for rank, other in enumerate(results[1:], 1):
        for a, b in zip(first, other):
            assert np.array_equal(a, b), f"rank {rank} differs from rank 0"


# ---------------------------------------------------------------------------- without processes

def test_part_splits_contiguously_in_rank_order():
    for size in (1, 2, 3, 4, 8):
        for n in range(0, 12):
            parts = [World(r, size, torch.device("cpu")).part(n) for r in range(size)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), parts
            sizes = [hi - lo for lo, hi in parts]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1, (n, size, sizes)


@pytest.mark.parametrize("size", [2, 4])
def test_every_weight_reassembles_from_its_shards(size):
    cfg = PRESETS["tiny2"]                                     # 3 heads, 777 ids: uneven at 2 and 4
    full = weights("tiny2")
    shards = [shard_weights(cfg, full, World(r, size, torch.device("cpu"))) for r in range(size)]
    for name, value in full.items():
        split = weight_split(cfg, name)
        pieces = [s[name].numpy() for s in shards]
        if split is None:
            assert all(np.array_equal(p, value) for p in pieces), name
            continue
        dim, units, width = split
        assert value.shape[dim] == units * width, name
        assert np.array_equal(np.concatenate(pieces, axis=dim), value), name
    assert [s["layers.0.attn.wo"].shape[1] for s in shards] == [cfg.v_head_dim * h for h in
                                                                ([2, 1] if size == 2 else [1, 1, 1, 0])]


# ---------------------------------------------------------------------------- logits, tokens, batches

def job_logits(world: World, name: str, moe: str) -> list[np.ndarray]:
    return forwards(engine(world, name, moe=moe))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name, moe", [("tiny", "grouped"), ("tiny", "dense"), ("tiny2", "grouped")])
def test_sharded_logits_equal_single_device_logits(gangs, size, name, moe):
    results = gangs(size).run(job_logits, name, moe)
    assert_ranks_agree(results)
    assert_close_to_single_device(results[0], forwards(engine(None, name, moe=moe)))


def decode_runs(model: Transformer) -> dict[str, list[list[int]]]:
    """AR greedy of two prompts batched and each alone, DDTree (oracle drafter) batched and alone."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (4, 9)]
    ar = ar_decode(model, prompts, 10)
    truth = [p + t for p, t in zip(prompts, ar.tokens)]
    ddtree = DDTreeConfig(block_size=4, budget=8)

    def drafter():
        return OracleDrafter(truth, model.cfg.vocab_size, accuracy=0.7, seed=5)
    return {"ar": ar.tokens,
            "ar alone": [ar_decode(model, [p], 10).tokens[0] for p in prompts],
            "ddtree": ddtree_decode(model, drafter(), prompts, ddtree, 10).tokens,
            "ddtree alone": [ddtree_decode(model, OracleDrafter([t], model.cfg.vocab_size, accuracy=0.7, seed=5),
                                           [p], ddtree, 10).tokens[0] for p, t in zip(prompts, truth)]}


def job_decode(world: World, name: str) -> dict[str, list[list[int]]]:
    return decode_runs(engine(world, name))


def test_sharded_greedy_tokens_ddtree_and_batches_equal_ar(gangs):
    results = gangs(4).run(job_decode, "tiny")
    assert all(r == results[0] for r in results)
    runs, single = results[0], decode_runs(engine(None, "tiny"))
    assert runs["ar"] == single["ar"], "sharded AR greedy tokens differ from one device's"
    for name in ("ar alone", "ddtree", "ddtree alone"):
        assert runs[name] == runs["ar"], f"{name} differs from AR batched under sharding"


# ---------------------------------------------------------------------------- vocab ties, remote experts

def tied_logits(size: int, vocab: int) -> np.ndarray:
    """[rows, vocab] float32 of small integers: row r ties its maximum at the two ids either side
    of rank boundary r; the last row ties rank 0's first id with the last rank's last id."""
    rng = np.random.default_rng(11)
    bounds = [World(r, size, torch.device("cpu")).part(vocab)[0] for r in range(1, size)]
    logits = rng.integers(0, 50, (len(bounds) + 1, vocab)).astype(np.float32)
    for row, b in enumerate(bounds):
        logits[row, [b - 1, b]] = 60.0
    logits[-1, [0, vocab - 1]] = 60.0
    return logits


def job_gather(world: World, logits: np.ndarray) -> tuple[np.ndarray, ...]:
    lo, hi = world.part(logits.shape[1])
    gathered = world.gather(torch.from_numpy(logits[:, lo:hi].copy()), logits.shape[1])
    return (gathered.numpy(), TorchStages().greedy_choices(gathered[None])[0].numpy(),
            top2_margins(gathered).numpy())


@pytest.mark.parametrize("size", SIZES)
def test_vocab_ties_across_rank_boundaries_go_to_the_smaller_id(gangs, size):
    vocab = PRESETS["tiny2"].vocab_size                        # 777: uneven shards
    logits = tied_logits(size, vocab)
    results = gangs(size).run(job_gather, logits)
    assert_ranks_agree(results)
    gathered, choices, margins = results[0]
    assert np.array_equal(gathered, logits), "the gathered logits are not the shards in rank order"
    bounds = [World(r, size, torch.device("cpu")).part(vocab)[0] for r in range(1, size)]
    assert choices.tolist() == [b - 1 for b in bounds] + [0]
    assert (margins == 0).all()


def remote_expert_weights(size: int) -> dict[str, np.ndarray]:
    """tiny's weights with every MoE layer's selection bias steering all tokens onto the experts
    of the last of `size` ranks (the bias steers selection only: the gate weights stay)."""
    cfg, w = PRESETS["tiny"], dict(weights("tiny"))
    lo, hi = World(size - 1, size, torch.device("cpu")).part(cfg.n_routed_experts)
    for name in w:
        if name.endswith("e_score_correction_bias"):
            w[name] = w[name].copy()
            w[name][lo:hi] += 10.0
    return w


def job_remote_experts(world: World | None, size: int, moe: str) -> tuple[list[np.ndarray], set[int]]:
    chosen: set[int] = set()

    def capture(name: str, layer: int, t: torch.Tensor) -> None:
        if name == "experts":
            chosen.update(t.flatten().tolist())
    model = Transformer(PRESETS["tiny"], remote_expert_weights(size), world=world, moe=moe, capture=capture)
    return forwards(model), chosen


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("moe", ["grouped", "dense"])
def test_an_expert_whose_tokens_all_live_on_another_rank(gangs, size, moe):
    results = gangs(size).run(job_remote_experts, size, moe)
    assert_ranks_agree([r[0] for r in results])
    lo, hi = World(size - 1, size, torch.device("cpu")).part(PRESETS["tiny"].n_routed_experts)
    chosen = results[0][1]
    assert chosen and chosen <= set(range(lo, hi)), f"routing not steered onto the last rank: {chosen}"
    assert_close_to_single_device(results[0][0], job_remote_experts(None, size, moe)[0])


# ---------------------------------------------------------------------------- invariant mode

def invariant_runs(model: Transformer) -> dict[str, object]:
    """A request's 9 tokens prefilled in one forward beside a 5-token companion, against the same
    request one token per forward alone; ar_decode against ddtree_decode (tokens and margins)."""
    rng = np.random.default_rng(5)
    vocab = model.cfg.vocab_size
    prompt, companion = rng.integers(0, vocab, 9), rng.integers(0, vocab, 9)
    cache = model.new_cache(2, 16)
    both = model.forward(torch.tensor(np.stack([prompt, companion])), torch.arange(9).expand(2, 9),
                         torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9), torch.tensor([9, 5]),
                         torch.zeros(2, dtype=torch.int64), cache)[0]
    alone_cache = model.new_cache(1, 16)
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    alone = torch.cat([model.forward(torch.tensor([[t]]), torch.tensor([[i]]), one, torch.tensor([1]),
                                     torch.tensor([i]), alone_cache)[0] for i, t in enumerate(prompt.tolist())])
    prompts = [prompt[:4].tolist(), companion[:7].tolist()]
    ar = ar_decode(model, prompts, 10)
    drafter = OracleDrafter([p + t for p, t in zip(prompts, ar.tokens)], vocab, accuracy=0.7, seed=5)
    dd = ddtree_decode(model, drafter, prompts, DDTreeConfig(block_size=4, budget=8), 10)
    return {"in batch": both.numpy(), "alone": alone.numpy(),
            "ar": [(r.tokens, r.margins) for r in ar.requests], "ddtree": [(r.tokens, r.margins) for r in dd.requests]}


def job_invariant(world: World) -> dict[str, object]:
    return invariant_runs(engine(world, "tiny", invariant=True))


def test_invariant_mode_holds_under_sharding(gangs):
    """At world size 4, where gloo's own all-reduce adds a row's partials in an order that
    depends on the row's place in the buffer (at 2 any order gives a + b)."""
    results = gangs(4).run(job_invariant)
    runs = results[0]
    assert all(np.array_equal(r["in batch"], runs["in batch"]) for r in results)
    assert np.array_equal(runs["in batch"], runs["alone"]), (
        f"{int((runs['in batch'] != runs['alone']).sum())} logits differ between the batch and one token alone")
    assert runs["ddtree"] == runs["ar"], "DDTree tokens or margins differ from AR in invariant mode"


# ---------------------------------------------------------------------------- validate, failures, CLI

def job_validate(world: World, path: str) -> tuple[bool, str, str, list[tuple[str, str]]]:
    from engine.validate import validate

    report = validate(None, path, world=world)
    return report.failed, report.implementation, report.summary(), [(c.name, c.status.value) for c in report.checks]


def assert_validate_passed(implementation: str, rows: list[tuple[str, str]], size: int) -> None:
    assert f"TP {size}" in implementation
    assert {status for name, status in rows if not name.startswith("capability ")} <= {
        "exact", "within tolerance", "near-tie"}, rows             # capability rows: what one file cannot check
    assert {"verify logits", "engine DDTree replay (batched)", "invariant DDTree == AR (layerskip)",
            ENGINE_TIES} <= {name for name, _ in rows}


class TiesToTheLargerId(TorchStages):
    def greedy_choices(self, logits):
        return logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1)


def job_tie_rows(world: World) -> list[tuple[str, str]]:
    """validate's greedy-ties row on this rank's shard of tiny2: with the engine's stages, then with
    an argmax whose ties go to the larger id -> [(status, detail)] of both."""
    from engine.adapter import TorchAdapter
    from engine.validate.rows.engine import ties_check

    adapter = TorchAdapter(world=world)
    adapter.model = engine(world, "tiny2")
    rows = [ties_check(adapter, "tiny2.kdtr")]
    adapter.stages = TiesToTheLargerId()
    rows.append(ties_check(adapter, "tiny2.kdtr"))
    return [(row.status.value, row.detail) for row in rows]


@pytest.mark.parametrize("size", SIZES)
def test_validate_checks_greedy_ties_across_shard_boundaries(gangs, size):
    """`kdtree validate --tp N`'s own row: ties either side of every shard boundary go to the
    smaller id; an argmax whose ties go to the larger id fails it, naming the first boundary."""
    results = gangs(size).run(job_tie_rows)
    assert all(r == results[0] for r in results)
    (status, detail), (planted, planted_detail) = results[0]
    assert status == "exact" and f"TP {size}: ties across its {size - 1} shard boundaries" in detail, detail
    first = World(1, size, torch.device("cpu")).part(PRESETS["tiny2"].vocab_size)[0]
    assert planted == "FAIL" and planted_detail.startswith(
        f"ids {first - 1}, {first} either side of the boundary of ranks 0 and 1 tie: chose {first}, expected "
        f"{first - 1}"), planted_detail


def test_sharded_validate_passes_at_world_size_4(gangs, small_fixture):
    """(World size 2: `kdtree validate --tp 2` below.)"""
    results = gangs(4).run(job_validate, str(small_fixture))
    assert all(r == results[0] for r in results), "the ranks' reports differ"
    failed, implementation, summary, rows = results[0]
    assert not failed, summary
    assert_validate_passed(implementation, rows, 4)


def job_fail_on(world: World, rank: int) -> int:
    if world.rank == rank:
        raise ValueError(f"planted failure on rank {rank}")
    return world.rank


def test_a_failing_rank_is_reraised_with_its_rank_and_the_gang_goes_on(gangs):
    gang = gangs(2)
    with pytest.raises(ValueError, match="planted failure on rank 1") as caught:
        gang.run(job_fail_on, 1)
    assert any("raised on rank 1" in note for note in caught.value.__notes__)
    assert gang.run(job_fail_on, -1) == [0, 1]


def kdtree(args: list[str], env: dict[str, str], monkeypatch, capfd) -> tuple[int, str, str]:
    """The CLI in this process with `env` set -> (exit status, stdout, stderr), the spawned
    ranks' output included (capfd captures the file descriptors they inherit). The CLI sets
    torch's CPU threads to 1, as the engine tests run anyway (tests/engine/conftest.py)."""
    from engine.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capfd.readouterr()
    return exit_info.value.code, out, err


def torchrun_env(size: int = 1, rank: int = 0) -> dict[str, str]:
    """The variables torchrun sets for a rank, with a free rendezvous port on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"WORLD_SIZE": str(size), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def test_validate_tp_2_spawns_its_ranks_and_passes(small_fixture, tmp_path, monkeypatch, capfd):
    path = tmp_path / "report.json"
    code, out, err = kdtree(["validate", "--tp", "2", "--fixtures", str(small_fixture), "--json", str(path)],
                            {}, monkeypatch, capfd)
    assert code == 0, out + err
    assert out.count("PASSED") == 1, "rank 1 printed too, or nobody did"
    report = json.loads(path.read_text())
    assert_validate_passed(report["implementation"], [(c["name"], c["status"]) for c in report["checks"]], 2)


def test_demo_tp_under_torchrun_reads_the_world_from_the_environment(small_fixture, monkeypatch, capfd):
    code, out, err = kdtree(["demo", "--tp", "1", "--fixture", str(small_fixture), "--max-new-tokens", "6",
                             "--budget", "4", "--block-size", "3"], torchrun_env(), monkeypatch, capfd)
    assert code == 0, out + err
    assert out.count("yes") == 3 and "NO" not in out


@pytest.mark.parametrize("args, env, message", [
    (["validate", "--tp", "0"], {}, "0 is not in the range x>=1"),
    (["validate", "--tp", "2", "--impl", "m:f"], {}, "--tp is a mode of the built-in engine"),
    (["validate", "--tp", "2", "--device", "cuda:1"], {}, "each rank takes the GPU of its local rank"),
    (["validate", "--tp", "9"], {}, "at most 8 ranks on the CPU"),
    (["demo", "--tp", "4"], torchrun_env(2), "--tp 4, but torchrun started 2 process(es)"),
    (["validate"], torchrun_env(2), "torchrun started 2 process(es): give --tp 2"),
    (["validate", "--tp", "2"], {**torchrun_env(2), "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_bad_tp_input_is_one_line(args, env, message, monkeypatch, capfd):
    code, _, err = kdtree(args, env, monkeypatch, capfd)
    assert code == 2 and err.count("\n") == 1 and message in err, err


# ---------------------------------------------------------------------------- NCCL (GPUs)

def job_cuda_logits(world: World, name: str) -> list[np.ndarray]:
    return forwards(Transformer(PRESETS[name], weights(name), device=world.device, world=world))


@pytest.mark.skipif(CUDA_GPUS < 1, reason="NCCL at world size 1: no CUDA GPU is visible")
def test_nccl_world_of_one_gpu_matches_single_device():
    with Gang(1, "cuda") as gang:
        got = gang.run(job_cuda_logits, "kimi-k2")[0]
    single = Transformer(PRESETS["kimi-k2"], weights("kimi-k2"), device="cuda")
    assert_close_to_single_device(got, forwards(single))


@pytest.mark.skipif(CUDA_GPUS < 2, reason=f"NCCL TP-2: needs 2 CUDA GPUs, {CUDA_GPUS} visible")
def test_nccl_tp2_validate_passes(small_fixture, monkeypatch, capfd):
    code, out, err = kdtree(["validate", "--tp", "2", "--device", "cuda", "--fixtures", str(small_fixture)], {},
                            monkeypatch, capfd)
    assert code == 0, out + err


def job_die(world: World, rank: int) -> int:
    if world.rank == rank:
        os._exit(3)
    return world.rank


def test_a_dying_rank_is_reported_not_waited_for(gangs):
    """Last: it stops the module's gang of 2."""
    gang = gangs(2)
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 3\)"):
        gang.run(job_die, 1)
    assert not gang.running
    with pytest.raises(RuntimeError, match="the ranks were stopped"):
        gang.run(job_die, -1)
