"""Dense weight projections ``x[..., K...] @ w[K..., N...]``: the single dispatch point for the layers' matmuls
that a decode step streams from HBM (KDA, MLA, shared-expert and latent-MoE projections, the LM head).

``cfg.decode_matmul_impl``:
- "xla" (default): ``jax.lax.dot_general``, what ``jnp.einsum`` emits (XLA picks a Triton gemm fusion or cuBLAS).
- "pallas": calls with at most ``DECODE_MAX_ROWS`` rows (decode) run the split-K kernel
  (`pallas_kernels.dense.decode_matmul`: the weight streamed once, K split until the grid fills the GPU) on a GPU
  without a multi-device mesh (the interpreter elsewhere: tests); bigger calls, and shapes whose contracted or
  output width is not a multiple of 16, stay on XLA. The kernel's gradient is the plain XLA product pair.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["DECODE_MAX_ROWS", "project", "unless_single_row"]

DECODE_MAX_ROWS = 256


def _tile(size: int) -> int:
    """The largest power of two <= 64 dividing `size` (0 when below 16: the kernel cannot take it)."""
    from pallas_kernels.tiling import largest_pow2_divisor  # lazy: pallas_kernels imports k3jax modules

    return largest_pow2_divisor(size, 64, 16)


def _kernel_backend(cfg, rows: int, k: int, n: int) -> str | None:
    if cfg.decode_matmul_impl != "pallas" or rows > DECODE_MAX_ROWS:
        return None
    if not (_tile(k) and _tile(n)):
        return None
    from sharding.mesh import gpu_kernel_backend  # lazy: sharding imports the ops

    return gpu_kernel_backend()


def project(x: jax.Array, w: jax.Array, cfg, *, contract: int = 1, preferred_element_type=None) -> jax.Array:
    """Contracts the last `contract` axes of x with the first `contract` axes of w (``"btd,dhk->bthk"`` is
    contract=1, ``"bthk,hkd->btd"`` contract=2); result dtype `preferred_element_type` or x's, f32 accumulation."""
    if x.shape[x.ndim - contract:] != w.shape[:contract]:
        raise ValueError(f"project: x {x.shape} and w {w.shape} disagree on the {contract} contracted axes")
    k = math.prod(w.shape[:contract])
    n = math.prod(w.shape[contract:])
    rows = math.prod(x.shape[:x.ndim - contract])
    out_shape = x.shape[:x.ndim - contract] + w.shape[contract:]
    backend = _kernel_backend(cfg, rows, k, n)
    if backend is None:
        dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
        return unless_single_row(
            lambda x2: jax.lax.dot_general(x2, w, (dims, ((), ())), preferred_element_type=preferred_element_type),
            x, x.ndim - contract)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    y = _kernel_matmul(x.reshape(rows, k), w.reshape(k, n).astype(x.dtype), backend, out_dtype)
    return y.reshape(out_shape)


def unless_single_row(fn, x: jax.Array, lead: int) -> jax.Array:
    """``fn(x)`` where the product of x's first `lead` axes (the rows of a matmul) is 1 (batch-1 decode) runs on x
    padded with a zero row along axis 0, then keeps the real row. XLA rewrites a one-row matmul as a multiply and a
    reduction over a materialised [K, N] product (k3_gpu decode at B = 1 spent ~1.8 ms of a 2.5 ms step there:
    benchmarks/RESULTS.md, 2026-11-30); two rows stay a matmul. `fn` must act row by row along axis 0."""
    if lead < 1 or math.prod(x.shape[:lead]) != 1:
        return fn(x)
    return fn(jnp.concatenate([x, jnp.zeros_like(x)], axis=0))[:1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kernel_matmul(x_mk, w_kn, backend, out_dtype):
    from pallas_kernels.dense import SplitTiling, decode_matmul  # lazy: pallas_kernels imports k3jax modules

    tiling = SplitTiling(tn=_tile(w_kn.shape[1]), tk=_tile(w_kn.shape[0]))
    return decode_matmul(x_mk, w_kn, tiling=tiling, backend=backend, out_dtype=out_dtype)


def _kernel_matmul_fwd(x_mk, w_kn, backend, out_dtype):
    return _kernel_matmul(x_mk, w_kn, backend, out_dtype), (x_mk, w_kn)


def _kernel_matmul_bwd(backend, out_dtype, residuals, dy_mn):
    x_mk, w_kn = residuals
    dy = dy_mn.astype(x_mk.dtype)
    return (jnp.matmul(dy, w_kn.T, preferred_element_type=jnp.float32).astype(x_mk.dtype),
            jnp.matmul(x_mk.T, dy, preferred_element_type=jnp.float32).astype(w_kn.dtype))


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)
