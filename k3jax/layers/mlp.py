"""The gated MLP used for the dense layer 0 and the shared experts (its SiTU-GLU / SiLU-GLU: `k3jax.ops.glu`)."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.ops.glu import glu
from k3jax.ops.linear import project as dense


class GatedMLP(nnx.Module):
    """down(act(gate x, up x)): the dense MLP (width `intermediate_size`) and the shared experts."""

    def __init__(self, cfg: ModelConfig, width: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, pd = cfg.hidden_size, cfg.runtime.jnp_param_dtype
        self.gate_proj = params.normal(rngs, (d, width), ("embed", "mlp"), pd)
        self.up_proj = params.normal(rngs, (d, width), ("embed", "mlp"), pd)
        self.down_proj = params.normal(rngs, (width, d), ("mlp", "embed"), pd)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        x = x_btd.astype(dt)
        h = glu(dense(x, self.gate_proj[...].astype(dt), cfg), dense(x, self.up_proj[...].astype(dt), cfg), cfg)
        return dense(h, self.down_proj[...].astype(dt), cfg)
