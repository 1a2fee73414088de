"""Checking Pallas GPU kernels without a GPU: lower a function for CUDA on this host and list its Triton calls."""

from __future__ import annotations

import re

import jax


def triton_kernels(fn, *args, name_pattern: str) -> tuple[int, list[str]]:
    """Lowers `jax.jit(fn)(*args)` (args may be ShapeDtypeStructs) for CUDA; returns (number of Triton custom calls,
    sorted distinct kernel names matching `name_pattern`, a regex with one group)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton"), sorted(set(re.findall(rf'name = "({name_pattern})', text)))
