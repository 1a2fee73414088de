"""The vision tower of a k3jax checkpoint (`OUT/params/vision`, described by manifest["hf"]["vision"]) as a
`k3jax.vision.VisionModel`."""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from k3jax.convert.checkpoint import read_manifest, restore_item
from k3jax.convert.vision import VISION_ITEM, load_vision_weights, vision_item_to_release
from k3jax.vision import VisionConfig, VisionModel


def load_vision_checkpoint(ckpt: str, *, dtype=jnp.float32, param_dtype=None) -> VisionModel | None:
    """The checkpoint's vision tower + projector (weights cast to `param_dtype`, default `dtype`), or None when it
    holds none (a text-only conversion). The item is checked against its recorded hash."""
    manifest, _ = read_manifest(ckpt)
    meta = manifest.get("hf", {}).get("vision")
    if not meta:
        return None
    cfg = VisionConfig.from_dict(meta["config"])
    arrays = restore_item(os.path.join(ckpt, "params", VISION_ITEM), meta.get("hash"))
    model = VisionModel(cfg, dtype=dtype, param_dtype=param_dtype or dtype, rngs=nnx.Rngs(0))
    load_vision_weights(model, vision_item_to_release(arrays, cfg))
    return model
