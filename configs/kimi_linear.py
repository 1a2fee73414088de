"""Kimi-Linear-48B-A3B, K3's public relative (docs/spec.md#kimi-linear): softplus gate, low-rank output gate, no q LoRA,
no MLA output gate, plain residuals, full-width SiLU experts."""

from k3jax.config import ModelConfig

# Default parallelism (sharding/plan.py `auto_mesh`): expert parallelism up to 16 (16 of the 256 experts per rank),
# the rest on 'data'; no tensor parallelism (48B parameters are FSDP-sharded over data x expert).
MESH_PLAN = {"expert": 16}


def config() -> ModelConfig:
    return ModelConfig(
        name="kimi_linear",
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        full_attn_layers=(4, 8, 12, 16, 20, 24, 27),
        first_k_dense_replace=1,
        intermediate_size=9216,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        kda_num_heads=32,
        kda_head_dim=128,
        kda_short_conv_kernel_size=4,
        kda_gate="softplus",
        kda_output_gate="low_rank",
        num_attention_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_output_gate=False,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        routed_scaling_factor=2.446,
        num_expert_group=1,
        topk_group=1,
        attn_res_block_size=None,
    )
