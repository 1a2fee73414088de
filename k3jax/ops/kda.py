"""Kimi Delta Attention: the single dispatch point between the pure-JAX cores (`k3jax.ops.kda_xla`: chunked,
recurrent, one-token step) and the Pallas kernels (`pallas_kernels.kda`: chunkwise GPU / TPU kernels with their
gradients, the one-token decode kernels). Conventions (shapes, gates, packed documents): `k3jax.ops.kda_xla`.

`kda` decides everything: the core (`impl`), the kernel backend (`k3jax.ops.backend` for the platform), the
gradient of the chunk kernels (`bwd`), K3's raw gate activated inside the kernel (`gate`), packed sequences
(`cu_seqlens`). `chunk_kda` / `chunk_kda_gated` are the kernel-shaped front ends (fla's call shapes) over it.
Under a multi-device mesh the layer runs `kda` inside `shard_map` (`sharding.kda_kernel`).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops import backend as backend_lib
from k3jax.ops.kda_xla import (
    SUB_CHUNK,
    check_shapes,
    document_index,
    kda_chunked,
    kda_recurrent,
    kda_step,
    l2_normalize,
)
from pallas_kernels.kda import BACKENDS as KERNEL_BACKENDS
from pallas_kernels.kda import (
    GATE_IN_KERNEL,
    KernelConfig,
    activate_gate,
    chunk_kda_kernel,
    chunk_kda_kernel_forward,
    chunk_kda_raw_gate_kernel,
    kda_decode_step,
)
from pallas_kernels.kda import (
    decode_fused as fused_kernel,
)
from pallas_kernels.kda.common import CHUNK

__all__ = ["BACKENDS", "BWD_IMPLS", "IMPLS", "SUB_CHUNK", "KernelConfig", "chunk_kda", "chunk_kda_gated",
           "decode_fused", "decode_kernel_backend", "document_index", "fused_decode_backend", "kda", "kda_chunked",
           "kda_recurrent", "kda_step", "l2_normalize", "resolve_impl"]

IMPLS = ("chunked", "recurrent", "pallas")
BACKENDS = (*KERNEL_BACKENDS, "xla")  # "xla": the XLA chunked core at the kernels' chunk (a reference)
BWD_IMPLS = ("pallas", "xla")


# --------------------------------------------------------------------------------------------
# Choosing a path
# --------------------------------------------------------------------------------------------


def resolve_impl(cfg) -> str:
    """The KDA core for this config on this platform: ``kda_impl``, with "auto" = the Pallas kernel on GPU and TPU
    when the config suits it (``cfg.kda_kernel_compatible``: the K3 lower-bounded gate, power-of-two head dims),
    else the pure-JAX chunked path. Under a multi-device mesh the layer runs the kernel inside ``shard_map``
    (``sharding.kda_kernel``)."""
    if cfg.runtime.kda_impl != "auto":
        return cfg.runtime.kda_impl
    on_accelerator = backend_lib.traced_accelerator() is not None  # a TPU topology compiled on a CPU host counts
    return "pallas" if on_accelerator and cfg.kda_kernel_compatible else "chunked"


def decode_kernel_backend():
    """The backend of the Pallas decode kernels for a T == 1 ``impl="pallas"`` call traced now: ``"gpu"`` on a
    GPU, None elsewhere (TPU and CPU take the XLA step). Tests patch it to ``"interpret"`` to run the kernel on CPU."""
    return "gpu" if backend_lib.on_gpu() else None


def fused_decode_backend(cfg) -> str | None:
    """The decode kernel backend when `cfg.runtime.kda_decode_fusion` fuses the prologue ("prologue", "prologue_output")
    into a one-token step on the Pallas decode kernel (K3's lower-bounded gate, the "pallas" core, no
    multi-device mesh), else None. The caller checks that the step is one token with a state."""
    if cfg.runtime.kda_decode_fusion == "step" or cfg.kda_gate != "lower_bound" or resolve_impl(cfg) != "pallas":
        return None
    if backend_lib.kernel_mesh() is not None:
        return None
    return decode_kernel_backend()


def decode_fused(*args, **kwargs):
    """One token through `pallas_kernels.kda.decode_fused.kda_decode_fused` (conv + activations + delta step in one
    kernel; arguments as there), with the backend from `fused_decode_backend`."""
    return fused_kernel.kda_decode_fused(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


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


def _resolve_args(q, k, v, g, beta, initial_state, cu_seqlens, segment_ids, scale, backend, bwd):
    """Validated kernel-path arguments: ``(cu_seqlens as host ints or None, segment_ids int32 or None,
    initial_state (zeros if None), scale (float))``."""
    cu_seqlens = _static_cu_seqlens(cu_seqlens)
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if segment_ids is not None:
        if cu_seqlens is not None:
            raise ValueError("chunk_kda: pass cu_seqlens or segment_ids, not both")
        if segment_ids.shape != q.shape[:2]:
            raise ValueError(f"chunk_kda: segment_ids must have shape [B, T] = {q.shape[:2]}, "
                             f"got {segment_ids.shape}")
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown backend {backend!r}; expected one of {BACKENDS}")
    if bwd not in BWD_IMPLS:
        raise ValueError(f"chunk_kda: unknown bwd {bwd!r}; expected one of {BWD_IMPLS}")
    b, _, h, kd = q.shape
    n_states = b if cu_seqlens is None else len(cu_seqlens) - 1
    scale = float(kd ** -0.5 if scale is None else scale)
    if initial_state is None:
        initial_state = jnp.zeros((n_states, h, kd, v.shape[-1]), jnp.float32)
    return cu_seqlens, segment_ids, initial_state, scale


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def _xla_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens):
    """The pure-XLA chunked core at the kernels' chunk; with cu_seqlens, one ``kda_chunked`` call per (non-empty)
    sequence."""
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _kernel_with_xla_grad(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend, config):
    """The kernel forward (``bwd="xla"``) whose gradient is the autodiff of the XLA chunked core (it recomputes its
    forward in XLA), for comparison with the backward kernels."""
    return chunk_kda_kernel_forward(q, k, v, g, beta, initial_state, segment_ids, scale=scale,
                                    cu_seqlens=cu_seqlens, backend=backend, config=config)


def _kernel_with_xla_grad_fwd(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend, config):
    out = _kernel_with_xla_grad(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend, config)
    return out, (q, k, v, g, beta, initial_state, segment_ids)


def _kernel_with_xla_grad_bwd(scale, cu_seqlens, backend, config, residuals, cotangents):
    del backend, config
    do, d_final = cotangents
    *inputs, segment_ids = residuals

    def xla_forward(*args):
        return _xla_kda(*args, segment_ids, scale, cu_seqlens)

    _, vjp = jax.vjp(xla_forward, *inputs)
    grads = vjp((do.astype(jnp.float32), d_final.astype(jnp.float32)))
    return (*(gr.astype(x.dtype) for gr, x in zip(grads, inputs)), None)


_kernel_with_xla_grad.defvjp(_kernel_with_xla_grad_fwd, _kernel_with_xla_grad_bwd)


def _one_token(q, k, v, g, beta, *, scale, initial_state):
    """``kda(impl="pallas")`` for T == 1: ``(o [B, 1, H, V] in q's dtype, state [B, H, K, V] f32)``: the decode
    kernel on a GPU, the XLA step elsewhere (the chunk kernels would pad the token to a whole chunk).

    One token holds no document boundary, so segment ids do not matter here (the initial state belongs to the
    row's first document)."""
    b, h, kd, vd = check_shapes(q, k, v, g, beta, initial_state, has_time=True)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, kd, vd), jnp.float32)
    token = tuple(x[:, 0] for x in (q, k, v, g, beta))
    backend = decode_kernel_backend()
    if backend is None:
        o_bhv, state_bhkv = kda_step(*token, initial_state, scale=scale)
    else:
        o_bhv, state_bhkv = kda_decode_step(*token, initial_state.astype(jnp.float32), scale=scale, backend=backend)
    return o_bhv[:, None].astype(q.dtype), state_bhkv.astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def kda(q, k, v, g, beta, *, scale, initial_state=None, impl="chunked", chunk_size=64, segment_ids=None,
        cu_seqlens=None, backend=None, config=None, bwd="pallas", gate=None):
    """KDA over a sequence; the single dispatch point for the cores and kernels.

    Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; initial_state ``[B, H, K, V]``
    (``[N_seq, H, K, V]`` with cu_seqlens) or None; segment_ids int ``[B, T]`` or None (packed documents: the
    state resets where the id changes; see `k3jax.ops.kda_xla`). Returns ``(o [B, T, H, V], final_state)``:
    float32 for the XLA cores; the kernel path returns ``o`` in q's dtype and the state in f32.

    Args:
      impl: ``"chunked"`` (default), ``"recurrent"`` or ``"pallas"``: the chunk kernels (need gates >= -5 per token
        and power-of-two head dims). With ``backend=None`` the kernel backend comes from the traced platform (the
        GPU kernel on a GPU, the Mosaic kernel on a TPU, the Pallas interpreter elsewhere), and T == 1 (decode) runs
        the fused one-token kernel `kda_decode_step` on a GPU and the XLA step :func:`kda_step` on TPU / CPU.
      chunk_size: used by ``"chunked"`` only (the kernel's chunk is 64).
      scale: q multiplier (None: ``K ** -0.5``; the kernel path only).
      cu_seqlens, backend, config, bwd, gate: the kernel path only (``impl="pallas"``).
        cu_seqlens: None, or host ints ``[0, ..., T]`` delimiting packed sequences (B = 1); the state restarts from
          ``initial_state[n]`` at each sequence and final_state is per sequence. Exclusive with segment_ids.
        backend: one of ``BACKENDS`` (``"xla"``: the XLA chunked core at chunk 64), or None (above).
        config: ``KernelConfig`` GPU tuning knobs (None: defaults).
        bwd: the chunk kernels' gradient: ``"pallas"`` (the backward kernels) or ``"xla"`` (autodiff of the XLA
          chunked path); ignored by ``backend="xla"``.
        gate: ``(a_hk, bias_hk, lower_bound)``: g is K3's raw gate input, activated as
          ``lower_bound * sigmoid(a_hk * (g + bias_hk))``: inside the intra kernel when it can (``config.intra``
          in ``GATE_IN_KERNEL`` on the GPU / interpret backends with ``bwd="pallas"``, no cu_seqlens, T a
          multiple of 64: the forward never writes the activated f32 gate), else in XLA first.
    """
    if impl not in IMPLS:
        raise ValueError(f"KDA: unknown impl {impl!r}; expected one of {IMPLS}")
    if impl != "pallas":
        if cu_seqlens is not None or backend is not None or gate is not None:
            raise ValueError(f"KDA: cu_seqlens, backend and gate belong to impl='pallas', got impl={impl!r}")
        if impl == "chunked":
            return kda_chunked(q, k, v, g, beta, scale=scale, initial_state_bhkv=initial_state,
                               chunk_size=chunk_size, segment_ids_bt=segment_ids)
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state_bhkv=initial_state,
                             segment_ids_bt=segment_ids)
    if backend is None and gate is None and cu_seqlens is None and q.ndim == 4 and q.shape[1] == 1:
        return _one_token(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    backend = backend_lib.forced_kernel_backend() if backend is None else backend
    cu_seqlens, segment_ids, initial_state, scale = _resolve_args(
        q, k, v, g, beta, initial_state, cu_seqlens, segment_ids, scale, backend, bwd)
    config = config or KernelConfig()
    if gate is not None:
        if (cu_seqlens is None and q.shape[1] % CHUNK == 0 and config.intra in GATE_IN_KERNEL
                and backend in ("gpu", "interpret") and bwd == "pallas"):
            a_hk, bias_hk, lower_bound = gate
            return chunk_kda_raw_gate_kernel(q, k, v, g, beta, initial_state, segment_ids, a_hk, bias_hk,
                                             scale=scale, lower_bound=lower_bound, backend=backend, config=config)
        g = activate_gate(g, gate)
    if backend == "xla":
        o, final_state = _xla_kda(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens)
        return o.astype(q.dtype), final_state
    if bwd == "xla":
        return _kernel_with_xla_grad(q, k, v, g, beta, initial_state, segment_ids, scale, cu_seqlens, backend,
                                     config)
    return chunk_kda_kernel(q, k, v, g, beta, initial_state, segment_ids, scale=scale, cu_seqlens=cu_seqlens,
                            backend=backend, config=config)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              segment_ids=None, backend=None, config=None, bwd="pallas"):
    """fla's ``chunk_kda`` call shape over `kda` (``impl="pallas"``): same result as the token recurrence
    `kda_recurrent`. q, k already L2-normalised; g the activated log-decay (>= -5 per token for the kernels);
    ``backend=None`` picks by JAX's default device (`k3jax.ops.backend.default_kernel_backend`: ``"gpu"``,
    ``"tpu"``, else ``"xla"``). Returns ``(o in q.dtype, final_state f32 or None)``."""
    backend = backend_lib.default_kernel_backend() if backend is None else backend
    o, final_state = kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, impl="pallas",
                         segment_ids=segment_ids, cu_seqlens=cu_seqlens, backend=backend, config=config, bwd=bwd)
    return o, (final_state if output_final_state else None)


def chunk_kda_gated(q, k, v, g_raw, beta_logits, *, A_log, dt_bias, lower_bound=-5.0, scale=None,
                    initial_state=None, output_final_state=False, cu_seqlens=None, segment_ids=None, backend=None,
                    config=None, bwd="pallas"):
    """``chunk_kda`` from K3's raw layer quantities (the call shape fla's ``chunk_kda`` offers with its in-kernel
    gate, L2 norm and beta sigmoid): q, k are L2-normalised (f32 math, back to q's dtype), the gate is K3's
    lower-bounded ``lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` (in the intra kernel where `kda`'s
    ``gate`` allows it) and ``beta = sigmoid(beta_logits)``. The L2 norms and beta run in XLA around the kernels.
    (Normalising q, k inside the intra kernels too measured slower in another device call, 3.97 vs 3.40 ms
    forward at 1x8192x96; a same-run A/B is pending, benchmarks/RESULTS.md.) Gradients reach
    ``q, k, v, g_raw, beta_logits``, ``A_log`` and ``dt_bias`` by autodiff through them.

    Args:
      q, k, g_raw: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta_logits: ``[B, T, H]``.
      A_log: ``[H]``; dt_bias: ``[H, K]`` or ``[H * K]`` (fla's layout).
      lower_bound: the gate's per-token floor, in [-5, 0) for the Pallas kernels' f32 range.
      Other arguments as ``chunk_kda``.
    """
    _, _, h, kd = q.shape
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
    backend = backend_lib.default_kernel_backend() if backend is None else backend
    o, final_state = kda(_l2(q), _l2(k), v, g_raw, beta, scale=scale, initial_state=initial_state, impl="pallas",
                         segment_ids=segment_ids, cu_seqlens=cu_seqlens, backend=backend, config=config, bwd=bwd,
                         gate=(a_hk, bias_hk, float(lower_bound)))
    return o, (final_state if output_final_state else None)


def _l2(x):
    return l2_normalize(x).astype(x.dtype)
