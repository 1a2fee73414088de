"""The fused AttnRes read + RMSNorm kernels (`pallas_kernels.attn_res` through `k3jax.ops.attn_res.read_norm`, the
Pallas interpreter on CPU) equal a float64 NumPy oracle of the forward, and their gradients equal the oracle's
directional derivatives (central differences in float64) for live, the bank, the query and the gain; in bf16 they
equal the XLA path's values and gradients; unused bank rows get zero gradient; a tiny model's loss and gradients
are the same with attn_res_impl="pallas" as with "xla"; the kernels lower to two Triton calls for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.attn_res import attn_res_mix
from k3jax.layers.norms import rms_norm
from k3jax.ops.attn_res import read_norm, read_norm_backend
from pallas_kernels.cuda_lowering import triton_kernels

B, T, D, ROWS, FILLED = 2, 16, 64, 3, 2
EPS_READ, EPS_NORM = 1e-6, 1e-5


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    live = rng.standard_normal((B, T, D))
    bank = rng.standard_normal((ROWS, B, T, D)) * np.array([2.0, 0.5, 1.0])[:, None, None, None]
    query = rng.standard_normal(D) * 0.3
    gain = 1.0 + 0.2 * rng.standard_normal(D)
    dout = rng.standard_normal((B, T, D))
    return [jnp.asarray(a, dtype) for a in (live, bank)] + [jnp.asarray(query, jnp.float32),
                                                           jnp.asarray(gain, dtype), jnp.asarray(dout, dtype)]


def _oracle(live, bank, query, gain):
    """float64: softmax over [bank[:FILLED]..., live] of (v·q)/rms(v), mix, RMSNorm with gain."""
    src = np.concatenate([np.asarray(bank, np.float64)[:FILLED], np.asarray(live, np.float64)[None]], axis=0)
    q, g = np.asarray(query, np.float64), np.asarray(gain, np.float64)
    a = (src @ q) / np.sqrt((src * src).mean(-1) + EPS_READ)
    p = np.exp(a - a.max(0))
    p /= p.sum(0)
    m = (p[..., None] * src).sum(0)
    return g * m / np.sqrt((m * m).mean(-1, keepdims=True) + EPS_NORM)


def _kernel(live, bank, query, gain):
    return read_norm(live, bank, FILLED, query, gain, eps_read=EPS_READ, eps_norm=EPS_NORM, backend="interpret")


def _xla(live, bank, query, gain):
    return rms_norm(attn_res_mix(live, bank, FILLED, query, EPS_READ), gain, EPS_NORM)


def test_read_norm_kernel_and_gradients_equal_float64_oracle():
    live, bank, query, gain, dout = _inputs(jnp.float32)
    out, vjp = jax.vjp(_kernel, live, bank, query, gain)
    np.testing.assert_allclose(np.asarray(out), _oracle(live, bank, query, gain), rtol=1e-5, atol=1e-5)
    grads = vjp(dout)
    assert not np.asarray(grads[1][FILLED:]).any()  # the unread bank row
    rng = np.random.default_rng(3)
    args = [np.asarray(a, np.float64) for a in (live, bank, query, gain)]
    for i, grad in enumerate(grads):  # <grad, u> against the float64 oracle's central difference along u
        for _ in range(2):
            u = rng.standard_normal(args[i].shape)
            h = 1e-4
            plus, minus = list(args), list(args)
            plus[i], minus[i] = args[i] + h * u, args[i] - h * u
            fd = ((_oracle(*plus) - _oracle(*minus)) / (2 * h) * np.asarray(dout, np.float64)).sum()
            got = float((np.asarray(grad, np.float64) * u).sum())
            assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (i, got, fd)


def test_read_norm_kernel_equals_xla_path_in_bf16():
    live, bank, query, gain, dout = _inputs(jnp.bfloat16, seed=1)
    out, vjp = jax.vjp(_kernel, live, bank, query, gain)
    ref, ref_vjp = jax.vjp(_xla, live, bank, query, gain)
    assert out.dtype == ref.dtype == jnp.bfloat16
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    np.testing.assert_allclose(f(out), f(ref), atol=2 ** -6, rtol=2 ** -7)
    for name, g, r in zip(("live", "bank", "query", "gain"), vjp(dout), ref_vjp(dout)):
        assert g.dtype == r.dtype, name
        scale = np.abs(f(r)).max()
        np.testing.assert_allclose(f(g), f(r), atol=2 ** -6 * scale, rtol=2 ** -6, err_msg=name)


def test_read_norm_with_a_traced_count_masks_the_rows_past_it():
    """Inside a scan over layers the count of filled rows is traced: every row is read, rows at or past the count
    weigh nothing and get zero gradient; equal to the float64 oracle and to the XLA path's gradients."""
    live, bank, query, gain, dout = _inputs(jnp.float32, seed=2)

    def kernel_traced(live, bank, query, gain, n):
        return read_norm(live, bank, n, query, gain, eps_read=EPS_READ, eps_norm=EPS_NORM, backend="interpret")

    def xla_traced(live, bank, query, gain, n):
        return rms_norm(attn_res_mix(live, bank, n, query, EPS_READ), gain, EPS_NORM)

    n = jnp.asarray(FILLED, jnp.int32)
    out, vjp = jax.vjp(lambda *a: jax.jit(kernel_traced)(*a, n), live, bank, query, gain)
    ref, ref_vjp = jax.vjp(lambda *a: jax.jit(xla_traced)(*a, n), live, bank, query, gain)
    np.testing.assert_allclose(np.asarray(out), _oracle(live, bank, query, gain), rtol=1e-5, atol=1e-5)
    grads, ref_grads = vjp(dout), ref_vjp(dout)
    assert not np.asarray(grads[1][FILLED:]).any()
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(r)).max())
    only_live = jax.jit(kernel_traced)(live, bank, query, gain, jnp.asarray(0, jnp.int32))  # nothing filled yet
    np.testing.assert_allclose(np.asarray(only_live), np.asarray(rms_norm(live, gain, EPS_NORM)), rtol=1e-5,
                               atol=1e-5)


def test_read_norm_backend_choice():
    assert read_norm_backend("auto", B, T, D, FILLED, 16, ROWS) is None  # CPU: XLA
    assert read_norm_backend("pallas", B, T, D, FILLED, 16, ROWS) == "interpret"
    assert read_norm_backend("pallas", B, T, D, None, 16, ROWS) == "interpret"  # traced count: rows masked
    assert read_norm_backend("pallas", B, T, D, 0, 16, ROWS) is None  # nothing to mix
    assert read_norm_backend("pallas", 1, 8, D, FILLED, 16, ROWS) is None  # too few tokens for one block
    assert read_norm_backend("xla", B, T, D, FILLED, 16, ROWS) is None
    with pytest.raises(ValueError, match="attn_res_impl"):
        read_norm_backend("fast", B, T, D, FILLED, 16, ROWS)


@pytest.mark.parametrize("traced", [False, True])
def test_read_normed_layer_site_uses_the_kernel_with_the_same_gradients(traced):
    """`read_normed` (an AttnResRead module and the RMSNorm after it, as the decoder layers call it) with
    attn_res_impl="pallas" equals "xla" in value and in the gradients of live, the bank and both modules' weights."""
    from flax import nnx

    import configs
    from k3jax.layers.attn_res import AttnResRead, read_normed
    from k3jax.layers.norms import RMSNorm

    cfg = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(hidden_size=D)
    live, bank, query, gain, dout = _inputs(jnp.float32, seed=5)
    read, norm = AttnResRead(cfg), RMSNorm(D, eps=EPS_NORM, param_dtype=jnp.float32)
    read.query[...], read.norm_weight[...], norm.weight[...] = query, 1.0 + 0.1 * query, gain

    def run(impl):
        c = cfg.replace(attn_res_impl=impl)

        def f(mods, live, bank, n):
            r, nm = mods
            return jnp.sum(read_normed(r, live, bank, n if traced else FILLED, nm, c) * dout)

        n = jnp.asarray(FILLED, jnp.int32)
        return nnx.jit(nnx.value_and_grad(f, argnums=(0, 1, 2)))((read, norm), live, bank, n)

    def traced_kernels(impl):
        c = cfg.replace(attn_res_impl=impl)
        return str(jax.make_jaxpr(lambda lv, bk, n: read_normed(read, lv, bk, n if traced else FILLED, norm, c))(
            live, bank, jnp.asarray(FILLED, jnp.int32))).count("attn_res_read_norm_fwd")

    assert traced_kernels("pallas") >= 1 and traced_kernels("xla") == 0
    (v_k, g_k), (v_x, g_x) = run("pallas"), run("xla")
    np.testing.assert_allclose(float(v_k), float(v_x), rtol=1e-5)
    flat = lambda g: [np.asarray(x) for x in jax.tree.leaves(g)]  # noqa: E731
    assert len(flat(g_k)) == len(flat(g_x)) == 5
    for a, r in zip(flat(g_k), flat(g_x)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5 * max(np.abs(r).max(), 1e-6))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_tiny_model_loss_and_gradients_same_with_the_fused_read(scan):
    """The whole tiny model (AttnRes) in f32; unrolled layers read static bank counts, scanned ones traced counts."""
    from flax import nnx

    import configs
    from k3jax.model import K3Model

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32", f"scan_layers={scan}"])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (2, 16)), jnp.int32)

    def loss_and_grads(impl):
        model = K3Model(base.replace(attn_res_impl=impl), rngs=nnx.Rngs(0))

        def loss(m):
            logits = m(tokens)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        graphdef, state = nnx.split(model)
        jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))
        return value, [np.asarray(v.get_value()) for _, v in sorted(nnx.to_flat_state(grads))], jaxpr

    v_kernel, g_kernel, jaxpr = loss_and_grads("pallas")
    v_xla, g_xla, jaxpr_xla = loss_and_grads("xla")
    assert "attn_res_read_norm_fwd" in jaxpr and "attn_res_read_norm" not in jaxpr_xla
    np.testing.assert_allclose(float(v_kernel), float(v_xla), rtol=1e-5)
    assert len(g_kernel) == len(g_xla) > 10
    for g, r in zip(g_kernel, g_xla):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-5 * max(np.abs(r).max(), 1e-6))


def test_read_norm_lowers_to_two_triton_kernels_for_cuda():
    live = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
    bank = jax.ShapeDtypeStruct((ROWS, B, T, D), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((D,), jnp.float32)

    def loss(live, bank, query, gain):
        out = read_norm(live, bank, FILLED, query, gain, eps_read=EPS_READ, eps_norm=EPS_NORM, backend="gpu")
        return jnp.sum(out.astype(jnp.float32))

    count, names = triton_kernels(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), live, bank, vec, vec,
                                  name_pattern=r"attn_res_read_norm_\w+")
    assert count == 2 and names == ["attn_res_read_norm_bwd", "attn_res_read_norm_fwd"]
