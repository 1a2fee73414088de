"""The fused one-token KDA decode kernel (``pallas_kernels.kda.decode``, Pallas interpreter on CPU) equals an
independent float64 NumPy step and the token recurrence, leaves idle slots (g = 0, beta = 0) bit-identical, and is
what ``kda(impl="pallas")`` and the model's cached decode run for one token when the kernel backend is chosen.

References: a float64 NumPy step written here (decay, delta-rule write, read) and ``k3jax.ops.kda.kda_recurrent``
(the ``lax.scan`` token recurrence). Shapes are tiny.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_ops
from pallas_kernels.kda import kda_decode_step


def _unit(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True))


def _inputs(b, h, kd, vd, seed=0):
    """float32 numpy inputs of one decode token: unit q/k, gates in (-5, 0), beta in (0, 1), a random state."""
    rng = np.random.default_rng(seed)
    q = _unit(rng.standard_normal((b, h, kd)))
    k = _unit(rng.standard_normal((b, h, kd)))
    v = rng.standard_normal((b, h, vd))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((b, h, kd))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, h))))
    s = rng.standard_normal((b, h, kd, vd))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, s))


def _numpy_step(q, k, v, g, beta, s, scale):
    """float64 KDA step per (batch, head): S' = diag(e^g) S; S'' = S' + k (beta (v - k^T S'))^T; o = (scale q)^T S''."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
    o = np.zeros(v.shape)
    new = np.zeros(s.shape)
    for bi, hi in np.ndindex(*beta.shape):
        st = np.exp(g[bi, hi])[:, None] * s[bi, hi]
        kt = k[bi, hi]
        st = st + np.outer(kt, beta[bi, hi] * (v[bi, hi] - kt @ st))
        o[bi, hi] = (scale * q[bi, hi]) @ st
        new[bi, hi] = st
    return o, new


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


@functools.partial(jax.jit, static_argnames=("scale", "block_v"))
def _interpret_step(q, k, v, g, beta, s, *, scale, block_v):
    return kda_decode_step(q, k, v, g, beta, s, scale=scale, backend="interpret", block_v=block_v)


@pytest.mark.parametrize("kd, h, block_v", [(64, 1, 16), (64, 3, 64), (128, 2, 32), (128, 1, 128)])
def test_f32_step_equals_float64_numpy_step(kd, h, block_v):
    q, k, v, g, beta, s = _inputs(b=2, h=h, kd=kd, vd=kd, seed=kd + h)
    scale = kd ** -0.5
    o, new = _interpret_step(q, k, v, g, beta, s, scale=scale, block_v=block_v)
    ref_o, ref_s = _numpy_step(q, k, v, g, beta, s, scale)
    assert o.dtype == new.dtype == jnp.float32
    assert o.shape == (2, h, kd) and new.shape == s.shape
    assert _rel_err(o, ref_o) < 2e-6 and _rel_err(new, ref_s) < 2e-6


def test_bf16_qkv_equal_float64_step_on_the_same_rounded_inputs():
    """bf16 q/k/v are read as f32 and all math is f32: the result is f32-accurate for the rounded inputs."""
    q, k, v, g, beta, s = _inputs(b=2, h=2, kd=128, vd=64, seed=5)
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o, new = _interpret_step(q16, k16, v16, g, beta, s, scale=0.1, block_v=32)
    ref_o, ref_s = _numpy_step(*(np.asarray(x.astype(jnp.float32)) for x in (q16, k16, v16)), g, beta, s, 0.1)
    assert o.dtype == jnp.float32
    assert _rel_err(o, ref_o) < 2e-6 and _rel_err(new, ref_s) < 2e-6


def test_idle_slot_with_zero_gate_and_beta_keeps_its_state_bit_identical():
    """A padded / idle decode slot (g = 0, beta = 0, as forward_cached sends them) leaves its state untouched, bit
    for bit, while the other slots of the same call are updated."""
    q, k, v, g, beta, s = _inputs(b=3, h=2, kd=64, vd=64, seed=9)
    g[1], beta[1] = 0.0, 0.0
    _, new = _interpret_step(q, k, v, g, beta, s, scale=0.125, block_v=32)
    new = np.asarray(new)
    np.testing.assert_array_equal(new[1].view(np.uint32), s[1].view(np.uint32))
    assert np.abs(new[0] - s[0]).max() > 1e-2 and np.abs(new[2] - s[2]).max() > 1e-2


def test_repeated_steps_equal_the_token_recurrence():
    """Five kernel steps from an initial state give the outputs and final state of ``kda_recurrent`` over the five
    tokens (the same L2-normalised inputs, one token at a time)."""
    b, t, h, kd, vd = 2, 5, 2, 64, 64
    rng = np.random.default_rng(11)
    q = _unit(rng.standard_normal((b, t, h, kd))).astype(np.float32)
    k = _unit(rng.standard_normal((b, t, h, kd))).astype(np.float32)
    v = rng.standard_normal((b, t, h, vd)).astype(np.float32)
    g = (-5.0 * rng.random((b, t, h, kd))).astype(np.float32)
    beta = rng.random((b, t, h)).astype(np.float32)
    s0 = (0.3 * rng.standard_normal((b, h, kd, vd))).astype(np.float32)
    scale = kd ** -0.5

    @jax.jit
    def kernel_loop(s):
        outs = []
        for i in range(t):
            o, s = kda_decode_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s, scale=scale,
                                   backend="interpret", block_v=32)
            outs.append(o)
        return jnp.stack(outs, axis=1), s

    o, s = kernel_loop(s0)
    ref_o, ref_s = jax.jit(functools.partial(kda_ops.kda_recurrent, scale=scale))(
        q, k, v, g, beta, initial_state_bhkv=s0)
    assert _rel_err(o, ref_o) < 1e-5 and _rel_err(s, ref_s) < 1e-5


def test_bad_inputs_are_rejected_with_clear_errors():
    q, k, v, g, beta, s = _inputs(b=1, h=2, kd=32, vd=32)

    def call(*args, **kw):
        kda_decode_step(*args, scale=1.0, **({"backend": "interpret"} | kw))

    with pytest.raises(ValueError, match=r"q, k, g must share a \[B, H, K\] shape"):
        call(q[..., :16], k, v, g, beta, s)
    with pytest.raises(ValueError, match=r"v must have shape \[B, H, V\]"):
        call(q, k, v[:, :1], g, beta, s)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, H\]"):
        call(q, k, v, g, beta[..., None], s)
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, K, V\]"):
        call(q, k, v, g, beta, s[..., :16])
    with pytest.raises(ValueError, match="state must be float32"):
        call(q, k, v, g, beta, s.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="q must be float32, bfloat16 or float16"):
        call(q.astype(np.int32), k, v, g, beta, s)
    with pytest.raises(ValueError, match="g must be a float array"):
        call(q, k, v, g.astype(np.int32), beta, s)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        q3, k3, g3 = (np.zeros((1, 2, 24), np.float32) for _ in range(3))
        call(q3, k3, v, g3, beta, np.zeros((1, 2, 24, 32), np.float32))
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16"):
        call(q, k, v, g, beta, s, block_v=24)
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        call(q, k, v, g, beta, s, backend="tpu")


def _one_token(seed, b=2, h=2, kd=32, vd=32):
    q, k, v, g, beta, s = _inputs(b=b, h=h, kd=kd, vd=vd, seed=seed)
    return tuple(x[:, None] for x in (q, k, v, g, beta)) + (s,)


def test_ops_kda_pallas_one_token_runs_the_xla_step_off_gpu_and_the_kernel_when_chosen(monkeypatch):
    """``kda(impl="pallas")`` with T = 1: on CPU the XLA step (no pallas_call; the chunk kernel would pad to 64
    rows), and with the kernel backend chosen (patched to the interpreter) the decode kernel; both equal the float64
    step, o in q's dtype, state f32. ``initial_state=None`` means zeros."""
    q, k, v, g, beta, s = _one_token(seed=3)
    scale = 32 ** -0.5
    ref_o, ref_s = _numpy_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s, scale)

    assert kda_ops.decode_kernel_backend() is None  # CPU
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "interpret")

        def run(state):  # a new function per platform choice: traces are cached per function
            return kda_ops.kda(q, k, v, g, beta, scale=scale, initial_state=state, impl="pallas")

        assert ("pallas_call" in str(jax.make_jaxpr(run)(s))) == patched
        o, new = jax.jit(run)(s)
        assert o.shape == (2, 1, 2, 32) and o.dtype == q.dtype and new.dtype == jnp.float32
        assert _rel_err(o[:, 0], ref_o) < 2e-6 and _rel_err(new, ref_s) < 2e-6
        o0, new0 = jax.jit(lambda: run(None))()
        zero_o, zero_s = _numpy_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], np.zeros_like(s), scale)
        assert _rel_err(o0[:, 0], zero_o) < 2e-6 and _rel_err(new0, zero_s) < 2e-6
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o16, new16 = jax.jit(lambda: kda_ops.kda(q16, k16, v16, g, beta, scale=scale, initial_state=s, impl="pallas"))()
    assert o16.dtype == jnp.bfloat16 and new16.dtype == jnp.float32


def test_layer_decode_under_a_mesh_runs_the_kernel_per_shard(monkeypatch):
    """The KDA layer's cached one-token decode with kda_impl="pallas" equals the recurrent path (kda_impl="chunked")
    on one CPU device (the XLA step) and, with the decode kernel chosen, under a (data 2, expert 2, model 2) mesh,
    where it goes through the shard_map wrapper (sharding.kda_kernel); a slot with valid_len 0 keeps its recurrent
    state bit-identical."""
    from sharding.mesh import make_mesh
    from tests.conftest import KDALayerDecode

    setup = KDALayerDecode(seed=12)
    params, x, state, valid = setup.args

    def decode(impl):
        return setup.decode(kda_impl=impl)

    y_ref, st_ref = jax.jit(decode("chunked"))(params, x, state, valid)
    y_cpu, st_cpu = jax.jit(decode("pallas"))(params, x, state, valid)  # one device, CPU: the XLA step
    assert _rel_err(y_cpu, y_ref) < 1e-6 and _rel_err(st_cpu.state_bhkv, st_ref.state_bhkv) < 1e-6
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "interpret")
    kernel_decode = decode("pallas")  # built outside the mesh: its logical axis names are not mesh axes
    mesh = make_mesh(data=2, expert=2, model=2)
    with (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh):
        jaxpr = str(jax.make_jaxpr(kernel_decode)(params, x, state, valid))
        y, st = jax.jit(kernel_decode)(params, x, state, valid)
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    rows = np.asarray(valid) == 1
    assert _rel_err(np.asarray(y)[rows], np.asarray(y_ref)[rows]) < 2e-5
    assert _rel_err(st.state_bhkv, st_ref.state_bhkv) < 2e-5
    np.testing.assert_array_equal(np.asarray(st.state_bhkv)[1].view(np.uint32),
                                  np.asarray(state.state_bhkv)[1].view(np.uint32))


def _kda_states(cache):
    from k3jax.layers.kda import KDAState

    states = jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, KDAState))
    return [np.asarray(st.state_bhkv) for st in states if isinstance(st, KDAState)]


def test_model_cached_decode_with_the_kernel_equals_the_recurrent_path(monkeypatch):
    """A 6-layer tiny model's cached decode (three tokens after a 3-token prompt, one idle slot) with kda_impl="pallas"
    and the decode kernel chosen (through the interpreter) gives the logits and KDA states of kda_impl="chunked"
    (whose one-token decode is the recurrent step); the idle slot's KDA states stay bit-identical."""
    from flax import nnx

    import configs
    from k3jax.layers.params import RouterBias
    from k3jax.model import K3Model, init_cache

    # 6 layers: KDA (unscanned), MLA, then a scanned (KDA, MLA) unit x 2 whose KDA states are stacked.
    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(
        num_hidden_layers=6, full_attn_layers=(2, 4, 6))

    def graph(impl):
        return nnx.split(nnx.eval_shape(lambda: K3Model(base.replace(kda_impl=impl), rngs=nnx.Rngs(0))))

    # Random weights without the (slow, eager) initialisers; router biases pin the top-k (no near-tie flips).
    _, abstract = graph("chunked")
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), abstract)
    params = nnx.merge_state(params, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape),
                                                  nnx.filter_state(params, RouterBias)))

    def cached(impl):
        gd = graph(impl)[0]
        return jax.jit(lambda p, ids, cache, valid: nnx.merge(gd, p).forward_cached(ids, cache, valid))

    recurrent_step = cached("chunked")
    cache0 = init_cache(base, 2, 8)
    for tok in rng.integers(0, 256, (3, 2, 1)):  # a 3-token prompt, one token at a time (one compile)
        _, cache0 = recurrent_step(params, jnp.asarray(tok, jnp.int32), cache0, jnp.asarray([1, 1], jnp.int32))
    tokens = jnp.asarray(rng.integers(0, 256, (3, 2, 1)), jnp.int32)
    valid = jnp.asarray([1, 0], jnp.int32)  # sequence 1 idles

    def decode(step):
        cache, logits = cache0, []
        for tok in tokens:
            out, cache = step(params, tok, cache, valid)
            logits.append(np.asarray(out)[0])
        return np.stack(logits), _kda_states(cache)

    want_logits, want_states = decode(recurrent_step)
    kernel_calls = []
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: kernel_calls.append(1) or "interpret")
    logits, states = decode(cached("pallas"))
    assert len(kernel_calls) == 2  # traced once per KDA layer body (unscanned, scanned)
    old_states = _kda_states(cache0)
    assert len(want_states) == len(old_states) == 2 and want_states[1].ndim == 5  # unscanned, then stacked
    assert _rel_err(logits, want_logits) < 1e-5
    for st, ref, old in zip(states, want_states, old_states, strict=True):
        assert _rel_err(st, ref) < 1e-5
        idle, idle_before = (st[:, 1], old[:, 1]) if st.ndim == 5 else (st[1], old[1])
        np.testing.assert_array_equal(idle.view(np.uint32), idle_before.view(np.uint32))
        assert np.abs(st[..., 0, :, :, :] - old[..., 0, :, :, :]).max() > 1e-3  # the running slot moved


def test_kernel_lowers_for_cuda_at_the_k3_gpu_decode_shape_with_the_state_aliased(monkeypatch):
    """Lowered for CUDA on this host (no GPU needed: a compile-only check): B = 64, H = 12, K = V = 128, bf16
    q/k/v give one Triton kernel whose new state aliases the (donated) old one, directly and through
    ``kda(impl="pallas")`` with the GPU platform chosen."""
    from pallas_kernels.cuda_lowering import triton_kernels

    sd = jax.ShapeDtypeStruct
    b, h, d = 64, 12, 128
    token = (sd((b, 1, h, d), jnp.bfloat16),) * 3 + (sd((b, 1, h, d), jnp.float32), sd((b, 1, h), jnp.float32))
    state = sd((b, h, d, d), jnp.float32)

    def direct(q, k, v, g, beta, s):
        return kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s, scale=d ** -0.5, backend="gpu")

    assert triton_kernels(direct, *token, state, name_pattern=r"kda_[a-z_]+") == (1, ["kda_decode_step"])
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "gpu")

    def dispatched(q, k, v, g, beta, s):
        return kda_ops.kda(q, k, v, g, beta, scale=d ** -0.5, initial_state=s, impl="pallas")

    assert triton_kernels(dispatched, *token, state, name_pattern=r"kda_[a-z_]+") == (1, ["kda_decode_step"])
    text = jax.jit(dispatched, donate_argnums=5).trace(*token, state).lower(lowering_platforms=("cuda",)).as_text()
    assert "output_operand_aliases" in text and "tf.aliasing_output" in text
