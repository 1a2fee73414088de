"""Test-only helpers: a plain jitted train step, the default next-token objective, jitted logits, a sharded
loss-and-gradient function (the trainer itself uses `k3jax.training.step.make_sharded_train_step`), placing a model
on a mesh, routing load statistics and the embedded-corpus dataset."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.data.pipeline import default_data_dir, make_dataset
from k3jax.data.prepare import BYTE_BOS, BYTE_EOS, BYTE_PAD
from k3jax.layers.routing import token_scores
from k3jax.training.loss import next_token_loss
from sharding.shard import ShardingPlan, TracedUnderMesh, batch_spec, plan_shardings


def next_token_loss_fn(model: nnx.Module, batch_bt: jax.Array) -> jax.Array:
    """Next-token cross-entropy on `batch[:, :-1] -> batch[:, 1:]`."""
    return next_token_loss(model(batch_bt[:, :-1]), batch_bt[:, 1:])


@functools.partial(jax.jit, static_argnums=1)
def _logits(state, graphdef, ids):
    return nnx.merge(graphdef, state)(ids)


def logits(model: nnx.Module, ids: jax.Array) -> np.ndarray:
    """`model(ids)` as a NumPy array, jitted once per model structure and input shape."""
    graphdef, state = nnx.split(model)
    return np.asarray(_logits(state, graphdef, ids))


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
                               wrt=nnx.Param, batch_ndim: int = 2):
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
                                     out_shardings=(replicated, param_plan.shardings)), mesh)

    def loss_and_grad(model: nnx.Module, batch_bt: jax.Array):
        _, params, rest = nnx.split(model, wrt, ...)
        return jitted(params, rest, batch_bt)

    loss_and_grad.jitted = jitted
    return loss_and_grad


def layer_output_and_grads(layer: nnx.Module, x: jax.Array, *args) -> tuple[jax.Array, list]:
    """A layer's output on `x` (extra call arguments `args`, e.g. segment ids) and the gradients of sum(sin(out))
    w.r.t. every parameter (sorted by path, as NumPy arrays) and then x."""
    @nnx.jit
    def run(m, x):
        def loss(m, x):
            y = m(x, *args)
            return jnp.sum(jnp.sin(y)), y

        (_, y), (g_params, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
        return y, g_params, g_x

    y, g_params, g_x = run(layer, x)
    return y, [np.asarray(v.get_value()) for _, v in sorted(nnx.to_flat_state(g_params))] + [g_x]


def shard_model(model: nnx.Module, mesh: Mesh) -> ShardingPlan:
    """Places every Variable of `model` on `mesh` per the rules (in place) and returns the plan used."""
    state = nnx.state(model)
    plan = plan_shardings(state, mesh)
    nnx.update(model, jax.device_put(state, plan.shardings))
    return plan


def route_top_k(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
    """Selected experts per token, int32 [m, k]: top-k of the biased scores (the bias only selects)."""
    return jax.lax.top_k(token_scores(scores) + bias.astype(jnp.float32), k)[1]


def expert_load_stats(experts_nk: jax.Array, n: int) -> dict[str, jax.Array]:
    """Load statistics of a routing: experts_nk int [N, k] (or any shape) of selected expert ids, n experts.

    `max_load` / `mean_load` (= N·k/n) / `max_over_mean` (1 = perfectly balanced), plus `loads` [n].
    """
    ids = experts_nk.reshape(-1).astype(jnp.int32)
    loads = jnp.zeros((n,), jnp.float32).at[ids].add(1.0)
    mean = jnp.float32(ids.shape[0]) / n
    max_load = loads.max()
    return {"max_load": max_load, "mean_load": mean, "max_over_mean": max_load / mean, "loads": loads}


def default_dataset(*, batch_size: int, seq_len: int, seed: int = 0, cache_root: str | None = None,
                    max_bytes: int = 8 << 20, bos_id: int = BYTE_BOS, eos_id: int = BYTE_EOS,
                    pad_id: int = BYTE_PAD, **kwargs):
    """`make_dataset` over the embedded standard-library corpus (prepared on first use, see `default_data_dir`)."""
    data_dir = default_data_dir(cache_root, max_bytes=max_bytes, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    return make_dataset(data_dir, batch_size=batch_size, seq_len=seq_len, seed=seed, **kwargs)


def use_compile_cache(path: str) -> None:
    """Every program compiled from now on is stored in / read from the persistent XLA cache at `path`."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
