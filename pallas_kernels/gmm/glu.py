"""`gmm_glu`: the fused expert up-projection act(lhs @ w_gate[i], lhs @ w_up[i]) per group, differentiable.

Forward: one kernel per backend ('gpu'/'interpret': Triton, 'tpu'/'tpu_interpret': Mosaic) walks the row tiles
like `gmm`, accumulates the gate and up products of a tile in two f32 accumulators over k and applies the
activation (`epilogue.glu_f32`, f32) before the only store: the [m, 2n] pre-activations never reach HBM.

Backward (custom VJP, recompute): the gate and up pre-activations are recomputed with two unfused `gmm` kernel
calls (f32 out), the activation's derivative is taken in f32, and the four products are the unfused kernels:
d_lhs = d_gate @ w_gateᵀ + d_up @ w_upᵀ (gmm over the transposed weights), d_w_gate = tgmm(lhs, d_gate),
d_w_up = tgmm(lhs, d_up). Residuals are only lhs, the weights and the group metadata (no [m, 2n] activations
saved), at the price of re-running the forward matmuls (forward + backward = 8 instead of 6 m·k·n products).
d_gate / d_up are cast to the compute dtype (bf16 in, f32 accumulation) like `gmm`'s cotangent.
'xla': `jax.lax.ragged_dot` twice (f32 out) and the same f32 activation, differentiated by JAX.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import api, epilogue
from pallas_kernels.gmm import gpu as gpu_kernels
from pallas_kernels.gmm import metadata as meta
from pallas_kernels.gmm import tpu as tpu_kernels


class _GluStatic(NamedTuple):
    backend: str
    tiling: api.Tiling | None
    out_dtype: object
    activation: str
    beta1: float | None
    beta2: float | None


def _kernel_glu(lhs_mk, w_gate, w_up, bounds, static: _GluStatic):
    family = api._FAMILY[static.backend]
    interpret = static.backend in ("interpret", "tpu_interpret")
    m, k = lhs_mk.shape
    n = w_gate.shape[2]
    tiling = api._fit(static.tiling or api._default_tiling(family, "glu", m, w_gate.shape[0]), m, k, n, family)
    tm, tk, tn = tiling[:3]
    w_gate, w_up = (api._pad_to(api._pad_to(w, 1, tk), 2, tn) for w in (w_gate, w_up))
    act = dict(activation=static.activation, beta1=static.beta1, beta2=static.beta2)
    if family == "gpu":
        lhs_p = api._pad_to(api._pad_to(lhs_mk, 1, tk), 0, 1, at_least=tm)
        tiles = meta.group_tiles(bounds, m, tm)
        out = gpu_kernels.gmm_glu(lhs_p, w_gate, w_up, tiles.tile_group, tiles.tile_row_start, bounds.ends_v,
                                  **act, tm=tm, tk=tk, tn=tn, out_dtype=static.out_dtype, interpret=interpret,
                                  num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    else:
        lhs_p = api._pad_to(api._pad_to(lhs_mk, 1, tk), 0, tm)
        items = meta.aligned_items(bounds, lhs_p.shape[0], tm, include_tail=True, visit_empty=False)
        out = tpu_kernels.gmm_glu(lhs_p, w_gate, w_up, items.item_group, items.item_tile, items.item_valid,
                                  bounds.starts_v, bounds.ends_v, **act, tm=tm, tk=tk, tn=tn,
                                  out_dtype=static.out_dtype, interpret=interpret)
    return out[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _glu_kernel(lhs_mk, w_gate, w_up, group_sizes_g, static: _GluStatic):
    return _glu_kernel_fwd(lhs_mk, w_gate, w_up, group_sizes_g, static)[0]


def _glu_kernel_fwd(lhs_mk, w_gate, w_up, group_sizes_g, static: _GluStatic):
    bounds = meta.group_bounds(group_sizes_g, lhs_mk.shape[0])
    compute = jnp.result_type(lhs_mk.dtype, w_gate.dtype, w_up.dtype)
    out = _kernel_glu(lhs_mk.astype(compute), w_gate.astype(compute), w_up.astype(compute), bounds, static)
    return out, (lhs_mk, w_gate, w_up, bounds)


def _glu_kernel_bwd(static: _GluStatic, residuals, d_out_mn):
    lhs_mk, w_gate, w_up, bounds = residuals
    compute = jnp.result_type(lhs_mk.dtype, w_gate.dtype, w_up.dtype)
    x, wg, wu = lhs_mk.astype(compute), w_gate.astype(compute), w_up.astype(compute)
    plain = api._Static(static.backend, static.tiling, jnp.float32)
    t = static.tiling
    transposed = plain._replace(tiling=None if t is None else t._replace(tk=t.tn, tn=t.tk))

    def matmul(a, w, transpose, out_dtype):
        return api._kernel_gmm(a, w, bounds, transposed if transpose else plain, transpose_rhs=transpose,
                               out_dtype=out_dtype, call="gmm_t" if transpose else "gmm")

    gate, up = matmul(x, wg, False, jnp.float32), matmul(x, wu, False, jnp.float32)
    d_gate, d_up = epilogue.glu_vjp_f32(gate, up, d_out_mn.astype(jnp.float32), static.activation, static.beta1,
                                        static.beta2)
    d_gate, d_up = d_gate.astype(compute), d_up.astype(compute)
    d_lhs = (matmul(d_gate, wg, True, jnp.float32) + matmul(d_up, wu, True, jnp.float32)).astype(lhs_mk.dtype)
    num_groups = w_gate.shape[0]
    d_wg = api._kernel_tgmm(x, d_gate, bounds, num_groups, plain, out_dtype=w_gate.dtype)
    d_wu = api._kernel_tgmm(x, d_up, bounds, num_groups, plain, out_dtype=w_up.dtype)
    return d_lhs, d_wg, d_wu, None


_glu_kernel.defvjp(_glu_kernel_fwd, _glu_kernel_bwd)


def _check(lhs_mk, w_gate, w_up, group_sizes_g, activation, beta1, beta2):
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gmm_glu needs w_gate and w_up of one shape [g, k, n], got {w_gate.shape} and "
                         f"{w_up.shape}")
    api._check(lhs_mk, w_gate, group_sizes_g)
    if activation not in epilogue.ACTIVATIONS:
        raise ValueError(f"unknown gmm_glu activation {activation!r}; available: {', '.join(epilogue.ACTIVATIONS)}")
    if activation == "situ" and (beta1 is None or beta2 is None or beta1 <= 0 or beta2 <= 0):
        raise ValueError(f"gmm_glu activation='situ' needs positive beta1 and beta2, got {beta1}, {beta2}")


def gmm_glu(lhs_mk: jax.Array, w_gate_gkn: jax.Array, w_up_gkn: jax.Array, group_sizes_g: jax.Array, *,
            activation: str = "situ", beta1: float | None = None, beta2: float | None = None,
            preferred_element_type=None, tiling=None, backend: str | None = None) -> jax.Array:
    """act(lhs @ w_gate[i], lhs @ w_up[i]) on the rows of group i -> [m, n] (`jax.lax.ragged_dot` row grouping;
    rows past sum(group_sizes) give zeros). activation 'situ' (needs beta1, beta2; K3: 4 and 25) or 'silu'.
    Products accumulate and the activation runs in f32; the result has `preferred_element_type` or the inputs'
    dtype. Differentiable in lhs and both weights (see the module docstring for the recomputing backward).
    `tiling`: (tm, tk, tn) or a `Tiling`; backend as in `gmm`."""
    _check(lhs_mk, w_gate_gkn, w_up_gkn, group_sizes_g, activation, beta1, beta2)
    beta1, beta2 = (None, None) if activation == "silu" else (float(beta1), float(beta2))
    backend = api._resolve_backend(backend)
    out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else \
        jnp.result_type(lhs_mk.dtype, w_gate_gkn.dtype, w_up_gkn.dtype)
    group_sizes_g = group_sizes_g.astype(jnp.int32)
    if backend == "xla":
        gate, up = (jax.lax.ragged_dot(lhs_mk, w, group_sizes_g, preferred_element_type=jnp.float32)
                    for w in (w_gate_gkn, w_up_gkn))
        return epilogue.glu_f32(gate, up, activation, beta1, beta2).astype(out_dtype)
    static = _GluStatic(backend, api._as_tiling(tiling), out_dtype, activation, beta1, beta2)
    return _glu_kernel(lhs_mk, w_gate_gkn, w_up_gkn, group_sizes_g, static)
