"""The KDA layer's causal depthwise short convolution (with SiLU), shared by the layer and the context-parallel
form (`sharding.context_parallel`), and the training prologue built on it (`conv_prologue`: conv → SiLU → per-head
L2 norm, in XLA or in one Pallas kernel each way, `pallas_kernels.kda.conv_prologue`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.numerics import wide
from k3jax.ops import backend as backend_lib
from k3jax.ops.kda_xla import document_index, l2_normalize
from pallas_kernels.kda import conv_prologue as prologue_kernel

__all__ = ["L2_EPS", "causal_depthwise_conv", "conv_prologue", "conv_prologue_unsupported", "prologue_backend"]

L2_EPS = 1e-6  # the KDA q/k norm's eps (`k3jax.ops.kda_xla.l2_normalize`)


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


def conv_prologue_unsupported(t: int, p: int, head_dim: int, block_t: int) -> str | None:
    """None when the prologue kernel takes T tokens of width P, else why not (the caller then stays on XLA)."""
    return prologue_kernel.supported(t, p, head_dim, block_t)


def prologue_backend(impl: str, t: int, p: int, head_dim: int, block_t: int) -> str | None:
    """The backend `conv_prologue` runs on for the knob `impl` (`RuntimeConfig.kda_conv_impl`): "auto" = "gpu"
    where a GPU kernel may run in this trace (`k3jax.ops.backend`) and the kernel takes the shape, else None (XLA);
    "pallas" = this platform's kernel or the interpreter (a shape it does not take is an error); "xla" = None.
    The caller uses it only with the "pallas" KDA core (whose numerics the prologue kernel has) and no context mesh."""
    if impl == "xla":
        return None
    reason = conv_prologue_unsupported(t, p, head_dim, block_t)
    if impl == "pallas":
        if reason:
            raise ValueError(f"kda_conv_impl='pallas': the prologue kernel does not take T={t}, width {p}: {reason}")
        backend = backend_lib.forced_kernel_backend()
        return backend if backend in ("gpu", "interpret") else "interpret"
    if impl != "auto":
        raise ValueError(f"kda_conv_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    return "gpu" if backend_lib.gpu_kernel_backend_here() == "gpu" and not reason else None


def conv_prologue(x_btp: jax.Array, kernel_wp: jax.Array, segment_ids_bt: jax.Array | None, *, head_dim: int,
                  normalize: bool, backend: str | None, block_t: int = 32, warps: int = 4,
                  bwd_block_t: int | None = None, bwd_warps: int | None = None) -> jax.Array:
    """The KDA training prologue from a zero conv history: ``round(l2_norm(round(silu(conv(x)))))`` per head of
    `head_dim` columns when `normalize` (q and k), else ``round(silu(conv(x)))`` (v); round = to x's dtype.

    `backend` None: XLA (`causal_depthwise_conv`, the cast, `l2_normalize`); "gpu" / "interpret": the Pallas kernels
    (`pallas_kernels.kda.conv_prologue`) with their backward as the gradient. Both give the model's numerics with
    the "pallas" KDA core; the caller checks `conv_prologue_unsupported` first. The backward kernel has its own
    tiling (`bwd_block_t`, `bwd_warps`; None = the forward's): its best tile differs (RESULTS.md 2026-12-05)."""
    dt = x_btp.dtype
    if backend is None:
        y = causal_depthwise_conv(x_btp, kernel_wp, None, segment_ids_bt)[0].astype(dt)
        if not normalize:
            return y
        b, t, p = y.shape
        return l2_normalize(y.reshape(b, t, p // head_dim, head_dim), L2_EPS).astype(dt).reshape(b, t, p)
    if backend not in ("gpu", "interpret"):
        raise ValueError(f"conv_prologue: backend must be None, 'gpu' or 'interpret', got {backend!r}")
    bwd_block_t = block_t if bwd_block_t is None else bwd_block_t
    bwd_warps = warps if bwd_warps is None else bwd_warps
    reason = conv_prologue_unsupported(x_btp.shape[1], x_btp.shape[2], head_dim, max(block_t, bwd_block_t))
    if reason:
        raise ValueError(f"conv_prologue: the kernel does not take x {list(x_btp.shape)}: {reason}")
    w = kernel_wp.shape[0]
    doc_pad = None
    if segment_ids_bt is not None:  # left pad: the zero history (first document); right pad: no document
        doc_pad = jnp.pad(document_index(segment_ids_bt), ((0, 0), (w - 1, 0)))
        doc_pad = jnp.pad(doc_pad, ((0, 0), (0, w - 1)), constant_values=-1)
    opts = dict(head_dim=head_dim, normalize=bool(normalize), interpret=backend == "interpret", block_t=block_t,
                warps=warps, bwd_block_t=bwd_block_t, bwd_warps=bwd_warps)
    return _prologue(x_btp, kernel_wp, doc_pad, tuple(sorted(opts.items())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _prologue(x_btp, kernel_wp, doc_pad, opts):
    return _prologue_fwd(x_btp, kernel_wp, doc_pad, opts)[0]


def _pad_rows(x_btp, left, right):
    return jnp.pad(x_btp, ((0, 0), (left, right), (0, 0)))


def _split_opts(opts, direction):
    """The kernel arguments of one direction: the shared ones plus that direction's block_t and warps."""
    o = dict(opts)
    bwd = (o.pop("bwd_block_t"), o.pop("bwd_warps"))
    if direction == "bwd":
        o["block_t"], o["warps"] = bwd
    return o


def _prologue_fwd(x_btp, kernel_wp, doc_pad, opts):
    o = _split_opts(opts, "fwd")
    w = kernel_wp.shape[0]
    x_pad = _pad_rows(x_btp, w - 1, w - 1)
    out = prologue_kernel.conv_prologue_fwd(x_pad, kernel_wp, doc_pad, t=x_btp.shape[1], eps=L2_EPS,
                                            out_dtype=x_btp.dtype, **o)
    return out, (x_pad, kernel_wp, doc_pad)


def _prologue_bwd(opts, res, dout_btp):
    x_pad, kernel_wp, doc_pad = res
    w = kernel_wp.shape[0]
    t = x_pad.shape[1] - 2 * (w - 1)
    dout_pad = _pad_rows(dout_btp.astype(x_pad.dtype), 0, w - 1)
    dx, dk_part = prologue_kernel.conv_prologue_bwd(x_pad, kernel_wp, doc_pad, dout_pad, t=t, eps=L2_EPS,
                                                    **_split_opts(opts, "bwd"))
    dk = jnp.sum(dk_part, axis=(0, 1)).astype(kernel_wp.dtype)
    d_doc = None if doc_pad is None else jnp.zeros(doc_pad.shape, jax.dtypes.float0)
    return dx, dk, d_doc


_prologue.defvjp(_prologue_fwd, _prologue_bwd)
