"""Batch-1 decode matmuls stay matmuls: `k3jax.ops.linear.unless_single_row` pads a one-row operand to two rows
(XLA otherwise rewrites the product as a multiply over a materialised [K, N] array plus a reduction, which made
k3_gpu decode at B = 1 slower than at B = 16 on an H200), and the real row's result is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from k3jax.layers import moe
from k3jax.layers.mla import MLA
from k3jax.ops.linear import project
from tests.conftest import jaxpr_eqns


def _dot_rows(fn, *args):
    """For every dot_general in fn's jaxpr (nested ones included), the smaller of its two operands' free sizes
    (product of the axes neither contracted nor batched): 1 means a matrix-vector product."""
    rows = []
    for eqn in jaxpr_eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "dot_general":
            (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
            free = [int(np.prod([s for i, s in enumerate(v.aval.shape) if i not in c + b]))
                    for v, c, b in ((eqn.invars[0], contract_l, batch_l), (eqn.invars[1], contract_r, batch_r))]
            rows.append(min(free))
    return rows


def test_one_row_projection_is_a_two_row_matmul_with_the_float64_result():
    cfg = configs.get_config("tiny")
    rng = np.random.default_rng(0)
    for x_shape, w_shape, contract, spec in [((1, 1, 64), (64, 4, 8), 1, "btd,dhk->bthk"),
                                             ((1, 1, 4, 8), (4, 8, 64), 2, "bthk,hkd->btd")]:
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        got = project(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), cfg, contract=contract)
        np.testing.assert_allclose(np.asarray(got, np.float64), np.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
        assert _dot_rows(lambda a, b: project(a, b, cfg, contract=contract), x.astype(np.float32),
                             w.astype(np.float32)) == [2]


def test_the_compiled_one_row_projection_keeps_a_two_row_dot():
    """Past the jaxpr: XLA's own simplifier (here the CPU compiler) does not fold the zero row away."""
    cfg = configs.get_config("tiny")
    x, w = jnp.ones((1, 1, 64), jnp.float32), jnp.ones((64, 48), jnp.float32)
    hlo = jax.jit(lambda a, b: project(a, b, cfg)).lower(x, w).compile().as_text()
    assert "f32[2,48]" in hlo and "dot(" in hlo


def test_mla_absorbed_einsums_of_one_token_equal_its_row_in_a_batch():
    cfg = configs.get_config("tiny")
    mla = MLA(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((3, 1, cfg.num_attention_heads, cfg.qk_head_dim)), jnp.float32)
    o = jnp.asarray(rng.standard_normal((3, 1, cfg.num_attention_heads, cfg.kv_lora_rank)), jnp.float32)
    for fn, x in ((mla._absorbed_queries, q), (mla._latent_values, o)):
        np.testing.assert_allclose(np.asarray(fn(x[1:2])), np.asarray(fn(x)[1:2]), rtol=1e-5, atol=1e-6)
        assert set(_dot_rows(fn, x[1:2])) == {2}


def test_more_rows_are_left_alone():
    cfg = configs.get_config("tiny")
    x, w = jnp.ones((3, 1, 64)), jnp.ones((64, 16))
    assert _dot_rows(lambda a, b: project(a, b, cfg), x, w) == [3]


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
    assert _dot_rows(lambda a: moe.route(a, router, bias, cfg), x[2:3]) == [2]
