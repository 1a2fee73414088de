"""Shared fixtures: models loaded with the independent reference's random HF-named weights."""

from __future__ import annotations

import os
import sys

# 8 emulated CPU devices for the sharding tests; set before anything imports jax (appended to any XLA_FLAGS given).
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def x64():
    """Runs the test body with float64 enabled (models built with dtype='float64' compute exactly in f64)."""
    import jax

    with jax.enable_x64(True):
        yield


def build_model(cfg, weights=None, seed: int = 0):
    """A K3Model for `cfg` holding `weights` (HF-named dict; random reference weights when None)."""
    from flax import nnx

    from k3jax.convert.hf_names import load_hf_weights
    from k3jax.model import K3Model
    from tests.reference import numpy_k3 as ref

    weights = ref.make_random_weights(cfg, seed=seed) if weights is None else weights
    model = K3Model(cfg, rngs=nnx.Rngs(seed))
    load_hf_weights(model, weights)
    return model, weights


def random_ids(cfg, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def jit_call(module, *args):
    """Calls `module(*args)` under `nnx.jit` (one compile instead of slow op-by-op eager dispatch)."""
    from flax import nnx

    return nnx.jit(lambda m, *a: m(*a))(module, *args)
