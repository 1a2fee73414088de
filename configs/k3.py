"""Kimi K3 (2.8T total, 104B active): every number from the released config (docs/spec.md#configs)."""

from k3jax.config import ModelConfig

# Default parallelism (sharding/plan.py `auto_mesh`, used without --mesh or with --mesh=auto): tensor parallelism
# 'model' up to 8 (96 KDA/MLA heads, the 163840 vocab, 33792 dense and 3072 expert widths all divide by 8; kept
# within a few chips of ICI), expert parallelism 'expert' up to 64 (14 of the 896 experts per rank), every further
# device on 'data' (FSDP + batch). Non-expert weights are FSDP over data x expert: 7168 = 2^10 * 7 divides for
# data x expert <= 1024, i.e. power-of-two slices up to 8192 chips shard every weight over every device.
MESH_PLAN = {"model": 8, "expert": 64}


def config() -> ModelConfig:
    return ModelConfig(
        name="k3",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=93,
        full_attn_layers=tuple(range(4, 93, 4)) + (93,),  # 23 x (KDA, KDA, KDA, MLA) + 1 MLA
        first_k_dense_replace=1,
        intermediate_size=33792,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        kda_num_heads=96,
        kda_head_dim=128,
        kda_short_conv_kernel_size=4,
        kda_gate="lower_bound",
        kda_gate_lower_bound=-5.0,
        kda_output_gate="full_rank",
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_output_gate=True,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        latent_moe_use_norm=True,
        routed_scaling_factor=1.0,
        num_expert_group=1,
        topk_group=1,
        attn_res_block_size=12,
        num_nextn_predict_layers=0,  # the release ships no MTP layer; training turns one on
        max_position_embeddings=1048576,
    )
