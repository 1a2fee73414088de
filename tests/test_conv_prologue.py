"""The KDA training prologue kernels (`pallas_kernels.kda.conv_prologue`: short conv → SiLU → per-head L2 norm,
forward and backward) through the Pallas interpreter equal a float64 NumPy oracle of the forward and of its
gradient (f32; packed documents whose boundaries fall inside and between blocks), equal the XLA path's values and
gradients in bf16 (same rounding points), refuse shapes they do not take by name, and lower to two Triton kernels
for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.conv import conv_prologue, conv_prologue_unsupported
from pallas_kernels.cuda_lowering import triton_kernels
from tests.helpers import layer_output_and_grads

B, T, H, K, W = 2, 64, 2, 16, 4
BLOCK = 16


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, T, H * K)), dtype)
    kernel = jnp.asarray(rng.standard_normal((W, H * K)) * 0.5, jnp.float32)
    dout = jnp.asarray(rng.standard_normal((B, T, H * K)), dtype)
    seg = np.zeros((B, T), np.int32)
    seg[0, 13:] = 1  # a boundary inside a block
    seg[0, 32:] = 2  # one on a block edge
    seg[0, 33:] = 3  # a one-token document
    seg[1, 50:] = 7
    return x, kernel, dout, jnp.asarray(seg)


def _oracle_fwd(x, kernel, seg, normalize):
    """float64: per output token the taps of its own document only, SiLU, per-head L2 norm; also the pieces."""
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    seg = np.zeros(x.shape[:2], np.int64) if seg is None else np.asarray(seg)
    c = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for w in range(W):
                src = t - (W - 1) + w
                if src >= 0 and seg[b, src:t + 1].min() == seg[b, src:t + 1].max():
                    c[b, t] += kernel[w] * x[b, src]
    sig = 1 / (1 + np.exp(-c))
    s = c * sig
    if not normalize:
        return s, (c, sig, s, None)
    sh = s.reshape(B, T, H, K)
    rho = np.sqrt((sh * sh).sum(-1, keepdims=True) + 1e-6)
    return (sh / rho).reshape(s.shape), (c, sig, s, rho)


def _oracle_grads(x, kernel, seg, normalize, dout):
    """float64 gradient of sum(out * dout) w.r.t. x and the kernel, by the chain rule written out."""
    _, (c, sig, s, rho) = _oracle_fwd(x, kernel, seg, normalize)
    x, kernel, dout = (np.asarray(a, np.float64) for a in (x, kernel, dout))
    seg = np.zeros(x.shape[:2], np.int64) if seg is None else np.asarray(seg)
    ds = dout
    if normalize:
        sh, dh = s.reshape(B, T, H, K), dout.reshape(B, T, H, K)
        ds = (dh / rho - sh * (sh * dh).sum(-1, keepdims=True) / rho ** 3).reshape(s.shape)
    dc = ds * (sig + c * sig * (1 - sig))
    dx, dk = np.zeros_like(x), np.zeros_like(kernel)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for w in range(W):
                src = t - (W - 1) + w
                if src >= 0 and seg[b, src:t + 1].min() == seg[b, src:t + 1].max():
                    dx[b, src] += kernel[w] * dc[b, t]
                    dk[w] += x[b, src] * dc[b, t]
    return dx, dk


def _kernel_fn(seg, normalize, backend, block_t=BLOCK, bwd_block_t=None):
    return lambda x, k: conv_prologue(x, k, seg, head_dim=K, normalize=normalize, backend=backend, block_t=block_t,
                                      bwd_block_t=bwd_block_t)


@pytest.mark.parametrize("normalize,packed,tiles", [
    (True, True, (BLOCK, None)), (True, False, (BLOCK, None)), (False, True, (BLOCK, None)),
    (False, False, (BLOCK, None)), (True, True, (2 * BLOCK, BLOCK))])
def test_prologue_kernel_and_gradient_equal_float64_oracle(normalize, packed, tiles):
    """Also with the backward on its own (smaller) tile than the forward (the last case)."""
    x, kernel, dout, seg = _inputs(jnp.float32)
    seg = seg if packed else None
    out, vjp = jax.vjp(_kernel_fn(seg, normalize, "interpret", *tiles), x, kernel)
    dx, dk = vjp(dout)
    ref_out, _ = _oracle_fwd(x, kernel, seg, normalize)
    ref_dx, ref_dk = _oracle_grads(x, kernel, seg, normalize, dout)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), ref_dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dk), ref_dk, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("normalize", [True, False])
def test_prologue_kernel_equals_xla_path_in_bf16(normalize):
    x, kernel, dout, seg = _inputs(jnp.bfloat16, seed=1)
    out, vjp = jax.vjp(_kernel_fn(seg, normalize, "interpret"), x, kernel)
    ref, ref_vjp = jax.vjp(_kernel_fn(seg, normalize, None), x, kernel)
    assert out.dtype == ref.dtype == jnp.bfloat16
    (dx, dk), (ref_dx, ref_dk) = vjp(dout), ref_vjp(dout)
    assert dx.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    # equal up to one bf16 rounding of differently ordered f32 sums
    np.testing.assert_allclose(f(out), f(ref), atol=2 ** -7, rtol=2 ** -7)
    np.testing.assert_allclose(f(dx), f(ref_dx), atol=2 ** -6 * np.abs(f(ref_dx)).max(), rtol=2 ** -7)
    np.testing.assert_allclose(f(dk), f(ref_dk), atol=1e-3 * np.abs(f(ref_dk)).max(), rtol=1e-2)


def test_prologue_refuses_shapes_it_does_not_take():
    assert conv_prologue_unsupported(64, 32, 16, 16) is None
    assert "multiple of block_t" in conv_prologue_unsupported(60, 32, 16, 16)
    assert "power of two" in conv_prologue_unsupported(64, 48, 24, 16)
    x, kernel, _, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="multiple of block_t"):
        conv_prologue(x[:, :60], kernel, None, head_dim=K, normalize=True, backend="interpret", block_t=BLOCK)
    with pytest.raises(ValueError, match="backend"):
        conv_prologue(x, kernel, None, head_dim=K, normalize=True, backend="tpu")


def test_prologue_lowers_to_two_triton_kernels_for_cuda():
    x = jax.ShapeDtypeStruct((B, T, H * K), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((W, H * K), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(x, k, seg):
        return jnp.sum(conv_prologue(x, k, seg, head_dim=K, normalize=True, backend="gpu", block_t=BLOCK)
                       .astype(jnp.float32))

    count, names = triton_kernels(jax.value_and_grad(loss, argnums=(0, 1)), x, k, seg,
                                  name_pattern=r"kda_conv_prologue_\w+")
    assert count == 2 and names == ["kda_conv_prologue_bwd", "kda_conv_prologue_fwd"]


def test_kda_layer_with_the_prologue_kernel_equals_its_xla_prologue():
    """The KDA layer's training forward (tiny config, f32, the "pallas" core through the interpreter) with
    kda_conv_impl="pallas" gives the output and every parameter / input gradient of kda_conv_impl="xla" on packed
    documents; "auto" keeps XLA off a GPU."""
    from flax import nnx

    import configs
    from k3jax.layers.kda import KDA
    from k3jax.ops.conv import prologue_backend

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32", "kda_impl=pallas",
                                       "kda_conv_block_t=16"])
    assert prologue_backend("auto", 48, 64, 32, 16) is None
    assert prologue_backend("pallas", 48, 64, 32, 16) == "interpret"
    with pytest.raises(ValueError, match="multiple of block_t"):
        prologue_backend("pallas", 40, 64, 32, 16)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 48, base.hidden_size)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 2]], [9, 20, 19], axis=1).astype(np.int32))

    def output_and_grads(conv_impl):
        return layer_output_and_grads(KDA(base.replace(kda_conv_impl=conv_impl), rngs=nnx.Rngs(7)), x, seg)

    def traced_kernels(conv_impl):
        graphdef, state = nnx.split(KDA(base.replace(kda_conv_impl=conv_impl), rngs=nnx.Rngs(7)))
        return str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, seg))(state, x)).count("kda_conv_prologue")

    assert traced_kernels("pallas") >= 3 and traced_kernels("xla") == 0  # q, k and v through the kernel
    y_kernel, g_kernel = output_and_grads("pallas")
    y_xla, g_xla = output_and_grads("xla")
    np.testing.assert_allclose(np.asarray(y_kernel), np.asarray(y_xla), rtol=1e-5, atol=1e-5)
    assert len(g_kernel) == len(g_xla) > 5
    for g, ref in zip(g_kernel, g_xla):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4, atol=1e-5 * np.abs(ref).max())
