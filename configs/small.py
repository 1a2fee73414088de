"""Small configs: `tiny` (CPU tests and the README's training run) and `k3_gpu` (K3-shaped, one H200)."""

from configs import k3, kimi_linear
from k3jax.config import ModelConfig, RuntimeConfig

# Byte-level tokenizer ids for the tiny configs: bytes 0..255, then specials.
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258


# Toy dimensions shared by both tiny variants (every head/latent width small, same layer kinds as the originals).
_TOY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    bos_token_id=BYTE_BOS,
    eos_token_id=BYTE_EOS,
    pad_token_id=BYTE_PAD,
    kda_num_heads=2,
    kda_head_dim=32,
    num_attention_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=8,
    num_experts_per_token=2,
    moe_intermediate_size=32,
    max_position_embeddings=8192,
    # f32 so CPU runs are fast and tests are tight; one decode step per loop iteration: half the decode compile
    # time on CPU (the unroll pays on GPUs)
    runtime=RuntimeConfig(param_dtype="float32", dtype="float32", kda_chunk_size=32, decode_loop_unroll=1),
)


def tiny() -> ModelConfig:
    """Every K3 layer kind at toy size: 13 layers = KDA x3 + MLA repeated (layer 0 dense), trailing MLA, 4 AttnRes
    blocks, latent MoE with SiTU, 2 scanned units. f32 so CPU runs are fast and tests are tight."""
    return k3.config().replace(
        name="tiny",
        num_hidden_layers=13,
        full_attn_layers=(4, 8, 12, 13),
        q_lora_rank=32,
        num_shared_experts=1,
        routed_expert_hidden_size=32,
        attn_res_block_size=4,
        **_TOY,
    )


def tiny_kimi_linear() -> ModelConfig:
    """The Kimi-Linear variant at toy size (used against HF transformers' kimi_linear)."""
    return kimi_linear.config().replace(name="tiny_kimi_linear", num_hidden_layers=8, full_attn_layers=(4, 8), **_TOY)


def k3_gpu() -> ModelConfig:
    """K3-shaped (same layer pattern family, head dims 128/192, latent MoE, AttnRes) at ~2B total parameters,
    sized for one H200; used by the GPU benchmarks."""
    return k3.config().replace(
        name="k3_gpu",
        hidden_size=1536,
        num_hidden_layers=17,
        full_attn_layers=(4, 8, 12, 16, 17),
        intermediate_size=6144,
        kda_num_heads=12,
        num_attention_heads=12,
        q_lora_rank=768,
        kv_lora_rank=512,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=2,
        moe_intermediate_size=768,
        routed_expert_hidden_size=768,
        attn_res_block_size=4,
    )
