"""OCP Microscaling (MX v1.0) fake quantization for quantization-aware training of the routed experts.

K3 trains its routed experts with their weights in MXFP4 and their input activations in MXFP8 (docs/training.md#qat):

- MXFP4: E2M1 elements {0, .5, 1, 1.5, 2, 3, 4, 6} (sign separate), one E8M0 scale per 32 consecutive elements
  along the matmul's reduction axis. Same grid, code numbering and byte layout as the serving format
  (`pallas_kernels.gmm.mxfp4`, docs/spec.md#mxfp4), so `pack_mxfp4` writes exactly the codes the QAT forward used.
- MXFP8: E4M3 elements (max normal 448, no Inf), one E8M0 scale per 32 elements.

Per group of 32 (OCP MX v1.0, section 6.3): shared_exp = floor(log2(amax)) - emax_elem (emax 2 for E2M1, 8 for E4M3),
clamped below to E8M0's -127 (a zero group gets -127 too); each element x / 2^shared_exp is rounded to the nearest
element value, ties to the even code, and saturated to the largest magnitude (6, 448). A group holding NaN or Inf
has the NaN scale (E8M0 byte 255): every element of it decodes to NaN. Note the serving quantizer of bf16
checkpoints (`k3jax.ops.gmm.quantize_mxfp4`) picks the scale so that nothing clips (ceil(log2(amax / 6))); on
weights that are already on an MX grid both rules give the same bytes (the QAT weights, quantized again, are
unchanged).

The fake quantizers return the decoded values in the input's dtype with straight-through gradients (the identity),
so the f32 master weights stay unquantized. MXFP4 values are decoded with the serving decoder's own ops
(`e2m1_to_f32(code) * e8m0_to_f32(scale)`), so a QAT forward and the MXFP4 serving forward see the same weights bit
for bit on one platform. (Where a platform flushes f32 subnormals, as XLA CPU does, the E8M0 scale 2^-127 decodes to
0 in both: groups whose amax is below 2^-125.)

Weight QAT on a GPU runs as one Pallas pass fused into the cast to the compute dtype that the forward makes anyway
(`fake_quant_mxfp4_cast`, `pallas_kernels.gmm.qat`: the same codes and decoder, bit for bit, and the same
straight-through gradient); elsewhere, and under a multi-device jit outside `shard_map`, XLA runs the quantizer
below. Cost measured in docs/training.md#qat (`benchmarks/qat_overhead.py`).

A small module of ours rather than `qwix` (which has MX qtypes): QAT must reproduce the serving format's codes and
decoder exactly and keep STE gradients on the f32 masters; that is ~100 lines here against a new dependency whose
rounding and scale conventions would have to be pinned to ours anyway.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.ops import backend as backend_lib
from pallas_kernels.gmm import mxfp4 as mxfp4_codec
from pallas_kernels.gmm import qat as qat_kernels

__all__ = ["GROUP", "WEIGHT_QAT_IMPLS", "expert_activation_qat", "expert_weight_qat", "fake_quant_mxfp4",
           "fake_quant_mxfp4_cast", "fake_quant_mxfp8", "mxfp4_encode", "mxfp8_encode", "pack_mxfp4",
           "weight_qat_impl"]

GROUP = mxfp4_codec.GROUP  # elements per E8M0 scale (both formats)
E2M1_EMAX, E2M1_MBITS, E2M1_EMIN, E2M1_MAX = 2, 1, 0, 6.0
E4M3_EMAX, E4M3_MBITS, E4M3_EMIN, E4M3_MAX = 8, 3, -6, 448.0
_E2M1_STEPS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude >= step i+1 -> code >= i+1


def _pow2(e):
    """2^e as f32 for int32 e in [-126, 127] (built from the exponent bits: exact)."""
    return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def _floor_log2(a):
    """floor(log2(a)) for finite a > 0 (exact, from the binary exponent); -127 for a == 0 (below any clamp)."""
    mant, exp = jnp.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    return jnp.where(a > 0, exp - 1, -127)


def _groups(x, axis: int):
    """x (any float dtype) -> f32 [..., k/32, 32] with `axis` moved last; errors name a misfitting axis."""
    x = jnp.moveaxis(jnp.asarray(x), axis, -1)
    if x.shape[-1] % GROUP:
        raise ValueError(f"MX quantization needs the quantized axis divisible by {GROUP}, got {x.shape[-1]}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def _shared_exp(x_gk, emax: int):
    """(shared_exp int32 [..., groups], finite bool [..., groups]) per OCP MX section 6.3."""
    finite = jnp.all(jnp.isfinite(x_gk), axis=-1)
    amax = jnp.max(jnp.where(jnp.isfinite(x_gk), jnp.abs(x_gk), 0.0), axis=-1)
    return jnp.maximum(_floor_log2(amax) - emax, -127), finite


def _round_element(a, mbits: int, emin: int, vmax: float):
    """Magnitudes a >= 0 rounded to the nearest value of a float format with `mbits` mantissa bits and minimum
    normal exponent `emin` (ties to even), saturated at `vmax`."""
    e = jnp.maximum(_floor_log2(a), emin)
    quantum = _pow2(e - mbits)
    return jnp.minimum(jnp.round(a / quantum) * quantum, vmax)  # exact: power-of-two quantum; round = half-even


def _scaled(x_gk, shared_exp):
    """x / 2^shared_exp, exact (the factor 2^-shared_exp is a normal f32 for shared_exp in [-127, 125])."""
    return x_gk * _pow2(-shared_exp)[..., None]


def mxfp4_encode(x, axis: int = -1):
    """MXFP4 codes of `x` along `axis`: (codes u8 [..., k] with `axis` moved last, 0..15: bit 3 the sign, bits 0-2
    the E2M1 magnitude; scales u8 [..., k/32]: E8M0 bytes, 255 = NaN for groups holding NaN/Inf)."""
    x_gk = _groups(x, axis)
    shared, finite = _shared_exp(x_gk, E2M1_EMAX)
    a = _round_element(jnp.abs(_scaled(x_gk, shared)), E2M1_MBITS, E2M1_EMIN, E2M1_MAX)
    mag = sum((a >= s).astype(jnp.int32) for s in _E2M1_STEPS)
    codes = jnp.where(finite[..., None], mag | jnp.where(jnp.signbit(x_gk), 8, 0), 0)
    scales = jnp.where(finite, shared + 127, 255)
    return codes.reshape(*codes.shape[:-2], -1).astype(jnp.uint8), scales.astype(jnp.uint8)


def mxfp8_encode(x, axis: int = -1):
    """MXFP8 (E4M3) of `x` along `axis`: (element values f32 [..., k] with `axis` moved last, each exactly an E4M3
    value; scales u8 [..., k/32]: E8M0 bytes, 255 = NaN for groups holding NaN/Inf)."""
    x_gk = _groups(x, axis)
    shared, finite = _shared_exp(x_gk, E4M3_EMAX)
    v = _scaled(x_gk, shared)
    q = jnp.copysign(_round_element(jnp.abs(v), E4M3_MBITS, E4M3_EMIN, E4M3_MAX), v)
    q = jnp.where(finite[..., None], q, jnp.nan)
    scales = jnp.where(finite, shared + 127, 255)
    return q.reshape(*q.shape[:-2], -1), scales.astype(jnp.uint8)


def _decode_mxfp4(codes, scales):
    """codes u8 [..., k] + scales u8 [..., k/32] -> f32 [..., k]: the serving decoder's arithmetic."""
    values = mxfp4_codec.e2m1_to_f32(codes.astype(jnp.int32))
    values = values.reshape(*values.shape[:-1], -1, GROUP)
    return (values * mxfp4_codec.e8m0_to_f32(scales.astype(jnp.int32))[..., None]).reshape(codes.shape)


def _decode_mxfp8(q, scales):
    """E4M3 values f32 [..., k] + scales u8 [..., k/32] -> f32 [..., k]: q * 2^(s-127) as two normal factors
    (exact wherever the result is a normal f32), NaN for scale 255."""
    e = scales.astype(jnp.int32) - 127
    half = e // 2
    factor = jnp.where(scales == 255, jnp.nan, 1.0)[..., None]
    q_gk = q.reshape(*q.shape[:-1], -1, GROUP)
    return (q_gk * _pow2(half)[..., None] * _pow2(e - half)[..., None] * factor).reshape(q.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def fake_quant_mxfp4(x: jax.Array, axis: int = -1) -> jax.Array:
    """x rounded to MXFP4 along `axis` (groups of 32), decoded, in x's dtype; gradient: the identity (STE)."""
    codes, scales = mxfp4_encode(x, axis)
    return jnp.moveaxis(_decode_mxfp4(codes, scales), -1, axis).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def fake_quant_mxfp8(x: jax.Array, axis: int = -1) -> jax.Array:
    """x rounded to MXFP8 (E4M3) along `axis` (groups of 32), decoded, in x's dtype; gradient: the identity."""
    q, scales = mxfp8_encode(x, axis)
    return jnp.moveaxis(_decode_mxfp8(q, scales), -1, axis).astype(x.dtype)


@fake_quant_mxfp4.defjvp
def _mxfp4_jvp(axis, primals, tangents):
    return fake_quant_mxfp4(primals[0], axis), tangents[0]


@fake_quant_mxfp8.defjvp
def _mxfp8_jvp(axis, primals, tangents):
    return fake_quant_mxfp8(primals[0], axis), tangents[0]


def pack_mxfp4(w_nk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., n, k] -> the serving layout (packed u8 [..., n, k/2]: low nibble = even k column; scales u8
    [..., n, k/32]) of the codes `fake_quant_mxfp4(w, axis=-1)` decodes: what an MXFP4 export of QAT weights
    writes (`python -m k3jax.convert --to_hf --experts mxfp4`)."""
    codes, scales = mxfp4_encode(w_nk, -1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8), scales


WEIGHT_QAT_IMPLS = ("auto", "kernel", "xla")
_IMPL = ["auto"]  # what impl=None means while tracing (`weight_qat_impl`)


@contextlib.contextmanager
def weight_qat_impl(impl: str):
    """Within the block, `fake_quant_mxfp4_cast` / `expert_weight_qat` called without an impl (the model's layers)
    trace with `impl` (benchmarks compare the kernel with the XLA form in one process)."""
    if impl not in WEIGHT_QAT_IMPLS:
        raise ValueError(f"unknown weight QAT impl {impl!r}; available: {', '.join(map(repr, WEIGHT_QAT_IMPLS))}")
    before, _IMPL[0] = _IMPL[0], impl
    try:
        yield
    finally:
        _IMPL[0] = before


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _kernel_cast(w_kn, dtype, interpret: bool):
    return qat_kernels.mxfp4_fake_quant(w_kn, out_dtype=dtype, interpret=interpret)


def _kernel_cast_fwd(w_kn, dtype, interpret: bool):
    return _kernel_cast(w_kn, dtype, interpret), jnp.zeros((0,), w_kn.dtype)


def _kernel_cast_bwd(dtype, interpret: bool, residual, g_kn):
    return (g_kn.astype(residual.dtype),)  # straight through, as fake_quant_mxfp4's JVP followed by the cast


_kernel_cast.defvjp(_kernel_cast_fwd, _kernel_cast_bwd)


def fake_quant_mxfp4_cast(w_kn: jax.Array, dtype, *, impl: str | None = None) -> jax.Array:
    """`fake_quant_mxfp4(w, axis=-2).astype(dtype)` for weights [..., k, n] (MXFP4 along the reduction axis k), with
    the same straight-through gradient (the cotangent cast back to w's dtype), bit for bit either way.

    impl: "kernel": one Pallas pass that reads w once and writes the `dtype` copy (`pallas_kernels.gmm.qat`; the
    interpreter off a GPU); "xla": the XLA fake quantizer, then the cast; "auto" (default): the kernel where a GPU
    kernel may run in this trace (`k3jax.ops.backend.gpu_kernel_backend_here`: one device or inside `shard_map`) and
    the shape fits (`pallas_kernels.gmm.qat.applies`), else XLA. None: "auto" unless `weight_qat_impl` says
    otherwise."""
    impl = impl or _IMPL[0]
    if impl not in WEIGHT_QAT_IMPLS:
        raise ValueError(f"unknown weight QAT impl {impl!r}; available: {', '.join(map(repr, WEIGHT_QAT_IMPLS))}")
    backend = {"kernel": backend_lib.forced_kernel_backend(), "xla": None}.get(
        impl, backend_lib.gpu_kernel_backend_here())
    if backend not in ("gpu", "interpret") or not qat_kernels.applies(w_kn.shape):
        if impl == "kernel":
            raise ValueError(f"the MXFP4 weight QAT kernel runs on GPU (or interpreted on CPU) for weights [..., k, n]"
                             f" with k a multiple of {GROUP} and n of 16; got backend {backend!r}, shape {w_kn.shape}")
        return fake_quant_mxfp4(w_kn, -2).astype(dtype)
    return _kernel_cast(w_kn, jnp.dtype(dtype), backend == "interpret")


def expert_weight_qat(w_ekn: jax.Array, cfg: ModelConfig, *, impl: str | None = None) -> jax.Array:
    """A routed-expert weight stack [E, in, out] as the forward uses it: with `cfg.runtime.expert_qat == 'mxfp4'`
    MXFP4-fake-quantized along `in` (the reduction axis) and already in the compute dtype (`fake_quant_mxfp4_cast`:
    on a GPU one pass fused into the cast the forward makes anyway), else unchanged."""
    if cfg.runtime.expert_qat != "mxfp4":
        return w_ekn
    return fake_quant_mxfp4_cast(w_ekn, cfg.runtime.jnp_dtype, impl=impl)


def expert_activation_qat(x_mk: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A routed-expert matmul's input rows [..., k] (k: the reduction axis): MXFP8-fake-quantized along k when
    `cfg.runtime.expert_act_qat == 'mxfp8'`, else unchanged."""
    return fake_quant_mxfp8(x_mk, -1) if cfg.runtime.expert_act_qat == "mxfp8" else x_mk
