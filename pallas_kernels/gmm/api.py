"""The single dispatch point of the grouped matmul: `gmm` (with a custom VJP) and `tgmm`, over four backends.

Backends: 'gpu' (Pallas Triton kernels), 'tpu' (Pallas Mosaic TPU kernels), 'interpret' (the GPU kernels
interpreted on CPU), 'tpu_interpret' (the TPU kernels under the TPU interpreter), 'xla' (`jax.lax.ragged_dot`).
The caller names the backend (`k3jax.ops.gmm` picks it from the traced platform).

Semantics are `jax.lax.ragged_dot`'s: group i owns the next group_sizes[i] rows of lhs and multiplies them by
rhs[i]; groups may be empty; rows past sum(group_sizes) give zeros. Accumulation is f32. Gradients: d_lhs is a
grouped matmul with each rhs[i] transposed (read transposed in the kernel, not materialised), d_rhs is `tgmm`; the
group metadata of the forward call is reused by the backward. The incoming cotangent is cast to the lhs dtype
before the backward kernels (bf16 in, f32 accumulation), like the forward's inputs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import gpu as gpu_kernels
from pallas_kernels.gmm import metadata as meta
from pallas_kernels.gmm import tpu as tpu_kernels
from pallas_kernels.tiling import next_pow2

BACKENDS = ("gpu", "tpu", "interpret", "tpu_interpret", "xla")


class Tiling(NamedTuple):
    """Block sizes of one call: tm rows, tk of the contracted dim, tn of the output columns (gmm); for tgmm tm is
    the row step of the reduction and (tk, tn) the output block. num_warps / num_stages: Triton only."""

    tm: int
    tk: int
    tn: int
    num_warps: int = 8
    num_stages: int = 3


# Defaults per kernel family and call: forward gmm, d_lhs (gmm over transposed rhs), d_rhs (tgmm).
# gmm_glu holds two accumulators (half the tn of gmm); gmm_mxfp4 decodes its weight tile in registers. TPU tk = 512
# divides both K3 contractions (3584, 3072), so the weights are not padded (copied) per call.
_DEFAULTS = {
    "gpu": {"gmm": Tiling(128, 64, 256), "gmm_t": Tiling(128, 64, 256), "tgmm": Tiling(64, 128, 256),
            "glu": Tiling(128, 64, 128), "mxfp4": Tiling(64, 128, 128, 4, 3)},
    "tpu": {"gmm": Tiling(512, 1024, 1024), "gmm_t": Tiling(512, 1024, 1024), "tgmm": Tiling(512, 1024, 1024),
            "glu": Tiling(512, 512, 512), "mxfp4": Tiling(256, 512, 512)},
}
# Decode-sized calls (a few rows per group: B=64 decode routes ~8 rows to each of 64 experts) are bound by reading
# the weights once: thin row tiles, 4 warps and deeper pipelining. H200, 512x768x768, 64 groups, 50 chained calls
# (`gmm_bench.py --chain=50`): 32.9 us balanced / 30.8 us skewed vs 38.3 / 38.1 with the training tiling.
_GPU_DECODE = Tiling(16, 64, 128, 4, 4)
DECODE_TILING = _GPU_DECODE  # public name: callers derive variants (row tile) from it
DECODE_ROWS_PER_GROUP = 32
_FAMILY = {"gpu": "gpu", "interpret": "gpu", "tpu": "tpu", "tpu_interpret": "tpu"}


def _resolve_backend(backend):
    if backend is None:
        raise ValueError(f"gmm needs a backend, one of {', '.join(BACKENDS)} (k3jax.ops.gmm picks one by platform)")
    if backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; available: {', '.join(BACKENDS)}")
    return backend


def _as_tiling(tiling):
    if tiling is None or isinstance(tiling, Tiling):
        return tiling
    if isinstance(tiling, dict):
        return Tiling(**tiling)
    tiling = Tiling(*tiling)
    if min(tiling[:3]) <= 0:
        raise ValueError(f"gmm tiling must be positive, got {tiling}")
    return tiling


def _fit(tiling: Tiling, m: int, k: int, n: int, family: str) -> Tiling:
    """Shrinks the default tiles for small problems (never below the hardware minimum: 16 on GPU; 8/128 on TPU)."""
    if family == "gpu":  # Triton blocks are powers of two, dot dims >= 16
        tm, tk, tn = (min(t, next_pow2(d, 16)) for t, d in zip(tiling[:3], (m, k, n)))
    else:
        tm, tk, tn = (min(tiling.tm, -(-m // 16) * 16), _dividing_tile(tiling.tk, k), _dividing_tile(tiling.tn, n))
    return tiling._replace(tm=tm, tk=tk, tn=tn)


def _dividing_tile(tile: int, d: int) -> int:
    """A TPU tile for a dim of size d: the largest of tile, tile/2, ... (>= 128) that divides d, so the operand is
    not padded (K3's latent width 3584 took 1024-wide tiles to 4096: a padded copy of every expert weight per call
    and an f32 [rows, 4096] output, 1/8 of it padding); else min(tile, d rounded up to 128) (then padded)."""
    t = tile
    while t >= 128:
        if d % t == 0:
            return t
        t //= 2
    return min(tile, -(-d // 128) * 128)


def _default_tiling(family: str, call: str, m: int, groups: int) -> Tiling:
    """The family's default tiling for `call`, or the decode tiling when the rows per group are few (GPU gmm)."""
    if family == "gpu" and call in ("gmm", "gmm_t", "glu") and m <= DECODE_ROWS_PER_GROUP * max(groups, 1):
        return _GPU_DECODE
    return _DEFAULTS[family][call]


def _pad_to(x, axis: int, multiple: int, at_least: int = 0):
    size = x.shape[axis]
    target = max(-(-size // multiple) * multiple, at_least)
    if target == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, target - size)
    return jnp.pad(x, pad)


def _check(lhs, rhs, group_sizes):
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"gmm expects lhs [m, k], rhs [g, k, n], group_sizes [g]; got lhs {lhs.shape}, "
                         f"rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"gmm shape mismatch: lhs {lhs.shape} (k={lhs.shape[1]}), rhs {rhs.shape} "
                         f"(g={rhs.shape[0]}, k={rhs.shape[1]}), group_sizes {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")


class _Static(NamedTuple):
    backend: str
    tiling: Tiling | None
    out_dtype: object


def _kernel_gmm(lhs_mk, rhs, bounds, static: _Static, *, transpose_rhs: bool, out_dtype, call: str):
    """Pads to the tiling, builds the row metadata and runs the forward-style kernel; returns [m, n]."""
    family = _FAMILY[static.backend]
    interpret = static.backend in ("interpret", "tpu_interpret")
    m, k = lhs_mk.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = _fit(static.tiling or _default_tiling(family, call, m, rhs.shape[0]), m, k, n, family)
    tm, tk, tn = tiling[:3]
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    rhs = _pad_to(_pad_to(rhs, k_axis, tk), n_axis, tn)
    if family == "gpu":
        lhs_p = _pad_to(_pad_to(lhs_mk, 1, tk), 0, 1, at_least=tm)
        tiles = meta.group_tiles(bounds, m, tm)
        out = gpu_kernels.gmm(lhs_p, rhs, tiles.tile_group, tiles.tile_row_start, bounds.ends_v, tm=tm, tk=tk,
                              tn=tn, transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret,
                              num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    else:
        lhs_p = _pad_to(_pad_to(lhs_mk, 1, tk), 0, tm)
        items = meta.aligned_items(bounds, lhs_p.shape[0], tm, include_tail=True, visit_empty=False)
        out = tpu_kernels.gmm(lhs_p, rhs, items.item_group, items.item_tile, items.item_valid, bounds.starts_v,
                              bounds.ends_v, tm=tm, tk=tk, tn=tn, transpose_rhs=transpose_rhs,
                              out_dtype=out_dtype, interpret=interpret)
    return out[:m, :n]


def _kernel_tgmm(lhs_mk, grad_mn, bounds, num_groups: int, static: _Static, *, out_dtype):
    family = _FAMILY[static.backend]
    interpret = static.backend in ("interpret", "tpu_interpret")
    m, k = lhs_mk.shape
    n = grad_mn.shape[1]
    tiling = _fit(static.tiling or _DEFAULTS[family]["tgmm"], m, k, n, family)
    tm, tk, tn = tiling[:3]
    if family == "gpu":
        lhs_p = _pad_to(_pad_to(lhs_mk, 1, tk), 0, 1, at_least=tm)
        grad_p = _pad_to(_pad_to(grad_mn, 1, tn), 0, 1, at_least=tm)
        out = gpu_kernels.tgmm(lhs_p, grad_p, bounds.starts_v, bounds.ends_v, num_groups=num_groups, tm=tm,
                               tk=tk, tn=tn, out_dtype=out_dtype, interpret=interpret,
                               num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    else:
        lhs_p = _pad_to(_pad_to(lhs_mk, 1, tk), 0, tm)
        grad_p = _pad_to(_pad_to(grad_mn, 1, tn), 0, tm)
        items = meta.aligned_items(bounds, lhs_p.shape[0], tm, include_tail=False, visit_empty=True)
        out = tpu_kernels.tgmm(lhs_p, grad_p, items.item_group, items.item_tile, items.item_valid,
                               bounds.starts_v, bounds.ends_v, num_groups=num_groups, tm=tm, tk=tk, tn=tn,
                               out_dtype=out_dtype, interpret=interpret)
    return out[:, :k, :n]


def _result_dtype(lhs, rhs, preferred_element_type):
    return jnp.dtype(preferred_element_type) if preferred_element_type is not None else \
        jnp.result_type(lhs.dtype, rhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_kernel(lhs_mk, rhs_gkn, group_sizes_g, static: _Static):
    out, _ = _gmm_kernel_fwd(lhs_mk, rhs_gkn, group_sizes_g, static)
    return out


def _gmm_kernel_fwd(lhs_mk, rhs_gkn, group_sizes_g, static: _Static):
    bounds = meta.group_bounds(group_sizes_g, lhs_mk.shape[0])
    compute = jnp.result_type(lhs_mk.dtype, rhs_gkn.dtype)
    out = _kernel_gmm(lhs_mk.astype(compute), rhs_gkn.astype(compute), bounds, static, transpose_rhs=False,
                      out_dtype=static.out_dtype, call="gmm")
    return out, (lhs_mk, rhs_gkn, bounds)


def _gmm_kernel_bwd(static: _Static, residuals, d_out_mn):
    lhs_mk, rhs_gkn, bounds = residuals
    compute = jnp.result_type(lhs_mk.dtype, rhs_gkn.dtype)
    d_out = d_out_mn.astype(compute)
    t = static.tiling  # a given (tm, tk, tn) is reused with the roles of k and n swapped for d_lhs
    d_lhs = _kernel_gmm(d_out, rhs_gkn.astype(compute), bounds,
                        static._replace(tiling=None if t is None else t._replace(tk=t.tn, tn=t.tk)),
                        transpose_rhs=True, out_dtype=lhs_mk.dtype, call="gmm_t")
    d_rhs = _kernel_tgmm(lhs_mk.astype(compute), d_out, bounds, rhs_gkn.shape[0], static,
                         out_dtype=rhs_gkn.dtype)
    return d_lhs, d_rhs, None


_gmm_kernel.defvjp(_gmm_kernel_fwd, _gmm_kernel_bwd)


def gmm(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *, preferred_element_type=None,
        tiling=None, backend: str | None = None) -> jax.Array:
    """Grouped matmul [m, k] x [g, k, n] -> [m, n] with `jax.lax.ragged_dot` semantics; differentiable in lhs
    and rhs. `tiling`: (tm, tk, tn) or a `Tiling` (defaults per backend, shrunk for small shapes)."""
    _check(lhs_mk, rhs_gkn, group_sizes_g)
    backend = _resolve_backend(backend)
    if backend == "xla":
        return jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32),
                                  preferred_element_type=preferred_element_type)
    static = _Static(backend, _as_tiling(tiling), _result_dtype(lhs_mk, rhs_gkn, preferred_element_type))
    return _gmm_kernel(lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32), static)


def tgmm(lhs_mk: jax.Array, grad_mn: jax.Array, group_sizes_g: jax.Array, *, preferred_element_type=None,
         tiling=None, backend: str | None = None) -> jax.Array:
    """Per-group lhsᵀ·grad: out[i] = lhs[rows of i]ᵀ @ grad[rows of i] -> [g, k, n] (the weight gradient of
    `gmm`); empty groups give zeros. Not differentiable itself."""
    if lhs_mk.ndim != 2 or grad_mn.ndim != 2 or group_sizes_g.ndim != 1 or lhs_mk.shape[0] != grad_mn.shape[0]:
        raise ValueError(f"tgmm expects lhs [m, k], grad [m, n], group_sizes [g]; got {lhs_mk.shape}, "
                         f"{grad_mn.shape}, {group_sizes_g.shape}")
    backend = _resolve_backend(backend)
    out_dtype = _result_dtype(lhs_mk, grad_mn, preferred_element_type)
    num_groups = group_sizes_g.shape[0]
    if backend == "xla":
        zeros = jnp.zeros((num_groups, lhs_mk.shape[1], grad_mn.shape[1]), out_dtype)
        _, pullback = jax.vjp(lambda w: jax.lax.ragged_dot(lhs_mk, w, group_sizes_g.astype(jnp.int32),
                                                           preferred_element_type=jnp.float32), zeros)
        return pullback(grad_mn.astype(jnp.float32))[0].astype(out_dtype)
    static = _Static(backend, _as_tiling(tiling), out_dtype)
    bounds = meta.group_bounds(group_sizes_g, lhs_mk.shape[0])
    compute = jnp.result_type(lhs_mk.dtype, grad_mn.dtype)
    return _kernel_tgmm(lhs_mk.astype(compute), grad_mn.astype(compute), bounds, num_groups, static,
                        out_dtype=out_dtype)
