"""Grouped matmul (rows grouped contiguously by expert): the single dispatch point for the MoE experts.

The expert weights `rhs` are either an array [g, k, n] (bf16/f32 parameters) or `MXFP4Experts` (packed E2M1
nibbles + E8M0 scales, inference only): the same call serves both, so the MoE layer and the expert-parallel path
never branch on the weight format.

impl:
- "auto" (default): the Pallas kernel (`pallas_kernels.gmm`: `gmm`, or `gmm_mxfp4` decoding the packed weights in
  the kernel) on GPU/TPU, `jax.lax.ragged_dot` on CPU (packed weights: dequantize, then `ragged_dot`). Under a
  multi-device jit outside `shard_map` it stays on the XLA path: a Pallas call is not partitioned automatically
  (Mosaic TPU refuses it, Triton would be replicated), so the kernel is used where each device sees its own rows
  (one device, or inside `shard_map`, e.g. the expert-parallel path).
- "pallas": the kernel on this platform's backend ('interpret' on CPU: slow, for tests).
- "ragged_dot": `jax.lax.ragged_dot` (packed weights: dequantize-then-`ragged_dot`).
All have `jax.lax.ragged_dot` semantics. Array weights are differentiable; packed weights are inference-only:
differentiating through them raises `InferenceOnlyError`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops import backend as backend_lib
from pallas_kernels import gmm as pallas_gmm
from pallas_kernels.gmm import mxfp4 as mxfp4_codec

IMPLS = ("auto", "pallas", "ragged_dot")
MXFP4_GROUP = mxfp4_codec.GROUP  # k columns sharing one E8M0 scale
DECODE_ROWS_PER_GROUP = pallas_gmm.DECODE_ROWS_PER_GROUP  # decode-sized calls: at most this many rows per group
DECODE_TILING = pallas_gmm.DECODE_TILING  # the GPU kernels' decode tiling (variants: `Tiling._replace`)


class InferenceOnlyError(ValueError):
    """Gradients were requested through an inference-only path (MXFP4 packed expert weights, or the plan-free decode
    expert kernels)."""


class MXFP4Experts(NamedTuple):
    """Routed-expert weights held packed: logically [E, in, out] like the bf16 stack, stored in the HF release's
    orientation [E, out, in] so `gmm_mxfp4` reads them as-is: `packed` u8 [E, out, in/2] (two E2M1 codes per byte,
    low nibble = even input column), `scales` u8 [E, out, in/32] (E8M0 exponents). 4.25 bits per weight."""

    packed: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical shape [E, in, out] (what the equivalent bf16 weight stack would have)."""
        e, out, half = self.packed.shape[-3:]
        return (*self.packed.shape[:-3], e, 2 * half, out)

    def dequantize(self, dtype) -> jax.Array:
        """[E, in, out] in `dtype` (exact where the values are in `dtype`'s normal range)."""
        return jnp.swapaxes(mxfp4_codec.dequantize(self.packed, self.scales, dtype), -1, -2)

    @classmethod
    def quantize(cls, w_ein: jax.Array) -> "MXFP4Experts":
        """Round-to-nearest MXFP4 of [E, in, out] weights (see `quantize_mxfp4`)."""
        return cls(*quantize_mxfp4(jnp.swapaxes(w_ein, -1, -2)))


def quantize_mxfp4(w_nk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., n, k] -> (packed u8 [..., n, k/2], scales u8 [..., n, k/32]).

    Per group of 32 k columns the scale is the smallest power of two 2^X with max|w| <= 6·2^X (nothing clips;
    X = ceil(log2(amax / 6)), found exactly from the binary exponent of amax), then each value rounds to the
    nearest E2M1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to the even code). All-zero groups get scale 2^0."""
    *lead, n, k = w_nk.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input width divisible by {MXFP4_GROUP}, got {w_nk.shape}")
    w = w_nk.astype(jnp.float32).reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = jnp.max(jnp.abs(w), axis=-1)
    mant, exp = jnp.frexp(amax)  # amax = mant · 2^exp, mant in [0.5, 1)
    x = exp - 3 + (mant > 0.75).astype(exp.dtype)  # 6·2^X >= amax > 6·2^(X-1)
    scale_byte = jnp.clip(jnp.where(amax > 0, x, 0) + 127, 0, 254).astype(jnp.int32)
    a = jnp.abs(w) / mxfp4_codec.e8m0_to_f32(scale_byte)[..., None]  # exact: a power-of-two divisor
    mag = sum((a > t).astype(jnp.int32) for t in (0.25, 1.25, 2.5, 5.0)) + \
        sum((a >= t).astype(jnp.int32) for t in (0.75, 1.75, 3.5))  # ties: 0.75->1, 1.75->2, 3.5->4 (even codes)
    codes = (mag | jnp.where((w < 0) & (mag > 0), 8, 0)).reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
    return packed, scale_byte.astype(jnp.uint8)


def expert_weights(w, dtype) -> jax.Array | MXFP4Experts:
    """The operand to hand `gmm`: array weights cast to the compute `dtype`, packed weights unchanged."""
    return w if isinstance(w, MXFP4Experts) else w.astype(dtype)


def dense_expert_weights(w, dtype) -> jax.Array:
    """[E, in, out] in `dtype` for paths that need materialised weights (the all-experts dense path)."""
    return w.dequantize(dtype) if isinstance(w, MXFP4Experts) else w.astype(dtype)


def refuse_gradients(message: str):
    """An identity that raises `InferenceOnlyError(message)` when differentiated: marks the inputs of an
    inference-only computation."""

    @jax.custom_jvp
    def identity(x: jax.Array) -> jax.Array:
        return x

    @identity.defjvp
    def _jvp(primals, tangents):
        raise InferenceOnlyError(message)

    return identity


# marks activations entering a computation with packed weights
inference_only = refuse_gradients("the routed experts are held as MXFP4 (expert_weights='mxfp4'), which is "
                                  "inference-only (no gradients through packed weights); train with "
                                  "expert_weights='bf16'")


def _backend(impl: str) -> str:
    """The `pallas_kernels.gmm` backend for `impl` ('xla' = ragged_dot): "auto" asks `k3jax.ops.backend` whether a
    kernel may run in this trace."""
    if impl == "auto":
        return backend_lib.kernel_backend_here() or "xla"
    if impl == "ragged_dot":
        return "xla"
    return backend_lib.forced_kernel_backend()


def gmm(lhs_mk: jax.Array, rhs, group_sizes_g: jax.Array, *, impl: str = "auto",
        preferred_element_type=None, tiling=None) -> jax.Array:
    """`jax.lax.ragged_dot` semantics: row block i (of size group_sizes[i]) is multiplied by rhs[i].

    `rhs`: an array [g, k, n] or `MXFP4Experts` (logically [g, k, n]; packed weights decode to the lhs dtype).
    `tiling`: a `pallas_kernels.gmm.Tiling` for the kernel backends (None: their defaults; ignored by XLA)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown gmm impl {impl!r}; available: {', '.join(repr(i) for i in IMPLS)}")
    group_sizes_g = group_sizes_g.astype(jnp.int32)
    backend = _backend(impl)
    if isinstance(rhs, MXFP4Experts):
        if not jnp.issubdtype(lhs_mk.dtype, jnp.floating):
            raise ValueError(f"gmm with MXFP4 weights needs a floating lhs, got {lhs_mk.dtype}")
        return pallas_gmm.gmm_mxfp4(inference_only(lhs_mk), rhs.packed, rhs.scales, group_sizes_g,
                                    preferred_element_type=preferred_element_type, backend=backend,
                                    tiling=None if backend == "xla" else tiling)
    if backend == "xla":
        return jax.lax.ragged_dot(lhs_mk, rhs, group_sizes_g, preferred_element_type=preferred_element_type)
    return pallas_gmm.gmm(lhs_mk, rhs, group_sizes_g, preferred_element_type=preferred_element_type,
                          backend=backend, tiling=tiling)


def fused_glu_applies(m: int, w_gate, impl: str = "auto") -> bool:
    """Whether `gmm_glu` runs the fused kernel for an [m, k] lhs: array weights, a kernel backend, and a
    decode-sized call (at most `DECODE_ROWS_PER_GROUP` rows per group). There one launch that reads the rows once
    beats two gmm calls plus the activation's kernels; at training sizes the fused epilogue measured slower
    (0.93x forward, 0.84x fwd+bwd of two gmm calls, RESULTS.md, 2026-11-30)."""
    if isinstance(w_gate, MXFP4Experts) or impl == "ragged_dot":
        return False
    if impl == "auto" and backend_lib.kernel_backend_here() is None:
        return False
    return m <= DECODE_ROWS_PER_GROUP * max(w_gate.shape[0], 1)


def gmm_glu(lhs_mk: jax.Array, w_gate_gkn: jax.Array, w_up_gkn: jax.Array, group_sizes_g: jax.Array, *,
            activation: str, beta1: float | None = None, beta2: float | None = None,
            impl: str = "auto", tiling=None) -> jax.Array:
    """act(lhs @ w_gate[i], lhs @ w_up[i]) on the rows of group i, in lhs's dtype, through the fused kernel
    (`pallas_kernels.gmm.gmm_glu`: both products accumulate in f32 and the activation is the epilogue). Callers
    check `fused_glu_applies` first (`k3jax.ops.glu.grouped_glu`)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown gmm impl {impl!r}; available: {', '.join(repr(i) for i in IMPLS)}")
    if impl == "ragged_dot":
        raise ValueError("gmm_glu is the fused kernel; impl='ragged_dot' has no fused form (use gmm twice)")
    return pallas_gmm.gmm_glu(lhs_mk, w_gate_gkn, w_up_gkn, group_sizes_g.astype(jnp.int32),
                              activation=activation, beta1=beta1, beta2=beta2,
                              preferred_element_type=lhs_mk.dtype, backend=_backend(impl), tiling=tiling)
