"""The scanned units' backward rebuilds each unit's AttnRes bank instead of saving it (`k3jax/model.py`,
`scan_units_rebuilding_bank`): the gradients equal plain autodiff of the scan, and the saved residuals hold the
residual stream per unit but the bank only twice."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from configs import get_config
from k3jax.model import ScannedUnits


def _units_and_inputs(remat: bool):
    cfg = get_config("tiny").replace(remat=remat)
    (group,) = [g for g in cfg.layer_groups() if g.num_repeats > 1]
    units = ScannedUnits(cfg, group, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    b, t, n = 2, 12, cfg.num_attn_res_snapshots
    h = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
    # rows already filled before the group keep values, the rest are zero (as the stack leaves them)
    bank = jnp.asarray(rng.standard_normal((n, b, t, cfg.hidden_size)), jnp.float32)
    bank = bank * (jnp.arange(n) < group.start // cfg.attn_res_block_size)[:, None, None, None]
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12], jnp.int32)
    return units, (h, bank), seg, group


def _loss(units, carry, seg):
    graphdef, weights, rest = nnx.split(units, nnx.Param, ...)

    def loss(weights, carry):
        h, bank = nnx.merge(graphdef, weights, rest)(carry, seg)
        return jnp.sum(jnp.sin(h)) + jnp.sum(bank * jnp.arange(bank.shape[0])[:, None, None, None])

    return loss, weights


@pytest.mark.slow  # two gradient compiles of the scanned group (~40 s idle on 2 cores); fast sibling below
def test_scanned_units_gradients_with_a_rebuilt_bank_equal_plain_autodiff():
    units, carry, seg, group = _units_and_inputs(remat=True)
    loss, weights = _loss(units, carry, seg)
    value, (dw, dcarry) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(weights, carry)
    plain_units, _, _, _ = _units_and_inputs(remat=False)
    plain_loss, plain_weights = _loss(plain_units, carry, seg)
    want, (want_dw, want_dcarry) = jax.jit(jax.value_and_grad(plain_loss, argnums=(0, 1)))(plain_weights, carry)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    pairs = list(zip(jax.tree.leaves((dw, dcarry)), jax.tree.leaves((want_dw, want_dcarry))))
    assert len(pairs) > 10
    for got, ref in pairs:
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * float(np.abs(ref).max() or 1.0))
    assert float(jnp.abs(dcarry[1]).max()) > 0  # the bank's cotangent reaches the group's input


def test_scanned_units_save_the_residual_stream_per_unit_but_the_bank_twice():
    units, carry, seg, group = _units_and_inputs(remat=True)
    loss, weights = _loss(units, carry, seg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, weights, carry)
    text = out.getvalue()
    n, b, t, d = carry[1].shape
    per_unit_bank = f"[{group.num_repeats},{n},{b},{t},{d}]"
    assert per_unit_bank not in text.replace(" ", ""), text
    assert f"[{group.num_repeats},{b},{t},{d}]" in text.replace(" ", ""), text
    assert text.replace(" ", "").count(f"[{n},{b},{t},{d}]") == 2, text


def test_train_step_with_per_layer_remat_traces_through_the_rebuilt_bank():
    """train.py's step (nnx.value_and_grad over the trainable parameters) under remat_policy=layer: the backward's
    unit recompute runs the layers' own remat regions, which write routing statistics into a unit merged inside
    the custom VJP (a regression: merging without a copy raised flax's TraceContextError)."""
    import dataclasses

    from k3jax.training.trainer import TrainOptions, build
    from sharding.mesh import make_mesh

    cfg = get_config("tiny", ["remat_policy=layer"])
    opts = dataclasses.replace(TrainOptions(), batch_size=2, seq_len=16)
    trainable, optimizer, step, _ = build(cfg, opts, make_mesh(devices=jax.devices()[:1]), abstract=True)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    batch = {"input_ids": tokens, "targets": tokens, "segment_ids": tokens,
             "loss_mask": jax.ShapeDtypeStruct((2, 16), jnp.float32)}
    text = step.jitted.lower(nnx.state((trainable, optimizer)), batch).as_text()
    assert "while" in text
