"""XLA flags the serving entry points (`serve.py`, `benchmarks/decode_bench.py`) add to ``XLA_FLAGS`` by default.

- ``--xla_gpu_graph_enable_concurrent_region=true``: a GPU decode step is one CUDA graph of ~770 mostly tiny
  kernels (k3_gpu, B = 64), many of them independent (the shared experts beside the routed ones, the KDA
  projections beside each other). With concurrent regions the graph runs independent kernels side by side instead
  of one after another: k3_gpu decode B = 64 took 3.22 ms per step instead of 3.57 (0.90x; benchmarks/RESULTS.md,
  2026-11-30). The same kernels run, and the decode step has no atomics; two identical runs with the flag
  decoded identically (greedy tokens and logits). Measured on one GPU: `serve.py --mesh` does not add it.

A flag the user already sets in ``XLA_FLAGS`` (any value) is left as it is. XLA reads the variable once, when the
backend starts: call `apply_serving_flags` before the first computation.
"""

from __future__ import annotations

import os
import sys

__all__ = ["SERVING_XLA_FLAGS", "apply_serving_flags", "with_serving_flags"]

SERVING_XLA_FLAGS = ("--xla_gpu_graph_enable_concurrent_region=true",)


def _name(flag: str) -> str:
    return flag.split("=", 1)[0].strip()


def with_serving_flags(xla_flags: str) -> str:
    """``xla_flags`` plus each of `SERVING_XLA_FLAGS` whose name it does not set already."""
    present = {_name(f) for f in xla_flags.split()}
    added = [f for f in SERVING_XLA_FLAGS if _name(f) not in present]
    return " ".join([xla_flags.strip()] + added).strip()


def apply_serving_flags(environ=None) -> tuple[str, ...]:
    """Adds the serving defaults to ``environ["XLA_FLAGS"]`` (default ``os.environ``); returns the flags added.
    Raises if JAX's backend is already running in this process (XLA would ignore them)."""
    environ = os.environ if environ is None else environ
    before = environ.get("XLA_FLAGS", "")
    after = with_serving_flags(before)
    added = tuple(f for f in after.split() if f not in before.split())
    if added and environ is os.environ and "jax" in sys.modules:
        try:  # a private JAX helper: if it moves, skip the check rather than fail
            from jax._src.xla_bridge import backends_are_initialized
        except ImportError:
            backends_are_initialized = lambda: False  # noqa: E731
        if backends_are_initialized():
            raise RuntimeError(f"apply_serving_flags: the JAX backend already started; XLA would ignore {added}. "
                               "Call it before the first JAX computation.")
    environ["XLA_FLAGS"] = after
    return added
