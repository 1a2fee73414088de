"""Incremental decoding caches: prefill + decode (token by token and in mixed chunks) equal the full forward pass;
right-padded batches equal their sequences alone; absorbed MLA decode equals the expanded form."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.params import RouterBias
from k3jax.model import K3Model, init_cache

TOL = dict(rtol=1e-4, atol=1e-4)


def fixed_routing(model):
    # Router scores at init are ~0.5 everywhere: pin top-k with a well-separated bias (it only selects) so the
    # comparison measures arithmetic, not routing flips on near-ties.
    biases = nnx.state(model, RouterBias)
    nnx.update(model, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape), biases))
    return model


@functools.lru_cache(maxsize=None)
def tiny_model(name: str) -> K3Model:
    """One model per config for all inference tests in a process (eager init of `tiny` takes seconds)."""
    return fixed_routing(K3Model(configs.get_config(name), rngs=nnx.Rngs(0)))


class Jitted:
    """The model's full forward and cached forward, jitted once per config (module-scoped). All tests use batch 3,
    cache capacity 16, full forwards of [3, 16] and chunks of 8 and 1 tokens, so each config compiles 3 times."""

    def __init__(self, name):
        self.cfg = configs.get_config(name)
        self.model = tiny_model(name)
        gd, state = nnx.split(self.model)
        self.state = state
        self.full = jax.jit(lambda st, ids: nnx.merge(gd, st)(ids))
        self.cached = jax.jit(lambda st, ids, cache, valid: nnx.merge(gd, st).forward_cached(ids, cache, valid))

    def step(self, ids, cache, valid=None):
        ids = jnp.asarray(ids, jnp.int32)
        if valid is None:
            valid = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32)
        return self.cached(self.state, ids, cache, jnp.asarray(valid, jnp.int32))


@pytest.fixture(scope="module", params=[pytest.param("tiny", marks=pytest.mark.slow), "tiny_kimi_linear"])
def jm(request):
    return Jitted(request.param)


def test_chunked_prefill_and_decode_match_full_forward(jm):
    """Mixed chunks 5, 3, 1, 1, 6 (multi-token chunks run through the T=8 bucket with a valid length, as the engine
    does) and token by token from an empty cache: logits equal the full forward pass."""
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 256, (3, 16)).astype(np.int32)
    full = np.asarray(jm.full(jm.state, jnp.asarray(ids)))
    for chunks in ([5, 3, 1, 1, 6], [1] * 16):
        cache, outs, pos = init_cache(jm.cfg, 3, 16), [], 0
        for c in chunks:
            t = 1 if c == 1 else 8
            chunk = np.full((3, t), 258, np.int32)
            chunk[:, :c] = ids[:, pos:pos + c]
            logits, cache = jm.step(chunk, cache, [c] * 3)
            outs.append(np.asarray(logits)[:, :c])
            pos += c
        np.testing.assert_allclose(np.concatenate(outs, axis=1), full, **TOL)
        np.testing.assert_array_equal(np.asarray(cache.lengths), [16, 16, 16])


def test_right_padded_batch_matches_each_sequence(jm):
    """Prompts of lengths 7, 3, 5 right-padded to 8 in one prefill, then 3 decode steps (one sequence paused for a
    step with valid length 0): every real position's logits equal the unpadded full forward of that sequence."""
    rng = np.random.RandomState(1)
    lens = [7, 3, 5]
    seqs = [rng.randint(0, 256, n + 3).astype(np.int32) for n in lens]
    ref_ids = np.full((3, 16), 258, np.int32)  # causal: tokens after a sequence cannot change its logits
    for i, s in enumerate(seqs):
        ref_ids[i, :len(s)] = s
    ref = np.asarray(jm.full(jm.state, jnp.asarray(ref_ids)))

    prompt = np.full((3, 8), 77, np.int32)  # pad with an arbitrary real token
    for i, n in enumerate(lens):
        prompt[i, :n] = seqs[i][:n]
    logits, cache = jm.step(prompt, init_cache(jm.cfg, 3, 16), lens)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits)[i, :n], ref[i, :n], **TOL)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)

    fed = list(lens)
    for step in range(3):
        active = np.array([1, int(step != 1), 1], np.int32)  # sequence 1 pauses at step 1
        tok = np.array([[seqs[i][fed[i]] if fed[i] < len(seqs[i]) else 0] for i in range(3)], np.int32)
        before = cache
        logits, cache = jm.step(tok, cache, active)
        for i in range(3):
            if active[i]:
                np.testing.assert_allclose(np.asarray(logits)[i, 0], ref[i, fed[i]], **TOL)
                fed[i] += 1
        # the paused sequence's caches are untouched (KDA states and MLA latent rows: with init_cache's default
        # layout and one page per sequence here, pool page b is sequence b's)
        for a, b in zip(jax.tree.leaves(before.layers), jax.tree.leaves(cache.layers)):
            batch_axis = 0 if a.shape[0] == 3 else 1
            same = np.array_equal(np.take(np.asarray(a), 1, batch_axis), np.take(np.asarray(b), 1, batch_axis))
            assert same == (not active[1])
    np.testing.assert_array_equal(np.asarray(cache.lengths), fed)


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_absorbed_mla_equals_expanded(name):
    cfg = configs.get_config(name)
    mla = MLA(cfg, rngs=nnx.Rngs(3))
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(2, 9, cfg.hidden_size), jnp.float32)
    full = np.asarray(mla(x))
    cache, table = mla.init_cache(2, 12)  # one 12-token page per sequence: page b holds sequence b
    y0, cache = mla.forward_cached(x[:, :6], cache, table, jnp.zeros((2,), jnp.int32))
    np.testing.assert_allclose(np.asarray(y0), full[:, :6], **TOL)
    start = jnp.full((2,), 6, jnp.int32)
    y_abs, c_abs = mla.forward_cached(x[:, 6:7], cache, table, start, absorb=True)
    y_exp, c_exp = mla.forward_cached(x[:, 6:7], cache, table, start, absorb=False)
    np.testing.assert_allclose(np.asarray(y_abs), np.asarray(y_exp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_abs), full[:, 6:7], **TOL)
    np.testing.assert_array_equal(np.asarray(c_abs), np.asarray(c_exp))
    # multi-token queries in the absorbed form too (e.g. speculative or chunked decode)
    y3 = mla.forward_cached(x[:, 6:9], cache, table, start, absorb=True)[0]
    np.testing.assert_allclose(np.asarray(y3), full[:, 6:9], **TOL)
    # the cache row is exactly [kv_a_layernorm(latent) | k_r]
    np.testing.assert_array_equal(np.asarray(c_abs)[:, :7], np.asarray(mla.latent(x[:, :7])))
    assert c_abs.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_kda_padding_is_a_no_op():
    """KDA.forward_cached on right-padded input: state and real outputs equal the unpadded `forward`."""
    cfg = configs.get_config("tiny", ["kda_impl=recurrent"])  # eager chunked is slow; the model tests cover it
    kda = KDA(cfg, rngs=nnx.Rngs(4))
    rng = np.random.RandomState(4)
    x = jnp.asarray(rng.randn(2, 10, cfg.hidden_size), jnp.float32)
    state0 = kda.forward(x[:, :4], kda.init_state(2))[1]
    lens = [3, 6]
    y, st = kda.forward_cached(x[:, 4:], state0, jnp.asarray(lens))
    for i, n in enumerate(lens):
        one = jax.tree.map(lambda a: a[i:i + 1], state0)
        y_ref, st_ref = kda.forward(x[i:i + 1, 4:4 + n], one)
        np.testing.assert_allclose(np.asarray(y)[i, :n], np.asarray(y_ref)[0], **TOL)
        for a, b in zip(st, st_ref):
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(b)[0], rtol=1e-5, atol=1e-6)
    y1, st1 = kda.forward_cached(x[:, 4:5], state0, jnp.asarray([0, 1]))  # decode: seq 0 frozen
    for a, b in zip(st1, state0):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
    y_ref, st_ref = kda.forward(x[1:2, 4:5], jax.tree.map(lambda a: a[1:2], state0))
    np.testing.assert_allclose(np.asarray(y1)[1], np.asarray(y_ref)[0], **TOL)


@pytest.mark.parametrize("t", [1, 3])
def test_conv_history_at_each_sequence_end_equals_the_last_inputs_before_it(t):
    """history_at (the KDA conv history after right-padded input) = the W-1 rows before end_b[b] of
    [history, x], by plain NumPy indexing; T = 1 (decode: a select) and T > 1 (a gather)."""
    from k3jax.layers.kda import history_at

    rng = np.random.default_rng(5)
    hist, x = rng.standard_normal((4, 3, 2)).astype(np.float32), rng.standard_normal((4, t, 2)).astype(np.float32)
    end = np.array([0, t, min(1, t), t // 2])
    got = np.asarray(history_at(jnp.asarray(hist), jnp.asarray(x), jnp.asarray(end)))
    padded = np.concatenate([hist, x], axis=1)
    for b in range(4):
        np.testing.assert_array_equal(got[b], padded[b, end[b]:end[b] + 3])
