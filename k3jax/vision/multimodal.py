"""Multimodal K3: image tokens (tower + projector) replace the `<|media_pad|>` embeddings before layer 0.

`K3VisionLanguageModel(language_model, vision)` pairs a text model with a `VisionModel`. The text model is used
only through `embed`, `hidden_states_from_embeddings`, `hidden_states_cached_from_embeddings` and `logits`
(`k3jax.model.K3Model`, unchanged and text-exact: this layer sits below the model and does not import it). The
prompt holds one placeholder per merged image token (`expand_media_placeholders`), images in prompt order; the
release's placeholder id is 163605 (`media_placeholder_token_id`), tiny test vocabularies pass their own.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from k3jax.vision.merge import MEDIA_PLACEHOLDER_ID, merge_image_tokens
from k3jax.vision.packing import PackedLayout, pack
from k3jax.vision.tower import VisionModel

__all__ = ["K3VisionLanguageModel", "expand_media_placeholders"]


def expand_media_placeholders(ids: Sequence[int], merged_counts: Sequence[int], *,
                              placeholder_id: int = MEDIA_PLACEHOLDER_ID) -> list[int]:
    """`ids` with its k-th placeholder repeated `merged_counts[k]` times (one per image token), as the release's
    processor expands each image's single `<|media_pad|>`; the counts must match the placeholders (ValueError)."""
    found = sum(1 for i in ids if i == placeholder_id)
    if found != len(merged_counts):
        raise ValueError(f"{found} image placeholder(s) (id {placeholder_id}) in the prompt but "
                         f"{len(merged_counts)} image(s)")
    out, k = [], 0
    for i in ids:
        if i == placeholder_id:
            out += [placeholder_id] * int(merged_counts[k])
            k += 1
        else:
            out.append(int(i))
    return out


class K3VisionLanguageModel(nnx.Module):
    """Text model + vision model. `model(ids_bt, pixels, layout)` -> logits f32 [B, T, V]: the layout's images
    (`VisionModel` input: patches [N, 3, p, p] and a `PackedLayout` or grids) fill the placeholders row-major
    over the batch. Without images it is the text model exactly."""

    def __init__(self, language_model, vision: VisionModel, *, placeholder_id: int = MEDIA_PLACEHOLDER_ID):
        self.language_model = language_model
        self.vision = vision
        self.placeholder_id = int(placeholder_id)
        text_d = language_model.cfg.hidden_size
        if vision.cfg.text_hidden_size != text_d:
            raise ValueError(f"vision_config.text_hidden_size ({vision.cfg.text_hidden_size}) must equal the text "
                             f"model's hidden_size ({text_d})")

    def layout(self, grids, *, pad_to: int | None = None) -> PackedLayout:
        return pack(grids, self.vision.cfg, pad_to=pad_to)

    def image_tokens(self, pixels: jax.Array, layout: PackedLayout | Sequence) -> jax.Array:
        """[M, D_text]: every image's tokens in order (`layout` or its grids)."""
        layout = layout if isinstance(layout, PackedLayout) else self.layout(layout)
        return self.vision(pixels, layout)

    def embed(self, input_ids_bt: jax.Array, image_tokens_md: jax.Array | None = None) -> jax.Array:
        """Token embeddings [B, T, D] with the placeholders' rows replaced by `image_tokens_md` (None: text only)."""
        embeds_btd = self.language_model.embed(input_ids_bt)
        if image_tokens_md is None:
            return embeds_btd
        return merge_image_tokens(embeds_btd, input_ids_bt, image_tokens_md, placeholder_id=self.placeholder_id)

    def _embeds(self, input_ids_bt, pixels, layout, image_tokens_md):
        if pixels is not None:
            if image_tokens_md is not None:
                raise ValueError("pass either pixels (with their layout) or image_tokens_md, not both")
            if layout is None:
                raise ValueError("pixels need their layout (a PackedLayout or the images' grids)")
            image_tokens_md = self.image_tokens(pixels, layout)
        return self.embed(input_ids_bt, image_tokens_md)

    def hidden_states(self, input_ids_bt: jax.Array, pixels: jax.Array | None = None, layout=None,
                      segment_ids_bt: jax.Array | None = None, *, image_tokens_md: jax.Array | None = None
                      ) -> jax.Array:
        """Final normed hidden states [B, T, D]; images as pixels + layout, or already encoded (`image_tokens_md`)."""
        embeds_btd = self._embeds(input_ids_bt, pixels, layout, image_tokens_md)
        return self.language_model.hidden_states_from_embeddings(embeds_btd, segment_ids_bt)

    def __call__(self, input_ids_bt: jax.Array, pixels: jax.Array | None = None, layout=None,
                 segment_ids_bt: jax.Array | None = None, *, image_tokens_md: jax.Array | None = None) -> jax.Array:
        h_btd = self.hidden_states(input_ids_bt, pixels, layout, segment_ids_bt, image_tokens_md=image_tokens_md)
        return self.language_model.logits(h_btd)

    def forward_cached(self, input_ids_bt: jax.Array, cache, valid_len_b: jax.Array | None = None, *,
                       image_tokens_md: jax.Array | None = None):
        """Incremental forward (`K3Model.forward_cached`) from merged embeddings: `image_tokens_md` holds the rows of
        the placeholders in THIS call's ids, in order (a prompt prefilled in chunks passes each chunk its share;
        `placeholder_rows` splits them; under jit they may be padded to a fixed count, the surplus never read).
        Returns (logits [B, T, V], new cache)."""
        embeds_btd = self.embed(input_ids_bt, image_tokens_md)
        h_btd, cache = self.language_model.hidden_states_cached_from_embeddings(embeds_btd, cache, valid_len_b)
        return self.language_model.logits(h_btd), cache

    def placeholder_rows(self, ids: Sequence[int], image_tokens_md: jax.Array, start: int, stop: int
                         ) -> jax.Array | None:
        """The rows of `image_tokens_md` (all of one sequence's image tokens) that fill the placeholders of
        ids[start:stop]; None when that span holds none."""
        ids_n = np.asarray(ids)
        first = int(np.sum(ids_n[:start] == self.placeholder_id))
        count = int(np.sum(ids_n[start:stop] == self.placeholder_id))
        return image_tokens_md[first:first + count] if count else None
