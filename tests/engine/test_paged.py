"""The engine's paged KV cache (engine/cache.py): pages out of order, the forward writing and
reading through the block table, compaction through it, decoding on it.

Against the contiguous cache on the same inputs (CPU: the torch backends; CUDA: the kernels'
attention and stages, skipped without a GPU): the logits and the logical cache bit for bit,
the decoded tokens identical. Against the golden paged cases (kernels/paged_kv.kdtr): the
attention backends within the fixture's tolerance and the compaction bit for bit, over
pools with shared and unused pages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kdtr_format
from engine.attention import bind_attention, torch_attention
from engine.cache import KVCache
from engine.decode import ar_decode, ddtree_decode
from engine.drafters import OracleDrafter
from engine.model import Transformer
from engine.stages import TorchStages
from kdtr_format import PRESETS, DDTreeConfig

PAGE_SIZES = (1, 16, 64)


def backends(device: str):
    """-> (attention backend, stages) the engine uses on `device`."""
    if device == "cpu":
        return torch_attention, TorchStages()
    from engine.adapter import cuda_backends

    stages, attention, notes = cuda_backends()
    if attention is None or stages is None:
        pytest.skip(f"kernels_cuda does not load: {notes}")
    return attention, stages


def logical(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (c_kv, k_pe) [layers, B, max_len, w]: every request's slots in slot order."""
    slots = torch.arange(cache.max_len, device=cache.device).expand(cache.batch, -1)
    rows = cache.slot_rows(slots)                                              # [B, T]
    return tuple(pool[:, rows] for pool in cache.rows())


def test_a_paged_cache_hands_out_every_page_once_and_out_of_order():
    cache = KVCache.allocate(PRESETS["tiny"], 3, 40, page_size=16)
    assert cache.paged and cache.page_size == 16 and cache.max_len == 48        # rounded up to whole pages
    assert cache.c_kv.shape == (PRESETS["tiny"].num_hidden_layers, 9, 16, PRESETS["tiny"].kv_lora_rank)
    table = cache.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    assert sorted(table.flatten().tolist()) == list(range(9))
    assert any((row.diff() < 0).any() for row in table)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        KVCache.allocate(PRESETS["tiny"], 1, 8, page_size=0)


def prefill_and_verify(model: Transformer, batch: int, seed: int) -> tuple[torch.Tensor, KVCache]:
    """A ragged causal prefill, then a tree verify on the same cache -> (verify logits [B, N, V], cache)."""
    g = torch.Generator().manual_seed(seed)
    device = model.device
    lengths = torch.tensor([21 - 5 * b for b in range(batch)])
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, 21), generator=g)
    cache = model.new_cache(batch, 128)
    causal = torch.ones(batch, 21, 21, dtype=torch.bool).tril()
    model.forward(tokens.to(device), torch.arange(21).expand(batch, 21).to(device), causal.to(device),
                  lengths.to(device), torch.zeros(batch, dtype=torch.int64, device=device), cache)
    parents = [-1, 0, 0, 1, 1, 2, 4, 4, 0]
    visibility = torch.eye(len(parents), dtype=torch.bool)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        visibility[i] |= visibility[parents[i]]
        depth[i] = depth[parents[i]] + 1
    tree = torch.randint(0, model.cfg.vocab_size, (batch, len(parents)), generator=g)
    positions = lengths[:, None] + torch.tensor(depth)[None]
    n_new = torch.tensor([len(parents) - 3 * b for b in range(batch)]).clamp(min=1)
    logits = model.forward(tree.to(device), positions.to(device),
                           visibility.expand(batch, -1, -1).to(device), n_new.to(device), lengths.to(device), cache)
    return logits, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny", "kimi-k2"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_forward_gives_the_contiguous_bits(model_zoo, device, page_size, preset, dtype):
    """Same inputs, 128-slot caches (whole pages): the verify logits and every request's
    slots equal the contiguous cache's bit for bit (the kernels read the same keys in the
    same order through the table; at K2 dims in bf16 on the GPU, the tensor-core path)."""
    if device == "cpu" and preset == "kimi-k2":
        pytest.skip("K2 dims run on the GPU only (the CPU covers the paging at tiny dims)")
    case = model_zoo.get(preset)
    attention, _ = backends(device)
    runs = {size: prefill_and_verify(Transformer(case.cfg, case.weights, device=device, dtype=dtype,
                                                 attention=attention, page_size=size), 3, seed=4)
            for size in (None, page_size)}
    (flat_logits, flat_cache), (paged_logits, paged_cache) = runs[None], runs[page_size]
    assert paged_cache.paged and not flat_cache.paged
    compare = torch.equal
    if device == "cuda":
        from kernels_cuda.mla_ops import paged_tensor_cores, uses_tensor_cores

        if uses_tensor_cores(dtype, case.cfg.kv_lora_rank, case.cfg.qk_rope_head_dim, torch.device(device)) \
                and not paged_tensor_cores(page_size):
            # these pages take the kernel's CUDA-core path, the contiguous cache its tensor cores:
            # the same math in another summation order, so bf16 rounding apart, not bit for bit
            compare = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2   # noqa: E731
    error = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))   # noqa: E731
    assert compare(paged_logits, flat_logits), f"logits: relative error {error(paged_logits, flat_logits):.3g}"
    for paged, flat in zip(logical(paged_cache), (flat_cache.c_kv, flat_cache.k_pe)):
        assert compare(paged, flat), f"cache: relative error {error(paged, flat):.3g}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decoding_on_a_paged_cache_gives_the_contiguous_tokens(model_zoo, device, page_size):
    case = model_zoo.get("tiny")
    attention, stages = backends(device)
    models = {size: Transformer(case.cfg, case.weights, device=device, attention=attention, page_size=size)
              for size in (None, page_size)}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, case.cfg.vocab_size, m).tolist() for m in (5, 12, 9)]
    ar = {size: ar_decode(model, prompts, 20, stages=stages) for size, model in models.items()}
    truth = [p + r.tokens for p, r in zip(prompts, ar[None].requests)]
    ddtree = {size: ddtree_decode(model, OracleDrafter(truth, case.cfg.vocab_size, accuracy=0.7, seed=6, device=device),
                                  prompts, DDTreeConfig(block_size=6, budget=16), 20, stages=stages)
              for size, model in models.items()}
    assert ar[page_size].tokens == ar[None].tokens
    assert ddtree[page_size].tokens == ddtree[None].tokens == ar[None].tokens
    assert ddtree[page_size].metrics.mean_acceptance > 1                     # trees were accepted, so compaction moved KV


def golden_cases(golden, op: str):
    with kdtr_format.open(golden / "kernels/paged_kv.kdtr") as fixture:
        for case in fixture.metadata["cases"]:
            if case["op"] == op:
                yield case, {name.rsplit("/", 1)[1]: torch.as_tensor(np.array(fixture[name]))
                             for name in fixture.names() if name.startswith(f"cases/{case['name']}/")}


def test_golden_paged_compaction_cases(golden, device):
    _, stages = backends(device)
    for case, t in golden_cases(golden, "compact"):
        offsets = t["accept_offsets"].tolist()
        paths = [t["accepted"][offsets[b]:offsets[b + 1]] for b in range(case["batch"])]
        accepted = torch.nn.utils.rnn.pad_sequence(paths, batch_first=True, padding_value=-1)
        cache = KVCache(c_kv=t["c_kv_pages"][None].clone(), k_pe=t["k_pe_pages"][None].clone(),
                        lengths=t["starts"].clone(), block_table=t["block_table"].clamp(min=0))
        cache = KVCache(*(x.to(device) for x in (cache.c_kv, cache.k_pe, cache.lengths, cache.block_table)))
        stages.compact_kv(cache, t["starts"].to(device), accepted.to(device),
                          torch.tensor([len(p) for p in paths], device=device))
        for got, want, original in ((cache.c_kv[0], t["c_kv_after"], t["c_kv_pages"]),
                                    (cache.k_pe[0], t["k_pe_after"], t["k_pe_pages"])):
            got = got.cpu()
            changed = [p for p in range(got.shape[0]) if not torch.equal(got[p], original[p])]
            assert not set(changed) & set(case["shared_pages"]), f"{case['name']}: a shared page was written"
            assert torch.equal(got, want), f"{case['name']}: pages {changed} changed"


def test_golden_paged_attention_cases_through_the_engine_backend(golden, device):
    """Each case as the engine's padded batch (starts = context, n_new = tree size) through
    bind_attention with the block table: o_lat within the fixture's float32 tolerance (bf16
    paging is held to the contiguous bits by the forward test)."""
    attention, _ = backends(device)
    for case, t in golden_cases(golden, "attention"):
        sizes, q_offsets, words = t["tree_sizes"], t["q_offsets"].tolist(), t["visibility_bits"]
        batch, n = case["batch"], int(sizes.max())
        pad = lambda x: torch.stack([torch.nn.functional.pad(x[q_offsets[b]:q_offsets[b + 1]],   # noqa: E731
                                                             (0, 0) * (x.dim() - 1) + (0, n - int(sizes[b])))
                                     for b in range(batch)])
        bits = pad(words.to(torch.int64))                                         # [B, N, W]
        visibility = ((bits[..., :, None] >> torch.arange(32)) & 1).flatten(-2)[..., :n].bool()
        table = t["block_table"].clamp(min=0).to(device)
        attend = bind_attention(attention, t["context"].to(device), sizes.to(device), visibility.to(device),
                                table.shape[1] * case["page_size"], table)
        o_lat = attend(pad(t["q_lat"]).to(device), pad(t["q_pe"]).to(device), t["c_kv_pages"].to(device),
                       t["k_pe_pages"].to(device), case["scale"])
        with kdtr_format.open(golden / "kernels/paged_kv.kdtr") as fixture:
            rule = fixture.metadata["tolerances"]["o_lat"]
        for b in range(batch):
            torch.testing.assert_close(o_lat[b, :int(sizes[b])].float().cpu(),
                                       t["o_lat"][q_offsets[b]:q_offsets[b + 1]], rtol=rule["rtol"],
                                       atol=rule["atol"], msg=lambda m: f"{case['name']} request {b}: {m}")
