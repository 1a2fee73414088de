"""Gradient accumulation: N micro-batches inside one jitted step, then one optimizer update.

Real pretraining takes millions of tokens per optimizer step; a device holds a few micro-batches of activations at
a time. `accumulated_value_and_grad` runs the loss and its gradient on each of `n` micro-batches in a `lax.scan`
(one compiled body, activations of one micro-batch live at a time), summing in f32:

- the gradients (cast back to the parameters' dtypes at the end, as one big batch's gradients would be);
- the loss and metrics (exact when `loss_fn` normalises by the whole batch's token count, see `token_counts`);
- the MoE routing statistics the forward passes record (`RoutingStats`: the margin histogram Quantile Balancing
  reads, expert loads, expert-parallel counters): every field is a count, so the sum is the whole batch's.

The caller then applies one optimizer update and one Quantile Balancing update, exactly as for one batch `n` times
larger (up to f32 summation order).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import RoutingStats


def split_micro_batches(batch: Any, n: int) -> Any:
    """[B, ...] leaves -> [n, B / n, ...]; micro-batch i holds rows i, i + n, i + 2n, ...

    Interleaved rows keep each device's rows on that device when B is sharded in contiguous blocks over the
    data-parallel axes (the split axis is the inner one), so no micro-batch lands on a subset of the devices."""
    def split(x):
        if x.shape[0] % n:
            raise ValueError(f"grad_accum={n} must divide the batch size, got a batch of {x.shape[0]} rows")
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _add(acc, new):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, new)


def _zeros_f32(tree):
    def zero(x):
        dtype = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jnp.zeros(x.shape, dtype)

    return jax.tree.map(zero, tree)


def accumulated_value_and_grad(loss_fn: Callable, model: nnx.Module, batch: Any, n: int, *, wrt=nnx.Param,
                               has_aux: bool = False, micro_batch_sharding: Any = None):
    """`nnx.value_and_grad(loss_fn, wrt)(model, batch)` computed as the sum over `n` micro-batches.

    `loss_fn(model, micro_batch)` must return a loss that sums to the whole batch's over micro-batches (normalise
    by the whole batch's token count). After the call `model`'s `RoutingStats` hold the sums over the micro-batches.
    `micro_batch_sharding`: an optional sharding (pytree prefix) each micro-batch is constrained to.
    Returns `(out, grads)` as `nnx.value_and_grad` would, grads in the parameters' dtypes.
    """
    if n == 1:
        return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=has_aux)(model, batch)
    graphdef, params, stats, rest = nnx.split(model, wrt, RoutingStats, ...)
    micro = split_micro_batches(batch, n)

    def one(micro_batch):
        if micro_batch_sharding is not None:
            micro_batch = jax.lax.with_sharding_constraint(micro_batch, micro_batch_sharding)

        def pure_loss(p):  # the model is rebuilt inside the traced function (NNX transforms need that)
            m = nnx.merge(graphdef, p, stats, rest, copy=True)
            out = loss_fn(m, micro_batch)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.to_pure_dict(nnx.state(m, RoutingStats)))

        (loss, (aux, new_stats)), grads = jax.value_and_grad(pure_loss, has_aux=True)(params)
        return ((loss, aux) if has_aux else loss), nnx.to_pure_dict(grads), new_stats

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(one, first)

    def body(carry, micro_batch):
        return _add(carry, one(micro_batch)), None

    total, _ = jax.lax.scan(body, _zeros_f32(shapes), micro)
    out, grads_sum, stats_sum = total
    grads = _with_values(nnx.state(model, wrt), grads_sum)  # a copy of the parameters' state, holding the sums
    nnx.update(model, _with_values(nnx.state(model, RoutingStats), stats_sum))
    return out, grads


def _with_values(state: nnx.State, values: dict) -> nnx.State:
    """`state` (a copy, as `nnx.state` returns) with `values` (a pure dict, cast to each variable's dtype)."""
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda old, new: new.astype(old.dtype),
                                                 nnx.to_pure_dict(state), values))
    return state
