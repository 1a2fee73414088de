"""Remat policies (`runtime.remat_policy`) change what the backward recomputes, not the values: loss and gradients
of the training loss equal those of the default policy (f32, `tiny`: scanned units and unscanned layers) to f32
rounding (XLA fuses the recomputed graphs differently, so the last bits may differ)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import get_config
from k3jax.training.trainer import Trainable, loss_fn


def _loss_and_grads(cfg, batch):
    graph, state = nnx.split(Trainable(cfg, mtp=False, rngs=nnx.Rngs(0)))  # same seed: same parameters
    return jax.jit(jax.value_and_grad(lambda s: loss_fn(nnx.merge(graph, s), batch, 0.3)[0]))(state)


@pytest.mark.slow  # two whole-model gradient compiles (~2 min on 2 cores)
@pytest.mark.parametrize("policy", ["layer", "dots"])
def test_remat_policy_keeps_loss_and_gradients(policy):
    cfg = get_config("tiny")
    assert {g.num_repeats > 1 for g in cfg.layer_groups()} == {True, False}
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, axis=1), "loss_mask": jnp.ones((2, 12), bool)}
    loss0, g0 = _loss_and_grads(cfg, batch)
    loss1, g1 = _loss_and_grads(cfg.replace(remat_policy=policy), batch)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        # f32 rounding of a differently fused recompute, measured against the leaf's own scale (a wrong recompute
        # moves gradients by O(1) of that scale; the last-bit differences seen are ~1e-5 of it).
        scale = float(np.max(np.abs(np.asarray(b)))) or 1.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5 * scale)
