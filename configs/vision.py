"""Named vision tower + projector configs for multimodal training (`train.py --vision_config NAME`), as the field
values of a `k3jax.vision.VisionConfig` (built by `k3jax.training.multimodal.named_vision_config`; configs sits
below k3jax.vision). A converted release carries its own (manifest["hf"]["vision"])."""


def k3() -> dict:
    """K3's MoonViT-V2 tower and patchmergerv2 projector into the 7168-wide text stream (VisionConfig's defaults)."""
    return {}


def tiny() -> dict:
    """K3's tower kinds at toy size for the `tiny` text config (64 wide): 4-pixel patches, an 8 x 8 learned
    position grid, 2 layers of width 32 (2 heads of 16), 2 x 2 merge."""
    return dict(patch_size=4, init_pos_emb_height=8, init_pos_emb_width=8, vt_num_attention_heads=2,
                vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64, qkv_hidden_size=32,
                mm_hidden_size=32, text_hidden_size=64)
