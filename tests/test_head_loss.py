"""The fused LM head + cross-entropy (k3jax/ops/head_loss.py: the saved-logits form, the training default, and the
vocabulary-chunked one) against a float64 NumPy reference and against the unfused head (f32 logits + softmax
cross-entropy), alone and inside the training loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import get_config
from k3jax.config import ConfigError
from k3jax.ops.head_loss import chunked_head_cross_entropy, head_cross_entropy
from k3jax.ops.linear import project_wide
from k3jax.training.trainer import Trainable, loss_fn


def _reference(h, w, targets, g):
    """float64: per-token losses, dL/dh and dL/dw of Σ g_n · loss_n."""
    h, w, g = (np.asarray(x, np.float64) for x in (h, w, g))
    logits = h @ w
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    loss = lse - logits[np.arange(len(targets)), targets]
    p = np.exp(logits - lse[:, None])
    p[np.arange(len(targets)), targets] -= 1.0
    dl = p * g[:, None]
    return loss, dl @ w.T, h.T @ dl


def _inputs(n=24, d=16, v=40, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(n, d)), dtype)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)
    return h, w, targets, g


@pytest.mark.parametrize("chunks", [1, 4, 40])
def test_chunked_head_loss_and_gradients_equal_a_float64_reference(chunks):
    h, w, targets, g = _inputs()
    loss, vjp = jax.vjp(lambda h, w: chunked_head_cross_entropy(h, w, targets, chunks=chunks), h, w)
    dh, dw = vjp(g)
    ref_loss, ref_dh, ref_dw = _reference(h, w, np.asarray(targets), g)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_saved_logits_head_loss_and_gradients_equal_a_float64_reference():
    h, w, targets, g = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(h, w, np.asarray(targets), g)
    for lead in ((24,), (4, 6)):  # [N] and [B, T] leading axes
        hx, tx, gx = h.reshape(lead + (16,)), targets.reshape(lead), g.reshape(lead)
        loss, vjp = jax.vjp(lambda h, w: head_cross_entropy(h, w, tx), hx, w)
        dh, dw = vjp(gx)
        np.testing.assert_allclose(np.ravel(loss), ref_loss, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.reshape(dh, (24, 16)), ref_dh, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_bf16_saved_logits_head_matches_the_unfused_head_with_its_rounding_points():
    """bf16 operands: same loss and gradients as f32 logits + softmax cross-entropy through `project_wide` (which
    rounds the logits' f32 cotangent to bf16 before its matmuls)."""
    h, w, targets, g = _inputs(n=64, d=32, v=96, dtype=jnp.bfloat16)

    def unfused(h, w):
        return optax.softmax_cross_entropy_with_integer_labels(project_wide(h, w).astype(jnp.float32), targets)

    loss, vjp = jax.vjp(lambda h, w: head_cross_entropy(h, w, targets), h, w)
    ref_loss, ref_vjp = jax.vjp(unfused, h, w)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_bf16_chunked_head_matches_the_unfused_head_with_its_rounding_points():
    """bf16 operands: both round the logits' cotangent to bf16 before the backward matmuls (`project_wide`)."""
    h, w, targets, g = _inputs(n=64, d=32, v=96, dtype=jnp.bfloat16)

    def unfused(h, w):
        return optax.softmax_cross_entropy_with_integer_labels(project_wide(h, w).astype(jnp.float32), targets)

    fused_loss, fused_vjp = jax.vjp(lambda h, w: chunked_head_cross_entropy(h, w, targets, chunks=8), h, w)
    ref_loss, ref_vjp = jax.vjp(unfused, h, w)
    np.testing.assert_allclose(fused_loss, ref_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(fused_vjp(g), ref_vjp(g)):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def _shapes_in(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _shapes_in(getattr(inner, "jaxpr", inner))


def test_chunked_head_gradient_never_builds_a_tokens_by_vocab_array():
    h, w, targets, g = _inputs(n=24, d=16, v=40)

    def loss(h, w, chunks):
        return (chunked_head_cross_entropy(h, w, targets, chunks=chunks) * g).sum()

    def full_shapes(chunks):
        jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: loss(h, w, chunks), argnums=(0, 1)))(h, w).jaxpr
        return [s for s in _shapes_in(jaxpr) if len(s) >= 2 and s[-2:] == (24, 40)]

    assert full_shapes(1), "the check must see the [N, V] array when there is one slice"
    assert full_shapes(4) == []


@pytest.mark.slow  # two whole-model gradient compiles (~2 min on 2 cores)
def test_fused_head_loss_in_the_training_loss_equals_the_unfused_one():
    cfg = get_config("tiny")
    fused = cfg.replace(loss_vocab_chunks=4)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, axis=1),
             "loss_mask": jnp.asarray(rng.uniform(size=(2, 16)) > 0.2),
             "segment_ids": jnp.asarray(np.repeat([[1] * 9 + [2] * 7], 2, axis=0), jnp.int32)}

    def run(model_cfg):
        graph, state = nnx.split(Trainable(model_cfg, mtp=True, rngs=nnx.Rngs(0)))  # same seed: same parameters
        return jax.jit(jax.value_and_grad(lambda s: loss_fn(nnx.merge(graph, s), batch, 0.3), has_aux=True))(state)

    (loss0, m0), g0 = run(cfg)
    (loss1, m1), g1 = run(fused)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    np.testing.assert_allclose(m1["mtp_loss"], m0["mtp_loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_loss_vocab_chunks_must_divide_the_vocabulary():
    with pytest.raises(ConfigError, match="loss_vocab_chunks=7 must divide vocab_size"):
        get_config("tiny", ["loss_vocab_chunks=7"])
