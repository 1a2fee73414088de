"""TPU grouped matmul kernels (Pallas Mosaic TPU; on CPU with `interpret=pltpu.InterpretParams()`).

Megablox-style: the grid walks work items (group, aligned row tile) from `metadata.aligned_items`, passed as
scalar-prefetch operands so the BlockSpec index maps pick the row tile and the group's weight block. Items of one
row tile are consecutive, so the output block stays in VMEM across them; an f32 VMEM accumulator is zeroed on the
first item of a tile (or of a group for tgmm) and each item adds only its own group's rows (row mask from the group
bounds). Padding items repeat the last real item and compute nothing.

gmm_glu (two accumulators, activation when the block is written) and gmm_mxfp4 (weights decoded in VMEM; see its
docstring for the lane-friendly form) use the same walk.

Layout needs (the caller pads): m % tm == 0, k % tk == 0, n % tn == 0; on hardware tm % 8 (16 for bf16) and
tk, tn % 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gmm import epilogue, mxfp4
from pallas_kernels.gmm.gpu import dot_precision


def _interpret_arg(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "transpose_rhs", "out_dtype", "interpret"))
def gmm(lhs_mk, rhs, item_group, item_tile, item_valid, starts_v, ends_v, *, tm, tk, tn, transpose_rhs,
        out_dtype, interpret):
    """out[m, n] with rows of group i = lhs rows @ rhs[i] (rhs [g, k, n], or [g, n, k] if transpose_rhs)."""
    m, k = lhs_mk.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    items = item_group.shape[0]
    k_tiles = k // tk
    prec = dot_precision(lhs_mk.dtype)
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


@functools.partial(jax.jit, static_argnames=("activation", "beta1", "beta2", "tm", "tk", "tn", "out_dtype",
                                             "interpret"))
def gmm_glu(lhs_mk, w_gate, w_up, item_group, item_tile, item_valid, starts_v, ends_v, *, activation, beta1, beta2,
            tm, tk, tn, out_dtype, interpret):
    """out[m, n] = act(lhs @ w_gate[i], lhs @ w_up[i]) on the rows of group i (w_* [g, k, n]). Same walk as `gmm`
    with two f32 VMEM accumulators (gate, up); the activation is applied when the output block is written (after
    the last k step), so each item's write holds act of the tile's rows accumulated so far and the tile's last item
    writes the final values (rows of no group, and the tail, stay 0 = act(0, 0))."""
    m, k = lhs_mk.shape
    g, _, n = w_gate.shape
    items = item_group.shape[0]
    k_tiles = k // tk
    prec = dot_precision(lhs_mk.dtype)

    def lhs_map(j, i, kk, grp, tile, valid, starts, ends):
        return tile[i], kk

    def w_map(j, i, kk, grp, tile, valid, starts, ends):
        return jnp.minimum(grp[i], g - 1), kk, j

    def out_map(j, i, kk, grp, tile, valid, starts, ends):
        return tile[i], j

    def kernel(grp, tile, valid, starts, ends, lhs_ref, gate_ref, up_ref, out_ref, acc_gate, acc_up):
        i, kk = pl.program_id(1), pl.program_id(2)
        first_of_tile = (i == 0) | (tile[i] != tile[jnp.maximum(i - 1, 0)])

        @pl.when(first_of_tile & (kk == 0))
        def _():
            acc_gate[...] = jnp.zeros_like(acc_gate)
            acc_up[...] = jnp.zeros_like(acc_up)

        gid = grp[i]

        @pl.when((valid[i] == 1) & (gid < g))
        def _():
            rows = tile[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mine = (rows >= starts[gid]) & (rows < ends[gid])
            lhs = lhs_ref[...]
            for w_ref, acc in ((gate_ref, acc_gate), (up_ref, acc_up)):
                prod = jax.lax.dot_general(lhs, w_ref[...], (((1,), (0,)), ((), ())), precision=prec,
                                           preferred_element_type=jnp.float32)
                acc[...] += jnp.where(mine, prod, 0.0)

        @pl.when(kk == k_tiles - 1)
        def _():
            out_ref[...] = epilogue.glu_f32(acc_gate[...], acc_up[...], activation, beta1, beta2).astype(out_dtype)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n // tn, items, k_tiles),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((None, tk, tn), w_map),
                  pl.BlockSpec((None, tk, tn), w_map)],
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="k3_gmm_glu_tpu",
    )(item_group, item_tile, item_valid, starts_v, ends_v, lhs_mk, w_gate, w_up)


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "out_dtype", "interpret"))
def gmm_mxfp4(lhs_eo, packed, scales, item_group, item_tile, item_valid, starts_v, ends_v, *, tm, tk, tn, out_dtype,
              interpret):
    """out[m, n] with rows of group i = lhs rows @ dequant(packed[i], scales[i])ᵀ, the weights decoded in VMEM.

    Lane-friendly form of the MXFP4 layout (no lane interleave or lane repeat, which Mosaic lacks):
    - lhs_eo [2, m, k/2] holds the even and odd lhs columns (the caller splits them), so the low nibbles (even
      columns) and high nibbles (odd columns) of a byte tile are two separate [tn, tk/2] operands:
      out += lhs_even @ loᵀ + lhs_odd @ hiᵀ.
    - scales [g, n, k/32] are one block of the full k/32 (a legal block for any k); the k step's per-column
      factors [tn, tk/2] come from an exact 0/1 expansion matmul factor[tn, k/32] @ E[k/32, tk/2] with
      E[j, c] = (column c of this step lies in scale group j), in bf16 (powers of two are exact) with f32 out.
    Needs m % tm == 0, k % tk == 0, tk % 256 == 0 (packed lanes multiple of 128), n % tn == 0."""
    _, m, half_k = lhs_eo.shape
    g, n, _ = packed.shape
    num_scale_groups = scales.shape[2]
    items = item_group.shape[0]
    half = tk // 2
    k_tiles = 2 * half_k // tk
    prec = dot_precision(lhs_eo.dtype)

    def lhs_map(j, i, kk, grp, tile, valid, starts, ends):
        return 0, tile[i], kk

    def packed_map(j, i, kk, grp, tile, valid, starts, ends):
        return jnp.minimum(grp[i], g - 1), j, kk

    def scales_map(j, i, kk, grp, tile, valid, starts, ends):
        return jnp.minimum(grp[i], g - 1), j, 0

    def out_map(j, i, kk, grp, tile, valid, starts, ends):
        return tile[i], j

    def kernel(grp, tile, valid, starts, ends, lhs_ref, packed_ref, scales_ref, out_ref, acc_ref):
        i, kk = pl.program_id(1), pl.program_id(2)
        first_of_tile = (i == 0) | (tile[i] != tile[jnp.maximum(i - 1, 0)])

        @pl.when(first_of_tile & (kk == 0))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        gid = grp[i]

        @pl.when((valid[i] == 1) & (gid < g))
        def _():
            factor = mxfp4.e8m0_to_f32(scales_ref[...].astype(jnp.int32)).astype(jnp.bfloat16)  # [tn, k/32]
            col = kk * half + jax.lax.broadcasted_iota(jnp.int32, (num_scale_groups, half), 1)
            grp_of_col = jax.lax.broadcasted_iota(jnp.int32, (num_scale_groups, half), 0)
            expand = ((col >> 4) == grp_of_col).astype(jnp.bfloat16)  # [k/32, tk/2]; 16 pairs per group
            factor = jax.lax.dot_general(factor, expand, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)  # [tn, tk/2], exact
            codes = packed_ref[...].astype(jnp.int32)
            dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                                    precision=prec, preferred_element_type=jnp.float32)
            lo = (mxfp4.e2m1_to_f32(codes & 15) * factor).astype(lhs_ref.dtype)
            hi = (mxfp4.e2m1_to_f32(codes >> 4) * factor).astype(lhs_ref.dtype)
            prod = dot(lhs_ref[0], lo) + dot(lhs_ref[1], hi)
            rows = tile[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mine = (rows >= starts[gid]) & (rows < ends[gid])
            acc_ref[...] += jnp.where(mine, prod, 0.0)

        @pl.when(kk == k_tiles - 1)
        def _():
            out_ref[...] = acc_ref[...].astype(out_dtype)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n // tn, items, k_tiles),
        in_specs=[pl.BlockSpec((2, tm, half), lhs_map), pl.BlockSpec((None, tn, half), packed_map),
                  pl.BlockSpec((None, tn, num_scale_groups), scales_map)],
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="k3_gmm_mxfp4_tpu",
    )(item_group, item_tile, item_valid, starts_v, ends_v, lhs_eo, packed, scales)


@functools.partial(jax.jit, static_argnames=("num_groups", "tm", "tk", "tn", "out_dtype", "interpret"))
def tgmm(lhs_mk, grad_mn, item_group, item_tile, item_valid, starts_v, ends_v, *, num_groups, tm, tk, tn,
         out_dtype, interpret):
    """out[i] = lhs[rows of i].T @ grad[rows of i] -> [g, k, n]; items from `aligned_items(visit_empty=True)`."""
    m, k = lhs_mk.shape
    n = grad_mn.shape[1]
    items = item_group.shape[0]
    prec = dot_precision(lhs_mk.dtype)

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
