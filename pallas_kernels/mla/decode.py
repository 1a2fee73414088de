"""Paged, absorbed MLA decode attention (Pallas, Triton GPU backend; CPU tests with ``interpret=True``).

One query token per sequence, attention in the MQA-over-latent form: each of the H query rows is C = latent + rope
wide (the nope part already folded through W_k), every cached position is one C-wide row of a page pool
``pages [N, page_size, C]`` shared by all heads, and the values are the rows' first ``latent`` columns. The kernel
reads each sequence's pages once, straight through its page-table row (no dense [B, P * page_size, C] gather):

* grid ``(B, splits, head blocks)``: program (b, s, hb) walks table slots ``s * per_b .. min((s + 1) * per_b,
  used_b)`` of sequence b (``used_b = ceil(length_b / page_size)``, ``per_b = ceil(used_b / splits)``: the
  sequence's own pages spread evenly over the splits, slots past the length never visited) for heads
  ``hb * block_h ..`` with a flash-decoding online softmax (running max / sum and the [block_h, latent]
  accumulator in f32, model-dtype matmul operands, f32 accumulation);
* each page is ``page_size / block_s`` steps of ``block_s`` rows; a row is loaded (masked load) only when its
  position is < length and its page id is in [0, N): a page with no id is never read, its positions drop out of
  the softmax like the ones past the length;
* the C columns are read as two power-of-two slices of the flattened pool ``[N * page_size, C]`` at a dynamic row
  offset (``pl.ds(page * page_size + step * block_s, block_s)`` x ``pl.ds(0, latent)`` / ``pl.ds(latent, rope)``),
  since Triton blocks must be powers of two and 576 is not; logits = q_lat . k_lat + q_rope . k_rope.

Splits (flash-decoding): at batch 1 one program per sequence would leave all but one SM idle while it walks every
page, so the pages of a sequence are cut into ``splits`` contiguous ranges (sized from its traced length, so a
short sequence in a wide table still spreads over every split), each program writes its normalised
partial output and log-sum-exp, and a small XLA combine (``_combine_splits``) merges them (exact: a softmax over
the union of the ranges). The default targets ~128 programs in all (``DecodeConfig.num_splits=0``); with one split
the kernel writes the final output itself and there is no combine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.tiling import is_pow2, triton_params

__all__ = ["BACKENDS", "DecodeConfig", "gpu_compatible", "paged_latent_attention"]

BACKENDS = ("gpu", "interpret")
_F32 = jnp.float32
_NEG = -1e30  # initial running max: finite, so fully masked steps give exp(-inf - _NEG) = 0 and never NaN
_AUTO_BLOCK_S = 64  # fastest on an H200 at B = 16/64 (benchmarks/RESULTS.md, 2026-11-30)
_TARGET_PROGRAMS = 128  # auto splits: about one program per SM of an H100/H200 (132 SMs)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs (results do not depend on them beyond rounding).

    block_h: query heads per program (H is padded to a multiple; power of two >= 16 on the GPU backend: Triton
      matmuls need every dim >= 16). More heads than block_h: several programs per sequence read the same pages.
    block_s: cached rows per loop step (divides page_size; 0 = auto: 64 when it divides page_size, else 32, else
      page_size; 64 measured fastest on an H200 at batch 1, 16 and 64 with 512 and 4096 cached tokens).
    num_splits: page ranges per sequence (0 = auto: about 128 programs in all, at most one range per page).
    num_warps, num_stages: Triton launch parameters (num_stages > 1 lets Triton pipeline the page loads).
    """

    block_h: int = 16
    block_s: int = 0
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_h", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_s", "num_splits"):
            if getattr(self, name) < 0:
                raise ValueError(f"DecodeConfig.{name} must be >= 0 (0 = auto), got {getattr(self, name)}")


def gpu_compatible(latent_dim: int, rope_dim: int, page_size: int, num_pages: int = 1,
                   config: DecodeConfig = DecodeConfig()) -> bool:
    """Whether the GPU (Triton) backend takes these shapes: latent_dim, the rope width (if any), the rows per step
    and block_h powers of two >= 16 (Triton blocks and matmul dims), the step dividing page_size, and a pool of
    fewer than 2**31 elements (int32 offsets)."""
    block_s = _block_s(config, page_size)
    dims = [latent_dim, block_s, config.block_h] + ([rope_dim] if rope_dim else [])
    small = num_pages * page_size * (latent_dim + rope_dim) < 2 ** 31
    return small and page_size % block_s == 0 and all(is_pow2(d, 16) for d in dims)


def _check(q_bhc, pages_npc, page_table_bp, length_b, latent_dim, backend, config):
    if backend not in BACKENDS:
        raise ValueError(f"paged_latent_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if q_bhc.ndim != 3:
        raise ValueError(f"paged_latent_attention: q must be [B, H, C], got shape {q_bhc.shape}")
    if pages_npc.ndim != 3:
        raise ValueError(f"paged_latent_attention: pages must be [N, page_size, C], got shape {pages_npc.shape}")
    b, h, c = q_bhc.shape
    n, page_size, c_pages = pages_npc.shape
    if c_pages != c:
        raise ValueError(f"paged_latent_attention: q has C={c} columns but the pages have {c_pages}")
    if page_table_bp.ndim != 2 or page_table_bp.shape[0] != b:
        raise ValueError(f"paged_latent_attention: page_table must be [B, P] with B={b}, got {page_table_bp.shape}")
    if length_b.shape != (b,):
        raise ValueError(f"paged_latent_attention: length must be [B] = [{b}], got {length_b.shape}")
    for name, x in (("page_table", page_table_bp), ("length", length_b)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"paged_latent_attention: {name} must be an integer array, got {x.dtype}")
    if q_bhc.dtype != pages_npc.dtype:
        raise ValueError(f"paged_latent_attention: q and pages must share a dtype, got {q_bhc.dtype} and "
                         f"{pages_npc.dtype}")
    if q_bhc.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"paged_latent_attention: dtype must be bfloat16, float16 or float32, got {q_bhc.dtype}")
    if not 0 < latent_dim <= c:
        raise ValueError(f"paged_latent_attention: latent_dim must be in [1, C={c}], got {latent_dim}")
    if min(b, h, n, page_size, page_table_bp.shape[1]) < 1:
        raise ValueError(f"paged_latent_attention: empty input (B={b}, H={h}, N={n}, page_size={page_size}, "
                         f"P={page_table_bp.shape[1]})")
    block_s = _block_s(config, page_size)
    if page_size % block_s:
        raise ValueError(f"paged_latent_attention: block_s={block_s} must divide page_size={page_size}")
    if backend == "gpu":
        if n * page_size * c >= 2 ** 31:
            raise ValueError(f"paged_latent_attention(backend='gpu'): the pool holds {n * page_size * c} elements; "
                             "the kernel's int32 offsets need fewer than 2**31 (split the pool)")
        rope = c - latent_dim
        dims = {"latent_dim": latent_dim, "block_s": block_s, "block_h": config.block_h}
        if rope:
            dims["rope width (C - latent_dim)"] = rope
        bad = {k: v for k, v in dims.items() if not is_pow2(v, 16)}
        if bad:
            raise ValueError(f"paged_latent_attention(backend='gpu'): these must be powers of two >= 16 (Triton "
                             f"blocks and matmul dims): {bad}")


def _kernel(table_ref, length_ref, q_ref, rows_ref, o_ref, lse_ref, *, page_size, block_s, splits,
            num_pages, latent, rope, block_h, scale, precision, final):
    b, split, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(pl.multiple_of(hb * block_h, block_h), block_h)
    length = length_ref[b]
    used = (length + page_size - 1) // page_size
    per_split = (used + splits - 1) // splits  # the sequence's own pages, evenly over the splits
    first = split * per_split
    last = jnp.minimum(first + per_split, used)
    dtype = q_ref.dtype
    q_lat = q_ref[b, heads, pl.ds(0, latent)]
    q_rope = q_ref[b, heads, pl.ds(latent, rope)] if rope else None
    steps = page_size // block_s
    offsets_s = lax.broadcasted_iota(jnp.int32, (block_s,), 0)

    def dot_nt(a, x):  # a @ x^T, f32 accumulation
        return lax.dot_general(a, x, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32)

    def page_body(j, carry):
        page = table_ref[b, j]
        present = (page >= 0) & (page < num_pages)
        base = jnp.where(present, page, 0) * page_size
        for step in range(steps):  # static: page_size / block_s
            m_h, l_h, acc_hl = carry
            pos_s = j * page_size + step * block_s + offsets_s
            keep_s = (pos_s < length) & present
            row0 = pl.multiple_of(base + step * block_s, block_s)
            rows = pl.ds(row0, block_s)
            k_lat = plt.load(rows_ref.at[rows, pl.ds(0, latent)],
                             mask=jnp.broadcast_to(keep_s[:, None], (block_s, latent)), other=0)
            logits_hs = dot_nt(q_lat, k_lat)
            if rope:
                k_rope = plt.load(rows_ref.at[rows, pl.ds(latent, rope)],
                                  mask=jnp.broadcast_to(keep_s[:, None], (block_s, rope)), other=0)
                logits_hs = logits_hs + dot_nt(q_rope, k_rope)
            logits_hs = jnp.where(keep_s[None, :], logits_hs * scale, -jnp.inf)
            m_new = jnp.maximum(m_h, jnp.max(logits_hs, axis=1))
            alpha_h = jnp.exp(m_h - m_new)
            p_hs = jnp.exp(logits_hs - m_new[:, None])
            l_h = l_h * alpha_h + jnp.sum(p_hs, axis=1)
            pv = lax.dot_general(p_hs.astype(dtype), k_lat, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=_F32)
            carry = (m_new, l_h, acc_hl * alpha_h[:, None] + pv)
        return carry

    init = (jnp.full((block_h,), _NEG, _F32), jnp.zeros((block_h,), _F32), jnp.zeros((block_h, latent), _F32))
    m_h, l_h, acc_hl = lax.fori_loop(first, last, page_body, init)
    seen_h = l_h > 0
    o_hl = acc_hl / jnp.where(seen_h, l_h, 1.0)[:, None]  # nothing attended (empty range): zeros
    if final:
        o_ref[b, heads, pl.ds(0, latent)] = o_hl
    else:
        o_ref[b, split, heads, pl.ds(0, latent)] = o_hl
        lse_ref[b, split, heads] = jnp.where(seen_h, m_h + jnp.log(jnp.where(seen_h, l_h, 1.0)), -jnp.inf)


def _combine_splits(o_bshl, lse_bsh):
    """Merges per-range softmax outputs: weights exp(lse_s - max lse) (ranges with nothing attended: lse = -inf,
    weight 0; a sequence with nothing attended at all gets zeros)."""
    top_bh = jnp.max(lse_bsh, axis=1)
    top_bh = jnp.where(jnp.isfinite(top_bh), top_bh, 0.0)
    w_bsh = jnp.exp(lse_bsh - top_bh[:, None])
    total_bh = jnp.sum(w_bsh, axis=1)
    o_bhl = jnp.einsum("bsh,bshl->bhl", w_bsh, o_bshl, precision=lax.Precision.HIGHEST)
    return o_bhl / jnp.where(total_bh > 0, total_bh, 1.0)[..., None]


def _block_s(config: DecodeConfig, page_size: int) -> int:
    if config.block_s:
        return config.block_s
    for block in (_AUTO_BLOCK_S, 32):
        if page_size % block == 0:
            return block
    return page_size


def _splits(config: DecodeConfig, b: int, head_blocks: int, width: int) -> int:
    """Page ranges per sequence: num_splits, or enough for ~_TARGET_PROGRAMS programs; at most one per table slot."""
    want = config.num_splits or -(-_TARGET_PROGRAMS // (b * head_blocks))
    return max(1, min(want, width))


@functools.partial(jax.jit, static_argnames=("scale", "latent_dim", "backend", "config"))
def paged_latent_attention(q_bhc: jax.Array, pages_npc: jax.Array, page_table_bp: jax.Array, length_b: jax.Array,
                           *, scale: float, latent_dim: int = 512, backend: str = "gpu",
                           config: DecodeConfig = DecodeConfig()) -> jax.Array:
    """Absorbed MLA decode attention read through a page table; returns o f32 [B, H, latent_dim].

    q_bhc [B, H, C]: each head's query (latent part then rope part); pages_npc [N, page_size, C]: the page pool
    (same dtype as q: bf16 / f16 / f32); page_table_bp int [B, P]: pool page of sequence b's positions
    j * page_size .. (j + 1) * page_size - 1, ids outside [0, N) (e.g. -1) = no page (never read, its positions
    excluded); length_b int [B]: sequence b attends to positions 0 .. length_b[b] - 1 (clipped to P * page_size;
    0: output zeros). o[b, h] = softmax_s(scale * q[b, h] . row_s) @ row_s[:latent_dim].
    backend: "gpu" (Pallas Triton) or "interpret" (the same kernel through the Pallas interpreter, for CPU tests).
    """
    _check(q_bhc, pages_npc, page_table_bp, length_b, latent_dim, backend, config)
    b, h, c = q_bhc.shape
    n, page_size, _ = pages_npc.shape
    width = page_table_bp.shape[1]
    rope = c - latent_dim
    block_h, block_s = config.block_h, _block_s(config, page_size)
    head_blocks = -(-h // block_h)
    hp = head_blocks * block_h
    splits = _splits(config, b, head_blocks, width)
    final = splits == 1
    if hp != h:
        q_bhc = jnp.pad(q_bhc, ((0, 0), (0, hp - h), (0, 0)))
    length_b = jnp.clip(length_b.astype(jnp.int32), 0, width * page_size)
    precision = lax.Precision.HIGHEST if q_bhc.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _kernel, page_size=page_size, block_s=block_s, splits=splits, num_pages=n, latent=latent_dim,
        rope=rope, block_h=block_h, scale=float(scale), precision=precision, final=final)
    if final:
        out_shape = (jax.ShapeDtypeStruct((b, hp, latent_dim), _F32),)
        kernel = functools.partial(_single_output, kernel)
    else:
        out_shape = (jax.ShapeDtypeStruct((b, splits, hp, latent_dim), _F32),
                     jax.ShapeDtypeStruct((b, splits, hp), _F32))
    interpret = backend == "interpret"
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, splits, head_blocks),
        interpret=interpret,
        compiler_params=triton_params(interpret, config.num_warps, config.num_stages),
        name="k3_mla_decode",
    )(page_table_bp.astype(jnp.int32), length_b, q_bhc, pages_npc.reshape(n * page_size, c))
    o_bhl = outs[0] if final else _combine_splits(*outs)
    return o_bhl[:, :h]


def _single_output(kernel, table_ref, length_ref, q_ref, rows_ref, o_ref):
    """One split: the kernel writes the final [B, H, latent] output and no log-sum-exp."""
    kernel(table_ref, length_ref, q_ref, rows_ref, o_ref, None)
