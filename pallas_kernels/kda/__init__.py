"""Pallas chunkwise KDA kernels (issue 6): ``chunk_kda`` dispatches between the Pallas GPU/interpret kernels
(forward: chunk_fwd.py, backward: chunk_bwd.py) and the pure-XLA chunked core."""

from pallas_kernels.kda.decode import kda_decode_step
from pallas_kernels.kda.dispatch import (
    BACKENDS,
    BWD_IMPLS,
    KernelConfig,
    chunk_kda,
    chunk_kda_gated,
    default_backend,
)

__all__ = ["BACKENDS", "BWD_IMPLS", "KernelConfig", "chunk_kda", "chunk_kda_gated", "default_backend",
           "kda_decode_step"]
