"""Image tokens into the text stream: the projector's rows replace the placeholder tokens' embeddings before layer 0.

The release's prompt holds one `<|media_pad|>` (id 163605, `media_placeholder_token_id`) per merged image token
(h*w/4 for an image of h x w patches); the rows of `VisionModel` output fill those positions in order, row-major
over the batch, as transformers' `masked_scatter` does for Kimi K2.5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MEDIA_PLACEHOLDER_ID = 163605


def merge_image_tokens(embeds_btd: jax.Array, ids_bt: jax.Array, image_tokens_md: jax.Array, *,
                       placeholder_id: int = MEDIA_PLACEHOLDER_ID) -> jax.Array:
    """`embeds_btd` with the k-th placeholder position (row-major) replaced by `image_tokens_md[k]` (cast to the
    embeddings' dtype). With concrete ids the counts must agree (one-line ValueError otherwise); under jit the
    caller guarantees it (a surplus placeholder repeats the last row)."""
    mask_bt = ids_bt == placeholder_id
    if not isinstance(ids_bt, jax.core.Tracer):
        n = int(np.asarray(mask_bt).sum())
        if n != image_tokens_md.shape[0]:
            raise ValueError(f"{n} image placeholder token(s) (id {placeholder_id}) in the ids but "
                             f"{image_tokens_md.shape[0]} image token(s) to place")
    b, t, d = embeds_btd.shape
    index_bt = (jnp.cumsum(mask_bt.reshape(-1)) - 1).reshape(b, t)
    rows_btd = image_tokens_md[jnp.clip(index_bt, 0, max(image_tokens_md.shape[0] - 1, 0))].astype(embeds_btd.dtype)
    return jnp.where(mask_bt[..., None], rows_btd, embeds_btd)
