"""TPU grouped matmul kernels (Pallas Mosaic TPU; on CPU with `interpret=pltpu.InterpretParams()`).

Megablox-style: the grid walks work items (group, aligned row tile) from `metadata.aligned_items`, passed as
scalar-prefetch operands so the BlockSpec index maps pick the row tile and the group's weight block. Items of one
row tile are consecutive, so the output block stays in VMEM across them; an f32 VMEM accumulator is zeroed on the
first item of a tile (or of a group for tgmm) and each item adds only its own group's rows (row mask from the group
bounds). Padding items repeat the last real item and compute nothing.

Layout needs (the caller pads): m % tm == 0, k % tk == 0, n % tn == 0; on hardware tm % 8 (16 for bf16) and
tk, tn % 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _interpret_arg(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "transpose_rhs", "out_dtype", "interpret"))
def gmm(lhs_mk, rhs, item_group, item_tile, item_valid, starts_v, ends_v, *, tm, tk, tn, transpose_rhs,
        out_dtype, interpret):
    """out[m, n] with rows of group i = lhs rows @ rhs[i] (rhs [g, k, n], or [g, n, k] if transpose_rhs)."""
    m, k = lhs_mk.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    items = item_group.shape[0]
    k_tiles = k // tk
    prec = _precision(lhs_mk.dtype)
    rhs_contract = 1 if transpose_rhs else 0

    def lhs_map(j, i, kk, grp, tile, valid, starts, ends):
        return tile[i], kk

    def rhs_map(j, i, kk, grp, tile, valid, starts, ends):
        gid = jnp.minimum(grp[i], g - 1)
        return (gid, j, kk) if transpose_rhs else (gid, kk, j)

    def out_map(j, i, kk, grp, tile, valid, starts, ends):
        return tile[i], j

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)

    def kernel(grp, tile, valid, starts, ends, lhs_ref, rhs_ref, out_ref, acc_ref):
        i, kk = pl.program_id(1), pl.program_id(2)
        first_of_tile = (i == 0) | (tile[i] != tile[jnp.maximum(i - 1, 0)])

        @pl.when(first_of_tile & (kk == 0))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        gid = grp[i]

        @pl.when((valid[i] == 1) & (gid < g))
        def _():
            rows = tile[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mine = (rows >= starts[gid]) & (rows < ends[gid])
            prod = jax.lax.dot_general(lhs_ref[...], rhs_ref[...], (((1,), (rhs_contract,)), ((), ())),
                                       precision=prec, preferred_element_type=jnp.float32)
            acc_ref[...] += jnp.where(mine, prod, 0.0)

        @pl.when(kk == k_tiles - 1)
        def _():
            out_ref[...] = acc_ref[...].astype(out_dtype)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n // tn, items, k_tiles),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="k3_gmm_tpu",
    )(item_group, item_tile, item_valid, starts_v, ends_v, lhs_mk, rhs)


@functools.partial(jax.jit, static_argnames=("num_groups", "tm", "tk", "tn", "out_dtype", "interpret"))
def tgmm(lhs_mk, grad_mn, item_group, item_tile, item_valid, starts_v, ends_v, *, num_groups, tm, tk, tn,
         out_dtype, interpret):
    """out[i] = lhs[rows of i].T @ grad[rows of i] -> [g, k, n]; items from `aligned_items(visit_empty=True)`."""
    m, k = lhs_mk.shape
    n = grad_mn.shape[1]
    items = item_group.shape[0]
    prec = _precision(lhs_mk.dtype)

    def lhs_map(kt, j, i, grp, tile, valid, starts, ends):
        return tile[i], kt

    def grad_map(kt, j, i, grp, tile, valid, starts, ends):
        return tile[i], j

    def out_map(kt, j, i, grp, tile, valid, starts, ends):
        return grp[i], kt, j

    def kernel(grp, tile, valid, starts, ends, lhs_ref, grad_ref, out_ref, acc_ref):
        i = pl.program_id(2)
        gid = grp[i]

        @pl.when((i == 0) | (gid != grp[jnp.maximum(i - 1, 0)]))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(valid[i] == 1)
        def _():
            rows = tile[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tk), 0)
            mine = (rows >= starts[gid]) & (rows < ends[gid])
            lhs = jnp.where(mine, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
            rows_n = tile[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, grad_ref.shape[1]), 0)
            grad = jnp.where((rows_n >= starts[gid]) & (rows_n < ends[gid]), grad_ref[...],
                             jnp.zeros((), grad_ref.dtype))
            acc_ref[...] += jax.lax.dot_general(lhs, grad, (((0,), (0,)), ((), ())), precision=prec,
                                                preferred_element_type=jnp.float32)

        out_ref[...] = acc_ref[...].astype(out_dtype)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(k // tk, n // tn, items),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), grad_map)],
        out_specs=pl.BlockSpec((None, tk, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="k3_tgmm_tpu",
    )(item_group, item_tile, item_valid, starts_v, ends_v, lhs_mk, grad_mn)
