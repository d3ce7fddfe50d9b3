"""engine: the torch reference engine for DDTree on DeepSeek-V3 / Kimi-K2-class models.

Modules: model, moe, cache, attention, weights, ragged, stages (the target and
DDTree stages; cuda_attention and cuda_stages on the kernels_cuda ops, fused/ the
fused GPU layers, parallel/ tensor and expert parallelism); decode (AR and DDTree
loops), graphs (their CUDA graphs), drafters, metrics, capture (per-layer
intermediates); diverge, diverge_run, diverge_ways (`kdtree diverge`); adapter
(the protocol a user engine implements) and adapters/ (third-party engines
behind it); serving/ (HTTP clients of serving engines); validate/, cli/
(`kdtree validate`, `kdtree diverge`, `kdtree demo`) and pytest_plugin.
"""
