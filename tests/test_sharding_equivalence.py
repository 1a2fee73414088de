"""`tiny` under each test mesh (8 emulated CPU devices): loss and gradients equal the single-device values, the
parameters really are distributed, and a sharded optimizer step keeps every shard where the plan put it.

Parameters and the batch are sharded by the rules; under a mesh with 'expert' > 1 the MoE runs expert-parallel
(`sharding/expert_parallel.py`) and with 'context' > 1 KDA and MLA run context-parallel over the sequence
(`sharding/context_parallel.py`); everything else follows GSPMD propagation. Compilation dominates the cost: each
mesh compiles one loss+grad program, at XLA:CPU backend optimisation level 0 to halve compile time (the
comparison tolerance is for reduction order).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import configs
from k3jax.layers import params
from k3jax.layers.params import RouterBias
from k3jax.model import K3Model
from k3jax.training.step import make_sharded_train_step
from sharding.mesh import make_mesh
from sharding.shard import shard_batch
from tests.helpers import make_sharded_loss_and_grad, next_token_loss_fn, shard_model

# Each mesh compiles the whole tiny model (~20 s on 2 CPU cores): one in the default suite, the rest marked slow.
MESHES = [
    (2, 4, 1, 1),
    pytest.param((1, 2, 2, 2), marks=pytest.mark.slow),
    pytest.param((8, 1, 1, 1), marks=pytest.mark.slow),
    pytest.param((2, 1, 4, 1), marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 8), marks=pytest.mark.slow),
]
BATCH, SEQ = 8, 32  # batch divisible by data * expert on every test mesh


# The KDA token recurrence (the reference core, same math as the chunked default) compiles in about half the time
# of the chunked form; the chunked path was checked on all five meshes by hand (same tolerance, worst gradient error
# 2.6e-5 of the tensor's max) but five compiles of it do not fit the CI budget.
TINY_OVERRIDES = ["kda_impl=recurrent"]


def build_tiny():
    """`tiny` (f32) with routing pinned by a well-separated selection bias, so rounding-order differences between
    meshes cannot flip a top-k choice and the comparison measures arithmetic only."""
    model = K3Model(configs.get_config("tiny", TINY_OVERRIDES), rngs=nnx.Rngs(0))
    biases = nnx.state(model, RouterBias)
    nnx.update(model, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape), biases))
    return model


@pytest.fixture(scope="module")
def ids():
    cfg = configs.get_config("tiny")
    return np.random.RandomState(0).randint(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(ids):
    """Loss and gradients on one device."""
    model = build_tiny()
    mesh = make_mesh(devices=jax.devices()[:1])
    shard_model(model, mesh)
    loss, grads = make_sharded_loss_and_grad(model, mesh)(model, shard_batch(ids, mesh))
    return float(loss), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else None)
def test_loss_and_grads_match_single_device(shape, ids, reference):
    ref_loss, ref_grads = reference
    mesh = make_mesh(*shape)
    model = build_tiny()
    plan = shard_model(model, mesh)

    # The parameters are placed as planned, and on a mesh with more than one way some really are split.
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    n_split = 0
    for key, var in params.items():
        path = ".".join(map(str, key))
        arr = var.get_value()
        assert arr.sharding.spec == plan.specs[path], path
        assert arr.sharding.mesh.shape == mesh.shape
        n_split += arr.sharding.shard_shape(arr.shape) != arr.shape
    assert n_split > 0, "no parameter is split on this mesh"

    loss, grads = make_sharded_loss_and_grad(model, mesh)(model, shard_batch(ids, mesh))
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (float(loss), ref_loss)
    flat = dict(nnx.to_flat_state(grads))
    assert flat.keys() == ref_grads.keys()
    for key, var in flat.items():
        got, want = var.get_value(), ref_grads[key]
        path = ".".join(map(str, key))
        assert got.sharding.spec == plan.specs[path], f"gradient of {path} left its parameter's sharding"
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=2e-4 * scale, err_msg=path)


def test_tensor_parallel_weights_are_split_over_model():
    mesh = make_mesh(model=8)
    model = build_tiny()
    shard_model(model, mesh)
    embed = model.embed_tokens.get_value()  # [vocab 384, embed 64]: vocab over 'model'
    assert embed.sharding.spec[0] == "model"
    assert embed.sharding.shard_shape(embed.shape) == (48, 64)
    assert {s.data.shape for s in embed.addressable_shards} == {(48, 64)} and len(embed.addressable_shards) == 8
    w1 = model.groups[1].layers[0].mlp.w1.get_value()  # [experts 8, latent 32, expert_mlp 32]
    assert w1.sharding.spec[2] == "model" and w1.sharding.shard_shape(w1.shape) == (8, 32, 4)


class ToyLM(nnx.Module):
    """A two-matrix language model with the same logical axes as K3's embedding/MLP/head: the train step's
    mechanics (sharded state in and out, donation, optimizer state placement) without K3's compile cost."""

    def __init__(self, rngs):
        self.embed_tokens = params.normal(rngs, (64, 16), ("vocab", "embed"), jnp.float32, std=1.0)
        self.up = params.normal(rngs, (16, 32), ("embed", "mlp"), jnp.float32)
        self.lm_head = params.normal(rngs, (32, 64), ("mlp", "vocab"), jnp.float32)

    def __call__(self, ids_bt):
        h = jnp.tanh(jnp.take(self.embed_tokens[...], ids_bt, axis=0) @ self.up[...])
        return h @ self.lm_head[...]


def _toy_step_on(mesh, batch, steps=2):
    model = ToyLM(nnx.Rngs(0))
    shard_model(model, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = make_sharded_train_step(model, optimizer, mesh, next_token_loss_fn)
    losses = [float(step(model, optimizer, shard_batch(batch, mesh))) for _ in range(steps)]
    return model, optimizer, step, losses


def test_sharded_train_step_matches_single_device_and_keeps_shardings():
    batch = np.random.RandomState(1).randint(0, 64, (8, 9)).astype(np.int32)
    ref_model, _, _, ref_losses = _toy_step_on(make_mesh(devices=jax.devices()[:1]), batch)
    mesh = make_mesh(data=2, expert=2, model=2)
    model, optimizer, step, losses = _toy_step_on(mesh, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert step.plan.specs["0.embed_tokens"] == P("model", ("data", "context", "expert"))
    ref = dict(nnx.to_flat_state(nnx.state(ref_model, nnx.Param)))
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        arr = var.get_value()
        assert arr.sharding.spec == step.plan.specs["0." + ".".join(map(str, key))]
        np.testing.assert_allclose(np.asarray(arr), np.asarray(ref[key].get_value()), rtol=1e-5, atol=1e-6)
    # AdamW moments live where their parameters do; the step count is replicated.
    for key, var in nnx.to_flat_state(nnx.state(optimizer)):
        path = ".".join(map(str, key))
        arr = var.get_value()
        assert arr.sharding.spec == step.plan.specs["1." + path], path
        if path.endswith("mu.up") or path.endswith("nu.up"):
            assert arr.sharding.spec == P(("data", "context", "expert"), "model")
    # A host (numpy) batch is resharded by jit's in_shardings; a batch the mesh cannot split is a clear error.
    assert math.isfinite(float(step(model, optimizer, batch)))
    with pytest.raises(ValueError, match="not divisible by data\\*expert = 4"):
        shard_batch(batch[:6], mesh)


def test_a_step_compiled_ahead_on_abstract_state_runs_the_real_state_without_tracing_again():
    """`TracedUnderMesh.compile_ahead` on an abstract build + `adopt` by the real step: the same losses as the step
    that compiles on first call, the real jit never traced; a batch of other shapes (or a host array) still runs."""
    batch = np.random.RandomState(1).randint(0, 64, (8, 9)).astype(np.int32)
    mesh = make_mesh(data=2, expert=2, model=2)
    _, _, _, want = _toy_step_on(mesh, batch, steps=3)

    def make():
        model = ToyLM(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    abstract_model, abstract_opt = nnx.eval_shape(make)
    ahead = make_sharded_train_step(abstract_model, abstract_opt, mesh, next_token_loss_fn)
    ahead.jitted.compile_ahead(nnx.state((abstract_model, abstract_opt)), jax.ShapeDtypeStruct((8, 9), jnp.int32))
    model, optimizer = make()
    shard_model(model, mesh)
    step = make_sharded_train_step(model, optimizer, mesh, next_token_loss_fn)
    step.jitted.adopt(ahead.jitted)
    got = [float(step(model, optimizer, shard_batch(batch, mesh))) for _ in range(2)]
    got.append(float(step(model, optimizer, batch)))  # a host array of the compiled shapes
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert step.jitted._cache_size() == 0
    assert math.isfinite(float(step(model, optimizer, shard_batch(batch[:, :5], mesh))))
    assert step.jitted._cache_size() == 1
