"""The fused Block Attention Residuals read + RMSNorm (`pallas_kernels.attn_res`) with its gradient rule, and where
it runs. The XLA form and the concept itself live in `k3jax.layers.attn_res`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops import backend as backend_lib
from pallas_kernels import attn_res as kernel

__all__ = ["read_norm", "read_norm_backend", "static_count"]


def read_norm_backend(impl: str, b: int, t: int, d: int, n_filled, block_t: int, bank_rows: int) -> str | None:
    """The backend `read_norm` runs on for the knob `impl` (`RuntimeConfig.attn_res_impl`), or None (XLA): "auto" =
    "gpu" for multi-token calls (training, prefill; the one-token decode step keeps its tuned XLA fusions) where a
    GPU kernel may run in this trace and the kernel takes the shape (B·T a multiple of block_t, D with a
    power-of-two divisor >= 16, `n_filled` a static count >= 1 or None for a traced one); "pallas" = this
    platform's kernel or the interpreter where the shape suits, else XLA; "xla" = None. Under a multi-device
    GSPMD mesh: XLA."""
    if impl == "xla":
        return None
    if impl not in ("auto", "pallas"):
        raise ValueError(f"attn_res_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if kernel.supported(b * t, d, n_filled, block_t, bank_rows) or (impl == "auto" and t == 1):
        return None
    if backend_lib.kernel_mesh() is not None:  # GSPMD does not partition a Pallas call (no shard_map form yet)
        return None
    if impl == "pallas":
        backend = backend_lib.forced_kernel_backend()
        return backend if backend in ("gpu", "interpret") else "interpret"
    return "gpu" if backend_lib.gpu_kernel_backend_here() == "gpu" else None


def static_count(num_filled, bank_rows: int) -> int | None:
    """The filled-row count as a Python int clamped to the bank, or None when it is traced."""
    if isinstance(num_filled, (int, np.integer)) and not isinstance(num_filled, (bool, np.bool_)):
        return min(int(num_filled), bank_rows)
    return None


def read_norm(live_btd: jax.Array, bank_nbtd: jax.Array, num_filled, query_d: jax.Array, gain_d: jax.Array, *,
              eps_read: float, eps_norm: float, backend: str, block_t: int = 16, warps: int = 4) -> jax.Array:
    """``rms_norm(attn_res_mix(live, bank, num_filled, query), gain)`` in one kernel each way (`backend` "gpu" or
    "interpret"; check `read_norm_backend` first). `num_filled`: a static int (only those rows are read) or a traced
    scalar (every row read, those at or past it masked). Gradients reach live, the bank, the query and the gain."""
    if backend not in ("gpu", "interpret"):
        raise ValueError(f"read_norm: backend must be 'gpu' or 'interpret', got {backend!r}")
    b, t, d = live_btd.shape
    n_filled = static_count(num_filled, bank_nbtd.shape[0])
    static = n_filled is not None
    reason = kernel.supported(b * t, d, n_filled, block_t, bank_nbtd.shape[0])
    if reason:
        raise ValueError(f"read_norm: the kernel does not take live {list(live_btd.shape)}: {reason}")
    opts = (("block_t", block_t), ("eps_norm", float(eps_norm)), ("eps_read", float(eps_read)),
            ("interpret", backend == "interpret"), ("n_filled", n_filled), ("warps", warps))
    count = None if static else jnp.asarray(num_filled, jnp.int32).reshape(1)
    out = _read_norm(live_btd.reshape(b * t, d), bank_nbtd.reshape(bank_nbtd.shape[0], b * t, d), query_d, gain_d,
                     count, opts)
    return out.reshape(b, t, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _read_norm(live, bank, query, gain, count, opts):
    return kernel.read_norm_fwd(live, bank, query, gain, count, **dict(opts))


def _fwd(live, bank, query, gain, count, opts):
    return _read_norm(live, bank, query, gain, count, opts), (live, bank, query, gain, count)


def _bwd(opts, res, dout):
    live, bank, query, gain, count = res
    o = dict(opts)
    d_live, d_bank, dq_part, dg_part = kernel.read_norm_bwd(live, bank, query, gain, dout, count, **o)
    pad = bank.shape[0] - d_bank.shape[0]
    d_bank = jnp.pad(d_bank, ((0, pad), (0, 0), (0, 0))).astype(bank.dtype) if pad else d_bank.astype(bank.dtype)
    d_count = None if count is None else np.zeros(count.shape, jax.dtypes.float0)
    return (d_live.astype(live.dtype), d_bank, jnp.sum(dq_part, axis=0).astype(query.dtype),
            jnp.sum(dg_part, axis=0).astype(gain.dtype), d_count)


_read_norm.defvjp(_fwd, _bwd)
