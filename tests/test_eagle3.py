"""EAGLE-3 draft: its features (AttnRes block outputs 1, 4 and the last) and W_E3 = [0 0 I] and its loss against
float64 NumPy references, the unrolled training form equal to the incremental serving form, training lowering the
loss, greedy speculative decoding with the trained draft equal to plain greedy, and save / load."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.eagle3 import DraftCheckpointError, Eagle3Layer, block_features, load_eagle3, save_eagle3
from k3jax.inference.eagle3_draft import Eagle3Draft
from k3jax.inference.engine import Engine
from k3jax.inference.speculative import SpeculativeEngine
from k3jax.layers.mla import contiguous_page_table, init_latent_pages
from k3jax.model import K3Model
from k3jax.training.draft import DraftOptions, DraftTrainer, data_iterator, new_draft, unrolled_loss
from tests.conftest import build_model, random_ids
from tests.reference import numpy_k3 as ref

# 5 layers (KDA x3, MLA x2), one AttnRes block per layer: blocks 1, 4 and 5 are three different block outputs; dense
# FFNs keep the compiles short (the draft never looks inside the target's FFNs)
SMALL = dict(num_hidden_layers=5, full_attn_layers=(4, 5), attn_res_block_size=1, first_k_dense_replace=5)
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4]]
K = 3


def small_cfg(*overrides):
    return configs.get_config("tiny", list(overrides)).replace(**SMALL)


def _softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_unrolled_loss_matches_float64_numpy_reference():
    rng = np.random.default_rng(0)
    b, t, v, steps = 2, 9, 11, 3
    target = rng.normal(size=(b, t, v)) * 2
    drafts = [rng.normal(size=(b, t, v)) * 2 for _ in range(steps)]
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
    terms, accept = [], {s: [] for s in range(1, steps + 1)}
    for s in range(1, steps + 1):  # chain p's step s predicts token p + s + 1: the target's row p + s
        for i in range(b):
            for p in range(t - s):
                if seg[i, p] > 0 and seg[i, p + s] == seg[i, p]:
                    a = np.minimum(_softmax64(target[i, p + s]), _softmax64(drafts[s - 1][i, p])).sum()
                    terms.append(-np.log(a))
                    accept[s].append(a)
    loss, metrics = unrolled_loss(jnp.asarray(target, jnp.float32), [jnp.asarray(d, jnp.float32) for d in drafts],
                                  jnp.asarray(seg, jnp.int32))
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)
    for s in range(1, steps + 1):
        np.testing.assert_allclose(float(metrics[f"accept_s{s}"]), np.mean(accept[s]), rtol=1e-5)


def test_identity_init_and_fusion_match_float64_numpy_reference(x64):
    cfg = small_cfg("param_dtype=float64", "dtype=float64")
    layer = Eagle3Layer(cfg, rngs=nnx.Rngs(1))
    assert layer.feature_blocks == (1, 4, 5)  # blocks 1, 4 and the last
    d = cfg.hidden_size
    w_ref = np.zeros((3 * d, d))
    w_ref[2 * d:] = np.eye(d)
    np.testing.assert_array_equal(np.asarray(layer.feature_proj[...]), w_ref)
    feats = np.random.default_rng(3).normal(size=(2, 5, 3 * d))
    np.testing.assert_array_equal(np.asarray(layer.fuse_features(jnp.asarray(feats))), feats[..., 2 * d:])
    w_rand = np.random.default_rng(4).normal(size=(3 * d, d))
    layer.feature_proj[...] = jnp.asarray(w_rand)
    np.testing.assert_allclose(np.asarray(layer.fuse_features(jnp.asarray(feats))), feats @ w_rand, rtol=1e-12,
                               atol=1e-12)


def test_features_are_block_outputs_1_4_and_last_of_numpy_reference(trained):
    target, weights, layer, _, _ = trained
    cfg = target.cfg
    ids = random_ids(cfg, 2, 11)
    gd, st = nnx.split(target)
    h, blocks = jax.jit(lambda st, i: nnx.merge(gd, st).hidden_states_and_blocks(i))(st, jnp.asarray(ids))
    logits_ref, blocks_ref = ref.forward(weights, cfg, ids, return_blocks=True)  # float64; blocks [B, N, T, D]
    assert blocks_ref.shape[1] == 5
    np.testing.assert_allclose(np.asarray(target.logits(h)), logits_ref, rtol=0,
                               atol=1e-4 * np.abs(logits_ref).max())  # the forward around the blocks unchanged
    feats_ref = np.concatenate([blocks_ref[:, 0], blocks_ref[:, 3], blocks_ref[:, 4]], axis=-1)
    np.testing.assert_allclose(np.asarray(block_features(blocks, layer.feature_blocks)), feats_ref, rtol=0,
                               atol=1e-4 * np.abs(feats_ref).max())


def test_unrolled_training_form_equals_incremental_chain():
    """Chain p's step s in `unrolled` equals serving's: the cached layer over positions 0..p with real features,
    then s - 1 single-token steps each fed the previous output (rows past p rewritten by the chain)."""
    cfg = small_cfg()
    layer = Eagle3Layer(cfg, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(1)
    b, t, steps, d = 2, 8, 4, cfg.hidden_size
    g = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    table_vd = jnp.asarray(rng.normal(size=(40, d)), jnp.float32)
    ids = rng.integers(0, 40, size=(b, t + steps))
    embeds = [table_vd[ids[:, s:s + t]] for s in range(1, steps + 1)]  # embeds[s-1][:, p] = Emb(t_{p+s})
    outs = np.asarray(jnp.stack(nnx.jit(lambda m, g, e: m.unrolled(g, e))(layer, g, embeds)))

    page_size, per_seq = 4, 4
    pages = init_latent_pages(cfg, b * per_seq, page_size)
    table = contiguous_page_table(b, per_seq)
    run = nnx.jit(lambda m, g, e, pages, start, valid: m.forward_cached(g, e, pages, table, start, valid))
    o_all, observed = run(layer, g, embeds[0], pages, jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32))
    np.testing.assert_allclose(np.asarray(o_all), outs[0], rtol=0, atol=2e-5)  # step 1: every position
    for p in range(t - 1):
        o_b1d, pages_p = o_all[:, p:p + 1], observed
        for s in range(2, steps + 1):
            o_b1d, pages_p = run(layer, o_b1d, table_vd[ids[:, p + s]][:, None], pages_p,
                                 jnp.full((b,), p + s - 1, jnp.int32), jnp.ones((b,), jnp.int32))
            np.testing.assert_allclose(np.asarray(o_b1d[:, 0]), outs[s - 1][:, p], rtol=0, atol=2e-5,
                                       err_msg=f"chain {p} step {s}")


@pytest.fixture(scope="module")
def trained():
    """A random small target (the NumPy reference's weights), a draft trained 12 steps on the embedded corpus, and
    the held-out metrics of the untrained and the trained draft."""
    cfg = small_cfg()
    target, weights = build_model(cfg)
    opts = DraftOptions(steps=12, batch_size=2, seq_len=32, learning_rate=3e-3, warmup_steps=2, unroll_steps=3)
    assert DraftOptions().unroll_steps == 7  # the default (EAGLE-3); 3 here keeps the compile short
    trainer = DraftTrainer(target, new_draft(cfg, opts), opts)
    held_out = data_iterator(cfg, None, opts, split="heldout")
    eval_batch = next(held_out)
    held_out.close()
    before = trainer.evaluate(eval_batch)
    batches = data_iterator(cfg, None, opts)
    for _ in range(opts.steps):
        trainer.step(next(batches))
    batches.close()
    return target, weights, trainer.layer, before, trainer.evaluate(eval_batch)


def test_training_lowers_draft_loss_and_raises_acceptance(trained):
    *_, before, after = trained
    assert after["loss"] < before["loss"] - 0.02, (before["loss"], after["loss"])
    assert after["accept_s1"] > before["accept_s1"] + 0.01
    assert after["accept_s3"] > before["accept_s3"]  # the chained steps improve too


@pytest.mark.slow  # ~50 s on 2 cores; the scheduler tests check speculative == plain with host and random drafts
def test_greedy_speculative_with_trained_eagle3_equals_plain(trained):
    target, _, layer, _, _ = trained
    want = [r.tokens for r in Engine(target, max_len=64).generate(PROMPTS, [20, 9, 14], eos_id=-1)]
    engine = SpeculativeEngine(target, Eagle3Draft(layer, K), max_len=64)
    got = engine.generate(PROMPTS, [20, 9, 14], eos_id=-1)
    assert [r.tokens for r in got] == want
    stats = engine.last_stats
    assert stats["steps"] >= 3 and 0 <= stats["acceptance_rate"] <= 1


def test_save_load_roundtrip_and_errors(trained, tmp_path):
    target, _, layer, _, _ = trained
    path = save_eagle3(layer, str(tmp_path / "draft"), info={"note": "test"})
    with pytest.raises(FileExistsError):
        save_eagle3(layer, path)
    loaded = load_eagle3(path, target.cfg)
    assert loaded.feature_blocks == layer.feature_blocks
    for (_, a), (_, b_) in zip(nnx.to_flat_state(nnx.state(layer)), nnx.to_flat_state(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b_.get_value()))
    with pytest.raises(DraftCheckpointError, match="another target architecture.*hidden_size"):
        load_eagle3(path, target.cfg.replace(hidden_size=128))
    with pytest.raises(DraftCheckpointError, match="not an EAGLE-3 draft"):
        load_eagle3(str(tmp_path), target.cfg)


@pytest.mark.slow
def test_draft_entry_point_trains_and_saves(tmp_path):
    from k3jax.loading import save_checkpoint

    cfg = small_cfg()
    ckpt = save_checkpoint(K3Model(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "target"))
    cmd = [sys.executable, "-m", "k3jax.training.draft", f"--init_from={ckpt}", f"--out={tmp_path / 'draft'}",
           "--steps=2", "--batch_size=2", "--seq_len=32", "--unroll_steps=2", "--log_every=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved the draft (step 2)" in done.stdout
    assert load_eagle3(str(tmp_path / "draft"), cfg).feature_blocks == (1, 4, 5)
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)  # --out exists, no --overwrite
    assert again.returncode == 2 and "error:" in again.stderr and "already exists" in again.stderr
