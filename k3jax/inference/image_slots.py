"""Image requests in the continuous-batching scheduler: the vision tower for serving and the admission program
that prefills a prompt whose placeholders carry image tokens.

`ImageEncoder(vision, placeholder_id, text_cfg)` runs the tower + projector on one image at a time (one compile per
image grid; attention is block-diagonal per image, so encoding images one by one equals encoding them packed) and
returns a request's image tokens in placeholder order. `admit_with_images` is `slot_steps.admit_slots` from
merged embeddings: the prompt's token embeddings with the k-th placeholder row replaced by the k-th image token
(`k3jax.vision.merge_image_tokens`), then the text model's cached forward from embeddings
(`K3Model.hidden_states_cached_from_embeddings`), exactly the multimodal model's prefill
(`K3VisionLanguageModel.forward_cached`). Image tokens are padded to a power-of-two row count (the surplus is
never read), so admission compiles once per (prompt bucket, image-token bucket).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.convert.vision import load_vision_weights, open_vision, read_vision, vision_item_to_release
from k3jax.convert.vision_load import load_vision_checkpoint
from k3jax.data.prepare import BYTE_PAD
from k3jax.inference.engine import MIN_PROMPT_BUCKET, bucket
from k3jax.inference.images import ImageInput
from k3jax.inference.slot_steps import TRACE_COUNTS, SlotState, _install_impl, _pinned, merge_model
from k3jax.model import init_cache
from k3jax.vision import MEDIA_PLACEHOLDER_ID, VisionModel, merge_image_tokens, pack


class ImageEncoder:
    """The serving vision tower: `encode(images)` -> image tokens [M_padded, D_text] (rows past the images' tokens
    are zeros and never read)."""

    def __init__(self, vision: VisionModel, placeholder_id: int, text_cfg):
        if vision.cfg.text_hidden_size != text_cfg.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size ({vision.cfg.text_hidden_size}) must equal the text "
                             f"model's hidden_size ({text_cfg.hidden_size})")
        if not 0 <= placeholder_id < text_cfg.vocab_size:
            raise ValueError(f"image placeholder id {placeholder_id} is outside the vocabulary [0, "
                             f"{text_cfg.vocab_size})")
        self.cfg = vision.cfg
        self.placeholder_id = int(placeholder_id)
        self.graphdef, self.params = nnx.split(vision)
        self._encode_one = jax.jit(self._encode_impl, static_argnames=("grid",))

    def _encode_impl(self, params, pixels, *, grid):
        TRACE_COUNTS["vision_encode"] += 1
        return nnx.merge(self.graphdef, params)(pixels, pack([grid], self.cfg))

    def encode(self, images: Sequence[ImageInput]) -> jax.Array:
        rows = [self._encode_one(self.params, jnp.asarray(im.pixels), grid=tuple(im.grid)) for im in images]
        tokens_md = jnp.concatenate(rows, axis=0)
        m = tokens_md.shape[0]
        return jnp.pad(tokens_md, ((0, bucket(m, MIN_PROMPT_BUCKET) - m), (0, 0)))


@functools.partial(jax.jit, static_argnames=("spec", "layout", "max_len", "page_size", "placeholder_id", "mesh"),
                   donate_argnums=(1, 2))
def admit_with_images(params, cache, state: SlotState, ids_nt, tokens_md, lens_n, slot_n, table_np,
                      new: SlotState, *, spec, layout, max_len, page_size, placeholder_id, mesh):
    """Prefills n prompts from merged embeddings (their placeholders take tokens_md's rows in order, row-major)
    and installs them in their slots. Returns (cache, state, tokens, done, their logprobs)."""
    TRACE_COUNTS["admit_images"] += 1
    model = merge_model(spec, params)
    layout = layout.value
    fresh = init_cache(model.cfg, ids_nt.shape[0], max_len, page_size=page_size, num_pages=1)
    fresh = layout.join(layout.split(fresh._replace(page_table=table_np))[0], layout.split(cache)[1])
    embeds_ntd = merge_image_tokens(model.embed(ids_nt), ids_nt, tokens_md, placeholder_id=placeholder_id)
    h_ntd, fresh = model.hidden_states_cached_from_embeddings(embeds_ntd, fresh, lens_n)
    logits_nv = model.logits(jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1))[:, 0]
    cache, state, tok_n, done_n, lps = _install_impl(cache, state, fresh, logits_nv, slot_n, new, layout, False)
    return (*_pinned(cache, state, mesh), tok_n, done_n, lps)


def count_placeholders(ids: Sequence[int], placeholder_id: int) -> int:
    return int(np.sum(np.asarray(ids) == placeholder_id))


def default_placeholder_id(cfg) -> int:
    """The release's `<|media_pad|>` id where the vocabulary has it, else the first id after the byte tokenizer's
    specials (the multimodal data preparation's default for byte-tokenized tiny models)."""
    return MEDIA_PLACEHOLDER_ID if cfg.vocab_size > MEDIA_PLACEHOLDER_ID else BYTE_PAD + 1


def load_serving_vision(*, checkpoint: str | None = None, hf_dir: str | None = None) -> VisionModel | None:
    """The vision tower + projector of a k3jax checkpoint (`params/vision`) or an HF directory (`vision_tower.*`,
    `mm_projector.*` per config.json's vision_config), float32; None when it has none."""
    if checkpoint:
        return load_vision_checkpoint(checkpoint)
    if not hf_dir:
        return None
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        src, _ = open_vision(hf_dir, json.load(f), text_only=False)
    if src is None:
        return None
    vision = VisionModel(src.cfg, rngs=nnx.Rngs(0))
    load_vision_weights(vision, vision_item_to_release(read_vision(src), src.cfg))
    return vision
