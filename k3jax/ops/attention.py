"""Attention cores: causal softmax attention (MLA's training / prefill core) and the paged latent decode kernel
(MLA's absorbed one-token step, `pallas_kernels.mla`) with the choice of their backends.

The XLA core materialises f32 scores (T x T per head). `impl="cudnn"` runs cuDNN's flash attention on a GPU
(`jax._src.cudnn.fused_attention_stablehlo`: private, because the public `jax.nn.dot_product_attention` takes no
value head dim unlike the key's, MLA's 192 vs 128). Packed documents reach it in cuDNN's own packed layout
(per-row segment offsets and lengths, `document_runs`): no T x T mask, which cuDNN would add as a bf16 bias AND
differentiate (a [B, 1, T, T] bias gradient per layer: 197 TFLOP/s at 32K; packed 481, unpacked 539; RESULTS.md
2026-12-04). jax's packed path strides the value rows by the key's head dim, so the 128-wide values are zero-padded
to 192 (`_cudnn_packed`; the extra columns of the output are sliced off; RESULTS.md 2026-12-03 recorded the wrong
outputs without the padding). A row with more than `max_segments` documents takes the blockwise core instead
(`lax.cond`, same result). cuDNN runs the packed layout as B x max_segments sequences of the full row length, and
its backward's workspace (an f32 dQ accumulator and row sums, sized on the device) grows with that product: 72 GiB
at one 131,072-token row with 64 slots (RESULTS.md 2026-12-05), so `max_segments=0` picks the count from
`CUDNN_WORKSPACE_BUDGET` (`cudnn_max_segments`).
`impl="flash"` (`k3jax/ops/flash_attention.py`) is blockwise attention in plain JAX with segment ids, f32
statistics and output, and a recomputing backward: no T x T array, on any backend (slower than cuDNN on a GPU:
RESULTS.md 2026-12-04).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from k3jax.numerics import wide
from k3jax.ops import backend as backend_lib
from k3jax.ops.flash_attention import DEFAULT_BLOCK, flash_causal_attention
from pallas_kernels.mla import DecodeConfig, gpu_compatible, paged_latent_attention

DEFAULT_MAX_SEGMENTS = 64  # documents per packed row the cuDNN path takes (more: the blockwise core)
CUDNN_WORKSPACE_BUDGET = 8 * 2**30  # bytes of cuDNN's packed backward workspace that max_segments=0 allows
CUDNN_MIN_SEGMENTS = 4  # max_segments=0 never picks fewer slots than this (a row of 4 documents stays on cuDNN)

__all__ = ["causal_attention", "cudnn_max_segments", "cudnn_packed_bwd_workspace_bytes", "document_runs",
           "segment_attention", "segment_attention_impl", "mla_decode_backend", "paged_latent_decode",
           "training_attention_impl"]


def training_attention_impl(impl: str, compute_dtype) -> str:
    """The core `mla_attention_impl` names for this trace. "auto": cuDNN on a GPU when the compute dtype is 16-bit
    (2.5x the XLA core on packed 4K rows, RESULTS.md 2026-12-04; it rounds wider operands), the blockwise core on
    a TPU (no T x T array), else the XLA core (CPU: exact f32)."""
    if impl != "auto":
        return impl
    platform = backend_lib.traced_accelerator()
    if platform == "gpu" and jnp.dtype(compute_dtype).itemsize == 2:
        return "cudnn"
    return "flash" if platform == "tpu" else "xla"


def cudnn_packed_bwd_workspace_bytes(batch: int, max_segments: int, heads: int, seq_len: int, head_dim: int) -> int:
    """Bytes of the workspace cuDNN's packed-layout attention backward asks for: an f32 [B·M, H, T, Dk + 1]
    (dQ accumulator and softmax row sums) over B rows x M document slots of the full length T. Read from the
    compiled GPU program (RESULTS.md 2026-12-05: u8[77712090112] at B=1, M=64, H=12, T=131072, Dk=192, this formula
    plus 25,600 bytes); a compile without a GPU leaves it at 0, as cuDNN sizes it on the device."""
    return 4 * batch * max_segments * heads * seq_len * (head_dim + 1)


def cudnn_max_segments(requested: int, batch: int, heads: int, seq_len: int, head_dim: int) -> int:
    """Document slots per row for cuDNN's packed layout: `requested` when > 0; 0 = the largest power of two <= 64
    whose backward workspace (`cudnn_packed_bwd_workspace_bytes`) fits `CUDNN_WORKSPACE_BUDGET`, at least
    `CUDNN_MIN_SEGMENTS` (4,096-token rows: 64 at B = 1, 32 at B = 4; 131,072: 4). Rows with more documents take the
    blockwise core (same result, slower)."""
    if requested > 0:
        return requested
    per_slot = cudnn_packed_bwd_workspace_bytes(batch, 1, heads, seq_len, head_dim)
    m = DEFAULT_MAX_SEGMENTS
    while m > CUDNN_MIN_SEGMENTS and m * per_slot > CUDNN_WORKSPACE_BUDGET:
        m //= 2
    return m


def causal_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, *, scale: float,
                     impl: str = "xla", segment_ids_bt: jax.Array | None = None,
                     block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK,
                     max_segments: int = DEFAULT_MAX_SEGMENTS,
                     operand_layout: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """softmax(q kᵀ · scale + causal mask) v with f32 softmax; returns f32 [B, T, H, V].

    `segment_ids_bt` int [B, T] (optional, packed documents): a query also only sees keys with its own id, so
    equal ids must be contiguous (as the KDA resets assume). Every query still sees itself: no empty row.
    impl "xla": f32 logits materialised. impl "cudnn": bf16/f16 operands on a GPU (wider ones rounded to bf16),
    flash attention (output rounded to the operands' dtype, then widened), documents in cuDNN's packed layout (up
    to `max_segments` per row, 0 = `cudnn_max_segments`'s choice; rows with more take impl "flash").
    impl "flash": blockwise (`block_q` x `block_k` tiles), f32 statistics and output, probabilities rounded to the
    operands' dtype before the value matmul.
    `operand_layout` (impl "cudnn"): applied to q, k and v as cuDNN receives them (the values padded): the caller's
    sharding constraint, since cuDNN's partitioner under a GSPMD mesh refuses operands of different layouts.
    """
    if impl == "cudnn":
        if segment_ids_bt is None:
            return _cudnn_causal(q_bthk, k_bthk, v_bthv, scale, operand_layout)
        def blockwise(q, k, v):
            return flash_causal_attention(q, k, v, scale=scale, segment_ids_bt=segment_ids_bt, block_q=block_q,
                                          block_k=block_k)

        b, t, h, dk = q_bthk.shape
        max_segments = cudnn_max_segments(max_segments, b, h, t, dk)
        return _cudnn_packed_or(q_bthk, k_bthk, v_bthv, segment_ids_bt, scale, max_segments, True, blockwise,
                                operand_layout)
    if impl == "flash":
        return flash_causal_attention(q_bthk, k_bthk, v_bthv, scale=scale, segment_ids_bt=segment_ids_bt,
                                      block_q=block_q, block_k=block_k)
    if impl != "xla":
        raise ValueError(f"unknown attention impl {impl!r}; available: 'xla', 'cudnn', 'flash'")
    b, t = q_bthk.shape[:2]
    logits = jnp.einsum("bqhk,bshk->bhqs", q_bthk, k_bthk, preferred_element_type=wide(q_bthk.dtype)) * scale
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]  # [1, 1, T, T]
    if segment_ids_bt is not None:
        if segment_ids_bt.shape != (b, t):
            raise ValueError(f"attention: segment_ids must have shape [B, T] = {(b, t)}, got {segment_ids_bt.shape}")
        mask = mask & (segment_ids_bt[:, None, :, None] == segment_ids_bt[:, None, None, :])
    logits = jnp.where(mask, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqs,bshv->bqhv", probs, v_bthv.astype(probs.dtype))


def _check_segments(segment_ids_bt, bt):
    if segment_ids_bt.shape != tuple(bt):
        raise ValueError(f"attention: segment_ids must have shape [B, T] = {tuple(bt)}, got {segment_ids_bt.shape}")


def document_runs(segment_ids_bt: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packed rows as cuDNN's ragged layout: (offsets int32 [B, M + 1], lengths int32 [B, M], runs int32 [B]).

    A run is a maximal stretch of equal ids (a document, or the padding tail); offsets hold each run's first
    position and lengths its size, -1 past the row's last run (cuDNN's convention); runs counts them. Rows with
    more than M = `max_segments` runs are incomplete here: callers check `runs <= M`."""
    b, t = segment_ids_bt.shape
    start_bt = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    run_bt = jnp.cumsum(start_bt, axis=1, dtype=jnp.int32) - 1
    runs_b = run_bt[:, -1] + 1
    rows_b1 = jnp.arange(b)[:, None]
    pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    offsets = jnp.full((b, max_segments + 1), -1, jnp.int32)
    offsets = offsets.at[rows_b1, jnp.where(start_bt, run_bt, max_segments + 1)].set(pos_bt, mode="drop")
    offsets = jnp.where(jnp.arange(max_segments + 1) < jnp.minimum(runs_b, max_segments)[:, None], offsets, -1)
    lengths = jnp.zeros((b, max_segments), jnp.int32).at[rows_b1, run_bt].add(1, mode="drop")
    lengths = jnp.where(jnp.arange(max_segments) < runs_b[:, None], lengths, -1)
    return offsets, lengths, runs_b


def _cudnn_dtype(x):
    # cuDNN runs 16-bit operands only: wider ones (e.g. MLA's f32 queries after the q LoRA norm) are rounded to bf16
    return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16


def _laid_out(layout, *arrays):
    return arrays if layout is None else tuple(layout(a) for a in arrays)


def _cudnn_causal(q_bthk, k_bthk, v_bthv, scale, layout=None):
    dt = _cudnn_dtype(q_bthk)
    q, k, v = _laid_out(layout, q_bthk.astype(dt), k_bthk.astype(dt), v_bthv.astype(dt))
    out = cudnn_attention.dot_product_attention(q, k, v, scale=scale, qkv_layout="BTNH",
                                                mask_type=cudnn_attention.MaskType.CAUSAL)
    return out.astype(wide(dt))


def _cudnn_packed(q_bthk, k_bthk, v_bthv, scale, offsets_bm, lengths_bm, causal: bool = True, layout=None):
    """Attention within each run of `offsets_bm` / `lengths_bm` (`document_runs`), causal or bidirectional. The
    values are zero-padded to the key's head dim: jax strides every packed operand by the query's row width."""
    dt = _cudnn_dtype(q_bthk)
    dk, dv = q_bthk.shape[-1], v_bthv.shape[-1]
    v = v_bthv.astype(dt)
    if dv < dk:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dk - dv)))
    elif dv > dk:
        raise ValueError(f"cuDNN packed attention: value head dim {dv} wider than the key's {dk}")
    mask = cudnn_attention.MaskType.CAUSAL if causal else cudnn_attention.MaskType.NO_MASK
    q, k, v = _laid_out(layout, q_bthk.astype(dt), k_bthk.astype(dt), v)
    out = cudnn_attention.dot_product_attention(q, k, v,
                                                q_seqlen=lengths_bm, kv_seqlen=lengths_bm,
                                                q_offsets=offsets_bm, kv_offsets=offsets_bm,
                                                scale=scale, qkv_layout="BTNH", mask_type=mask)
    return out[..., :dv].astype(wide(dt))


def _cudnn_packed_or(q_bthk, k_bthk, v_bthv, segment_ids_bt, scale, max_segments, causal, fallback, layout=None):
    """cuDNN's packed layout over the rows' document runs, or `fallback(q, k, v)` (f32) when a row has more than
    `max_segments` runs (`lax.cond`: both compiled, one runs)."""
    _check_segments(segment_ids_bt, q_bthk.shape[:2])
    offsets_bm, lengths_bm, runs_b = document_runs(segment_ids_bt, max_segments)

    def packed(q, k, v):
        return _cudnn_packed(q, k, v, scale, offsets_bm, lengths_bm, causal=causal, layout=layout)

    return jax.lax.cond(jnp.all(runs_b <= max_segments), packed, fallback, q_bthk, k_bthk, v_bthv)


def segment_attention_impl(dtype) -> str:
    """The backend of `segment_attention` for this trace: cuDNN on a GPU with 16-bit operands, else XLA."""
    return "cudnn" if backend_lib.traced_accelerator() == "gpu" and jnp.dtype(dtype).itemsize == 2 else "xla"


def segment_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, segment_ids_bt: jax.Array, *,
                      scale: float, xla_core, max_segments: int = DEFAULT_MAX_SEGMENTS) -> jax.Array:
    """Bidirectional softmax attention within each run of equal `segment_ids_bt` (the vision tower's packed images);
    returns f32 [B, T, H, V]. On a GPU with 16-bit operands cuDNN's packed layout (up to `max_segments` runs per
    row); otherwise, and for rows with more runs, `xla_core(q, k, v)` (the caller's masked core)."""
    _check_segments(segment_ids_bt, q_bthk.shape[:2])
    if segment_attention_impl(q_bthk.dtype) != "cudnn":
        return xla_core(q_bthk, k_bthk, v_bthv)
    return _cudnn_packed_or(q_bthk, k_bthk, v_bthv, segment_ids_bt, scale, max_segments, False,
                            lambda q, k, v: xla_core(q, k, v).astype(jnp.float32))


def mla_decode_backend(cfg, num_pages: int, page_size: int) -> str | None:
    """The paged decode kernel's backend for this trace, or None for the XLA gather path
    (`cfg.runtime.mla_decode_impl`): "auto" takes the kernel ("gpu") when the traced platform is a GPU and the
    pool suits Triton (kv_lora_rank, the rope width and page_size powers of two >= 16, < 2**31 elements);
    "pallas" takes it anywhere ("interpret" off GPU). Under a multi-device mesh (outside shard_map) the XLA path
    runs: GSPMD cannot partition a Pallas call."""
    if cfg.runtime.mla_decode_impl == "xla" or backend_lib.kernel_mesh() is not None:
        return None
    on_gpu = backend_lib.on_gpu()
    if cfg.runtime.mla_decode_impl == "pallas":
        return "gpu" if on_gpu else "interpret"
    fits = gpu_compatible(cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size, num_pages)
    return "gpu" if on_gpu and fits else None


def paged_latent_decode(q_bhc, pages_npc, page_table_bp, lengths_b, *, scale, latent_dim, backend, num_splits=0):
    """One query per sequence over its paged latent rows (`pallas_kernels.mla.paged_latent_attention`, on the
    backend from `mla_decode_backend`): positions 0 .. lengths_b - 1 read through the page table; returns the
    attended latent [B, H, latent_dim] f32. `num_splits`: page ranges per sequence (0 = auto)."""
    return paged_latent_attention(q_bhc, pages_npc, page_table_bp, lengths_b, scale=scale, latent_dim=latent_dim,
                                  backend=backend, config=DecodeConfig(num_splits=num_splits))
