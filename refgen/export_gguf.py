"""An export's model as one GGUF file for llama.cpp (`refgen export --gguf`), written with the `gguf`
package as llama.cpp's own converter writes a DeepseekV3 checkpoint (convert_hf_to_gguf.py's
DeepseekV2Model, llama.cpp's `deepseek2` architecture), but for the tokenizer: that converter refuses
the export's word-level vocabulary ("BPE pre-tokenizer was not recognized": it identifies a tokenizer
by the hash of its ids for a test text, and knows published ones only).

- Metadata: the converter's keys for this config: MLA widths (key/value lengths, their `_mla` forms),
  experts, sigmoid gating, group routing, YaRN (type, factor, original context, beta fast / slow, and
  `yarn_log_multiplier` = 0.1 mscale_all_dim, as the converter writes it; llama.cpp ignores
  `mscale`, a known difference: docs/serving.md).
- Tensors: HF names mapped by gguf's own name map for `deepseek2`; routed experts stacked [E, ...];
  `kv_b_proj` split into `attn_k_b` [H, kv_lora, nope] (transposed per head) and `attn_v_b`
  [H, v, kv_lora], as the converter does for llama.cpp's absorbed MLA; the correction bias as
  `exp_probs_b.bias`. float32 exports store F32, bfloat16 ones BF16 for matrices (vectors and the
  router `ffn_gate_inp` F32, as the converter keeps them). The MTP layer is left out, as the
  converter leaves it out.
- Tokenizer: llama.cpp's `rwkv` model (a trie of byte strings, longest match first, text out as
  the tokens' bytes), token i the text " t<i>" (the export's word `t<i>` of tokenizer.json, a
  space before it), normal tokens, no special ones: a reply detokenizes to " t762 t465 ...",
  whose words the client reads back through tokenizer.json, and " t5 t17" tokenizes to [5, 17].
  No token ends generation (`ignore_eos` masks none); no BOS is added. (A BPE vocabulary of the
  words, as `whitespace` pre-tokenizes for it, detokenizes without spaces: "t762t465".)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from kdtr_format import ModelConfig

GGUF_FILE = "model.gguf"
ARCH = "deepseek2"
F32_MATRICES = ("ffn_gate_inp.weight",)       # the router: F32 in a BF16 file, as the converter keeps it


def _gguf():
    import gguf                     # refgen.export.check_out refuses --gguf first when it is not installed

    return gguf


def gguf_tensors(cfg: ModelConfig, hf_name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """One HF tensor (routed experts stacked, named model.layers.{i}.mlp.experts.{part}_proj.weight)
    -> its GGUF tensors (module docstring)."""
    gguf = _gguf()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    if hf_name.endswith("kv_b_proj.weight"):
        H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = weight.reshape(H, dn + dv, cfg.kv_lora_rank)
        for part, value in (("k_b_proj", kv_b[:, :dn].transpose(0, 2, 1)), ("v_b_proj", kv_b[:, dn:])):
            yield names.get_name(hf_name.replace("kv_b_proj", part), try_suffixes=(".weight",)), value
        return
    hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"{hf_name}: no GGUF name for it in gguf's deepseek2 map")
    yield name, weight


def write_gguf(path: Path, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: str,
               token_text) -> int:
    """The GGUF file of `cfg` with the HF-named `tensors` (experts stacked) stored for `dtype`
    ("float32" or "bfloat16") -> its bytes."""
    gguf = _gguf()
    writer = gguf.GGUFWriter(str(path), ARCH)
    _metadata(writer, gguf, cfg, dtype)
    tokens = [f" {token_text(i)}" for i in range(cfg.vocab_size)]       # the vocabulary: module docstring
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    for hf_name, weight in tensors:
        for name, value in gguf_tensors(cfg, hf_name, np.asarray(weight, np.float32)):
            value = np.ascontiguousarray(value, np.float32)
            if dtype == "bfloat16" and value.ndim > 1 and not name.endswith(F32_MATRICES):
                # the quantized bytes: the writer takes their shape for a byte shape, [..., 2 n]
                writer.add_tensor(name, gguf.quants.quantize(value, gguf.GGMLQuantizationType.BF16),
                                  raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def _metadata(writer, gguf, cfg: ModelConfig, dtype: str) -> None:
    """The converter's keys for this config (convert_hf_to_gguf: TextModel and DeepseekV2Model)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)                              # MLA as MQA over the latent
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bfloat16" else gguf.LlamaFileType.ALL_F32)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    yarn = cfg.rope_scaling
    if yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(yarn.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(yarn.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(yarn.beta_slow)
        writer.add_rope_scaling_yarn_log_mul(0.1 * yarn.mscale_all_dim)
