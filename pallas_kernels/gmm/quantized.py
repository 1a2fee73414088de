"""`gmm_mxfp4`: grouped matmul with MXFP4 expert weights kept packed in HBM (inference, forward only).

out[rows of group i] = lhs[rows of i] @ W_iᵀ with W_i = dequant(packed[i], scales[i]) [n, k] in the HF layout
(packed u8 [g, n, k/2], low nibble = even k column; scales u8 [g, n, k/32] E8M0), i.e. the released
`weight_packed` / `weight_scale` of one projection stacked over experts, used as-is (no transpose, no repack).

Backends: 'gpu' / 'interpret': the Triton kernel decodes each [tn, tk/2] byte tile and its scales to the lhs dtype
in registers and accumulates in f32, so the weights are read at 4.25 bits per value. 'tpu' / 'tpu_interpret':
the Mosaic kernel decodes in VMEM (lhs split into even/odd columns by the wrapper, one [2, m, k/2] copy of the
activations per call; the per-column scale factors from an exact 0/1 expansion matmul; see tpu.gmm_mxfp4).
'xla': dequantize the whole weights (`mxfp4.dequantize`) then `jax.lax.ragged_dot` (the reference path, and CPU's
default).

Weights decode to the lhs dtype: exact in bf16 wherever |value| is in bf16's normal range (2^-126 .. 3·2^128),
so the result equals a matmul with the exactly dequantized bf16 weights. f32-subnormal weights (scale < 2^-126 /
6) may flush to zero. An E8M0 NaN scale (255) gives NaN (on TPU it spreads to every k column of that weight row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import api, mxfp4
from pallas_kernels.gmm import gpu as gpu_kernels
from pallas_kernels.gmm import metadata as meta
from pallas_kernels.gmm import tpu as tpu_kernels
from pallas_kernels.tiling import next_pow2


def _pad_axis(x, axis: int, multiple: int, value):
    size = x.shape[axis]
    target = -(-size // multiple) * multiple
    if target == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, target - size)
    return jnp.pad(x, pad, constant_values=value)


def _kernel_mxfp4(lhs_mk, packed_gnh, scales_gns, group_sizes_g, backend: str, tiling, out_dtype):
    m, k = lhs_mk.shape
    g, n = packed_gnh.shape[:2]
    if tiling is None:  # rows per tile ~ the mean rows per group (decode: a few rows per expert -> tm = 16)
        default = api._DEFAULTS["gpu"]["mxfp4"]
        tiling = default._replace(tm=min(default.tm, next_pow2(-(-m // g), 16)))
    tiling = api._fit(tiling, m, k, n, "gpu")
    tm, tk, tn = tiling[:3]
    if tk % mxfp4.GROUP:
        raise ValueError(f"gmm_mxfp4 needs tk to be a multiple of {mxfp4.GROUP}, got {tiling}")
    # padding columns: code 0 (= 0.0) with scale 127 (= 1.0; 255 would be NaN · 0)
    packed = _pad_axis(_pad_axis(packed_gnh, 2, tk // 2, 0), 1, tn, 0)
    scales = _pad_axis(_pad_axis(scales_gns, 2, tk // mxfp4.GROUP, 127), 1, tn, 127)
    lhs_p = api._pad_to(api._pad_to(lhs_mk, 1, tk), 0, 1, at_least=tm)
    bounds = meta.group_bounds(group_sizes_g, m)
    tiles = meta.group_tiles(bounds, m, tm)
    out = gpu_kernels.gmm_mxfp4(lhs_p, packed, scales, tiles.tile_group, tiles.tile_row_start, bounds.ends_v,
                                tm=tm, tk=tk, tn=tn, out_dtype=out_dtype, interpret=backend == "interpret",
                                num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out[:m, :n]


def _kernel_mxfp4_tpu(lhs_mk, packed_gnh, scales_gns, group_sizes_g, backend: str, tiling, out_dtype):
    m, k = lhs_mk.shape
    n = packed_gnh.shape[1]
    tiling = tiling or api._DEFAULTS["tpu"]["mxfp4"]
    tm = min(tiling.tm, -(-m // 16) * 16)
    tk = min(-(-tiling.tk // 256) * 256, -(-k // 256) * 256)  # packed lanes tk/2: a multiple of 128
    tn = min(tiling.tn, -(-n // 128) * 128)
    packed = _pad_axis(_pad_axis(packed_gnh, 2, tk // 2, 0), 1, tn, 0)
    scales = _pad_axis(_pad_axis(scales_gns, 2, tk // mxfp4.GROUP, 127), 1, tn, 127)
    lhs_p = api._pad_to(api._pad_to(lhs_mk, 1, tk), 0, tm)
    lhs_eo = jnp.moveaxis(lhs_p.reshape(lhs_p.shape[0], -1, 2), 2, 0)  # [2, m, k/2]: even, odd columns
    bounds = meta.group_bounds(group_sizes_g, m)
    items = meta.aligned_items(bounds, lhs_p.shape[0], tm, include_tail=True, visit_empty=False)
    out = tpu_kernels.gmm_mxfp4(lhs_eo, packed, scales, items.item_group, items.item_tile, items.item_valid,
                                bounds.starts_v, bounds.ends_v, tm=tm, tk=tk, tn=tn, out_dtype=out_dtype,
                                interpret=backend == "tpu_interpret")
    return out[:m, :n]


def gmm_mxfp4_reference_xla(lhs_mk, packed_gnh, scales_gns, group_sizes_g, *, preferred_element_type=None):
    """Dequantize-then-`ragged_dot` (the 'xla' path; also the benchmark's baseline)."""
    w_gkn = jnp.swapaxes(mxfp4.dequantize(packed_gnh, scales_gns, lhs_mk.dtype), 1, 2)
    return jax.lax.ragged_dot(lhs_mk, w_gkn, group_sizes_g.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)


def gmm_mxfp4(lhs_mk: jax.Array, packed_gnh: jax.Array, scales_gns: jax.Array, group_sizes_g: jax.Array, *,
              preferred_element_type=None, tiling=None, backend: str | None = None) -> jax.Array:
    """lhs [m, k] x MXFP4 weights (packed u8 [g, n, k/2], scales u8 [g, n, k/32]) -> [m, n], row groups as in
    `jax.lax.ragged_dot` (rows past sum(group_sizes) give zeros). f32 accumulation; the result has
    `preferred_element_type` or the lhs dtype. Forward only (no VJP). `tiling`: (tm, tk, tn[, num_warps,
    num_stages]) with tk a multiple of 32 (TPU: rounded up to 256); backend as in `gmm`. Default GPU tiling:
    64×128×128 with tm shrunk to the mean rows per group (>= 16) for decode-sized batches."""
    mxfp4.check_shapes(lhs_mk, packed_gnh, scales_gns, group_sizes_g)
    if not jnp.issubdtype(lhs_mk.dtype, jnp.floating):
        raise ValueError(f"gmm_mxfp4 needs a floating lhs, got {lhs_mk.dtype}")
    backend = api._resolve_backend(backend)
    out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else lhs_mk.dtype
    group_sizes_g = group_sizes_g.astype(jnp.int32)
    if backend == "xla":
        return gmm_mxfp4_reference_xla(lhs_mk, packed_gnh, scales_gns, group_sizes_g,
                                       preferred_element_type=out_dtype)
    if backend in ("tpu", "tpu_interpret"):
        return _kernel_mxfp4_tpu(lhs_mk, packed_gnh, scales_gns, group_sizes_g, backend, api._as_tiling(tiling),
                                 out_dtype)
    return _kernel_mxfp4(lhs_mk, packed_gnh, scales_gns, group_sizes_g, backend, api._as_tiling(tiling), out_dtype)
