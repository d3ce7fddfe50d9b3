"""The built-in torch engine as an adapter of the validation protocol
(engine/validate/protocol.py), with the CUDA stages and attention kernels on CUDA
devices when they load."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from kdtr_format import ModelConfig

from .attention import AttentionBackend, torch_attention
from .cache import KVCache
from .model import Transformer
from .parallel import World
from .stages import Stages, TorchStages, TreeBatch


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
    """The built-in torch engine (engine.model, engine.stages, engine.attention) as an adapter.

    device "cuda" takes the CUDA stages and attention kernels when they load
    (`backends` says which ran), the torch paths otherwise. invariant: the model in
    batch-invariant mode (Transformer's `invariant`). world: the model sharded over a
    tensor-parallel group (Transformer's `world`, docs/tensor-parallel.md).
    """

    capabilities = ("model", "topk", "tree", "compile", "accept", "sample_accept", "compact", "attention")

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 invariant: bool = False, world: World | None = None) -> None:
        self.device = torch.device(device)
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
        self.name = f"torch engine ({self.device.type}, stages: {self.backends['stages'].split()[0]}, " \
                    f"attention: {self.backends['attention'].split()[0]}{', invariant' if invariant else ''}" \
                    f"{f', TP {world.size}' if world else ''})"
        self.model: Transformer | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.cache: KVCache | None = None

    # model
    def load_weights(self, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = {name: torch.tensor(np.asarray(w)) for name, w in weights.items()}
        self.model = Transformer(config, self.weights, device=self.device, dtype=self.dtype,
                                 attention=self.attention_backend, invariant=self.invariant, world=self.world)

    def reset(self, max_len: int) -> None:
        self.cache = self._model().new_cache(1, max_len)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start+n] -> logits float32 [n, V]."""
        model = self._model()
        if self.cache is None:
            raise ValueError("forward before reset(max_len)")
        n = len(tokens)
        visibility = np.asarray(visibility, dtype=bool)
        if visibility.shape != (n, start + n):
            raise ValueError(f"visibility shape {list(visibility.shape)} != {[n, start + n]}")
        if not visibility[:, :start].all():
            raise ValueError("the torch engine sees every cached slot: visibility[:, :start] must be all True")
        dev = self.device
        logits = model.forward(torch.tensor(np.asarray(tokens), dtype=torch.int64, device=dev)[None],
                               torch.tensor(np.asarray(positions), dtype=torch.int64, device=dev)[None],
                               torch.as_tensor(visibility[:, start:], device=dev)[None],
                               torch.tensor([n], device=dev), torch.tensor([start], device=dev), self.cache)
        return logits[0].cpu().numpy()

    # stages
    def topk_logprobs(self, draft_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """draft_logits [L, V] float32 -> (topk_lp [L, K] float32, topk_id [L, K] int64)."""
        lp, ids = self.stages.topk_logprobs(torch.tensor(np.asarray(draft_logits), device=self.device)[None], k)
        return lp[0].cpu().numpy(), ids[0].cpu().numpy()

    def build_tree(self, topk_lp: np.ndarray, topk_id: np.ndarray, budget: int,
                   root: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> parents, tokens, depths [n+1] int64, scores [n+1] float64."""
        trees = self.stages.build_trees(torch.tensor(np.asarray(topk_lp), device=self.device)[None],
                                        torch.tensor(np.asarray(topk_id), device=self.device)[None],
                                        torch.tensor([budget], device=self.device),
                                        torch.tensor([root], device=self.device))
        count = int(trees.n[0]) + 1
        return tuple(t[0, :count].cpu().numpy() for t in (trees.parents, trees.tokens, trees.depths, trees.scores))

    def compile_tree(self, parents: np.ndarray, depths: np.ndarray,
                     start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> positions [n+1], visibility_bits uint32 [n+1, W], first_child [n+1], next_sibling [n+1]."""
        trees = self._tree(parents, np.full(len(parents), -1), depths)
        compiled = self.stages.compile_trees(trees, torch.tensor([start], device=self.device))
        bits = compiled.visibility_bits[0].cpu().numpy().astype(np.int64) & 0xFFFFFFFF
        return (compiled.positions[0].cpu().numpy(), bits.astype(np.uint32),
                compiled.first_child[0].cpu().numpy(), compiled.next_sibling[0].cpu().numpy())

    def accept(self, parents: np.ndarray, tokens: np.ndarray, choices: np.ndarray) -> tuple[np.ndarray, int]:
        """parents, tokens, choices [n+1] -> (accepted [a], next_root)."""
        depths = np.zeros(len(parents), dtype=np.int64)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        choices_t = torch.tensor(np.asarray(choices), dtype=torch.int64, device=self.device)[None]
        accepted, accept_len, next_root = self.stages.accept(self._tree(parents, tokens, depths), choices_t)
        return accepted[0, :int(accept_len[0])].cpu().numpy(), int(next_root[0])

    def sample_accept(self, parents: np.ndarray, tokens: np.ndarray, logits: np.ndarray, temperature: float,
                      uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """parents, tokens [n+1], logits [n+1, V], uniforms [n+1] -> (choices [n+1], accepted [a], next_root)."""
        choices = self.stages.sample_choices(torch.tensor(np.asarray(logits), device=self.device)[None],
                                             float(temperature),
                                             torch.tensor(np.asarray(uniforms), dtype=torch.float64,
                                                          device=self.device)[None])[0].cpu().numpy()
        return (choices, *self.accept(parents, tokens, choices))

    def _tree(self, parents: np.ndarray, tokens: np.ndarray, depths: np.ndarray) -> TreeBatch:
        """One request's tree as a TreeBatch (scores unused by compile and accept: zeros)."""
        def put(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.asarray(a), dtype=torch.int64, device=self.device)[None]

        return TreeBatch(n=torch.tensor([len(parents) - 1], device=self.device), parents=put(parents),
                         tokens=put(tokens), depths=put(depths),
                         scores=torch.zeros(1, len(parents), dtype=torch.float64, device=self.device),
                         depth=int(np.max(depths)))

    def compact(self, c_kv: np.ndarray, k_pe: np.ndarray, start: int,
                accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """c_kv [S, R], k_pe [S, dr] -> the compacted copies (one layer, one request)."""
        cache = KVCache(c_kv=torch.tensor(np.asarray(c_kv), device=self.device)[None, None],
                        k_pe=torch.tensor(np.asarray(k_pe), device=self.device)[None, None],
                        lengths=torch.tensor([start], device=self.device))
        path = torch.tensor(np.asarray(accepted), dtype=torch.int64, device=self.device)[None]
        self.stages.compact_kv(cache, torch.tensor([start], device=self.device), path,
                               torch.tensor([path.shape[1]], device=self.device))
        return cache.c_kv[0, 0].cpu().numpy(), cache.k_pe[0, 0].cpu().numpy()

    def attention(self, q_lat: np.ndarray, q_pe: np.ndarray, c_kv: np.ndarray, k_pe: np.ndarray,
                  visibility: np.ndarray, scale: float) -> np.ndarray:
        """q_lat [n, H, R], q_pe [n, H, dr], c_kv [S, R], k_pe [S, dr], visibility [n, S] -> o_lat [n, H, R]."""
        n, slots = visibility.shape
        context = slots - n
        if not np.asarray(visibility)[:, :context].all():
            raise ValueError("the attention backend sees every cached row: visibility[:, :S-n] must be all True")
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.asarray(a), device=dev)[None]

        o_lat = self.attention_backend(put(q_lat), put(q_pe), put(c_kv), put(k_pe),
                                       torch.tensor([context], device=dev), torch.tensor([n], device=dev),
                                       put(np.asarray(visibility, dtype=bool)[:, context:]), scale)
        return o_lat[0].cpu().numpy()

    def _model(self) -> Transformer:
        if self.model is None:
            raise ValueError("the adapter has no weights: call load_weights first")
        return self.model
