"""A plain jitted train step on an unsharded model: `step(model, optimizer, batch [B, T+1]) -> loss`.

Used where the full trainer (`k3jax.training.trainer`, behind train.py) is more than needed: optimizer tests.
"""

from __future__ import annotations

from flax import nnx

from k3jax.training.loss import next_token_loss


def make_train_step():
    """A jitted `step(model, optimizer, batch [B, T+1]) -> loss`: next-token loss, gradients, optimizer update."""

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            return next_token_loss(model(batch[:, :-1]), batch[:, 1:])

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return step
