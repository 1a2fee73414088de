"""HF `config.json` <-> ModelConfig.

Two formats are read:
- K3 (multimodal release): top level holds `text_config` (the text backbone fields), `linear_attn_config` (KDA:
  1-based `kda_layers`/`full_attn_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`, `gate_lower_bound`,
  `use_full_rank_gate`; accepted at top level or inside `text_config`), `quantization_config` (MXFP4 experts) and
  vision fields (ignored). Missing K3-only fields take the K3 values (`configs/k3.py`).
- Kimi-Linear (flat, as `transformers` `KimiLinearConfig` writes it): the same field names at top level; missing
  fields take the Kimi-Linear semantics (softplus gate, low-rank output gate, no MLA gate, no AttnRes, no latent).
Aliases used by other writers (`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `norm_topk_prob`,
`n_group`, `model_max_length`) are accepted; unrelated HF keys are ignored. Any of our own field names present in
the text config is taken as is (so a config written by `config_to_hf` reads back exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from k3jax.config import ConfigError, ModelConfig

# The architecture fields: every ModelConfig field but `runtime` (how the model runs is never in config.json).
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "runtime")
# Architecture fields that describe the model but not the checkpoint's tensors, so `check_config` lets them differ:
# the config's name, the initialisation scale and the context limit.
_UNCHECKED = frozenset({"name", "initializer_range", "max_position_embeddings"})

_SAME = ["vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size", "hidden_act",
         "activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "tie_word_embeddings",
         "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "num_attention_heads", "q_lora_rank",
         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate",
         "mla_lora_norm_eps", "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
         "routed_scaling_factor", "topk_group", "attn_res_block_size", "num_nextn_predict_layers",
         "max_position_embeddings", "kda_gate", "kda_gate_lower_bound", "kda_output_gate",
         "kda_num_heads", "kda_head_dim", "kda_short_conv_kernel_size", "full_attn_layers",
         "num_experts", "num_experts_per_token", "num_shared_experts", "moe_renormalize", "num_expert_group"]
_ALIASES = {
    "num_local_experts": "num_experts", "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group", "model_max_length": "max_position_embeddings",
}
_LINEAR = {"num_heads": "kda_num_heads", "head_dim": "kda_head_dim",
           "short_conv_kernel_size": "kda_short_conv_kernel_size", "gate_lower_bound": "kda_gate_lower_bound",
           "full_attn_layers": "full_attn_layers"}
_KIMI_LINEAR_DEFAULTS = dict(kda_gate="softplus", kda_output_gate="low_rank", mla_use_output_gate=False,
                             attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
                             hidden_act="silu", q_lora_rank=None)


def is_k3_format(hf: Mapping[str, Any]) -> bool:
    return "text_config" in hf


def config_from_hf(hf: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """Builds our ModelConfig from a parsed HF `config.json` (K3 nested or Kimi-Linear flat). Pure."""
    k3 = is_k3_format(hf)
    text = dict(hf["text_config"]) if k3 else dict(hf)
    lin = dict(hf.get("linear_attn_config") or text.get("linear_attn_config") or {})
    values: dict[str, Any] = {} if k3 else dict(_KIMI_LINEAR_DEFAULTS)
    for key, value in text.items():
        field = _ALIASES.get(key, key)
        if field in _SAME and (key == field or field not in text):
            values[field] = value
    for key, field in _LINEAR.items():
        if key in lin:
            values[field] = lin[key]
    if "gate_lower_bound" in lin:
        values["kda_gate"] = "lower_bound"
    if "use_full_rank_gate" in lin:
        values["kda_output_gate"] = "full_rank" if lin["use_full_rank_gate"] else "low_rank"
    n = values.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    if "full_attn_layers" in values:
        values["full_attn_layers"] = tuple(int(i) for i in values["full_attn_layers"])
        if "kda_layers" in lin:
            kda = set(int(i) for i in lin["kda_layers"])
            full = set(values["full_attn_layers"])
            if kda & full or kda | full != set(range(1, n + 1)):
                raise ConfigError(f"linear_attn_config: kda_layers {sorted(kda)} and full_attn_layers {sorted(full)} "
                                  f"must partition the 1-based layers 1..{n}")
    elif "layer_types" in text:
        values["full_attn_layers"] = tuple(i + 1 for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    elif not k3:
        raise ConfigError("config.json has no linear_attn_config.full_attn_layers (nor layer_types)")
    if "layer_types" in text and "full_attn_layers" in values:
        from_types = tuple(i + 1 for i, t in enumerate(text["layer_types"]) if t == "full_attention")
        if tuple(sorted(values["full_attn_layers"])) != from_types:
            raise ConfigError(f"layer_types marks full attention at {from_types} but linear_attn_config."
                              f"full_attn_layers is {tuple(sorted(values['full_attn_layers']))}")
    heads = values.get("num_attention_heads")
    kv = text.get("num_key_value_heads")
    if kv is not None and heads is not None and kv != heads:
        raise ConfigError(f"num_key_value_heads={kv} != num_attention_heads={heads}: MLA here has one kv head per "
                          f"query head")
    for key in ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta",
                "kda_gate_lower_bound", "mla_lora_norm_eps"):
        if key in values and isinstance(values[key], int) and not isinstance(values[key], bool):
            values[key] = float(values[key])
    values["name"] = name
    base = ModelConfig()  # K3 defaults for anything the file leaves out
    return base.replace(**values)


def check_config(from_hf: ModelConfig, named: ModelConfig) -> None:
    """Raises ConfigError listing EVERY architecture field on which the HF config and the named config differ."""
    diffs = []
    for name in ARCH_FIELDS:
        if name in _UNCHECKED:
            continue
        a, b = getattr(from_hf, name), getattr(named, name)
        if name == "full_attn_layers":
            a, b = tuple(sorted(a)), tuple(sorted(b))
        if a != b:
            diffs.append(f"{name}: config.json has {a!r}, --config {named.name!r} has {b!r}")
    if diffs:
        raise ConfigError(f"config.json disagrees with --config {named.name!r} on {len(diffs)} field(s):\n  "
                          + "\n  ".join(diffs))


def config_to_hf(cfg: ModelConfig, *, k3_format: bool | None = None, torch_dtype: str = "bfloat16",
                 quantization_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An HF config.json for `cfg` (K3 nested format when it uses AttnRes or a latent MoE, else Kimi-Linear flat).
    `config_from_hf(config_to_hf(cfg))` reproduces every architecture field of `cfg`."""
    if k3_format is None:
        k3_format = cfg.uses_attn_res or cfg.routed_expert_hidden_size is not None
    n = cfg.num_hidden_layers
    full = sorted(cfg.full_attn_layers)
    lin = {"full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in set(full)],
           "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
           "short_conv_kernel_size": cfg.kda_short_conv_kernel_size}
    if cfg.kda_gate == "lower_bound":
        lin["gate_lower_bound"] = cfg.kda_gate_lower_bound
    lin["use_full_rank_gate"] = cfg.kda_output_gate == "full_rank"
    text = {name: getattr(cfg, name) for name in ARCH_FIELDS
            if name not in {"name", "full_attn_layers", "kda_num_heads", "kda_head_dim", "kda_short_conv_kernel_size",
                            "kda_gate_lower_bound"}}
    text["num_key_value_heads"] = cfg.num_attention_heads
    text["torch_dtype"] = torch_dtype
    if k3_format:
        out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "text_config": {**text, "model_type": "kimi_k3_text"}, "linear_attn_config": lin,
               "torch_dtype": torch_dtype}
        if quantization_config is not None:
            out["quantization_config"] = dict(quantization_config)
        return out
    out = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **text, "linear_attn_config": lin}
    if quantization_config is not None:
        out["quantization_config"] = dict(quantization_config)
    return out
