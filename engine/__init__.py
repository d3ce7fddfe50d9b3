"""engine: the torch reference engine for DDTree on DeepSeek-V3 / Kimi-K2-class models.

Modules: model, moe, cache, attention, stages (the target and DDTree stages;
cuda_attention and cuda_stages on the kernels_cuda ops); decode (AR and DDTree
loops), graphs (their CUDA graphs), drafters, metrics; adapter (the protocol a
user engine implements), validate and cli (`kdtree validate`, `kdtree demo`).
"""
