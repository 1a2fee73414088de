"""`causal_attention(impl="flash")` (k3jax/ops/flash_attention.py): forward and q/k/v gradients equal a float64
NumPy reference (causal, packed documents crossing block boundaries, T not a multiple of the block, q/k head dim
unlike v's, f32 and bf16 operands); the tiny model's loss and gradients equal the XLA core's; and the compiled
forward+backward holds no T x T array."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.config import ConfigError
from k3jax.model import K3Model
from k3jax.ops.attention import causal_attention

DK, DV = 24, 16


def _attention_f64(q, k, v, seg, scale):
    """Float64 dense reference: output and the vjp for a cotangent g, written from the softmax definition."""
    b, t, h, _ = q.shape
    s = np.einsum("bqhk,bshk->bhqs", q, k) * scale
    mask = np.tril(np.ones((t, t), bool))[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqs,bshv->bqhv", p, v)

    def vjp(g):
        dp = np.einsum("bqhv,bshv->bhqs", g, v)
        dv = np.einsum("bhqs,bqhv->bshv", p, g)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
        return np.einsum("bhqs,bshk->bqhk", ds, k), np.einsum("bhqs,bqhk->bshk", ds, q), dv

    return out, vjp


def _segments(rng, b, t, docs):
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        bounds = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
        seg[r] = 1 + np.searchsorted(bounds, np.arange(t), side="right")
    return seg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("t,block_q,block_k", [(37, 8, 8), (40, 16, 8), (29, 64, 64)])
def test_flash_forward_and_gradients_equal_the_float64_reference(dtype, packed, t, block_q, block_k):
    """T = 37 with 8-blocks (T padded to 40), 16 x 8 blocks, one block larger than T; 4 documents per row at random
    boundaries (crossing blocks). bf16: the reference runs on the bf16-rounded inputs; tolerance allows the
    probabilities' rounding to bf16 before their matmuls."""
    rng = np.random.default_rng(t + block_q)
    b, h, scale = 2, 3, DK ** -0.5
    dt = jnp.dtype(dtype)
    q, k = (jnp.asarray(rng.normal(size=(b, t, h, DK)), dt) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, t, h, DV)), dt)
    seg = _segments(rng, b, t, 4) if packed else np.ones((b, t), np.int32)
    g = rng.normal(size=(b, t, h, DV))

    def flash(q, k, v):
        return causal_attention(q, k, v, scale=scale, impl="flash", block_q=block_q, block_k=block_k,
                                segment_ids_bt=jnp.asarray(seg) if packed else None)

    out, vjp = jax.vjp(jax.jit(flash), q, k, v)
    assert out.dtype == jnp.float32 and out.shape == (b, t, h, DV)
    grads = vjp(jnp.asarray(g, jnp.float32))
    want, want_vjp = _attention_f64(*(np.asarray(x, np.float64) for x in (q, k, v)), seg, scale)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out), want, rtol=tol, atol=tol)
    for name, got, ref in zip("qkv", grads, want_vjp(g)):
        assert got.dtype == dt, name
        scale_ref = np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol * scale_ref,
                                   err_msg=f"d{name}")


def test_flash_equals_the_xla_core_in_float64_with_a_one_token_document():
    """float64 operands: flash and the dense XLA core agree to 1e-12, including a document of one token that
    starts a block and a row whose first block is all one document."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        b, t, h = 2, 24, 2
        q, k = (jnp.asarray(rng.normal(size=(b, t, h, DK))) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(b, t, h, DV)))
        seg = jnp.asarray(np.array([[1] * 8 + [2] + [3] * 15, [4] * 13 + [5] * 11], np.int32))
        w = jnp.asarray(rng.normal(size=(b, t, h, DV)))

        def loss(impl, q, k, v):
            return jnp.sum(causal_attention(q, k, v, scale=0.3, impl=impl, segment_ids_bt=seg, block_q=8,
                                            block_k=8) * w)

        got = jax.value_and_grad(lambda *a: loss("flash", *a), argnums=(0, 1, 2))(q, k, v)
        want = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
        for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-12, atol=1e-12)


def _max_array_elements(impl, t, block):
    q = jax.ShapeDtypeStruct((1, t, 1, DK), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, t, 1, DV), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, seg):
        out = causal_attention(q, k, v, scale=0.2, impl=impl, segment_ids_bt=seg, block_q=block, block_k=block)
        return jnp.sum(out)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, v, seg).compile().as_text()
    dims = re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([0-9,]*)\]", text)
    return max(int(np.prod([int(d) for d in s.split(",") if d])) for s in dims)


def test_flash_forward_and_backward_hold_no_t_by_t_array():
    """T = 2048, blocks of 256: the compiled gradient program's largest array is far below T² elements (a tile
    is 256² = T²/64); the XLA core's is at least T², so the check can tell them apart."""
    t = 2048
    assert _max_array_elements("flash", t, 256) <= t * t // 16
    assert _max_array_elements("xla", t, 256) >= t * t


def _tiny_loss_and_grads(impl):
    cfg = configs.get_config("tiny", [f"mla_attention_impl={impl}", "mla_flash_block=8", "num_hidden_layers=1",
                                      "full_attn_layers=1"])
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 29)), jnp.int32)
    seg = jnp.asarray(np.array([[1] * 11 + [2] * 18, [3] * 29], np.int32))

    def loss_fn(m):
        logp = jax.nn.log_softmax(m(ids[:, :-1], seg[:, :-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
    return float(loss), jax.tree.map(np.asarray, nnx.state(grads, nnx.Param))


def test_tiny_model_loss_and_gradients_with_flash_equal_the_xla_core():
    """`tiny` (f32) cut to its MLA layer (one compile of seconds) on packed rows of T = 28 with 8-token blocks:
    loss and every parameter gradient agree."""
    loss_f, grads_f = _tiny_loss_and_grads("flash")
    loss_x, grads_x = _tiny_loss_and_grads("xla")
    np.testing.assert_allclose(loss_f, loss_x, rtol=1e-5)
    flat_f, flat_x = jax.tree.leaves_with_path(grads_f), jax.tree.leaves(grads_x)
    assert len(flat_f) == len(flat_x) > 0
    for (path, a), r in zip(flat_f, flat_x):
        np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-5 * (np.abs(r).max() + 1e-30),
                                   err_msg=jax.tree_util.keystr(path))


def test_config_takes_flash_and_rejects_a_nonpositive_block():
    cfg = configs.get_config("tiny", ["mla_attention_impl=flash", "mla_flash_block=256"])
    assert (cfg.runtime.mla_attention_impl, cfg.runtime.mla_flash_block) == ("flash", 256)
    with pytest.raises(ConfigError, match="mla_flash_block must be > 0"):
        configs.get_config("tiny", ["mla_flash_block=0"])
    with pytest.raises(ConfigError, match="mla_attention_impl"):
        configs.get_config("tiny", ["mla_attention_impl=splash"])
