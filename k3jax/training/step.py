"""The sharded jitted train step: one optimizer step with explicit in/out shardings on a mesh.

Shardings come from `sharding.shard.plan_shardings` (parameters, optimizer state) and `sharding.shard.batch_spec`
(batches); the step is traced under its mesh as the context mesh (`sharding.shard.TracedUnderMesh`), so the MoE
takes its expert-parallel path when 'expert' > 1.
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.training.accumulate import accumulated_value_and_grad
from sharding.shard import TracedUnderMesh, batch_spec, plan_shardings


def make_sharded_train_step(model: nnx.Module, optimizer: nnx.Optimizer, mesh: Mesh, loss_fn: Callable, *,
                            wrt=nnx.Param, batch_ndim: int = 2, donate: bool = True,
                            compiler_options: dict | None = None, has_aux: bool = False,
                            after_update: Callable | None = None, grad_accum: int = 1,
                            accumulate_context: Callable | None = None):
    """`step(model, optimizer, batch) -> loss`: one optimizer step on `loss_fn(model, batch)`, updating `model` and
    `optimizer` in place.

    Jitted with explicit shardings: parameters and optimizer state enter and leave in the shardings
    `plan_shardings` gives them (so the partitioner cannot drift them between steps), the batch (an array or a
    dict of arrays, all [B, ...] with `batch_ndim` dims) is sharded over ('data', 'expert') on its leading axis
    (pass it through `shard_batch`, or any array: jit reshards it), the loss is replicated. With `donate`, the old
    state buffers are donated to the new ones.

    With `has_aux`, `loss_fn` returns `(loss, metrics dict)` and the step returns `(loss, metrics)`.
    `after_update(model, grads) -> dict` runs inside the jitted step after the optimizer update (e.g. Quantile
    Balancing's bias update); its dict is merged into the metrics (and the step returns `(loss, metrics)`).
    Traced (called or lowered) under `mesh` as the context mesh.

    With `grad_accum` = N > 1 the batch is split into N micro-batches run one after another inside the step
    (`k3jax.training.accumulate`): gradients, loss, metrics and routing statistics are summed, then one optimizer
    update and one `after_update`. `accumulate_context(batch) -> dict` (e.g. the whole batch's token counts, so
    that `loss_fn` normalises each micro-batch's loss by them) is computed once and merged into every micro-batch.
    """
    graphdef, state = nnx.split((model, optimizer))
    plan = plan_shardings(state, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, batch_spec(batch_ndim))
    with_metrics = has_aux or after_update is not None

    def pure(state, batch_bt):
        model, optimizer = nnx.merge(graphdef, state)
        if grad_accum > 1:
            context = accumulate_context(batch_bt) if accumulate_context is not None else {}
            out, grads = accumulated_value_and_grad(lambda m, mb: loss_fn(m, {**mb, **context}), model, batch_bt,
                                                    grad_accum, wrt=wrt, has_aux=has_aux,
                                                    micro_batch_sharding=batch)
        else:
            out, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=has_aux)(model, batch_bt)
        loss, metrics = out if has_aux else (out, {})
        optimizer.update(model, grads)
        if after_update is not None:
            metrics = {**metrics, **after_update(model, grads)}
        return nnx.state((model, optimizer)), ((loss, metrics) if with_metrics else loss)

    jitted = TracedUnderMesh(jax.jit(pure, in_shardings=(plan.shardings, batch),
                                     out_shardings=(plan.shardings, replicated),
                                     donate_argnums=(0,) if donate else (), compiler_options=compiler_options), mesh)

    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch_bt):
        new_state, out = jitted(nnx.state((model, optimizer)), batch_bt)
        nnx.update((model, optimizer), new_state)
        return out

    step.jitted = jitted
    step.plan = plan
    return step
