"""Tensor- and expert-parallel sharding of the engine through torch.distributed (docs/tensor-parallel.md).

`Transformer(cfg, weights, ..., world=World)` holds this rank's part of the weights and sums
or gathers the ranks' partial outputs; everything outside the forward (the decoding loops,
the DDTree stages, the drafters, validation) runs unchanged on every rank on the same
replicated values. Modules, one job each: `world` (a rank's place and the collectives),
`shard` (which part of every weight a rank holds), `launch` (starting the ranks: torchrun, or
local processes spawned here).
"""

from .launch import Gang, join, run, torchrun_size
from .shard import first_expert, shard_weights, weight_split
from .world import World

__all__ = ["Gang", "World", "first_expert", "join", "run", "shard_weights", "torchrun_size", "weight_split"]
