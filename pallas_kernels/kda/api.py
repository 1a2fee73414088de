"""``chunk_kda``: the one dispatch point for chunkwise KDA kernels.

Backends:
  ``"gpu"``       Pallas kernels (chunk_fwd.py) compiled by the Pallas Triton GPU backend.
  ``"interpret"`` the same kernels through the Pallas interpreter (CPU tests).
  ``"xla"``       the pure-JAX chunked core ``k3jax.ops.kda.kda_chunked``.
  ``"tpu"``       Mosaic TPU kernels (tpu.py: one fused forward kernel; backward = forward again saving the
                  chunk-entry states, then one reverse-chunk kernel).
  ``"tpu_interpret"`` the TPU kernels through the TPU interpreter (``pltpu.InterpretParams``; CPU tests).
``backend=None`` picks ``"gpu"`` on a GPU, ``"tpu"`` on a TPU and ``"xla"`` elsewhere.

Gradients: ``jax.custom_vjp`` saving only the inputs. ``bwd="pallas"`` (default) runs the Pallas backward kernels
(chunk_bwd.py, or tpu.py for the TPU backends: recompute per chunk, reverse chunk loop for the state gradient;
also with cu_seqlens);
``bwd="xla"`` differentiates the XLA chunked path instead (recomputes its forward in XLA), for comparison.

Packed variable-length sequences (``cu_seqlens``, B = 1): host values (a list, tuple or numpy array; under ``jit``
pass them as a static argument). The kernels lay each sequence out on whole chunks and reset the state at each
start; the XLA path (and the backward) runs ``kda_chunked`` once per sequence.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.norms import l2_normalize
from k3jax.ops.kda import kda_chunked
from pallas_kernels.kda.chunk_bwd import chunk_kda_bwd
from pallas_kernels.kda.chunk_fwd import CHUNK, GATE_IN_KERNEL, KernelConfig, activate_gate, chunk_kda_fwd
from pallas_kernels.kda.tpu import chunk_kda_bwd_tpu, chunk_kda_fwd_tpu

__all__ = ["BACKENDS", "BWD_IMPLS", "KernelConfig", "chunk_kda", "chunk_kda_gated", "default_backend"]

BACKENDS = ("gpu", "tpu", "interpret", "tpu_interpret", "xla")
BWD_IMPLS = ("pallas", "xla")


def default_backend() -> str:
    """``"gpu"`` when JAX's default device is a GPU, ``"tpu"`` on a TPU, else ``"xla"``."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    return "gpu" if platform in ("gpu", "cuda", "rocm") else "xla"


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"chunk_kda: q, k, g must share a [B, T, H, K] shape, got {q.shape}, {k.shape}, {g.shape}")
    b, t, h, kd = q.shape
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"chunk_kda: v must have shape [B, T, H, V] = [{b}, {t}, {h}, V], got {v.shape}")
    if beta.shape != (b, t, h):
        raise ValueError(f"chunk_kda: beta must have shape {(b, t, h)}, got {beta.shape}")
    if t < 1:
        raise ValueError("chunk_kda: sequence length T must be >= 1")
    n_states = b if cu_seqlens is None else len(cu_seqlens) - 1
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"chunk_kda: cu_seqlens needs batch size 1 (packed sequences), got B={b}")
        if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != t or np.any(np.diff(cu_seqlens) < 0):
            raise ValueError(f"chunk_kda: cu_seqlens must be [0, ..., T={t}] non-decreasing, got {list(cu_seqlens)}")
    if initial_state is not None and initial_state.shape != (n_states, h, kd, v.shape[-1]):
        raise ValueError(f"chunk_kda: initial_state must have shape {(n_states, h, kd, v.shape[-1])}, "
                         f"got {initial_state.shape}")


def _static_cu_seqlens(cu_seqlens):
    """cu_seqlens as a tuple of host ints (a static jit argument), or None."""
    if cu_seqlens is None:
        return None
    try:
        return tuple(int(x) for x in np.asarray(cu_seqlens).reshape(-1))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as err:
        raise ValueError("chunk_kda: cu_seqlens must be host values (list/tuple/numpy); under jit pass it as a "
                         "static argument") from err


def _xla_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens):
    """The pure-XLA chunked core; with cu_seqlens, one ``kda_chunked`` call per (non-empty) sequence."""
    def core(sl, state):
        return kda_chunked(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale,
                           initial_state_bhkv=state, chunk_size=CHUNK,
                           segment_ids_bt=None if segment_ids is None else segment_ids[:, sl])

    if cu_seqlens is None:
        return core(slice(None), initial_state)
    outs, finals = [], []
    for s, (start, end) in enumerate(itertools.pairwise(cu_seqlens)):
        if end == start:
            finals.append(initial_state[s].astype(jnp.float32))
            continue
        o, final = core(slice(start, end), initial_state[s:s + 1])
        outs.append(o)
        finals.append(final[0])
    return jnp.concatenate(outs, axis=1), jnp.stack(finals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config, bwd):
    del bwd
    return chunk_kda_fwd(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret, config=config,
                         cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def _pallas_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config, bwd):
    """Residuals: the inputs, plus the forward's intra-chunk results when ``config.residuals == "intra"`` (the
    Pallas backward then skips recomputing them)."""
    inputs = (q, k, v, g, beta, initial_state, segment_ids)
    if bwd == "pallas" and config.residuals == "intra":
        out, intra = chunk_kda_fwd(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret, config=config,
                                   cu_seqlens=cu_seqlens, segment_ids=segment_ids, return_intra=True)
        return out, (*inputs, intra)
    out = _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, config, bwd)
    return out, (*inputs, None)


def _pallas_kda_bwd(scale, cu_seqlens, interpret, config, bwd, residuals, cotangents):
    """Pallas backward kernels (``bwd="pallas"``) or the autodiff of the XLA chunked core (``bwd="xla"``)."""
    do, d_final = cotangents
    *inputs, segment_ids, intra = residuals
    if bwd == "pallas":
        grads = chunk_kda_bwd(*inputs, do, d_final, scale=scale, interpret=interpret, config=config,
                              cu_seqlens=cu_seqlens, segment_ids=segment_ids, intra=intra)
    else:
        def xla_forward(*args):
            return _xla_kda(*args, segment_ids, scale, cu_seqlens)

        _, vjp = jax.vjp(xla_forward, *inputs)
        grads = vjp((do.astype(jnp.float32), d_final.astype(jnp.float32)))
    return (*(gr.astype(x.dtype) for gr, x in zip(grads, inputs)), None)


_pallas_kda.defvjp(_pallas_kda_fwd, _pallas_kda_bwd)


def _l2(x):
    return l2_normalize(x).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _pallas_kda_raw_gate(q, k, v, g_raw, beta, initial_state, segment_ids, a_hk, bias_hk, scale, lower_bound,
                         interpret, config):
    """``_pallas_kda`` taking K3's raw gate input: the intra kernel activates it as it loads each tile
    (``chunk_fwd.activate_gate``), so the forward never writes the activated ``[B, T, H, K]`` f32 gate. The
    backward activates it in XLA for the backward kernels and chains ``dg`` through the activation."""
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, bwd):
    """The Mosaic TPU forward; gradients by the TPU backward kernels (``bwd="pallas"``) or the XLA path."""
    del bwd
    return chunk_kda_fwd_tpu(q, k, v, g, beta, initial_state, scale=scale, interpret=interpret,
                             cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def _tpu_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, bwd):
    out = _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, interpret, bwd)
    return out, (q, k, v, g, beta, initial_state, segment_ids)


def _tpu_kda_bwd(scale, cu_seqlens, interpret, bwd, residuals, cotangents):
    if bwd == "xla":
        return _pallas_kda_bwd(scale, cu_seqlens, interpret, None, "xla", (*residuals, None), cotangents)
    do, d_final = cotangents
    *inputs, segment_ids = residuals
    grads = chunk_kda_bwd_tpu(*inputs, do, d_final, scale=scale, interpret=interpret, cu_seqlens=cu_seqlens,
                              segment_ids=segment_ids)
    return (*(gr.astype(x.dtype) for gr, x in zip(grads, inputs)), None)


_tpu_kda.defvjp(_tpu_kda_fwd, _tpu_kda_bwd)


def _resolve_args(q, k, v, g, beta, initial_state, cu_seqlens, segment_ids, scale, backend, bwd):
    """Validated call arguments: ``(cu_seqlens as host ints or None, segment_ids int32 or None, initial_state
    (zeros if None), scale (float), backend)``."""
    cu_seqlens = _static_cu_seqlens(cu_seqlens)
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if segment_ids is not None:
        if cu_seqlens is not None:
            raise ValueError("chunk_kda: pass cu_seqlens or segment_ids, not both")
        if segment_ids.shape != q.shape[:2]:
            raise ValueError(f"chunk_kda: segment_ids must have shape [B, T] = {q.shape[:2]}, "
                             f"got {segment_ids.shape}")
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown backend {backend!r}; expected one of {BACKENDS}")
    if bwd not in BWD_IMPLS:
        raise ValueError(f"chunk_kda: unknown bwd {bwd!r}; expected one of {BWD_IMPLS}")
    b, _, h, kd = q.shape
    n_states = b if cu_seqlens is None else len(cu_seqlens) - 1
    scale = float(kd ** -0.5 if scale is None else scale)
    if initial_state is None:
        initial_state = jnp.zeros((n_states, h, kd, v.shape[-1]), jnp.float32)
    return cu_seqlens, segment_ids, initial_state, scale, backend


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              segment_ids=None, backend=None, config=None, bwd="pallas"):
    """Chunkwise KDA (chunk 64); same result as the token recurrence ``k3jax.ops.kda.kda_recurrent``.

    Args:
      q, k: ``[B, T, H, K]``, already L2-normalised; v: ``[B, T, H, V]``.
      g: ``[B, T, H, K]`` activated per-channel log-decay (natural log, <= 0). The Pallas kernels need the K3
        lower-bounded gate (>= -5 per token) for f32 safety of their sub-chunk factorisation.
      beta: ``[B, T, H]`` in (0, 1).
      scale: q multiplier, default ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` (``[N_seq, H, K, V]`` with cu_seqlens; cast to f32) or None (zeros).
      output_final_state: return the final state (else None).
      cu_seqlens: None, or host ints ``[0, ..., T]`` (N_seq + 1 of them) delimiting packed sequences (B = 1); the
        state restarts from ``initial_state[n]`` at each sequence and final_state is per sequence.
      segment_ids: None, or int ``[B, T]`` (may be traced) packed documents per row: the state resets to zero
        wherever the id changes (initial_state belongs to each row's first document, final_state is the state
        after its last token); the kernels mask instead of relaying out. Exclusive with cu_seqlens.
      backend: one of ``BACKENDS`` or None (``default_backend()``).
      config: ``KernelConfig`` GPU tuning knobs for the Pallas backends (None: defaults).
      bwd: gradient implementation for the Pallas backends: ``"pallas"`` (the backward kernels) or ``"xla"``
        (autodiff of the XLA chunked path); ignored by ``backend="xla"``.

    Returns:
      ``(o [B, T, H, V] in q.dtype, final_state [B, H, K, V] f32 or None)``.
    """
    cu_seqlens, segment_ids, initial_state, scale, backend = _resolve_args(
        q, k, v, g, beta, initial_state, cu_seqlens, segment_ids, scale, backend, bwd)

    if backend == "xla":
        o, final_state = _xla_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens)
        o = o.astype(q.dtype)
    elif backend in ("tpu", "tpu_interpret"):
        o, final_state = _tpu_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens,
                                  backend == "tpu_interpret", bwd)
    else:
        o, final_state = _pallas_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens,
                                     backend == "interpret", config or KernelConfig(), bwd)
    return o, (final_state if output_final_state else None)


def chunk_kda_gated(q, k, v, g_raw, beta_logits, *, A_log, dt_bias, lower_bound=-5.0, scale=None,
                    initial_state=None, output_final_state=False, cu_seqlens=None, segment_ids=None, backend=None,
                    config=None, bwd="pallas"):
    """``chunk_kda`` from K3's raw layer quantities (the call shape fla's ``chunk_kda`` offers with its in-kernel
    gate, L2 norm and beta sigmoid): q, k are L2-normalised (f32 math, back to q's dtype), the gate is K3's
    lower-bounded ``lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` and ``beta = sigmoid(beta_logits)``.

    The L2 norms and beta run in XLA around the kernels; the gate is activated inside the intra kernel when it can
    (``config.intra`` in ``GATE_IN_KERNEL`` on the GPU / interpret backends with ``bwd="pallas"``, no
    ``cu_seqlens`` and T a multiple of 64: the forward then never writes the activated f32 gate), else in XLA
    before ``chunk_kda``. (Normalising q, k inside the intra kernels too measured slower in another device call,
    3.97 vs 3.40 ms forward at 1x8192x96; a same-run A/B is pending, benchmarks/RESULTS.md.) Gradients reach
    ``q, k, v, g_raw, beta_logits``, ``A_log`` and ``dt_bias`` by autodiff through them.

    Args:
      q, k, g_raw: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta_logits: ``[B, T, H]``.
      A_log: ``[H]``; dt_bias: ``[H, K]`` or ``[H * K]`` (fla's layout).
      lower_bound: the gate's per-token floor, in [-5, 0) for the Pallas kernels' f32 range.
      Other arguments as ``chunk_kda``.
    """
    b, t, h, kd = q.shape
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"chunk_kda_gated: lower_bound must be in [-5, 0) (the kernels' f32 range), got {lower_bound}")
    if A_log.shape != (h,):
        raise ValueError(f"chunk_kda_gated: A_log must have shape ({h},), got {A_log.shape}")
    if dt_bias.size != h * kd:
        raise ValueError(f"chunk_kda_gated: dt_bias must have H*K = {h * kd} entries ([H, K] or [H*K]), got "
                         f"{dt_bias.shape}")

    a_hk = jnp.broadcast_to(jnp.exp(A_log.astype(jnp.float32))[:, None], (h, kd))
    bias_hk = dt_bias.reshape(h, kd).astype(jnp.float32)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
    config = config or KernelConfig()
    if (cu_seqlens is None and t % CHUNK == 0 and config.intra in GATE_IN_KERNEL
            and (backend or default_backend()) in ("gpu", "interpret") and bwd == "pallas"):
        # the intra kernel activates the gate as it loads it
        _, segment_ids, initial_state, scale, backend = _resolve_args(
            q, k, v, g_raw, beta, initial_state, None, segment_ids, scale, backend, bwd)
        o, final_state = _pallas_kda_raw_gate(_l2(q), _l2(k), v, g_raw, beta, initial_state, segment_ids, a_hk,
                                              bias_hk, scale, float(lower_bound), backend == "interpret", config)
        return o, (final_state if output_final_state else None)
    g = activate_gate(g_raw, (a_hk, bias_hk, lower_bound))
    return chunk_kda(_l2(q), _l2(k), v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                     backend=backend, config=config, bwd=bwd)
