"""The KDA layer's causal depthwise short convolution (with SiLU), shared by the layer and the context-parallel
form (`sharding.context_parallel`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.numerics import wide
from k3jax.ops.kda_xla import document_index

__all__ = ["causal_depthwise_conv"]


def causal_depthwise_conv(x_btp: jax.Array, kernel_wp: jax.Array, history_bwp: jax.Array | None,
                          segment_ids_bt: jax.Array | None = None):
    """y_t = Σ_w kernel[w] · x_{t-(W-1)+w} (tap W-1 is the current token), in f32, then SiLU.

    `history` holds the W-1 inputs before x (zeros when None). With `segment_ids_bt` (packed documents, see
    `k3jax.ops.kda`), taps reaching a token of an earlier document are dropped; the history counts as part of
    the first document. Returns (silu(y) f32, new history: the last W-1 inputs, whatever their document).
    """
    w = kernel_wp.shape[0]
    b, t, p = x_btp.shape
    if history_bwp is None:
        history_bwp = jnp.zeros((b, w - 1, p), x_btp.dtype)
    padded = jnp.concatenate([history_bwp.astype(x_btp.dtype), x_btp], axis=1)
    padded = padded.astype(wide(jnp.promote_types(padded.dtype, kernel_wp.dtype)))
    kernel = kernel_wp.astype(padded.dtype)
    doc_padded = None
    if segment_ids_bt is not None:
        doc_bt = document_index(segment_ids_bt)
        doc_padded = jnp.pad(doc_bt, ((0, 0), (w - 1, 0)))  # history: document 0, the row's first

    def tap(i):  # the inputs that tap i multiplies, zeroed where they belong to an earlier document
        x = padded[:, i:i + t, :]
        if doc_padded is None:
            return x
        return jnp.where((doc_padded[:, i:i + t] == doc_bt)[..., None], x, 0.0)

    y = sum(tap(i) * kernel[i] for i in range(w))
    return jax.nn.silu(y), padded[:, t:, :].astype(x_btp.dtype)
