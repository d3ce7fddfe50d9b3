"""`Stages` on the GPU with the kernels_cuda tree ops (engine/stages.py has the protocol).

Top-k, tree build, compile, greedy accept, sampling choices (the float64 inverse CDF,
when tree_ops.SAMPLE_KERNEL) and KV compaction run as CUDA kernels (torch.ops.kdtree.*);
greedy choices are torch's argmax, already on the GPU. Outputs have TorchStages' layout exactly: trees are built
into 1 + max(budget) columns and trimmed to 1 + max(n), which costs two host syncs.
"""

from __future__ import annotations

import torch

from kernels_cuda import tree_ops

from .cache import KVCache
from .stages import CompiledBatch, TorchStages, TreeBatch


def _possible_nodes(depth: int, k: int, cap: int) -> int:
    """min(cap, sum of k^d for d = 1 .. depth): every node a full k-ary tree of `depth` levels has."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= cap:
            return cap
    return total


def unpack_visibility(bits: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [..., W] bit-packed rows -> bool [..., width] (bit b of word w = column 32 w + b)."""
    column = torch.arange(width, device=bits.device)
    return ((bits[..., column // 32] >> (column % 32)) & 1).bool()


class CudaStages:
    """The CUDA implementation of `Stages` (inputs must be CUDA tensors)."""

    def __init__(self) -> None:
        self._torch = TorchStages()

    def topk_logprobs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_logits [B, L, V] float32|bf16|fp16 -> (topk_lp float32 [B, L, K], topk_id int64 [B, L, K])."""
        if draft_logits.dim() != 3:
            raise ValueError(f"draft_logits: expected [B, L, V], got shape {list(draft_logits.shape)}")
        if bool(draft_logits.isnan().any()):      # the contract's explicit error (one host read; the graphed
            raise ValueError("draft_logits: contains NaN")   # round, engine/graphs.py, skips it)
        return tree_ops.topk_logprobs(draft_logits, k)

    def build_trees(self, topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor,
                    roots: torch.Tensor) -> TreeBatch:
        """topk_lp float32 [B, L, K], topk_id int64 [B, L, K], budgets, roots int64 [B] -> TreeBatch."""
        if topk_lp.dim() != 3:
            raise ValueError(f"topk_lp: expected [B, L, K], got shape {list(topk_lp.shape)}")
        batch, depth, k = topk_lp.shape
        if not isinstance(budgets, torch.Tensor):
            raise ValueError(f"budgets: expected a torch.Tensor, got {type(budgets).__name__}")
        smallest, largest = torch.stack(torch.aminmax(budgets)).tolist() if budgets.numel() > 0 else (0, 0)
        if smallest < 0:
            raise ValueError(f"budgets: must be >= 0, got {budgets.tolist()}")
        width = 1 + _possible_nodes(depth, k, largest)
        n, parents, tokens, depths, scores = tree_ops.build_trees(topk_lp, topk_id, budgets, roots, width)
        used = 1 + (int(n.max()) if batch > 0 else 0)
        trim = (lambda t: t[:, :used].contiguous()) if used < width else (lambda t: t)
        return TreeBatch(n=n, parents=trim(parents), tokens=trim(tokens), depths=trim(depths),
                         scores=trim(scores), depth=depth)

    def compile_trees(self, trees: TreeBatch, starts: torch.Tensor) -> CompiledBatch:
        """TreeBatch, starts int64 [B] -> CompiledBatch (the dense visibility unpacked from the bits)."""
        positions, bits, first_child, next_sibling = tree_ops.compile_trees(trees.parents, trees.depths, trees.n, starts)
        return CompiledBatch(positions=positions, visibility=unpack_visibility(bits, trees.width),
                             visibility_bits=bits, first_child=first_child, next_sibling=next_sibling)

    def greedy_choices(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, N, V] -> int64 [B, N]: torch's argmax (ties to the smaller id)."""
        return self._torch.greedy_choices(logits)

    def sample_choices(self, logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
        """logits [B, N, V], uniforms [B, N] -> int64 [B, N]: the float64 inverse CDF, by the kernel
        kdtree::sample_choices when tree_ops.SAMPLE_KERNEL is set, else by TorchStages' torch ops."""
        if not tree_ops.SAMPLE_KERNEL:
            return self._torch.sample_choices(logits, temperature, uniforms)
        if logits.dim() != 3:
            raise ValueError(f"logits: expected [B, N, V], got shape {list(logits.shape)}")
        choices = tree_ops.sample_choices(logits.contiguous(), temperature, uniforms.double().contiguous())
        refused = (choices < 0).nonzero().tolist()
        if refused:
            raise ValueError(f"uniforms: every value must lie in [0, 1), and every logits row needs a finite "
                             f"maximum and no NaN; refused at [b, n] = {refused[:8]}")
        return choices

    def accept(self, trees: TreeBatch, choices: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """choices int64 [B, Nmax] -> (accepted int64 [B, L+1] padded -1, accept_len [B], next_root [B])."""
        return tree_ops.accept_greedy(trees.parents, trees.tokens, trees.n, choices, trees.depth + 1)

    def compact_kv(self, cache: KVCache, starts: torch.Tensor, accepted: torch.Tensor,
                   accept_len: torch.Tensor) -> None:
        """In place on every layer of `cache`; leaves cache.lengths to the caller."""
        tree_ops.compact_kv(cache.c_kv, cache.k_pe, starts, accepted, accept_len, block_table=cache.block_table)
