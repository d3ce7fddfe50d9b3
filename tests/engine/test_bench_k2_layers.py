"""GPU cost of one Kimi K2 layer at full dims, for extrapolating to the whole model (docs/scale_up_k2.md).

The torch engine's own layer code (engine.model.MLA, MoE, DenseMLP) in bf16 at Kimi K2's dims
(kdtr_format.CONFIGS["kimi-k2-full"]: hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64; 384
routed experts of width 2048, 8 a token, one shared), seeded random weights made on the device:

- MLA: decode (one token, batch 1 and 8) and a 64-token tree verify (batch 1), contexts 4096 and 32768,
  with the torch attention and, when kernels_cuda loads, the CUDA tree-verify kernel: the layer's
  projections, the new tokens' cache rows written, attention over the cache, the output projection
  (what `Transformer.forward` runs per layer between the input norm and the FFN).
- MoE: 1, 8 and 64 tokens, with each routed-expert dispatch (engine/moe.py: "grouped", the default on
  Hopper in bf16, and "dense"); the routed experts the tokens touch depend on the random router and
  are recorded.
- The dense MLP of K2's first layer (width 18432): 1, 8 and 64 tokens.

Each case records in benchmark.extra_info: the median milliseconds from CUDA events over the rounds, the
layer's weight bytes, the bytes the call must move at least (weights it touches, the KV cache it reads)
and its flops, the peak memory above the weights during the call, and the two ceilings measured in the
same run (device-to-device copy bandwidth, bf16 matmul rate) with the fraction of the binding one the
call reaches. Nothing is asserted about speed. Skipped without CUDA; with benchmarks disabled (the
default test run) each case runs its layer once. scripts/gpu_k2_layers.sh runs it with benchmarks on
and writes k2_layers.json and the table k2_layers.md.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from bench_record import record
from kdtr_format import CONFIGS
from engine.adapter import cuda_backends
from engine.attention import bind_attention, torch_attention
from engine.cache import KVCache
from engine.model import MLA, DenseMLP, MoE, rope_cos_sin, rope_inv_freq, route, softmax_scale
from engine.moe import DISPATCHES, moe_dispatch
from engine.weights import weight_dtype, weight_shapes

CFG = dataclasses.replace(CONFIGS["kimi-k2-full"], num_hidden_layers=2)     # layer 0 dense, layer 1 MoE
LAYER = 1
ROUNDS = 20
GIB = 2 ** 30


def _needs_gpu(gib: float) -> None:
    if not torch.cuda.is_available():
        pytest.skip("K2 layer benchmark: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    if total < gib:
        pytest.skip(f"K2 layer benchmark: needs about {gib:.0f} GiB of GPU memory, the GPU has {total:.0f}")


def _weights(prefix: str) -> dict[str, torch.Tensor]:
    """The weights under `prefix`, bf16 (the router float32), 1/sqrt(fan-in) scaled, norms 1."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, shape in weight_shapes(CFG).items():
        if not name.startswith(prefix):
            continue
        dtype = weight_dtype(name, torch.bfloat16)
        if len(shape) == 1:
            value = (torch.randn(shape, device="cuda", generator=generator, dtype=dtype) * 1e-2
                     if name.endswith("e_score_correction_bias") else torch.ones(shape, device="cuda", dtype=dtype))
        else:
            value = torch.randn(shape, device="cuda", generator=generator, dtype=dtype).mul_(shape[-1] ** -0.5)
        weights[name] = value
    return weights


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _events_ms(call, rounds: int = ROUNDS) -> float:
    """Median milliseconds of `call` from CUDA events (after two warm-up calls)."""
    for _ in range(2):
        call()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.fixture(scope="module")
def ceilings() -> dict[str, float]:
    """The two ceilings, measured now: copy bandwidth (bytes read + written) and the bf16 matmul rate."""
    _needs_gpu(48)
    source = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    copy_ms = _events_ms(lambda: torch.empty_like(source).copy_(source), rounds=10)
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul_ms = _events_ms(lambda: x @ x, rounds=10)
    return {"copy_gb_s": 2 * 2 * GIB / copy_ms / 1e6, "bf16_tflop_s": 2 * n ** 3 / matmul_ms / 1e9}


def _record(benchmark, ceilings, call, *, layer: str, bytes_min: float, flops: float, weight_bytes: int,
            **case) -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    if benchmark.disabled:          # a plain test run (--benchmark-disable): the layer ran once, on the GPU
        return
    ms = _events_ms(call)
    floor_ms = max(bytes_min / (ceilings["copy_gb_s"] * 1e6), flops / (ceilings["bf16_tflop_s"] * 1e9))
    record(benchmark, dict(
        layer=layer, dtype="bfloat16", ms=ms, floor_ms=floor_ms, fraction_of_floor=floor_ms / ms,
        weight_gib=weight_bytes / GIB, bytes_min=bytes_min, flops=flops, peak_activation_gib=peak / GIB,
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, **ceilings, **case), "cuda")

    def synchronized():
        call()
        torch.cuda.synchronize()
    benchmark.pedantic(synchronized, rounds=5, iterations=1, warmup_rounds=1)


@pytest.fixture(scope="module")
def mla_layer():
    _needs_gpu(48)
    w = _weights(f"layers.{LAYER}.attn.")
    return MLA(CFG, w, f"layers.{LAYER}.attn."), _nbytes(w.values())


def _attention_backends():
    backends = {"torch": torch_attention}
    if torch.cuda.is_available():
        _, cuda, _ = cuda_backends()
        if cuda is not None:
            backends["cuda"] = cuda
    return backends


@pytest.mark.gpu
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (8, 1), (1, 64)], ids=["decode-b1", "decode-b8", "verify64-b1"])
@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_bench_k2_mla_layer(benchmark, ceilings, mla_layer, backend, batch, tokens, context):
    mla, weight_bytes = mla_layer
    backends = _attention_backends()
    if backend not in backends:
        pytest.skip("CUDA attention unavailable (kernels_cuda did not load): the torch attention case runs")
    cfg, generator = CFG, torch.Generator(device="cuda").manual_seed(1)
    cache = KVCache.allocate(cfg, batch, context + tokens, "cuda", torch.bfloat16)
    cache.c_kv.normal_(generator=generator)
    cache.k_pe.normal_(generator=generator)
    x = torch.randn(batch * tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    positions = (context + torch.arange(tokens, device="cuda")).repeat(batch)                # [M]
    cos, sin = rope_cos_sin(cfg, positions, rope_inv_freq(cfg).to("cuda"))
    starts = torch.full((batch,), context, device="cuda")
    n_new = torch.full((batch,), tokens, device="cuda")
    visibility = torch.ones(tokens, tokens, dtype=torch.bool, device="cuda").tril().expand(batch, tokens, tokens)
    attend = bind_attention(backends[backend], starts, n_new, visibility, cache.max_len)
    c_kv_cache, k_pe_cache = cache.c_kv[LAYER], cache.k_pe[LAYER]                          # [B, T, R], [B, T, dr]
    scale = softmax_scale(cfg)

    def call():
        q_lat, q_pe, c_kv, k_pe = mla.project(x, cos, sin)
        c_kv_cache[:, context:] = c_kv.view(batch, tokens, -1)
        k_pe_cache[:, context:] = k_pe.view(batch, tokens, -1)
        o_lat = attend(q_lat.view(batch, tokens, *q_lat.shape[1:]), q_pe.view(batch, tokens, *q_pe.shape[1:]),
                       c_kv_cache, k_pe_cache, scale)
        return mla.output(o_lat.reshape(q_lat.shape).to(x.dtype))

    H, R, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    kv_bytes = batch * (context + tokens) * (R + dr) * 2
    per_token = 2 * (cfg.hidden_size * (cfg.q_lora_rank + R + dr) + cfg.q_lora_rank * H * cfg.qk_head_dim
                     + H * cfg.qk_nope_head_dim * R + H * cfg.v_head_dim * R + H * cfg.v_head_dim * cfg.hidden_size)
    attention_flops = 2 * H * (2 * R + dr) * (context + (tokens + 1) / 2)
    _record(benchmark, ceilings, call, layer="mla", bytes_min=weight_bytes + kv_bytes,
            flops=batch * tokens * (per_token + attention_flops), weight_bytes=weight_bytes,
            batch=batch, tokens=tokens, context=context, attention=backend)


@pytest.fixture(scope="module")
def moe_layer():
    _needs_gpu(48)
    w = _weights(f"layers.{LAYER}.moe.")
    return MoE(CFG, w, f"layers.{LAYER}.moe."), w


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_bench_k2_moe_layer(benchmark, ceilings, moe_layer, dispatch, tokens):
    moe, w = moe_layer
    if moe_dispatch(torch.device("cuda"), torch.bfloat16) != dispatch and dispatch == "grouped":
        pytest.skip("grouped MoE dispatch: torch has no grouped kernel for bf16 on this GPU (engine/moe.py)")
    cfg, p = CFG, f"layers.{LAYER}.moe."
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(2))
    real = torch.ones(tokens, dtype=torch.bool, device="cuda")
    idx, _ = route(cfg, x, w[p + "gate"], w[p + "e_score_correction_bias"])
    touched = int(idx.unique().numel())
    expert_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    shared = [w[p + f"shared.w_{n}"] for n in ("gate", "up", "down")]
    router = [w[p + "gate"], w[p + "e_score_correction_bias"]]
    bytes_min = touched * expert_bytes + _nbytes(shared) + _nbytes(router)
    experts_per_token = cfg.num_experts_per_tok + cfg.n_shared_experts
    per_token = (2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size * experts_per_token
                 + 2 * cfg.n_routed_experts * cfg.hidden_size)
    _record(benchmark, ceilings, lambda: moe(x, real, dispatch), layer="moe", bytes_min=bytes_min,
            flops=tokens * per_token, weight_bytes=_nbytes(w.values()), batch=tokens, tokens=tokens, context=0,
            experts_touched=touched, attention=f"- ({dispatch})")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_bench_k2_dense_mlp(benchmark, ceilings, tokens):
    _needs_gpu(48)
    w = _weights("layers.0.mlp.")
    mlp = DenseMLP(w, "layers.0.mlp.")
    x = torch.randn(tokens, CFG.hidden_size, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(3))
    weight_bytes = _nbytes(w.values())
    _record(benchmark, ceilings, lambda: mlp(x), layer="dense mlp", bytes_min=weight_bytes,
            flops=tokens * 2 * 3 * CFG.intermediate_size * CFG.hidden_size, weight_bytes=weight_bytes,
            batch=tokens, tokens=tokens, context=0, attention="-")
