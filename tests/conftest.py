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


class DecodeHarness:
    """One set of random weights for a config and its runtime variants (`cfg.replace(**overrides)` that keep the
    parameter tree, e.g. a kernel choice): jitted cached-forward steps to compare a decode path with the XLA one."""

    def __init__(self, cfg, seed: int, scale: float = 0.1):
        import jax
        import jax.numpy as jnp

        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        _, abstract = self._split(cfg)
        self.params = jax.tree.map(lambda x: jnp.asarray(scale * self.rng.standard_normal(x.shape), x.dtype),
                                   abstract)

    @staticmethod
    def _split(cfg):
        from flax import nnx

        from k3jax.model import K3Model

        return nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))

    def step(self, **overrides):
        """jit((params, ids [B, T], cache, valid_len [B]) -> (logits, new cache)) of the variant."""
        import jax
        from flax import nnx

        graphdef, _ = self._split(self.cfg.replace(**overrides))
        return jax.jit(lambda p, ids, cache, valid: nnx.merge(graphdef, p).forward_cached(ids, cache, valid))

    def ids(self, batch: int, length: int):
        import jax.numpy as jnp

        return jnp.asarray(self.rng.integers(0, self.cfg.vocab_size, (batch, length)), jnp.int32)

    def cache(self, batch: int, max_len: int):
        from k3jax.model import init_cache

        return init_cache(self.cfg, batch, max_len)


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
