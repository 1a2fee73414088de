"""Batch-1 decode matmuls stay matmuls: `k3jax.ops.linear.unless_single_row` pads a one-row operand to two rows
(XLA otherwise rewrites the product as a multiply over a materialised [K, N] array plus a reduction, which made
k3_gpu decode at B = 1 slower than at B = 16 on an H200), and the real row's result is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np

import configs
from k3jax.layers import moe
from k3jax.ops.linear import project


def _dot_lhs_rows(fn, *args):
    """The number of rows (product of the lhs free axes) of every dot_general in fn's jaxpr."""
    rows = []
    for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract_l, _), (batch_l, _) = eqn.params["dimension_numbers"]
            shape = eqn.invars[0].aval.shape
            rows.append(int(np.prod([s for i, s in enumerate(shape) if i not in contract_l + batch_l])))
    return rows


def test_one_row_projection_is_a_two_row_matmul_with_the_float64_result():
    cfg = configs.get_config("tiny")
    rng = np.random.default_rng(0)
    for x_shape, w_shape, contract, spec in [((1, 1, 64), (64, 4, 8), 1, "btd,dhk->bthk"),
                                             ((1, 1, 4, 8), (4, 8, 64), 2, "bthk,hkd->btd")]:
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        got = project(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), cfg, contract=contract)
        np.testing.assert_allclose(np.asarray(got, np.float64), np.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
        assert _dot_lhs_rows(lambda a, b: project(a, b, cfg, contract=contract), x.astype(np.float32),
                             w.astype(np.float32)) == [2]


def test_more_rows_are_left_alone():
    cfg = configs.get_config("tiny")
    x, w = jnp.ones((3, 1, 64)), jnp.ones((64, 16))
    assert _dot_lhs_rows(lambda a, b: project(a, b, cfg), x, w) == [3]


def test_one_token_routing_matches_the_routing_of_the_same_token_in_a_batch():
    cfg = configs.get_config("tiny")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.num_experts)) * 0.05, jnp.float32)
    bias = jnp.zeros((cfg.num_experts,), jnp.float32)
    w_all, e_all, s_all = moe.route(x, router, bias, cfg)
    w_one, e_one, s_one = moe.route(x[2:3], router, bias, cfg)
    np.testing.assert_array_equal(np.asarray(e_one), np.asarray(e_all[2:3]))
    np.testing.assert_allclose(np.asarray(s_one), np.asarray(s_all[2:3]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(w_one), np.asarray(w_all[2:3]), rtol=1e-6, atol=1e-7)
    assert _dot_lhs_rows(lambda a: moe.route(a, router, bias, cfg), x[2:3]) == [2]
