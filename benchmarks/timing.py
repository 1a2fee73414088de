"""Wall-clock timing shared by the JAX benchmarks."""

from __future__ import annotations

import statistics
import time

import jax

__all__ = ["median_ms"]


def median_ms(fn, iters: int) -> float:
    """Median ms of `fn()` (blocked until its outputs are ready) over `iters` calls, after one warm-up call
    (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
