"""GPU grouped matmul kernels (Pallas, Triton backend; also run on CPU with `interpret=True`).

gmm: one program per (row tile, output column tile). Row tiles start at group starts (`metadata.group_tiles`), so
each tile belongs to one group and multiplies by that group's weight only; the tile's loads are shifted back to
stay inside the array (never reading past m) and the store is masked to the tile's own rows, so tiles of different
groups never write the same row. The tail group writes zeros. Programs are ordered in bands of `_BAND` row tiles
(every column tile of a band before the next band) so a band's lhs rows and weight columns stay in L2.

tgmm: one program per (group, k tile, n tile), reducing over the group's rows in steps of tm with row masks; an
empty group writes zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_BAND = 8  # row tiles per L2 band


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _compiler_params(num_warps, num_stages, interpret):
    return None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "transpose_rhs", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def gmm(lhs_mk, rhs, tile_group, tile_row_start, ends_v, *, tm, tk, tn, transpose_rhs, out_dtype, interpret,
        num_warps=8, num_stages=3):
    """out[m, n] with rows of group i = lhs rows @ rhs[i] (rhs [g, k, n], or [g, n, k] if transpose_rhs).
    Needs m >= tm, k % tk == 0, n % tn == 0 (the caller pads)."""
    m, k = lhs_mk.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    slots = tile_group.shape[0]
    n_tiles, k_tiles = n // tn, k // tk
    prec = _precision(lhs_mk.dtype)
    rhs_contract = 1 if transpose_rhs else 0

    def kernel(tile_group_ref, tile_row_start_ref, ends_ref, lhs_ref, rhs_ref, out_ref):
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
        w = jnp.minimum(lo, m - tm)
        rows = w + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        keep = (rows >= lo) & (rows < hi)
        out_block = out_ref.at[pl.ds(w, tm), pl.ds(n0, tn)]

        @pl.when((gid < g) & (lo < hi))
        def _():
            def body(kk, acc):
                k0 = pl.multiple_of(kk * tk, tk)
                a = lhs_ref[pl.ds(w, tm), pl.ds(k0, tk)]
                if transpose_rhs:
                    b = rhs_ref[gid, pl.ds(n0, tn), pl.ds(k0, tk)]
                else:
                    b = rhs_ref[gid, pl.ds(k0, tk), pl.ds(n0, tn)]
                return acc + jax.lax.dot_general(a, b, (((1,), (rhs_contract,)), ((), ())), precision=prec,
                                                 preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, k_tiles, body, jnp.zeros((tm, tn), jnp.float32))
            plt.store(out_block, acc.astype(out_dtype), mask=keep)

        @pl.when((gid == g) & (lo < hi))
        def _():
            plt.store(out_block, jnp.zeros((tm, tn), out_dtype), mask=keep)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(slots * n_tiles,),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        name="k3_gmm",
    )(tile_group, tile_row_start, ends_v, lhs_mk, rhs)


@functools.partial(jax.jit, static_argnames=("num_groups", "tm", "tk", "tn", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def tgmm(lhs_mk, grad_mn, starts_v, ends_v, *, num_groups, tm, tk, tn, out_dtype, interpret, num_warps=8,
         num_stages=3):
    """out[i] = lhs[rows of i].T @ grad[rows of i] -> [g, k, n]. Needs m >= tm, k % tk == 0, n % tn == 0."""
    m, k = lhs_mk.shape
    n = grad_mn.shape[1]
    k_tiles, n_tiles = k // tk, n // tn
    prec = _precision(lhs_mk.dtype)

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
