"""Activation sharding constraints by logical axis names, resolved through the same rules table as parameters.

`constrain(x, ("batch", "seq", "act_embed"))` pins an activation's layout when the code is traced under a mesh
context (`sharding.shard.mesh_context`, which the sharded train step uses); without a mesh, or inside a
`shard_map` (manual axes), it is the identity. Divisibility fallbacks are the parameters' (`resolve_spec`), so a
tiny model on a big mesh still compiles.
"""

from __future__ import annotations

from typing import Sequence

import jax

from k3jax.ops.backend import mesh_context
from sharding.shard import resolve_spec

# The logical layouts the model annotates (every name must have a rule in sharding/rules.py; tested).
ACT_BTD = ("batch", "seq", "act_embed")  # residual stream / layer outputs
ACT_NBTD = (None, "batch", "seq", "act_embed")  # the AttnRes snapshot bank
ACT_BTV = ("batch", "seq", "act_vocab")  # logits
ACT_BTHK = ("batch", "seq", "heads", "head_dim")  # per-head attention operands (cuDNN's partitioner wants one layout)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    if mesh_context() != "mesh":
        return x
    mesh = jax.sharding.get_abstract_mesh()
    spec, _ = resolve_spec(logical, x.shape, mesh, path="activation")
    return jax.lax.with_sharding_constraint(x, spec)
