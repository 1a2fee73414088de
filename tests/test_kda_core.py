"""Tests for the pure-JAX KDA cores in k3jax/ops/kda.py.

The oracle is an independent float64 NumPy token loop written here (it does not use kda_recurrent).
Tolerances are f32-tight: rtol = atol = 1e-5 against float64 for outputs and states, also for the
unbounded softplus gate (observed errors are ~1e-7); the same tolerance for chunked-vs-recurrent
gradients (observed ~1e-6 on gradients of size up to ~10). The only loose check is bf16 vs f32
inputs, which measures bf16 input rounding, not the core.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import kda, kda_chunked, kda_recurrent, kda_step

RTOL = 1e-5
ATOL = 1e-5


# --------------------------------------------------------------------------------------------
# Inputs and the float64 oracle
# --------------------------------------------------------------------------------------------


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def make_inputs(seed, b, t, h, kd, vd, *, gate="bounded", with_state=False):
    """Random f32 KDA inputs as NumPy arrays.

    gate="bounded": K3 gate g = -5 * sigmoid(x), in (-5, 0).
    gate="softplus": Kimi-Linear-style unbounded gate g = -e^2 * softplus(x + 3); x is widened so
    many values go below -30 and the most negative reach ~ -60 (a 16-token sub-chunk then spans
    hundreds of nats, a 64-token chunk thousands), plus a few tokens with g ~ 0 to mix scales.
    """
    rng = np.random.default_rng(seed)
    q = _l2norm(rng.standard_normal((b, t, h, kd)))
    k = _l2norm(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    if gate == "bounded":
        g = -5.0 * _sigmoid(rng.standard_normal((b, t, h, kd)))
    elif gate == "softplus":
        g = -np.exp(2.0) * _softplus(2.0 * rng.standard_normal((b, t, h, kd)) + 3.0)
        g[:, ::7] *= 1e-3  # some nearly non-decaying tokens
    else:
        raise AssertionError(gate)
    beta = _sigmoid(rng.standard_normal((b, t, h)))
    s0 = rng.standard_normal((b, h, kd, vd)) * 0.5 if with_state else None
    return tuple(None if x is None else np.asarray(x, np.float32) for x in (q, k, v, g, beta, s0))


def numpy_kda_reference(q, k, v, g, beta, scale, s0=None):
    """Independent float64 token loop. Per head and token:
    S = diag(e^g) S;  S += k (beta (v - S^T k))^T;  o = S^T (scale q)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, kd = k.shape
    vd = v.shape[-1]
    s = np.zeros((b, h, kd, vd)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((b, t, h, vd))
    for i in range(t):
        s = np.exp(g[:, i])[..., None] * s
        err = v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + k[:, i][..., :, None] * (beta[:, i][..., None] * err)[..., None, :]
        o[:, i] = np.einsum("bhk,bhkv->bhv", scale * q[:, i], s)
    return o, s


@functools.cache
def _jitted(impl, chunk_size=64):
    """A jitted core ``fn(q, k, v, g, beta, s0, scale)`` (cached: one compile per shape)."""

    def fn(q, k, v, g, beta, s0, scale):
        if impl == "recurrent":
            return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state_bhkv=s0)
        return kda_chunked(
            q, k, v, g, beta, scale=scale, initial_state_bhkv=s0, chunk_size=chunk_size
        )

    return jax.jit(fn)


def _close(actual, expected, rtol=RTOL, atol=ATOL, what=""):
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, (what, actual.dtype)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


# --------------------------------------------------------------------------------------------
# Recurrent / step
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_numpy(gate, with_state):
    b, t, h, kd, vd = 2, 37, 2, 32, 16
    q, k, v, g, beta, s0 = make_inputs(0, b, t, h, kd, vd, gate=gate, with_state=with_state)
    scale = kd**-0.5
    o, s = _jitted("recurrent")(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = numpy_kda_reference(q, k, v, g, beta, scale, s0)
    assert o.shape == (b, t, h, vd) and s.shape == (b, h, kd, vd)
    _close(o, o_ref, what="o")
    _close(s, s_ref, what="state")


def test_step_iterated_matches_recurrent():
    b, t, h, kd, vd = 2, 9, 3, 16, 24
    q, k, v, g, beta, s0 = make_inputs(1, b, t, h, kd, vd, with_state=True)
    scale = kd**-0.5
    step = jax.jit(functools.partial(kda_step, scale=scale))
    state = jnp.asarray(s0)
    outs = []
    for i in range(t):
        o_i, state = step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state)
        assert o_i.shape == (b, h, vd) and o_i.dtype == jnp.float32
        outs.append(o_i)
    o_rec, s_rec = _jitted("recurrent")(q, k, v, g, beta, s0, scale)
    # Same f32 ops in the same order: agreement to rounding.
    np.testing.assert_allclose(np.stack(outs, axis=1), o_rec, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, s_rec, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Chunked vs the float64 oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t,chunk_size",
    [(1, 64), (15, 64), (64, 64), (100, 64), (130, 64), (100, 16), (100, 32), (70, 8)],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_numpy(t, chunk_size, with_state):
    b, h, kd, vd = 2, 2, 32, 16  # K != V
    q, k, v, g, beta, s0 = make_inputs(10 + t, b, t, h, kd, vd, with_state=with_state)
    scale = kd**-0.5
    o, s = _jitted("chunked", chunk_size)(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = numpy_kda_reference(q, k, v, g, beta, scale, s0)
    assert o.shape == (b, t, h, vd) and s.shape == (b, h, kd, vd)
    _close(o, o_ref, what="o")
    _close(s, s_ref, what="state")


@pytest.mark.parametrize("h", [1, 2, 3])
def test_chunked_heads_and_square_dims(h):
    b, t, kd, vd = 1, 80, 16, 16
    q, k, v, g, beta, s0 = make_inputs(20 + h, b, t, h, kd, vd, with_state=True)
    scale = kd**-0.5
    o, s = _jitted("chunked", 32)(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = numpy_kda_reference(q, k, v, g, beta, scale, s0)
    _close(o, o_ref, what="o")
    _close(s, s_ref, what="state")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_unbounded_softplus_gate_no_overflow(chunk_size):
    """Gates down to ~ -60 per token: a 64-token chunk spans thousands of nats of cumulative decay.

    Any exp(G) * exp(-G) split would overflow f32 to inf/NaN here; the sub-chunk factorisation
    only ever exponentiates non-positive numbers.
    """
    b, t, h, kd, vd = 2, 150, 2, 32, 16
    q, k, v, g, beta, s0 = make_inputs(3, b, t, h, kd, vd, gate="softplus", with_state=True)
    assert g.min() < -50.0
    scale = kd**-0.5
    o, s = _jitted("chunked", chunk_size)(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = numpy_kda_reference(q, k, v, g, beta, scale, s0)
    _close(o, o_ref, what="o")
    _close(s, s_ref, what="state")


def test_chunked_extreme_gate_value():
    """A single enormous log-decay (-1e4 nats) in the middle of a chunk: state is wiped, no NaN."""
    b, t, h, kd, vd = 1, 64, 1, 16, 16
    q, k, v, g, beta, s0 = make_inputs(4, b, t, h, kd, vd, with_state=True)
    g[:, 40, :, :] = -1e4
    scale = kd**-0.5
    o, s = _jitted("chunked", 64)(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = numpy_kda_reference(q, k, v, g, beta, scale, s0)
    _close(o, o_ref, what="o")
    _close(s, s_ref, what="state")


@pytest.mark.parametrize("t1", [40, 64])
def test_split_sequence_carries_state(t1):
    b, t, h, kd, vd = 2, 130, 2, 32, 16
    q, k, v, g, beta, s0 = make_inputs(5, b, t, h, kd, vd, with_state=True)
    scale = kd**-0.5
    run = _jitted("chunked", 64)
    o_all, s_all = run(q, k, v, g, beta, s0, scale)
    first = tuple(x[:, :t1] for x in (q, k, v, g, beta))
    second = tuple(x[:, t1:] for x in (q, k, v, g, beta))
    o1, s1 = run(*first, s0, scale)
    o2, s2 = run(*second, s1, scale)
    # Both sides are f32 with different chunk boundaries: compare at f32-rounding level.
    _close(np.concatenate([o1, o2], axis=1), o_all, what="o split")
    _close(s2, s_all, what="state split")


def test_bf16_inputs():
    """bf16 inputs run, return f32, and (math being f32 inside) match the f64 oracle evaluated on
    the bf16-rounded inputs at f32 tolerance; the state is given in bf16 as well."""
    b, t, h, kd, vd = 2, 100, 2, 32, 16
    inputs = make_inputs(6, b, t, h, kd, vd, with_state=True)
    bf = tuple(jnp.asarray(x, jnp.bfloat16) for x in inputs)
    rounded = tuple(np.asarray(x, np.float32) for x in bf)
    scale = kd**-0.5
    o_ref, s_ref = numpy_kda_reference(*rounded[:5], scale, rounded[5])
    for impl in ("chunked", "recurrent"):
        o, s = jax.jit(functools.partial(kda, scale=scale, impl=impl))(*bf[:5], initial_state=bf[5])
        assert o.dtype == jnp.float32 and s.dtype == jnp.float32
        _close(o, o_ref, what=f"o {impl}")
        _close(s, s_ref, what=f"state {impl}")
    # And close to the full-precision result. The difference is the bf16 rounding of the inputs
    # (~4e-3 relative each), not the core: observed max |diff| ~6e-4 on outputs of size ~0.2.
    o32, _ = numpy_kda_reference(*inputs[:5], scale, inputs[5])
    np.testing.assert_allclose(o, o32, rtol=0, atol=3e-3)


# --------------------------------------------------------------------------------------------
# Dispatch and validation
# --------------------------------------------------------------------------------------------


def test_dispatch_impls_agree():
    b, t, h, kd, vd = 1, 50, 2, 16, 8
    q, k, v, g, beta, s0 = make_inputs(7, b, t, h, kd, vd, with_state=True)
    scale = kd**-0.5
    o_c, s_c = kda(q, k, v, g, beta, scale=scale, initial_state=s0, chunk_size=32)
    o_r, s_r = kda(q, k, v, g, beta, scale=scale, initial_state=s0, impl="recurrent")
    np.testing.assert_allclose(o_c, o_r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(s_c, s_r, rtol=RTOL, atol=ATOL)


def test_invalid_impl_and_chunk_size():
    q, k, v, g, beta, _ = make_inputs(8, 1, 5, 1, 8, 8)
    with pytest.raises(ValueError, match="pallas_v9"):
        kda(q, k, v, g, beta, scale=1.0, impl="pallas_v9")
    for bad in (48 + 8, 24, 0, -16, 64.0):
        with pytest.raises(ValueError, match="chunk_size"):
            kda(q, k, v, g, beta, scale=1.0, chunk_size=bad)
    with pytest.raises(ValueError, match="beta"):
        kda_chunked(q, k, v, g, beta[..., None], scale=1.0)


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


def test_grad_chunked_matches_recurrent():
    b, t, h, kd, vd = 1, 40, 2, 16, 8
    q, k, v, g, beta, s0 = make_inputs(9, b, t, h, kd, vd, with_state=True)
    rng = np.random.default_rng(99)
    do = jnp.asarray(rng.standard_normal((b, t, h, vd)), jnp.float32)
    ds = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
    scale = kd**-0.5

    def loss(args, impl):
        o, s = kda(*args[:5], scale=scale, initial_state=args[5], impl=impl, chunk_size=32)
        return jnp.sum(o * do) + jnp.sum(s * ds)

    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0))
    grads_c = jax.jit(jax.grad(functools.partial(loss, impl="chunked")))(args)
    grads_r = jax.jit(jax.grad(functools.partial(loss, impl="recurrent")))(args)
    for name, gc, gr in zip(("q", "k", "v", "g", "beta", "s0"), grads_c, grads_r):
        assert np.all(np.isfinite(gc)), name
        # Gradients reach O(10); observed max |diff| ~1.5e-6, so the f32 tolerance still holds.
        np.testing.assert_allclose(gc, gr, rtol=RTOL, atol=ATOL, err_msg=name)


def test_grad_chunked_finite_with_softplus_gate():
    """No NaN/inf gradients from the masked exponents under an unbounded gate."""
    b, t, h, kd, vd = 1, 48, 1, 16, 8
    q, k, v, g, beta, s0 = make_inputs(11, b, t, h, kd, vd, gate="softplus", with_state=True)
    scale = kd**-0.5

    def loss(args, impl):
        o, s = kda(*args[:5], scale=scale, initial_state=args[5], impl=impl, chunk_size=32)
        return jnp.sum(o**2) + jnp.sum(s**2)

    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0))
    grads_c = jax.jit(jax.grad(functools.partial(loss, impl="chunked")))(args)
    grads_r = jax.jit(jax.grad(functools.partial(loss, impl="recurrent")))(args)
    for name, gc, gr in zip(("q", "k", "v", "g", "beta", "s0"), grads_c, grads_r):
        assert np.all(np.isfinite(gc)), name
        np.testing.assert_allclose(gc, gr, rtol=RTOL, atol=ATOL, err_msg=name)
