"""Test-only training helpers: a plain jitted train step, the default next-token objective and a sharded
loss-and-gradient function (the trainer itself uses `k3jax.training.step.make_sharded_train_step`)."""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.training.loss import next_token_loss
from sharding.shard import TracedUnderMesh, batch_spec, plan_shardings


def next_token_loss_fn(model: nnx.Module, batch_bt: jax.Array) -> jax.Array:
    """Next-token cross-entropy on `batch[:, :-1] -> batch[:, 1:]`."""
    return next_token_loss(model(batch_bt[:, :-1]), batch_bt[:, 1:])


def make_train_step():
    """A jitted `step(model, optimizer, batch [B, T+1]) -> loss` on an unsharded model: next-token loss,
    gradients, optimizer update."""

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            return next_token_loss(model(batch[:, :-1]), batch[:, 1:])

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return step


def make_sharded_loss_and_grad(model: nnx.Module, mesh: Mesh, loss_fn: Callable = next_token_loss_fn, *,
                               wrt=nnx.Param, batch_ndim: int = 2, compiler_options: dict | None = None):
    """`fn(model, batch) -> (loss, grads)`, jitted with explicit shardings: the model's Variables as
    `plan_shardings` places them, the batch over ('data', 'expert') on its leading axis, the loss replicated and
    the gradients (an `nnx.State` of the `wrt` Variables) in their parameters' shardings.

    `model` fixes the graph structure; call `fn` with that model (or one of the same structure) after `shard_model`.
    Traced under `mesh` as the context mesh (so the MoE takes its expert-parallel path when 'expert' > 1).
    """
    graphdef, params, rest = nnx.split(model, wrt, ...)
    param_plan = plan_shardings(params, mesh, log_fallbacks=False)
    rest_plan = plan_shardings(rest, mesh, log_fallbacks=False)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, batch_spec(batch_ndim))

    def pure(params, rest, batch_bt):
        model = nnx.merge(graphdef, params, rest)
        return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch_bt)

    jitted = TracedUnderMesh(jax.jit(pure, in_shardings=(param_plan.shardings, rest_plan.shardings, batch),
                                     out_shardings=(replicated, param_plan.shardings),
                                     compiler_options=compiler_options), mesh)

    def loss_and_grad(model: nnx.Module, batch_bt: jax.Array):
        _, params, rest = nnx.split(model, wrt, ...)
        return jitted(params, rest, batch_bt)

    loss_and_grad.jitted = jitted
    return loss_and_grad
