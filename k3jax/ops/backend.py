"""Where a kernel may run: the one place that reads the traced platform and the mesh for every op and layer that
chooses between a Pallas kernel, its interpreter and the XLA path.

- The platform: the context mesh's device platform when one is set (a TPU topology compiled on a CPU host counts as
  TPU, `sharding.aot`), else JAX's default backend; `traced_accelerator` maps it to a kernel family.
- The mesh: GSPMD does not partition a Pallas call (Mosaic TPU refuses it, Triton would be replicated), so a
  kernel traced under a multi-device mesh outside `shard_map` must either run inside `shard_map` (the KDA kernel,
  `sharding.kda_kernel`) or give way to the XLA path.
Layer-specific eligibility (rows, shapes, dtypes) stays next to each op; it asks this module for the rest.
"""

from __future__ import annotations

import jax

__all__ = ["default_kernel_backend", "forced_kernel_backend", "gpu_kernel_backend_here", "kernel_backend_here",
           "kernel_mesh", "mesh_context", "on_gpu", "traced_accelerator", "traced_platform"]

# JAX platform name -> kernel family; anything else (CPU) has none
_KERNEL_FAMILY = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def traced_platform() -> str:
    """The platform the current trace is for: the context mesh's device platform when one is set, else JAX's
    default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def traced_accelerator() -> str | None:
    """The kernel family for the platform being traced: "gpu" (CUDA / ROCm), "tpu", or None (CPU and anything
    else: the XLA paths)."""
    return _KERNEL_FAMILY.get(traced_platform())


def on_gpu() -> bool:
    """Whether the current trace is for a GPU."""
    return traced_accelerator() == "gpu"


def default_kernel_backend() -> str:
    """The kernel backend for JAX's default device, ignoring any mesh: "gpu", "tpu", else "xla" (no kernel)."""
    return _KERNEL_FAMILY.get(jax.default_backend(), "xla")


def mesh_context() -> str:
    """How the current trace sees the devices: "manual" inside `shard_map` (each device sees its own block),
    "mesh" under a context mesh that GSPMD partitions, "none" without a context mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:
        return "manual"
    return "none" if mesh.empty else "mesh"


def kernel_mesh():
    """The mesh a kernel call traced now must be sharded over, or None: no mesh, a one-device mesh, or already
    inside a `shard_map` (each device then sees its own block)."""
    if mesh_context() != "mesh":
        return None
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if mesh.size > 1 else None


def kernel_backend_here() -> str | None:
    """The kernel family an "auto" op may run in the current trace ("gpu" / "tpu"), or None for the XLA path:
    an accelerator, and either inside `shard_map`, under a one-device mesh, or with no mesh on a one-device
    process (a Pallas call is not partitioned automatically)."""
    family = traced_accelerator()
    if family is None:
        return None
    context = mesh_context()
    if context == "manual":
        return family
    if context == "mesh":
        return family if kernel_mesh() is None else None
    return family if jax.device_count() == 1 else None


def forced_kernel_backend() -> str:
    """The kernel backend when an op is told to use its kernel ("pallas"): this platform's family, or the Pallas
    interpreter off an accelerator (exact but slow, for tests)."""
    return traced_accelerator() or "interpret"


def gpu_kernel_backend_here() -> str | None:
    """`kernel_backend_here` when it is the GPU kernel family ("gpu", or "interpret" where tests stand the
    interpreter in for it), else None: where a GPU-only kernel or a GPU `Tiling` applies."""
    backend = kernel_backend_here()
    return backend if backend in ("gpu", "interpret") else None
