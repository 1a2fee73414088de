"""The MoonViT vision tower and projector of multimodal K3 (docs/spec.md, "Vision tower"): config, NaViT packing,
NNX modules, NumPy image preprocessing and the multimodal forward (image tokens merged into the text stream).
Imports only configs, k3jax.config, k3jax.ops and k3jax.layers."""

from k3jax.vision.config import VisionConfig
from k3jax.vision.merge import MEDIA_PLACEHOLDER_ID, merge_image_tokens
from k3jax.vision.multimodal import K3VisionLanguageModel, expand_media_placeholders
from k3jax.vision.packing import PackedLayout, pack
from k3jax.vision.tower import VisionModel, split_images

__all__ = ["MEDIA_PLACEHOLDER_ID", "K3VisionLanguageModel", "VisionConfig", "PackedLayout", "VisionModel",
           "expand_media_placeholders", "merge_image_tokens", "pack", "split_images"]
