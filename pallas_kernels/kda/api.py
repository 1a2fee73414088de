"""The chunkwise KDA kernels with their gradients: `chunk_kda_kernel` (activated gate) and
`chunk_kda_raw_gate_kernel` (K3's raw gate, activated inside the intra kernel). `k3jax.ops.kda.kda` is the one
dispatch point that picks these or the XLA cores.

Backends:
  ``"gpu"``       Pallas kernels (chunk_fwd.py / chunk_bwd.py) compiled by the Pallas Triton GPU backend.
  ``"interpret"`` the same kernels through the Pallas interpreter (CPU tests).
  ``"tpu"``       Mosaic TPU kernels (tpu.py: one fused forward kernel; backward = forward again saving the
                  chunk-entry states, then one reverse-chunk kernel).
  ``"tpu_interpret"`` the TPU kernels through the TPU interpreter (``pltpu.InterpretParams``; CPU tests).

Gradients: ``jax.custom_vjp`` saving the inputs (plus, with ``config.residuals == "intra"``, the forward's
intra-chunk results), the backward kernels recomputing per chunk with a reverse chunk loop for the state gradient.
`chunk_kda_kernel_forward` is the forward alone (no gradient), for callers that differentiate another path.

Inputs: q, k ``[B, T, H, K]`` L2-normalised, v ``[B, T, H, V]``, g the activated log-decay (>= -5 per token), beta
``[B, T, H]``, initial_state ``[N, H, K, V]`` f32, segment_ids int32 ``[B, T]`` or None, cu_seqlens a tuple of host
ints or None (validated by the caller). Returns ``(o [B, T, H, V] in q.dtype, final_state [N, H, K, V] f32)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk_bwd import chunk_kda_bwd
from pallas_kernels.kda.chunk_fwd import chunk_kda_fwd
from pallas_kernels.kda.common import KernelConfig, activate_gate
from pallas_kernels.kda.tpu import chunk_kda_bwd_tpu, chunk_kda_fwd_tpu

__all__ = ["BACKENDS", "chunk_kda_kernel", "chunk_kda_kernel_forward", "chunk_kda_raw_gate_kernel"]

BACKENDS = ("gpu", "tpu", "interpret", "tpu_interpret")


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown kernel backend {backend!r}; expected one of {BACKENDS}")


def chunk_kda_kernel_forward(q, k, v, g, beta, initial_state, segment_ids, *, scale, cu_seqlens, backend,
                             config=None):
    """The kernel forward without a gradient rule: ``(o, final_state)``."""
    _check_backend(backend)
    if backend in ("tpu", "tpu_interpret"):
        return chunk_kda_fwd_tpu(q, k, v, g, beta, initial_state, scale=scale, interpret=backend == "tpu_interpret",
                                 cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    return chunk_kda_fwd(q, k, v, g, beta, initial_state, scale=scale, interpret=backend == "interpret",
                         config=config or KernelConfig(), cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def chunk_kda_kernel(q, k, v, g, beta, initial_state, segment_ids, *, scale, cu_seqlens, backend, config=None):
    """The kernel forward with the backward kernels as its gradient: ``(o, final_state)``."""
    _check_backend(backend)
    if backend in ("tpu", "tpu_interpret"):
        return _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend == "tpu_interpret")
    return _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend == "interpret",
                       config or KernelConfig())


def chunk_kda_raw_gate_kernel(q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, *, scale,
                              lower_bound, backend, config=None):
    """`chunk_kda_kernel` taking K3's raw gate input (GPU / interpret backends, no cu_seqlens, T a multiple of 64,
    ``config.intra`` in ``GATE_IN_KERNEL``): the intra kernel activates it as it loads each tile
    (``activate_gate``), so the forward never writes the activated ``[B, T, H, K]`` f32 gate. The backward
    activates it in XLA for the backward kernels and chains ``dg`` through the activation; gradients also reach
    ``a_hk`` and ``bias_hk``."""
    if backend not in ("gpu", "interpret"):
        raise ValueError(f"chunk_kda_raw_gate_kernel: the in-kernel gate needs the GPU kernels, got {backend!r}")
    return _pallas_kda_raw_gate(q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, scale,
                                float(lower_bound), backend == "interpret", config or KernelConfig())


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config):
    return chunk_kda_fwd(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret, config=config,
                         cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def _pallas_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config):
    """Residuals: the inputs, plus the forward's intra-chunk results when ``config.residuals == "intra"`` (the
    backward then skips recomputing them)."""
    inputs = (q, k, v, g, beta, initial_state, segment_ids)
    if config.residuals == "intra":
        out, intra = chunk_kda_fwd(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret, config=config,
                                   cu_seqlens=cu_seqlens, segment_ids=segment_ids, return_intra=True)
        return out, (*inputs, intra)
    out = _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config)
    return out, (*inputs, None)


def _pallas_kda_bwd(scale, cu_seqlens, interpret, config, residuals, cotangents):
    do, d_final = cotangents
    *inputs, segment_ids, intra = residuals
    grads = chunk_kda_bwd(*inputs, do, d_final, scale=scale, interpret=interpret, config=config,
                          cu_seqlens=cu_seqlens, segment_ids=segment_ids, intra=intra)
    return (*(gr.astype(x.dtype) for gr, x in zip(grads, inputs)), None)


_pallas_kda.defvjp(_pallas_kda_fwd, _pallas_kda_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _pallas_kda_raw_gate(q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, scale, lower_bound,
                         interpret, config):
    return chunk_kda_fwd(q, k, v, g_raw, beta, initial_state, scale=scale, interpret=interpret, config=config,
                         segment_ids=segment_ids, gate_hk=(a_hk, bias_hk), gate_lower_bound=lower_bound)


def _pallas_kda_raw_gate_fwd(q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, scale, lower_bound,
                             interpret, config):
    keep = config.residuals == "intra"
    result = chunk_kda_fwd(q, k, v, g_raw, beta, initial_state, scale=scale, interpret=interpret, config=config,
                           segment_ids=segment_ids, gate_hk=(a_hk, bias_hk), gate_lower_bound=lower_bound,
                           return_intra=keep)
    out, intra = result if keep else (result, None)
    return out, (q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, intra)


def _pallas_kda_raw_gate_bwd(scale, lower_bound, interpret, config, residuals, cotangents):
    q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, intra = residuals
    do, d_final = cotangents
    g, gate_vjp = jax.vjp(lambda *x: activate_gate(x[0], (x[1], x[2], lower_bound)), g_raw, a_hk, bias_hk)
    dq, dk, dv, dg, dbeta, d_initial = chunk_kda_bwd(q, k, v, g, beta, initial_state, do, d_final, scale=scale,
                                                     interpret=interpret, config=config, segment_ids=segment_ids,
                                                     intra=intra)
    dg_raw, da, dbias = gate_vjp(dg.astype(jnp.float32))
    grads = zip((dq, dk, dv, dg_raw, dbeta, d_initial), (q, k, v, g_raw, beta, initial_state))
    return (*(gr.astype(x.dtype) for gr, x in grads), None, da, dbias)


_pallas_kda_raw_gate.defvjp(_pallas_kda_raw_gate_fwd, _pallas_kda_raw_gate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret):
    """The Mosaic TPU forward; gradients by the TPU backward kernels."""
    return chunk_kda_fwd_tpu(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret,
                             cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def _tpu_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret):
    out = _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret)
    return out, (q, k, v, g, beta, initial_state, segment_ids)


def _tpu_kda_bwd(scale, cu_seqlens, interpret, residuals, cotangents):
    do, d_final = cotangents
    *inputs, segment_ids = residuals
    grads = chunk_kda_bwd_tpu(*inputs, do, d_final, scale=scale, interpret=interpret, cu_seqlens=cu_seqlens,
                              segment_ids=segment_ids)
    return (*(gr.astype(x.dtype) for gr, x in zip(grads, inputs)), None)


_tpu_kda.defvjp(_tpu_kda_fwd, _tpu_kda_bwd)
