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

Through the prefix cache (`extend_chunk`, `ImageEncoder.key_ids`): a prompt is prefilled in chunks, each chunk from
merged embeddings with the rows of its own placeholders (`extend_with_images`), and the cache keys are built from
the ids with every placeholder of an image replaced by a negative value derived from the image's pixel digest, so
a prefix holding an image matches only a prompt holding the same image there (text blocks before the first image
still match any prompt).
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
from k3jax.inference import sharded
from k3jax.inference.engine import MIN_PROMPT_BUCKET, bucket
from k3jax.inference.images import ImageInput
from k3jax.inference.slot_steps import (
    TRACE_COUNTS,
    SlotState,
    _install_impl,
    _pinned,
    extend_sequences,
    merge_model,
)
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

    def key_ids(self, ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """The prefix-cache key sequence of a prompt: `ids` with the placeholders of image k replaced by
        -(the first 60 bits of its pixel digest) - 1 (never a token id; equal only for the same pixels)."""
        marks = [-int(im.digest[:15], 16) - 1 for im in images for _ in range(im.num_tokens)]
        out, k = [], 0
        for i in ids:
            if i == self.placeholder_id:
                out.append(marks[k])
                k += 1
            else:
                out.append(int(i))
        return out

    def chunk_rows(self, tokens_md: jax.Array, ids: Sequence[int], start: int, width: int) -> jax.Array:
        """The image-token rows of the placeholders in ids[start:start + width], padded to `width` rows."""
        ids_n = np.asarray(ids)
        first = count_placeholders(ids_n[:start], self.placeholder_id)
        rows = tokens_md[first:first + count_placeholders(ids_n[start:start + width], self.placeholder_id)]
        return jnp.pad(rows, ((0, width - rows.shape[0]), (0, 0)))


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


@functools.partial(jax.jit, static_argnames=("spec", "layout", "placeholder_id", "mesh"), donate_argnums=(2,))
def extend_with_images(params, seq_n, pools, ids_nt, rows_md, lens_n, *, spec, layout, placeholder_id, mesh):
    """`slot_steps.extend_sequences` from merged embeddings: the chunk's placeholders take rows_md's rows in
    order. Returns (seq_n, pools, last-token logits)."""
    TRACE_COUNTS["extend_images"] += 1
    layout = layout.value
    model = merge_model(spec, params)
    embeds_ntd = merge_image_tokens(model.embed(ids_nt), ids_nt, rows_md, placeholder_id=placeholder_id)
    h_ntd, cache_n = model.hidden_states_cached_from_embeddings(embeds_ntd, layout.join(seq_n, pools), lens_n)
    logits_nv = model.logits(jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1))[:, 0]
    return (*layout.split(sharded.constrain_cache(cache_n, mesh.value)), logits_nv)


def extend_chunk(params, seq_n, pools, ids_nt, lens_n, *, spec, layout, mesh, images: ImageEncoder | None,
                 tokens_md, ids: Sequence[int], start: int):
    """A prefix-cache chunk: `extend_sequences`, or `extend_with_images` when the request has image tokens
    (`tokens_md`: all of them; `ids`: its whole prompt, the chunk starting at `start`)."""
    if tokens_md is None:
        return extend_sequences(params, seq_n, pools, ids_nt, lens_n, spec=spec, layout=layout, mesh=mesh)
    rows_md = images.chunk_rows(tokens_md, ids, start, ids_nt.shape[1])
    return extend_with_images(params, seq_n, pools, ids_nt, rows_md, lens_n, spec=spec, layout=layout,
                              placeholder_id=images.placeholder_id, mesh=mesh)


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
