"""Fixture writer for the conversion tests: tiny random HF directories in both released layouts, written with
`safetensors.numpy` (not with k3jax's writer) and an MXFP4 encoder written here, independently of
`k3jax.convert.mxfp4` (which only decodes).

- K3 layout: `language_model.` prefix, bf16 tensors except the f32 ones of docs/spec.md#checkpoint, MXFP4 routed experts
  (`weight_packed` / `weight_scale`), `A_log` stored with a zero tail, nested config.json (`text_config`,
  `linear_attn_config`, `quantization_config`, `vision_config`); with `vision=True` also two placeholder vision
  tensors (which match no vision_config: a conversion refuses them unless `text_only`).
- Kimi-Linear layout: no prefix, flat config.json, f32 `experts.{e}.wN.weight`.
Both are split into >= 2 shards with `model.safetensors.index.json`.

`write_hf_dir` returns the weights exactly as stored (f32 copies of the bf16 values; decoded experts), which is
what the float64 reference forward must see.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from tests.reference import numpy_k3 as ref

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias",
                 "routed_expert_norm.weight")


def mxfp4_encode(w: np.ndarray):
    """Round-to-nearest MXFP4 of [out, in]: (packed u8 [out, in/2], scale u8 [out, in/32], dequantized f64)."""
    w = np.asarray(w, np.float64)
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // 32, 32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).astype(np.int64)
    exp = np.clip(exp, -127, 127)
    scaled = np.abs(g) / np.ldexp(1.0, exp)[..., None]
    mag = np.abs(scaled[..., None] - _E2M1).argmin(-1)  # nearest magnitude code 0..7
    sign = (g < 0) & (mag > 0)
    codes = (mag + 8 * sign).astype(np.uint8).reshape(out_f, in_f)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = (exp + 127).astype(np.uint8)
    deq = np.where(sign, -1.0, 1.0) * _E2M1[mag] * np.ldexp(1.0, exp)[..., None]
    return packed, scale, deq.reshape(out_f, in_f)


def separate_routing(weights, cfg):
    """A well-separated router bias (it only selects experts) so f32 noise cannot flip top-k near-ties."""
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = (np.arange(cfg.num_experts) * 10.0).astype(np.float32)
    return weights


def k3_hf_config(cfg, a_log_len):
    mla = sorted(cfg.full_attn_layers)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "kimi_k3_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "first_k_dense_replace": cfg.first_k_dense_replace,
            "intermediate_size": cfg.intermediate_size, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
            "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "mla_use_output_gate": True, "num_experts": cfg.num_experts,
            "num_experts_per_token": cfg.num_experts_per_token, "num_shared_experts": cfg.num_shared_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "routed_expert_hidden_size": cfg.routed_expert_hidden_size, "latent_moe_use_norm": True,
            "routed_scaling_factor": cfg.routed_scaling_factor, "moe_renormalize": True, "num_expert_group": 1,
            "topk_group": 1, "attn_res_block_size": cfg.attn_res_block_size, "num_nextn_predict_layers": 0,
            "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": "bfloat16",
        },
        "linear_attn_config": {
            "full_attn_layers": mla,
            "kda_layers": [i for i in range(1, cfg.num_hidden_layers + 1) if i not in mla],
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda_short_conv_kernel_size, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "a_log_storage_size": a_log_len,
        },
        "quantization_config": {"quant_method": "mxfp4", "group_size": 32, "scale_format": "e8m0",
                                "modules": ["experts"]},
        "vision_config": {"patch_size": 14, "hidden_size": 32},
    }


def kimi_linear_hf_config(cfg):
    mla = sorted(cfg.full_attn_layers)
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "first_k_dense_replace": cfg.first_k_dense_replace, "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": None, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token, "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size, "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1, "model_max_length": 1048576,
        "linear_attn_config": {
            "full_attn_layers": mla,
            "kda_layers": [i for i in range(1, cfg.num_hidden_layers + 1) if i not in mla],
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda_short_conv_kernel_size,
        },
    }


def write_hf_dir(path, cfg, *, k3: bool, seed: int = 0, a_log_len: int | None = None, n_shards: int = 2,
                 vision: bool = False):
    """Writes a random HF directory for `cfg`; returns (stored weights as f32, without prefix, experts decoded;
    the raw stored tensors keyed by their file names)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    weights = separate_routing(ref.make_random_weights(cfg, seed=seed, a_log_len=a_log_len), cfg)
    stored, decoded = {}, {}
    prefix = "language_model." if k3 else ""
    for name, w in weights.items():
        if k3 and ".experts." in name:
            packed, scale, deq = mxfp4_encode(w)
            stored[prefix + name + "_packed"] = packed
            stored[prefix + name + "_scale"] = scale
            decoded[name] = deq.astype(np.float32)
        elif k3 and not name.endswith(_F32_SUFFIXES):
            stored[prefix + name] = w.astype(ml_dtypes.bfloat16)
            decoded[name] = stored[prefix + name].astype(np.float32)
        else:
            stored[prefix + name] = w
            decoded[name] = w
    if vision:
        stored["vision_tower.patch_embed.proj.weight"] = np.ones((4, 3, 14, 14), ml_dtypes.bfloat16)
        stored["mm_projector.proj.0.weight"] = np.ones((16, 16), ml_dtypes.bfloat16)
    names = list(stored)
    per = -(-len(names) // n_shards)
    weight_map = {}
    for s in range(n_shards):
        file = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {n: np.ascontiguousarray(stored[n]) for n in names[s * per:(s + 1) * per]}
        save_file(chunk, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    hf_cfg = k3_hf_config(cfg, a_log_len) if k3 else kimi_linear_hf_config(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    return decoded, stored


def test_encoder_is_exact_on_representable_values():
    """The test-side encoder: values already on the MXFP4 grid come back unchanged, nibble order as specified."""
    rng = np.random.default_rng(0)
    mag = _E2M1[rng.integers(0, 8, (4, 64))] * np.where(rng.random((4, 64)) < 0.5, -1, 1)
    mag[:, ::32] = 6.0  # each group reaches the top code, so the scale is fixed by the group
    w = mag * np.ldexp(1.0, rng.integers(-10, 5, (4, 2))).repeat(32, axis=1)
    packed, scale, deq = mxfp4_encode(w)
    np.testing.assert_array_equal(deq, w)
    assert packed[0, 0] & 0x0F == 7  # column 0 (even) = +6.0 = code 7 in the low nibble
