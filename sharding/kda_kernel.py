"""The Pallas KDA kernel under a device mesh.

GSPMD does not partition a Pallas call (a custom call): traced under a multi-device mesh it would gather its
operands onto every device. KDA is independent per (sequence, head), so under a mesh the kernel runs inside
`shard_map` with the batch split over ('data', 'expert') and the heads over 'model' wherever they divide (the same
layout the rules give the activations around it), each device calling the kernel on its own rows and heads. The
'context' axis is not used here: a context-split sequence takes the context-parallel path
(`sharding.context_parallel`), which runs the same kernel per context shard from its composed incoming state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops import kda as kda_ops
from sharding.context_parallel import batch_axes, model_axis

__all__ = ["kda_kernel_on_mesh"]


def kda_kernel_on_mesh(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, *, scale, initial_state=None, impl="pallas",
                       chunk_size=64, segment_ids=None, mesh):
    """`k3jax.ops.kda.kda` (same arguments) run per device on its batch rows and heads of `mesh`; global arrays in
    and out: ``(o [B, T, H, V], final_state [B, H, K, V] f32)``."""
    b, t, h, kd = q_bthk.shape
    vd = v_bthv.shape[-1]
    ba, ma = batch_axes(mesh, b), model_axis(mesh, h)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, kd, vd), jnp.float32)
    has_ids = segment_ids is not None
    ids = segment_ids if has_ids else jnp.zeros((b, t), jnp.int32)
    tok4, tok3, state = P(ba, None, ma, None), P(ba, None, ma), P(ba, ma, None, None)

    def body(q, k, v, g, beta, s0, ids_local):
        o, s_out = kda_ops.kda(q, k, v, g, beta, scale=scale, initial_state=s0, impl=impl, chunk_size=chunk_size,
                               segment_ids=ids_local if has_ids else None)
        return o, s_out.astype(jnp.float32)

    # check_vma off: a Pallas call's outputs carry no varying-axes type.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok4, tok4, tok4, tok4, tok3, state, P(ba, None)),
                       out_specs=(tok4, state), check_vma=False)
    return fn(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, initial_state.astype(jnp.float32), ids)
