"""Power-of-two sizes for Pallas Triton blocks (block dims must be powers of two; dot operands at least 16) and the
Triton compiler parameters shared by the kernel families."""

from __future__ import annotations

from jax.experimental.pallas import triton as pl_triton

__all__ = ["is_pow2", "largest_pow2_divisor", "next_pow2", "triton_params"]


def next_pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= max(n, at_least)."""
    n = max(int(n), int(at_least), 1)
    return 1 << (n - 1).bit_length()


def is_pow2(n: int, at_least: int = 1) -> bool:
    """Whether n is a power of two >= at_least."""
    return n >= at_least and n & (n - 1) == 0


def largest_pow2_divisor(n: int, at_most: int, at_least: int = 1) -> int:
    """The largest power of two in [at_least, at_most] dividing n; 0 when there is none."""
    t = 1 << (int(at_most).bit_length() - 1)
    while t >= at_least:
        if n % t == 0:
            return t
        t //= 2
    return 0


def triton_params(interpret: bool, warps: int, stages: int = 1):
    """Triton compiler parameters (None in interpret mode)."""
    if interpret:
        return None
    return pl_triton.CompilerParams(num_warps=warps, num_stages=stages)
