"""The built-in torch engine as an adapter of the validation protocol, version 2
(engine/validate/door/protocol_v2.py: batched, ragged, on torch tensors on its device), with
the CUDA stages and attention kernels on CUDA devices when they load. Paged KV (verify
attention and compaction through a block table) goes through the same attention backend
and stages as the engine's own paged cache (engine/cache.py).

The engine's own layout is padded ([B, width] with a count per request); the adapter
converts the protocol's ragged rows to it and back on the device. Its host reads are
the batch's largest sizes (to shape the padded tensors); no tensor goes through the host.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from kdtr_format import ModelConfig

from .attention import AttentionBackend, bind_attention, torch_attention
from .cache import KVCache
from .capture import capturing
from .model import Transformer
from .parallel import World
from .ragged import forward_of_one, offsets_of, sizes, to_padded, to_ragged, unpack_visibility, widest
from .stages import Stages, TorchStages, TreeBatch
from .weights import as_tensor


def cuda_backends() -> tuple[Stages | None, AttentionBackend | None, dict[str, str]]:
    """The CUDA stages and attention backend when CUDA is present and kernels_cuda loads.

    -> (stages or None, attention or None, {"stages": why / "cuda", "attention": ...}).
    """
    notes = {"stages": "torch", "attention": "torch"}
    if not torch.cuda.is_available():
        return None, None, {k: "torch (no CUDA device)" for k in notes}
    stages = attention = None
    try:
        from .cuda_stages import CudaStages
        stages, notes["stages"] = CudaStages(), "cuda"
    except Exception as exc:    # a missing build, nvcc or module is reported, not fatal
        notes["stages"] = f"torch (CUDA stages unavailable: {type(exc).__name__}: {exc})"
    try:
        from .cuda_attention import CudaAttention
        attention, notes["attention"] = CudaAttention(), "cuda"
    except Exception as exc:
        notes["attention"] = f"torch (CUDA attention unavailable: {type(exc).__name__}: {exc})"
    return stages, attention, notes


class TorchAdapter:
    """The built-in torch engine (engine.model, engine.stages, engine.attention) as a v2 adapter.

    device "cuda" takes the CUDA stages and attention kernels when they load
    (`backends` says which ran), the torch paths otherwise. invariant: the model in
    batch-invariant mode (Transformer's `invariant`). world: the model sharded over a
    tensor-parallel group (Transformer's `world`, docs/tensor-parallel.md). page_size: its
    KV cache paged with pages of this many slots (engine/cache.py; None: contiguous).
    Shapes: protocol_v2's docstring.
    """

    protocol = 2
    capabilities = ("model", "topk", "tree", "compile", "accept", "sample_accept", "compact", "attention",
                    "paged_attention", "paged_compact")

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 invariant: bool = False, world: World | None = None, page_size: int | None = None) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.dtype = dtype
        self.invariant = invariant
        self.world = world
        self.stages: Stages = TorchStages()
        self.attention_backend: AttentionBackend = torch_attention
        self.backends = {"stages": "torch", "attention": "torch"}
        if self.device.type == "cuda":
            stages, attention, self.backends = cuda_backends()
            self.stages = stages or self.stages
            self.attention_backend = attention or self.attention_backend
        self.name = ""
        self._name()
        self.model: Transformer | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.cache: KVCache | None = None

    def _name(self) -> None:
        dtype = "" if self.dtype == torch.float32 else f", {str(self.dtype).removeprefix('torch.')}"
        self.name = f"torch engine ({self.device.type}{dtype}, stages: {self.backends['stages'].split()[0]}, " \
                    f"attention: {self.backends['attention'].split()[0]}{', invariant' if self.invariant else ''}" \
                    f"{f', TP {self.world.size}' if self.world else ''}" \
                    f"{f', pages of {self.page_size}' if self.page_size else ''})"

    # precision
    def set_dtype(self, dtype: str) -> None:
        """"float32" or "bfloat16": the compute dtype of the model loaded next (and of one loaded now)."""
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"the torch engine computes in float32 or bfloat16, not {dtype!r}")
        self.dtype = dtypes[dtype]
        self._name()
        if self.model is not None:
            self.load_weights(self.model.cfg, self.weights)

    # model
    def load_weights(self, config: ModelConfig, weights: Mapping[str, Any]) -> None:
        """weights: torch tensors (any dtype or device) or numpy arrays, named as docs/fixtures.md."""
        self.weights = {name: as_tensor(w) for name, w in weights.items()}
        self.model = Transformer(config, self.weights, device=self.device, dtype=self.dtype,
                                 attention=self.attention_backend, invariant=self.invariant, world=self.world,
                                 page_size=self.page_size)

    def reset(self, batch: int, max_len: int) -> None:
        self.cache = self._model().new_cache(batch, max_len)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor,
                visibility_bits: torch.Tensor) -> torch.Tensor:
        """tokens, positions [T], offsets [B+1], starts [B], visibility_bits int32 [T, W] -> logits float32 [T, V]."""
        model, cache = self._model(), self._cache()
        n_new = sizes(offsets)
        if len(n_new) != cache.batch:
            raise ValueError(f"forward: {len(n_new)} requests, the cache was reset for {cache.batch}")
        width = widest(n_new)
        visibility = unpack_visibility(to_padded(visibility_bits, offsets, width), width)      # [B, width, width]
        logits = model.forward(to_padded(tokens, offsets, width), to_padded(positions, offsets, width), visibility,
                               n_new, starts, cache, check=False)
        return to_ragged(logits, n_new)

    def compact_cache(self, starts: torch.Tensor, accepted: torch.Tensor, accept_offsets: torch.Tensor) -> None:
        """Every layer of the cache: slot starts[b] + k <- slot starts[b] + accepted path[k]."""
        cache = self._cache()
        self._compact(cache, starts, accepted, accept_offsets)
        cache.lengths = torch.where(sizes(accept_offsets) > 0, starts + sizes(accept_offsets), cache.lengths)

    # intermediates
    def intermediates(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                      start: int) -> dict[str, np.ndarray]:
        """One request, in protocol v1's shapes (intermediates are per request in both protocols):
        `forward` with every capture point's rows: {"layers.{i}.{point}": [n, ...], "logits": [n, V],
        "layers.{i}.expert_counts": [E]} in the compute dtype (engine/capture.py). The cache holds
        one request (reset(1, max_len))."""
        with capturing(self._model(), [len(tokens)]) as captured:
            self.forward(*forward_of_one(tokens, positions, visibility, start, self.device, "intermediates"))
        counts = {f"layers.{layer}.expert_counts": c for layer, c in captured.expert_counts.items()}
        return {**captured.values, **counts}

    # stages
    def topk_logprobs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_logits [B, L, V] -> (topk_lp float32 [B, L, K], topk_id int64 [B, L, K])."""
        return self.stages.topk_logprobs(draft_logits, k)

    def build_trees(self, topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor,
                    roots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> node_offsets [B+1], parents, tokens, depths [N] int64, scores [N] float64."""
        trees = self.stages.build_trees(topk_lp, topk_id, budgets, roots)
        counts = trees.n + 1
        return (offsets_of(counts), *(to_ragged(t, counts) for t in (trees.parents, trees.tokens, trees.depths,
                                                                      trees.scores)))

    def compile_trees(self, parents: torch.Tensor, depths: torch.Tensor, node_offsets: torch.Tensor,
                      starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> positions [N], visibility_bits int32 [N, W], first_child [N], next_sibling [N]."""
        trees = self._trees(parents, parents.new_full(parents.shape, -1), node_offsets, depths)
        compiled = self.stages.compile_trees(trees, starts)
        counts = trees.n + 1
        return tuple(to_ragged(t, counts) for t in (compiled.positions, compiled.visibility_bits,
                                                     compiled.first_child, compiled.next_sibling))

    def accept(self, parents: torch.Tensor, tokens: torch.Tensor, choices: torch.Tensor,
               node_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> accepted [A], accept_offsets [B+1], next_roots [B]."""
        trees = self._trees(parents, tokens, node_offsets)
        accepted, accept_len, next_root = self.stages.accept(trees, to_padded(choices, node_offsets, trees.width))
        return to_ragged(accepted, accept_len), offsets_of(accept_len), next_root

    def sample_accept(self, parents: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor,
                      node_offsets: torch.Tensor, temperature: float,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """logits float64 [N, V], uniforms float64 [N] -> choices [N], accepted [A], accept_offsets, next_roots."""
        counts = sizes(node_offsets)
        width = widest(counts)
        choices = self.stages.sample_choices(to_padded(logits, node_offsets, width), float(temperature),
                                             to_padded(uniforms, node_offsets, width, fill=0.5))
        choices = to_ragged(choices, counts)
        return (choices, *self.accept(parents, tokens, choices, node_offsets))

    def compact(self, c_kv: torch.Tensor, k_pe: torch.Tensor, starts: torch.Tensor, accepted: torch.Tensor,
                accept_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [B, S, R], k_pe [B, S, dr] (one layer) -> the compacted copies."""
        return self._compacted(c_kv, k_pe, None, starts, accepted, accept_offsets)

    def paged_compact(self, c_kv_pages: torch.Tensor, k_pe_pages: torch.Tensor, block_table: torch.Tensor,
                      starts: torch.Tensor, accepted: torch.Tensor,
                      accept_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv_pages [P, page, R], k_pe_pages [P, page, dr], block_table int32 [B, W] -> the compacted
        copies: the stages' compaction through the table, as of the engine's paged cache (each moved
        row written at its slot's page and row, nothing else)."""
        return self._compacted(c_kv_pages, k_pe_pages, block_table, starts, accepted, accept_offsets)

    def attention(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                  q_offsets: torch.Tensor, kv_offsets: torch.Tensor, contexts: torch.Tensor,
                  visibility_bits: torch.Tensor, scale: float) -> torch.Tensor:
        """q_lat [T, H, R], q_pe [T, H, dr], c_kv [S, R], k_pe [S, dr] -> o_lat [T, H, R] (the backend's
        padded form: request b's keys gathered into row b)."""
        keys = widest(contexts + sizes(q_offsets))
        rows = (kv_offsets[:, None] + torch.arange(keys, device=c_kv.device)).clamp(max=c_kv.shape[0] - 1)
        return self._verify(q_lat, q_pe, c_kv[rows], k_pe[rows], None, q_offsets, contexts, visibility_bits, scale)

    def paged_attention(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv_pages: torch.Tensor,
                        k_pe_pages: torch.Tensor, block_table: torch.Tensor, q_offsets: torch.Tensor,
                        contexts: torch.Tensor, visibility_bits: torch.Tensor, scale: float) -> torch.Tensor:
        """q_lat [T, H, R], q_pe [T, H, dr], c_kv_pages [P, page, R], k_pe_pages [P, page, dr], block_table
        int32 [B, W] -> o_lat [T, H, R]: the backend over the pools as the engine's paged forward calls it
        (the CUDA kernel reads through the table; the torch backends gather each request's pages)."""
        return self._verify(q_lat, q_pe, c_kv_pages, k_pe_pages, block_table, q_offsets, contexts, visibility_bits,
                            scale)

    def _verify(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                block_table: torch.Tensor | None, q_offsets: torch.Tensor, contexts: torch.Tensor,
                visibility_bits: torch.Tensor, scale: float) -> torch.Tensor:
        """Ragged queries [T, H, *] over c_kv, k_pe: [B, slots, *] per request, or the pools
        [P, page, *] with block_table [B, W] -> o_lat [T, H, R], through the attention backend."""
        n = sizes(q_offsets)
        width = widest(n)
        slots = c_kv.shape[1] if block_table is None else block_table.shape[1] * c_kv.shape[1]
        visibility = unpack_visibility(to_padded(visibility_bits, q_offsets, width), width)
        attend = bind_attention(self.attention_backend, contexts, n, visibility, slots, block_table)
        return to_ragged(attend(to_padded(q_lat, q_offsets, width), to_padded(q_pe, q_offsets, width), c_kv, k_pe,
                                scale), n)

    def _compacted(self, c_kv: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None,
                   starts: torch.Tensor, accepted: torch.Tensor,
                   accept_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's c_kv, k_pe ([B, S, *], or the pools [P, page, *] with block_table) compacted on copies."""
        cache = KVCache(c_kv=c_kv.clone()[None], k_pe=k_pe.clone()[None], lengths=starts.clone(),
                        block_table=block_table)
        if block_table is not None:      # an empty path's self-copy at slot 0: a held page, where its start may not be
            starts = torch.where(sizes(accept_offsets) > 0, starts, 0)
        self._compact(cache, starts, accepted, accept_offsets)
        return cache.c_kv[0], cache.k_pe[0]

    def _compact(self, cache: KVCache, starts: torch.Tensor, accepted: torch.Tensor,
                 accept_offsets: torch.Tensor) -> None:
        """The stages' compaction of ragged paths (a request with an empty path copies its slot
        starts[b] onto itself)."""
        length = sizes(accept_offsets)
        path = to_padded(accepted, accept_offsets, max(1, widest(length)))
        self.stages.compact_kv(cache, starts, path, length.clamp(min=1))

    def _trees(self, parents: torch.Tensor, tokens: torch.Tensor, node_offsets: torch.Tensor,
               depths: torch.Tensor | None = None) -> TreeBatch:
        """Ragged trees as a TreeBatch (scores unused by compile and accept: zeros; without depths,
        the deepest a tree of its width can be)."""
        counts = sizes(node_offsets)
        width = widest(counts)
        padded = [to_padded(t, node_offsets, width, fill=-1) for t in (parents, tokens)]
        depth = int(depths.max()) if depths is not None and len(depths) else width - 1
        return TreeBatch(n=counts - 1, parents=padded[0], tokens=padded[1],
                         depths=to_padded(depths, node_offsets, width, fill=-1) if depths is not None
                         else torch.zeros_like(padded[0]),
                         scores=torch.zeros(padded[0].shape, dtype=torch.float64, device=parents.device),
                         depth=max(depth, 0))

    def _model(self) -> Transformer:
        if self.model is None:
            raise ValueError("the adapter has no weights: call load_weights first")
        return self.model

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise ValueError("no cache: call reset(batch, max_len) first")
        return self.cache

