"""Translate HF `transformers`' Kimi-Linear naming to the released checkpoint naming that `hf_names` loads.

Why this exists: `transformers` (>= 5.23) ships `models/kimi_linear`, a pure-torch implementation of Kimi-Linear
(K3's public relative, docs/spec.md#kimi-linear) that we use as an external numerical oracle. Its in-memory
modules do not use the released tensor names: on load, `transformers` applies a weight-conversion table
(`conversion_mapping.py`, key "kimi_linear") that renames and fuses tensors, and `save_pretrained` applies the
inverse only partly. To compare our model against it we must load *its* weights, so this module maps both of its
spellings back to the release naming of `k3jax.convert.hf_names` (then `load_hf_weights` does the layout change).

`KimiLinearForCausalLM.state_dict()` (in memory, transformers 5.2x)   ->  release name
  self_attn.conv1d.weight [3P,1,W] (q|k|v concatenated on dim 0)      ->  self_attn.{q,k,v}_conv1d.weight [P,1,W]
  self_attn.forget_gate.{f_a_proj.weight,f_b_proj.weight,dt_bias}     ->  self_attn.{...}
  self_attn.forget_gate.A_log [1,1,H,1]                               ->  self_attn.A_log [H]
  mlp.gate.{weight,e_score_correction_bias}                           ->  block_sparse_moe.gate.{...}
  mlp.experts.gate_up_proj [E,2M,D] (gate rows first, then up)        ->  block_sparse_moe.experts.{e}.w1/w3.weight
  mlp.experts.down_proj [E,D,M]                                       ->  block_sparse_moe.experts.{e}.w2.weight
  mlp.shared_experts.*                                                ->  block_sparse_moe.shared_experts.*
  mlp.{gate,up,down}_proj.weight on a dense layer                     ->  unchanged (the release says mlp.*)

`save_pretrained` output (the on-disk spelling) is already release-like except that it writes every layer's `mlp.`
prefix as `block_sparse_moe.`, including the dense layer 0 (`block_sparse_moe.{gate,up,down}_proj.weight`), and
keeps A_log as [1,1,H,1]. Both spellings are accepted, key by key. Whether a layer is dense or MoE, KDA or MLA is
taken from `cfg` (our ModelConfig), so a layer whose tensors do not fit the config is reported, not guessed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from k3jax.config import ModelConfig

_GLOBAL = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
# self_attn tensors whose names already agree with the release, per attention kind
_KDA_SAME = {
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "b_proj.weight", "g_proj.weight", "g_a_proj.weight",
    "g_b_proj.weight", "o_norm.weight", "o_proj.weight",
}
_MLA_SAME = {
    "q_proj.weight", "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight", "kv_b_proj.weight", "g_proj.weight", "o_proj.weight",
}
_FORGET_GATE = {"f_a_proj.weight", "f_b_proj.weight", "dt_bias"}
_DENSE_MLP = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
_MOE_SAME = {
    "gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
}
_EXPERT_SPLIT = re.compile(r"^experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a NumPy array or a torch tensor (bf16 tensors are widened to f32; NumPy has no bf16)."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def release_weights_from_transformers(state_dict: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Returns the tensors of a transformers `KimiLinearForCausalLM` (its `state_dict()` or its `save_pretrained`
    safetensors) under the released HF names that `k3jax.convert.hf_names.load_hf_weights` expects.

    Values may be NumPy arrays or torch tensors; the result holds NumPy arrays. Raises ValueError naming every key
    that has no mapping (unknown names, or names that do not fit the layer kind `cfg` gives that layer), every
    tensor whose shape does not fit `cfg`, and every release name produced twice (e.g. both spellings present).
    """
    specs = cfg.layer_specs()
    p = cfg.kda_num_heads * cfg.kda_head_dim
    e_count, m = cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    bad_shape: list[str] = []
    duplicate: list[str] = []

    def put(name: str, arr: np.ndarray) -> None:
        if name in out:
            duplicate.append(name)
        out[name] = arr

    for key, value in state_dict.items():
        if key in _GLOBAL:
            put(key, _numpy(value))
            continue
        match = _LAYER_KEY.match(key)
        if match is None or int(match.group(1)) >= len(specs):
            unknown.append(key)
            continue
        layer, local = int(match.group(1)), match.group(2)
        spec, prefix = specs[layer], f"model.layers.{layer}."

        if local in _NORMS:
            put(prefix + local, _numpy(value))
        elif local.startswith("self_attn."):
            rest = local[len("self_attn."):]
            if spec.attn == "kda" and rest == "conv1d.weight":
                arr = _numpy(value)
                if arr.ndim != 3 or arr.shape[0] != 3 * p or arr.shape[1] != 1:
                    bad_shape.append(f"{key} {arr.shape} (expected [3*{p}, 1, W])")
                    continue
                for i, part in enumerate("qkv"):
                    put(f"{prefix}self_attn.{part}_conv1d.weight", np.ascontiguousarray(arr[i * p:(i + 1) * p]))
            elif spec.attn == "kda" and rest in ("forget_gate.A_log", "A_log"):
                put(prefix + "self_attn.A_log", _numpy(value).reshape(-1))
            elif spec.attn == "kda" and rest.startswith("forget_gate.") and rest[len("forget_gate."):] in _FORGET_GATE:
                put(prefix + "self_attn." + rest[len("forget_gate."):], _numpy(value))
            elif rest in (_KDA_SAME if spec.attn == "kda" else _MLA_SAME):
                put(prefix + local, _numpy(value))
            else:
                unknown.append(key)
        elif local.startswith(("mlp.", "block_sparse_moe.")):
            rest = local.split(".", 1)[1]
            if spec.ffn == "dense":
                if rest in _DENSE_MLP:
                    put(prefix + "mlp." + rest, _numpy(value))
                else:
                    unknown.append(key)
                continue
            moe = prefix + "block_sparse_moe."
            if rest in _MOE_SAME:
                put(moe + rest, _numpy(value))
            elif rest == "experts.gate_up_proj":
                arr = _numpy(value)
                if arr.ndim != 3 or arr.shape[0] != e_count or arr.shape[1] != 2 * m:
                    bad_shape.append(f"{key} {arr.shape} (expected [{e_count}, 2*{m}, D])")
                    continue
                for e in range(e_count):
                    put(f"{moe}experts.{e}.w1.weight", np.ascontiguousarray(arr[e, :m]))  # gate
                    put(f"{moe}experts.{e}.w3.weight", np.ascontiguousarray(arr[e, m:]))  # up
            elif rest == "experts.down_proj":
                arr = _numpy(value)
                if arr.ndim != 3 or arr.shape[0] != e_count or arr.shape[2] != m:
                    bad_shape.append(f"{key} {arr.shape} (expected [{e_count}, D, {m}])")
                    continue
                for e in range(e_count):
                    put(f"{moe}experts.{e}.w2.weight", np.ascontiguousarray(arr[e]))
            elif (split := _EXPERT_SPLIT.match(rest)) is not None and int(split.group(1)) < e_count:
                put(moe + rest, _numpy(value))
            else:
                unknown.append(key)
        else:
            unknown.append(key)

    problems = []
    if unknown:
        problems.append(f"{len(unknown)} key(s) with no release name for config {cfg.name!r}: {sorted(unknown)}")
    if bad_shape:
        problems.append(f"tensor(s) whose shape does not fit config {cfg.name!r}: {bad_shape}")
    if duplicate:
        problems.append(f"release name(s) produced more than once (two spellings of one tensor?): "
                        f"{sorted(set(duplicate))}")
    if problems:
        raise ValueError("; ".join(problems))
    return out


def kimi_linear_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments of transformers' ``KimiLinearConfig`` with exactly ``cfg``'s dimensions (the oracle tests
    and the HF side-by-side benchmark build the HF model from them; dtype / attention choice are the caller's)."""
    specs = cfg.layer_specs()
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        linear_attn_config={"full_attn_layers": [s.index + 1 for s in specs if s.attn == "mla"],
                            "kda_layers": [s.index + 1 for s in specs if s.attn == "kda"],
                            "head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_num_heads,
                            "short_conv_kernel_size": cfg.kda_short_conv_kernel_size},
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
        n_shared_experts=cfg.num_shared_experts, routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.moe_renormalize, n_group=cfg.num_expert_group, topk_group=cfg.topk_group,
        first_k_dense_replace=cfg.first_k_dense_replace, hidden_act=cfg.hidden_act, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, max_position_embeddings=cfg.max_position_embeddings,
    )
