"""`tie_gradients` (k3jax/layers/grad_order.py): an identity whose backward makes the first cotangent (a layer's
input gradient) depend on the others (the layer's weight gradients), so a scheduler cannot defer the weight
gradients past the input gradient. Values and gradients are unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import get_config
from k3jax.layers.grad_order import tie_gradients
from k3jax.training.trainer import Trainable, loss_fn


def _f(x, w, *, tie):
    if tie:
        x, w = tie_gradients((x, w))
    return jnp.sum(jnp.tanh(x @ w)) + jnp.sum(jnp.sqrt(w * w + 1.0))


def test_tie_gradients_keeps_values_and_gradients_bitwise():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    plain = jax.jit(jax.value_and_grad(lambda x, w: _f(x, w, tie=False), argnums=(0, 1)))(x, w)
    tied = jax.jit(jax.value_and_grad(lambda x, w: _f(x, w, tie=True), argnums=(0, 1)))(x, w)
    for a, b in zip(jax.tree.leaves(tied), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)


def test_input_gradient_takes_a_data_dependence_on_weight_gradients():
    # d/dw sqrt(w) is inf at w = 0: only a real data dependence carries it into x's gradient (0 * inf = NaN, at
    # x's first element alone); an optimization barrier by itself would leave dx finite
    def f(x, w, tie):
        if tie:
            x, w = tie_gradients((x, w))
        return jnp.sum(2.0 * x) + jnp.sum(jnp.sqrt(w))

    x, w = jnp.ones((3, 2)), jnp.zeros((4,))
    dx_plain = jax.grad(f)(x, w, False)
    dx_tied = jax.grad(f)(x, w, True)
    np.testing.assert_array_equal(dx_plain, 2.0)
    assert np.isnan(dx_tied[0, 0])
    np.testing.assert_array_equal(np.asarray(dx_tied).reshape(-1)[1:], 2.0)


def test_tie_gradients_passes_integer_leaves_single_leaf_trees_and_empty_arrays():
    ids = jnp.arange(3)
    x = jnp.ones((2,))
    assert tie_gradients((ids, x))[0] is ids
    assert tie_gradients(x) is x
    g = jax.grad(lambda x: jnp.sum(tie_gradients((ids, x))[1] ** 2))(x)
    np.testing.assert_array_equal(g, 2.0)
    empty = jnp.zeros((0, 3))  # Kimi-Linear's AttnRes bank: [0, B, T, D]
    g = jax.grad(lambda x, e: jnp.sum(tie_gradients((x, e))[0] ** 2) + jnp.sum(e), argnums=(0, 1))(x, empty)
    np.testing.assert_array_equal(g[0], 2.0)
    assert g[1].shape == (0, 3)


@pytest.mark.slow  # two whole-model gradient compiles
def test_tied_layer_gradients_equal_untied_on_the_whole_model():
    cfg = get_config("tiny").replace(remat_policy="layer")
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, axis=1), "loss_mask": jnp.ones((2, 12), bool)}
    out = []
    for tie in (False, True):
        graph, state = nnx.split(Trainable(cfg.replace(tie_layer_gradients=tie), mtp=False, rngs=nnx.Rngs(0)))
        out.append(jax.jit(jax.value_and_grad(lambda s: loss_fn(nnx.merge(graph, s), batch, 0.3)[0]))(state))
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[0][1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
