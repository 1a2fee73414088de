"""Pallas chunkwise KDA kernels (issue 6): ``chunk_kda`` dispatches between the Pallas GPU/interpret kernels and
the pure-XLA chunked core."""

from pallas_kernels.kda.dispatch import (
    BACKENDS,
    KernelConfig,
    chunk_kda,
    default_backend,
)

__all__ = ["BACKENDS", "KernelConfig", "chunk_kda", "default_backend"]
