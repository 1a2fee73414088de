"""Gradient accumulation: N micro-batches in one step give the loss, gradients, parameter update and Quantile
Balancing bias update of one batch N times larger (up to f32 summation order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.layers.moe import LatentMoE
from k3jax.layers.params import RouterBias, RoutingStats
from k3jax.training.accumulate import accumulated_value_and_grad, split_micro_batches
from k3jax.training.balancing import apply_quantile_balancing
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option


def _batch(rng, b, t, vocab):
    ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    seg[:, t // 2:] = 2  # two documents per row
    mask = np.ones((b, t), np.float32)
    mask[1, -5:] = 0  # rows differ in token count: the loss must be normalised by the whole batch
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": seg, "loss_mask": mask}


def _one_step(cfg, grad_accum, batch, mesh_text):
    opts = TrainOptions(steps=10, batch_size=batch["input_ids"].shape[0], seq_len=batch["input_ids"].shape[1],
                        mesh=mesh_text, grad_accum=grad_accum)
    trainable, optimizer, step, _ = build(cfg, opts, make_mesh_from_option(mesh_text))
    loss, metrics = step(trainable, optimizer, batch)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainable, nnx.Param)))
    stats = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainable, RoutingStats)))
    bias = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainable, RouterBias)))
    return float(loss), jax.tree.map(np.asarray, metrics), params, stats, bias


def test_split_micro_batches_interleaves_rows():
    x = np.arange(8)[:, None] * np.ones((1, 3), int)
    got = np.asarray(split_micro_batches(x, 2))
    assert got.shape == (2, 4, 3)
    np.testing.assert_array_equal(got[0, :, 0], [0, 2, 4, 6])
    np.testing.assert_array_equal(got[1, :, 0], [1, 3, 5, 7])
    with pytest.raises(ValueError, match="grad_accum=3 must divide the batch size"):
        split_micro_batches(x, 3)


class _MoEOnly(nnx.Module):
    """Embedding -> the latent MoE layer (recording routing statistics) -> tied logits: a small differentiable
    model with the routing state gradient accumulation must sum."""

    def __init__(self, cfg, rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.moe = LatentMoE(cfg, rngs=rngs)

    def __call__(self, ids_bt):
        h = self.embed(ids_bt)
        return self.embed.attend(h + self.moe(h))


def _moe_loss(model, batch):
    logits = model(batch["input_ids"]).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    loss = (nll * batch["loss_mask"]).sum() / batch["lm_tokens"]
    return loss, {"nll_sum": (nll * batch["loss_mask"]).sum()}


@pytest.mark.parametrize("n", [2, 4])
def test_accumulated_gradients_routing_stats_and_balancing_equal_the_whole_batch(n):
    """`accumulated_value_and_grad` over n micro-batches == one `nnx.value_and_grad` over the whole batch: loss,
    metrics, every gradient, the summed margin histogram / expert loads, and the Quantile Balancing bias from it."""
    cfg = configs.get_config("tiny", ["record_routing_stats=true"])
    rng = np.random.default_rng(1)
    b, t = 8, 16
    batch = {"input_ids": rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32),
             "loss_mask": (rng.random((b, t)) > 0.2).astype(np.float32)}
    batch["lm_tokens"] = np.float32(batch["loss_mask"].sum())

    def run(accum):
        model = _MoEOnly(cfg, nnx.Rngs(0))

        @nnx.jit
        def go(model, batch):
            tokens = batch.pop("lm_tokens")
            fn = lambda m, mb: _moe_loss(m, {**mb, "lm_tokens": tokens})  # noqa: E731
            out, grads = accumulated_value_and_grad(fn, model, batch, accum, has_aux=True)
            apply_quantile_balancing(model)
            return out, grads

        out, grads = go(model, dict(batch))
        return (jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)),
                jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, RoutingStats))),
                np.asarray(model.moe.router_bias[...]))

    (loss1, aux1), g1, s1, b1 = run(1)
    (loss_n, aux_n), g_n, s_n, b_n = run(n)
    np.testing.assert_allclose(loss_n, loss1, rtol=1e-5)
    np.testing.assert_allclose(aux_n["nll_sum"], aux1["nll_sum"], rtol=1e-5)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-7), g_n, g1)
    jax.tree.map(np.testing.assert_array_equal, s_n, s1)  # integer counts and token loads: exactly the same
    assert s1["moe"]["margin_counts"].sum() > 0
    np.testing.assert_allclose(b_n, b1, rtol=1e-5, atol=1e-6)
    assert np.abs(b1).max() > 0


@pytest.mark.slow
def test_two_micro_batches_equal_one_batch_twice_as_large():
    """Muon + MTP + Quantile Balancing on a data-parallel mesh: loss, gradient norm, every updated parameter, the
    router biases (set from the summed margin histogram) and the recorded routing statistics agree."""
    cfg = configs.get_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])
    batch = _batch(np.random.default_rng(0), 4, 32, cfg.vocab_size)
    loss1, m1, p1, s1, b1 = _one_step(cfg, 1, batch, "2,1,1,1")
    loss2, m2, p2, s2, b2 = _one_step(cfg, 2, batch, "2,1,1,1")
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    for key in ("lm_loss", "mtp_loss", "grad_norm"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-4, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p2, p1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), s2, s1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), b2, b1)
    assert any(np.abs(b).max() > 0 for b in jax.tree.leaves(b1))  # Quantile Balancing did move the biases
