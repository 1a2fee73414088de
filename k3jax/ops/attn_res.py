"""The fused Block Attention Residuals read + RMSNorm (`pallas_kernels.attn_res`) with its gradient rule, and where
it runs. The XLA form and the concept itself live in `k3jax.layers.attn_res`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops import backend as backend_lib
from pallas_kernels import attn_res as kernel

__all__ = ["read_norm", "read_norm_backend"]


def read_norm_backend(impl: str, b: int, t: int, d: int, n_filled, block_t: int) -> str | None:
    """The backend `read_norm` runs on for the knob `impl` (`RuntimeConfig.attn_res_impl`), or None (XLA): "auto" =
    "gpu" for multi-token calls (training, prefill; the one-token decode step keeps its tuned XLA fusions) where a
    GPU kernel may run in this trace and the kernel takes the shape (a static count of filled bank rows >= 1, B·T a
    multiple of block_t); "pallas" = this platform's kernel or the interpreter where the shape suits, else XLA (a
    traced row count inside a scan); "xla" = None."""
    if impl == "xla":
        return None
    if impl not in ("auto", "pallas"):
        raise ValueError(f"attn_res_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if kernel.supported(b * t, d, n_filled, block_t) or (impl == "auto" and t == 1):
        return None
    if impl == "pallas":
        backend = backend_lib.forced_kernel_backend()
        return backend if backend in ("gpu", "interpret") else "interpret"
    return "gpu" if backend_lib.gpu_kernel_backend_here() == "gpu" else None


def read_norm(live_btd: jax.Array, bank_nbtd: jax.Array, n_filled: int, query_d: jax.Array, gain_d: jax.Array, *,
              eps_read: float, eps_norm: float, backend: str, block_t: int = 16, warps: int = 4) -> jax.Array:
    """``rms_norm(attn_res_mix(live, bank[:n_filled], query), gain)`` in one kernel each way (`backend` "gpu" or
    "interpret"; check `read_norm_backend` first). Gradients reach live, the bank, the query and the gain."""
    if backend not in ("gpu", "interpret"):
        raise ValueError(f"read_norm: backend must be 'gpu' or 'interpret', got {backend!r}")
    b, t, d = live_btd.shape
    reason = kernel.supported(b * t, d, n_filled, block_t)
    if reason:
        raise ValueError(f"read_norm: the kernel does not take live {list(live_btd.shape)}: {reason}")
    opts = (("block_t", block_t), ("eps_norm", float(eps_norm)), ("eps_read", float(eps_read)),
            ("interpret", backend == "interpret"), ("n_filled", int(n_filled)), ("warps", warps))
    out = _read_norm(live_btd.reshape(b * t, d), bank_nbtd.reshape(bank_nbtd.shape[0], b * t, d), query_d, gain_d,
                     opts)
    return out.reshape(b, t, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _read_norm(live, bank, query, gain, opts):
    return kernel.read_norm_fwd(live, bank, query, gain, **dict(opts))


def _fwd(live, bank, query, gain, opts):
    return _read_norm(live, bank, query, gain, opts), (live, bank, query, gain)


def _bwd(opts, res, dout):
    live, bank, query, gain = res
    o = dict(opts)
    d_live, d_bank, dq_part, dg_part = kernel.read_norm_bwd(live, bank, query, gain, dout, **o)
    pad = bank.shape[0] - o["n_filled"]
    d_bank = jnp.pad(d_bank, ((0, pad), (0, 0), (0, 0))).astype(bank.dtype) if pad else d_bank.astype(bank.dtype)
    return (d_live.astype(live.dtype), d_bank, jnp.sum(dq_part, axis=0).astype(query.dtype),
            jnp.sum(dg_part, axis=0).astype(gain.dtype))


_read_norm.defvjp(_fwd, _bwd)
