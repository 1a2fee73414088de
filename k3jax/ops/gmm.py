"""Grouped matmul (rows grouped contiguously by expert): the single dispatch point for the MoE experts.

impl:
- "auto" (default): the Pallas kernel (`pallas_kernels.gmm`) on GPU/TPU, `jax.lax.ragged_dot` on CPU. Under a
  multi-device jit outside `shard_map` it stays on `ragged_dot`: a Pallas call is not partitioned automatically
  (Mosaic TPU refuses it, Triton would be replicated), so the kernel is used where each device sees its own rows
  (one device, or inside `shard_map`, e.g. the expert-parallel path).
- "pallas": the kernel on this platform's backend ('interpret' on CPU: slow, for tests).
- "ragged_dot": `jax.lax.ragged_dot`.
All three have `jax.lax.ragged_dot` semantics and are differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import gmm as pallas_gmm

IMPLS = ("auto", "pallas", "ragged_dot")


def _kernel_backend_here() -> str | None:
    """The kernel backend 'auto' may use in the current trace, or None for ragged_dot."""
    backend = pallas_gmm.default_backend()
    if backend == "xla":
        return None
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    if mesh is not None and getattr(mesh, "manual_axes", ()):
        return backend  # inside shard_map: each device sees its own rows
    if mesh is not None and not getattr(mesh, "empty", True):
        return backend if mesh.size == 1 else None  # tracing under a mesh context: its size decides
    return backend if jax.device_count() == 1 else None


def gmm(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *, impl: str = "auto",
        preferred_element_type=None) -> jax.Array:
    """`jax.lax.ragged_dot` semantics: row block i (of size group_sizes[i]) is multiplied by rhs[i]."""
    if impl not in IMPLS:
        raise ValueError(f"unknown gmm impl {impl!r}; available: {', '.join(repr(i) for i in IMPLS)}")
    group_sizes_g = group_sizes_g.astype(jnp.int32)
    if impl == "auto":
        backend = _kernel_backend_here()
        if backend is None:
            impl = "ragged_dot"
        else:
            return pallas_gmm.gmm(lhs_mk, rhs_gkn, group_sizes_g, preferred_element_type=preferred_element_type,
                                  backend=backend)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, preferred_element_type=preferred_element_type)
    backend = pallas_gmm.default_backend()
    return pallas_gmm.gmm(lhs_mk, rhs_gkn, group_sizes_g, preferred_element_type=preferred_element_type,
                          backend="interpret" if backend == "xla" else backend)
