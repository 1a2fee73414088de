"""Models the benchmarks build."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from k3jax.model import K3Model

__all__ = ["random_model"]


def random_model(cfg) -> K3Model:
    """A randomly initialised model, initialised in one jitted call on the host CPU (the accelerator compile of the
    whole-model init program is minutes for `k3_gpu`), then copied to the default device uncommitted."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    with jax.default_device(jax.devices("cpu")[0]):
        state = jax.jit(lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(0))))()
    state = jax.device_put(jax.tree.map(np.asarray, state))
    return nnx.merge(graphdef, state)
