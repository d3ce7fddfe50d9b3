"""HF transformers' `DeepseekV3ForCausalLM` through the validation protocol (the model capability).

    kdtree validate --impl engine.adapters.hf:HFAdapter     # float64: HF's own differences show
    kdtree validate --impl engine.adapters.hf:float32       # float32, as an engine runs it

- `load_weights`: the config becomes a `DeepseekV3Config` (`hf_config`), the fixture's
  weights (names of docs/fixtures.md) HF's state dict (hf_mapping.py); eager attention
  and eager experts, HF's reference implementations.
- `forward`: HF's forward with explicit `position_ids` and a 4D additive mask built from
  the harness's visibility (0 where visible, -inf elsewhere), over HF's own DynamicCache.
  DynamicCache only appends, and the harness writes at slot `start`: forward first crops
  the cache back to `start` slots (so the restated accepted path overwrites the tree's
  slots, as compaction would) and refuses a `start` beyond the slots the cache holds.
- `deviations`: HF's known differences from the reference semantics (docs/model.md),
  each declared only where it applies to this config and dtype, and measured by lifting
  it alone (`lifted`) on a fixed probe. With every declared deviation lifted, float64 HF
  equals the reference to rounding (tests/engine/test_hf_adapter.py), so the list is
  complete for the committed fixtures.

Every transformers from `TRANSFORMERS_MIN` on (docs/versions.md), by what the installed one has:
forward's cache argument (`CACHE_ARGUMENT`), a router that routes or one whose MoE block routes
(`_router_lift`), `q_a_layernorm` absent or None without q_lora.

Why float64 is the default: in float32 HF's float32 internals are no deviation, and
float32 rounding (about 8e-6 in the committed fixtures' logits) hides differences of
2e-6; in float64 each difference stands at its own size (1.5e-6 to 2.7e-6 on the
committed fixtures, 3.6e-5 for a latent-norm eps of 1e-5) above a rounding floor of 1e-14.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from .hf_mapping import TRANSFORMERS_MIN, deepseek_v3_kwargs, hf_state_dict

try:
    import transformers
    from packaging.version import Version
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_modeling
except ImportError as exc:
    raise ImportError(f"engine.adapters.hf needs HF transformers >= {TRANSFORMERS_MIN} "
                      f"(pip install 'transformers>={TRANSFORMERS_MIN}'): {exc}") from None
if Version(transformers.__version__) < Version(TRANSFORMERS_MIN):
    raise ImportError(f"engine.adapters.hf needs HF transformers >= {TRANSFORMERS_MIN} (before it, DeepseekV3 "
                      f"routes a dropped group's experts where the kept scores are negative); "
                      f"found {transformers.__version__}")

from kdtr_format import ModelConfig

from ..model import rope_inv_freq, rope_mscale
from ..validate.judging.deviations import Deviation
from ..weights import check_weights

LOGIT_ROWS = ("prefill logits", "verify logits")
PROBE_TOKENS = 24              # the causal prefill each deviation's effect is measured on
PROBE_SEED = 0
MEASURED_ON = f"max |logit change| lifting it alone, {PROBE_TOKENS}-token prefill of default_rng({PROBE_SEED}) tokens"
# forward's cache argument: `cache` from transformers 5.24 on, `past_key_values` before (and an alias after)
CACHE_ARGUMENT = ("cache" if "cache" in inspect.signature(transformers.DeepseekV3ForCausalLM.forward).parameters
                  else "past_key_values")

def hf_config(cfg: ModelConfig, attn_implementation: str = "eager") -> "transformers.DeepseekV3Config":
    """The `DeepseekV3Config` of a ModelConfig, with eager experts and this attention."""
    config = transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg))
    config._attn_implementation = attn_implementation
    config._experts_implementation = "eager"
    return config


# ---- HF's float32 islands, lifted: the same computations in the hidden states' dtype ----

def _rms_norm_wide(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """DeepseekV3RMSNorm.forward without its float32 cast. x [..., d] -> [..., d]."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _route_wide(config, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's sigmoid noaux_tc routing in the logits' dtype, dropped groups at -inf (the reference's).
    logits [T, E], bias [E] -> (topk_weights [T, k], topk_indices [T, k])."""
    E, G = config.n_routed_experts, config.n_group
    scores = logits.sigmoid()
    choice = scores + bias.to(logits.dtype)
    groups = choice.view(-1, G, E // G)
    kept = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(config.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(groups[..., 0]).scatter_(1, kept, 1).bool()
    choice = choice.masked_fill(~keep[..., None].expand_as(groups).reshape(-1, E), float("-inf"))
    indices = torch.topk(choice, k=config.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, indices


def _router_lift(hf: torch.nn.Module) -> list[contextlib.AbstractContextManager]:
    """HF's router (logits, sigmoid scores, expert weights) in the hidden states' dtype.

    Two layouts: the router routes (it returns logits, weights and indices), or it returns
    the logits and the MoE block routes them (`route_tokens_to_experts`, transformers < 5.13)."""
    config = hf.config
    routers = [m for m in hf.modules() if isinstance(m, hf_modeling.DeepseekV3TopkRouter)]

    def router_logits(router: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.reshape(-1, config.hidden_size)          # [T, D] -> [T, E]
        return F.linear(h, router.weight.to(h.dtype))

    if hasattr(hf_modeling.DeepseekV3MoE, "route_tokens_to_experts"):
        def route(moe: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, indices = _route_wide(config, logits, moe.gate.e_score_correction_bias)
            return indices, weights
        blocks = [m for m in hf.modules() if isinstance(m, hf_modeling.DeepseekV3MoE)]
        return [_instance_method(routers, "forward", router_logits),
                _instance_method(blocks, "route_tokens_to_experts", route)]

    def routed(router: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = router_logits(router, hidden_states)
        return (logits, *_route_wide(config, logits, router.e_score_correction_bias))
    return [_instance_method(routers, "forward", routed)]


def _rope_wide(cfg: ModelConfig) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """DeepseekV3RotaryEmbedding.forward with float64 angles, cos and sin, from the reference's
    frequencies and gain (engine.model): position_ids [b, n] -> cos, sin [b, n, d_rope] in x's dtype."""
    inv_freq, gain = rope_inv_freq(cfg), rope_mscale(cfg)

    def forward(rotary: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * gain).to(x.dtype), (emb.sin() * gain).to(x.dtype)
    return forward


@contextlib.contextmanager
def _instance_method(modules: list[torch.nn.Module], name: str, method: Callable) -> Iterator[None]:
    """Every module in `modules` runs `method` as its method `name` instead of its class's,
    until the block ends."""
    for m in modules:
        setattr(m, name, types.MethodType(method, m))
    try:
        yield
    finally:
        for m in modules:
            delattr(m, name)


@contextlib.contextmanager
def _attribute(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class HFAdapter:
    """HF's DeepseekV3ForCausalLM in `dtype` (float64 or float32) with `attn_implementation`
    ("eager" or "sdpa"): the model capability of the protocol, and `deviations`."""

    def __init__(self, dtype: torch.dtype = torch.float64, attn_implementation: str = "eager") -> None:
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"dtype: float64 or float32, got {dtype}")
        if attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"attn_implementation: 'eager' or 'sdpa', got {attn_implementation!r}")
        self.dtype, self.attn_implementation = dtype, attn_implementation
        self.name = (f"HF transformers {transformers.__version__} DeepseekV3ForCausalLM "
                     f"({str(dtype).removeprefix('torch.')}, {attn_implementation} attention)")
        self.backends = {"model": f"transformers {transformers.__version__}", "attention": attn_implementation}
        self.cfg: ModelConfig | None = None
        self.hf: torch.nn.Module | None = None
        self.cache = None
        self.max_len = 0

    # ---- the model capability ----
    def load_weights(self, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
        check_weights(config, weights)
        hf = transformers.DeepseekV3ForCausalLM(hf_config(config, self.attn_implementation))
        state = {name: torch.from_numpy(np.asarray(w, dtype=np.float32)) for name, w in
                 hf_state_dict(config, weights).items()}
        missing, unexpected = hf.load_state_dict(state, strict=False)
        missing = [name for name in missing if "rotary_emb" not in name]
        if missing or unexpected:
            raise ValueError(f"HF state dict: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.cfg, self.hf = config, hf.to(self.dtype).eval()
        self.cache, self.max_len = None, 0

    def reset(self, max_len: int) -> None:
        self.cache = transformers.DynamicCache(config=self._model().config)
        self.max_len = int(max_len)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start+n] bool -> logits [n, V] in the adapter's dtype."""
        if self.cache is None:
            raise ValueError("forward before reset(max_len)")
        n = len(tokens)
        visibility = np.asarray(visibility)
        if visibility.dtype != np.bool_ or visibility.shape != (n, start + n):
            raise ValueError(f"visibility: expected bool [{n}, {start + n}], got {visibility.dtype} "
                             f"{list(visibility.shape)}")
        if start + n > self.max_len:
            raise ValueError(f"start {start} + {n} tokens exceeds the cache's max_len {self.max_len}")
        held = self.cache.get_seq_length()
        if start > held:
            raise ValueError(f"start {start} is beyond the {held} slots HF's cache holds "
                             "(DynamicCache appends; it cannot leave a gap)")
        if start < held:
            self.cache.crop(start - held)
        return self._logits(tokens, positions, visibility, self.cache).numpy()

    # ---- known deviations ----
    def deviations(self) -> list[Deviation]:
        """HF's differences from the reference semantics for the loaded config, each with its
        measured effect (module docstring)."""
        probe = np.random.default_rng(PROBE_SEED).integers(0, self._model().config.vocab_size, PROBE_TOKENS)
        causal = np.tri(PROBE_TOKENS, dtype=bool)

        def logits() -> torch.Tensor:
            return self._logits(probe, np.arange(PROBE_TOKENS), causal, transformers.DynamicCache())

        base = logits()
        declared = []
        for name, description in self._applicable().items():
            with self.lifted(name):
                effect = float((logits() - base).abs().max())
            declared.append(Deviation(name, LOGIT_ROWS, description, effect, MEASURED_ON))
        return declared

    @contextlib.contextmanager
    def lifted(self, *names: str) -> Iterator[None]:
        """HF with the named deviations (names of `deviations()`) replaced by the reference's
        semantics until the block ends."""
        hf, cfg = self._model(), self.cfg

        def of(cls: type) -> list[torch.nn.Module]:
            return [m for m in hf.modules() if isinstance(m, cls)]

        lifts: dict[str, Callable[[], list[contextlib.AbstractContextManager]]] = {
            "latent-norm eps": lambda: [_attribute(m, "variance_epsilon", cfg.latent_norm_eps)
                                        for m in self._latent_norms()],
            "float32 RMSNorm": lambda: [_instance_method(of(hf_modeling.DeepseekV3RMSNorm), "forward",
                                                         _rms_norm_wide)],
            "float32 router": lambda: _router_lift(hf),
            "rope": lambda: [_instance_method(of(hf_modeling.DeepseekV3RotaryEmbedding), "forward",
                                              _rope_wide(cfg))],
            "float32 softmax": lambda: [_attribute(hf.config, "_attn_implementation", "sdpa")],
        }
        unknown = [name for name in names if name not in lifts]
        if unknown:
            raise ValueError(f"lifted: unknown deviation {unknown[0]!r} (known: {', '.join(lifts)})")
        with contextlib.ExitStack() as stack:
            for name in names:
                for context in lifts[name]():
                    stack.enter_context(context)
            yield

    def _applicable(self) -> dict[str, str]:
        """name -> description of each difference that applies to the loaded config and dtype."""
        hf, cfg = self._model(), self.cfg
        found = {}
        reference_eps = cfg.latent_norm_eps
        hf_eps = sorted({m.variance_epsilon for m in self._latent_norms()})
        if hf_eps != [reference_eps]:
            found["latent-norm eps"] = (f"HF's latent norms ({'q_a and ' if cfg.q_lora_rank else ''}kv_a) use eps "
                                        f"{', '.join(map(str, hf_eps))}, the reference {reference_eps}")
        wide = self.dtype == torch.float64
        if wide:
            found["float32 RMSNorm"] = "HF computes every RMSNorm in float32"
            found["float32 router"] = "HF computes router logits, sigmoid scores and expert weights in float32"
        rope = ["HF computes rope frequencies, angles, cos and sin in float32"] if wide else []
        rotary, reference_freq, reference_gain = hf.model.rotary_emb, rope_inv_freq(cfg), rope_mscale(cfg)
        freq_error = float(((rotary.inv_freq.double() - reference_freq) / reference_freq).abs().max())
        if freq_error > 1e-6:
            rope.append(f"HF's YaRN frequencies differ from the reference's by up to {freq_error:.2e} relative")
        if abs(rotary.attention_scaling - reference_gain) > 1e-12:
            rope.append(f"HF's cos/sin gain is {rotary.attention_scaling:.6g}, the reference's {reference_gain:.6g}")
        if rope:
            found["rope"] = "; ".join(rope)
        if wide and hf.config._attn_implementation == "eager":
            found["float32 softmax"] = "HF's eager attention takes its softmax in float32"
        return found

    def _latent_norms(self) -> list[torch.nn.Module]:
        return [m for layer in self._model().model.layers
                for m in (getattr(layer.self_attn, "q_a_layernorm", None), layer.self_attn.kv_a_layernorm)
                if m is not None]

    def _logits(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray, cache) -> torch.Tensor:
        """One HF forward over `cache`: tokens [n], positions [n], visibility [n, S] -> logits [n, V]."""
        mask = torch.zeros(visibility.shape, dtype=self.dtype)
        mask[~torch.from_numpy(visibility)] = float("-inf")
        with torch.no_grad():
            out = self._model()(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.int64)[None],
                                position_ids=torch.tensor(np.asarray(positions), dtype=torch.int64)[None],
                                attention_mask=mask[None, None], use_cache=True, **{CACHE_ARGUMENT: cache})
        return out.logits[0]

    def _model(self) -> torch.nn.Module:
        if self.hf is None:
            raise ValueError("the adapter has no weights: call load_weights first")
        return self.hf


def float32() -> HFAdapter:
    """HF in float32 with eager attention: the precision an engine runs."""
    return HFAdapter(torch.float32)
