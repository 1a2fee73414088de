"""GPU grouped matmul kernels (Pallas, Triton backend; also run on CPU with `interpret=True`).

gmm: one program per (row tile, output column tile). Row tiles start at group starts (`metadata.group_tiles`), so
each tile belongs to one group and multiplies by that group's weight only; the tile's loads are shifted back to
stay inside the array (never reading past m) and the store is masked to the tile's own rows, so tiles of different
groups never write the same row. The tail group writes zeros. Programs are ordered in bands of `_BAND` row tiles
(every column tile of a band before the next band) so a band's lhs rows and weight columns stay in L2.

gmm_mxfp4 and gmm_glu walk the same row tiles (`_row_tiles_call`): gmm_mxfp4 decodes packed MXFP4 weight tiles in
registers (`mxfp4.decode_tile`), gmm_glu accumulates gate and up in two f32 accumulators and stores only
act(gate, up) (`epilogue.glu_f32`).

tgmm: one program per (group, k tile, n tile), reducing over the group's rows in steps of tm with row masks; an
empty group writes zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gmm import epilogue, mxfp4

_BAND = 8  # row tiles per L2 band


def dot_precision(dtype):
    """In-kernel dot precision: f32 operands at HIGHEST (no TF32 rounding), 16-bit ones at DEFAULT."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _compiler_params(num_warps, num_stages, interpret):
    return None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _row_tiles_call(tile_body, operands, tile_group, tile_row_start, ends_v, *, m, n, g, tm, tn, out_dtype,
                    interpret, num_warps, num_stages, name):
    """The row-tile walk shared by gmm, gmm_mxfp4 and gmm_glu: one program per (row tile, column tile).

    `tile_body(gid, w, n0, *operand_refs)` returns the [tm, tn] block of rows w..w+tm, columns n0..n0+tn computed
    with group gid's weights; it is stored masked to the tile's own rows [lo, hi). Tail tiles (group g) store
    zeros. The first tm rows of every operand are readable (m >= tm)."""
    slots = tile_group.shape[0]
    n_tiles = n // tn

    def kernel(tile_group_ref, tile_row_start_ref, ends_ref, *refs):
        *operand_refs, out_ref = refs
        pid = pl.program_id(0)
        per_band = _BAND * n_tiles
        first = (pid // per_band) * _BAND
        band_size = jnp.minimum(slots - first, _BAND)
        local = pid % per_band
        slot = first + local % band_size
        n0 = pl.multiple_of((local // band_size) * tn, tn)
        gid = tile_group_ref[slot]
        lo = tile_row_start_ref[slot]
        hi = jnp.minimum(lo + tm, ends_ref[gid])
        w = jnp.minimum(lo, m - tm)  # shift the tile back inside the array; the store mask keeps [lo, hi)
        rows = w + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        keep = (rows >= lo) & (rows < hi)
        out_block = out_ref.at[pl.ds(w, tm), pl.ds(n0, tn)]

        @pl.when((gid < g) & (lo < hi))
        def _():
            plt.store(out_block, tile_body(gid, w, n0, *operand_refs).astype(out_dtype), mask=keep)

        @pl.when((gid == g) & (lo < hi))
        def _():
            plt.store(out_block, jnp.zeros((tm, tn), out_dtype), mask=keep)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(slots * n_tiles,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        name=name,
    )(tile_group, tile_row_start, ends_v, *operands)


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "transpose_rhs", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def gmm(lhs_mk, rhs, tile_group, tile_row_start, ends_v, *, tm, tk, tn, transpose_rhs, out_dtype, interpret,
        num_warps=8, num_stages=3):
    """out[m, n] with rows of group i = lhs rows @ rhs[i] (rhs [g, k, n], or [g, n, k] if transpose_rhs).
    Needs m >= tm, k % tk == 0, n % tn == 0 (the caller pads)."""
    m, k = lhs_mk.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    prec = dot_precision(lhs_mk.dtype)
    rhs_contract = 1 if transpose_rhs else 0

    def tile_body(gid, w, n0, lhs_ref, rhs_ref):
        def body(kk, acc):
            k0 = pl.multiple_of(kk * tk, tk)
            a = lhs_ref[pl.ds(w, tm), pl.ds(k0, tk)]
            if transpose_rhs:
                b = rhs_ref[gid, pl.ds(n0, tn), pl.ds(k0, tk)]
            else:
                b = rhs_ref[gid, pl.ds(k0, tk), pl.ds(n0, tn)]
            return acc + jax.lax.dot_general(a, b, (((1,), (rhs_contract,)), ((), ())), precision=prec,
                                             preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tm, tn), jnp.float32))

    return _row_tiles_call(tile_body, (lhs_mk, rhs), tile_group, tile_row_start, ends_v, m=m, n=n, g=g, tm=tm,
                           tn=tn, out_dtype=out_dtype, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, name="k3_gmm")


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "out_dtype", "interpret", "num_warps",
                                             "num_stages"))
def gmm_mxfp4(lhs_mk, packed, scales, tile_group, tile_row_start, ends_v, *, tm, tk, tn, out_dtype, interpret,
              num_warps=4, num_stages=3):
    """out[m, n] with rows of group i = lhs rows @ dequant(packed[i], scales[i])ᵀ; packed u8 [g, n, k/2], scales
    u8 [g, n, k/32]. Each k step loads a [tn, tk/2] byte tile and its [tn, tk/32] scales, decodes them to the lhs
    dtype in registers (`mxfp4.decode_tile`) and accumulates in f32. Needs m >= tm, k % tk == 0, tk % 32 == 0,
    n % tn == 0."""
    m, k = lhs_mk.shape
    g, n, _ = packed.shape
    prec = dot_precision(lhs_mk.dtype)
    half, groups = tk // 2, tk // mxfp4.GROUP

    def tile_body(gid, w, n0, lhs_ref, packed_ref, scales_ref):
        def body(kk, acc):
            a = lhs_ref[pl.ds(w, tm), pl.ds(pl.multiple_of(kk * tk, tk), tk)]
            p = packed_ref[gid, pl.ds(n0, tn), pl.ds(pl.multiple_of(kk * half, half), half)]
            s = scales_ref[gid, pl.ds(n0, tn), pl.ds(kk * groups, groups)]
            b = mxfp4.decode_tile(p, s, a.dtype)  # [tn, tk]
            return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                                             preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tm, tn), jnp.float32))

    return _row_tiles_call(tile_body, (lhs_mk, packed, scales), tile_group, tile_row_start, ends_v, m=m, n=n,
                           g=g, tm=tm, tn=tn, out_dtype=out_dtype, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, name="k3_gmm_mxfp4")


@functools.partial(jax.jit, static_argnames=("activation", "beta1", "beta2", "tm", "tk", "tn", "out_dtype",
                                             "interpret", "num_warps", "num_stages"))
def gmm_glu(lhs_mk, w_gate, w_up, tile_group, tile_row_start, ends_v, *, activation, beta1, beta2, tm, tk, tn,
            out_dtype, interpret, num_warps=8, num_stages=3):
    """out[m, n] = act(lhs @ w_gate[i], lhs @ w_up[i]) on the rows of group i (w_* [g, k, n]): both products are
    accumulated in f32 in one pass over k (two accumulators) and the activation is the epilogue, so the [m, 2n]
    pre-activations never reach HBM. Needs m >= tm, k % tk == 0, n % tn == 0."""
    m, k = lhs_mk.shape
    g, _, n = w_gate.shape
    prec = dot_precision(lhs_mk.dtype)

    def tile_body(gid, w, n0, lhs_ref, gate_ref, up_ref):
        def body(kk, accs):
            k0 = pl.multiple_of(kk * tk, tk)
            a = lhs_ref[pl.ds(w, tm), pl.ds(k0, tk)]
            dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                                    precision=prec, preferred_element_type=jnp.float32)
            return (accs[0] + dot(a, gate_ref[gid, pl.ds(k0, tk), pl.ds(n0, tn)]),
                    accs[1] + dot(a, up_ref[gid, pl.ds(k0, tk), pl.ds(n0, tn)]))

        zeros = jnp.zeros((tm, tn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, k // tk, body, (zeros, zeros))
        return epilogue.glu_f32(gate, up, activation, beta1, beta2)

    return _row_tiles_call(tile_body, (lhs_mk, w_gate, w_up), tile_group, tile_row_start, ends_v, m=m, n=n, g=g,
                           tm=tm, tn=tn, out_dtype=out_dtype, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, name="k3_gmm_glu")


@functools.partial(jax.jit, static_argnames=("num_groups", "tm", "tk", "tn", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def tgmm(lhs_mk, grad_mn, starts_v, ends_v, *, num_groups, tm, tk, tn, out_dtype, interpret, num_warps=8,
         num_stages=3):
    """out[i] = lhs[rows of i].T @ grad[rows of i] -> [g, k, n]. Needs m >= tm, k % tk == 0, n % tn == 0."""
    m, k = lhs_mk.shape
    n = grad_mn.shape[1]
    k_tiles, n_tiles = k // tk, n // tn
    prec = dot_precision(lhs_mk.dtype)

    def kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref):
        pid = pl.program_id(0)
        gid = pid // (k_tiles * n_tiles)
        rest = pid % (k_tiles * n_tiles)
        k0 = pl.multiple_of((rest // n_tiles) * tk, tk)
        n0 = pl.multiple_of((rest % n_tiles) * tn, tn)
        lo, hi = starts_ref[gid], ends_ref[gid]
        steps = (hi - lo + tm - 1) // tm

        def body(s, acc):
            r = lo + s * tm
            w = jnp.minimum(r, m - tm)
            rows_k = w + jax.lax.broadcasted_iota(jnp.int32, (tm, tk), 0)
            rows_n = w + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            a = plt.load(lhs_ref.at[pl.ds(w, tm), pl.ds(k0, tk)], mask=(rows_k >= r) & (rows_k < hi), other=0)
            b = plt.load(grad_ref.at[pl.ds(w, tm), pl.ds(n0, tn)], mask=(rows_n >= r) & (rows_n < hi), other=0)
            return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((tk, tn), jnp.float32))
        out_ref[gid, pl.ds(k0, tk), pl.ds(n0, tn)] = acc.astype(out_dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid=(num_groups * k_tiles * n_tiles,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        name="k3_tgmm",
    )(starts_v, ends_v, lhs_mk, grad_mn)
