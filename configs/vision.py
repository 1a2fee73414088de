"""Named vision tower + projector configs (`k3jax.vision.VisionConfig`) for multimodal training
(`train.py --vision_config NAME`); a converted release carries its own (manifest["hf"]["vision"])."""

from k3jax.vision.config import VisionConfig


def k3() -> VisionConfig:
    """K3's MoonViT-V2 tower and patchmergerv2 projector into the 7168-wide text stream (the defaults)."""
    return VisionConfig()


def tiny() -> VisionConfig:
    """K3's tower kinds at toy size for the `tiny` text config (64 wide): 4-pixel patches, an 8 x 8 learned
    position grid, 2 layers of width 32 (2 heads of 16), 2 x 2 merge."""
    return VisionConfig(patch_size=4, init_pos_emb_height=8, init_pos_emb_width=8, vt_num_attention_heads=2,
                        vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64, qkv_hidden_size=32,
                        mm_hidden_size=32, text_hidden_size=64)
