"""The fused AttnRes read + RMSNorm kernel (`pallas_kernels.attn_res.mix_norm`) through the Pallas interpreter
equals a float64 NumPy oracle (f32 and bf16 activations, no / some / all bank rows filled, row counts that are not
a multiple of the row block); bad inputs are refused by name; the kernel lowers for CUDA on this host; a tiny model
decoding with attn_res_impl="pallas" takes the kernel for every read of its unrolled stack and gives the logits of
attn_res_impl="xla", while scanned layers (traced bank fill) and a 300-row prefill stay on XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attn_res import mix_norm
from pallas_kernels.cuda_lowering import triton_kernels


def _oracle(live, bank, num_filled, key_gain, query, out_gain, eps, out_eps, act_dtype):
    """float64 AttnRes read (softmax over depth of rmsnorm(source) . (key_gain * query)) then the released RMSNorm
    (gain after the cast back to the activation dtype); roundings to the activation dtype where the model has them."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    sources = np.concatenate([f(bank)[:num_filled], f(live)[None]], axis=0)  # [S, M, D]
    q = f(key_gain) * f(query)
    normed = sources / np.sqrt(np.mean(sources ** 2, axis=-1, keepdims=True) + eps)
    scores = normed @ q  # [S, M]
    probs = np.exp(scores - scores.max(0))
    probs /= probs.sum(0)
    mix = np.einsum("sm,smd->md", probs, sources)
    mix = f(jnp.asarray(mix, act_dtype))
    y = f(jnp.asarray(mix / np.sqrt(np.mean(mix ** 2, axis=-1, keepdims=True) + out_eps), act_dtype))
    return f(out_gain) * y


def _inputs(m, d, n, dtype, gain_dtype, seed):
    rng = np.random.default_rng(seed)
    live = jnp.asarray(rng.standard_normal((m, d)), dtype)
    bank = jnp.asarray(rng.standard_normal((n, m, d)) * rng.uniform(0.5, 3.0, (n, 1, 1)), dtype)
    key_gain = jnp.asarray(1 + 0.2 * rng.standard_normal(d), gain_dtype)
    query = jnp.asarray(rng.standard_normal(d) / np.sqrt(d) * 8, gain_dtype)  # scores of a few units: a real softmax
    out_gain = jnp.asarray(1 + 0.2 * rng.standard_normal(d), gain_dtype)
    return live, bank, key_gain, query, out_gain


@pytest.mark.parametrize("m,d,n,num_filled,dtype,gain_dtype,tol", [
    (6, 96, 5, 0, jnp.float32, jnp.float32, 2e-6),
    (6, 96, 5, 3, jnp.float32, jnp.float32, 2e-6),
    (5, 64, 4, 4, jnp.float32, jnp.float32, 2e-6),
    (16, 1536, 5, 5, jnp.bfloat16, jnp.bfloat16, 1.6e-2),
    (3, 128, 2, 1, jnp.bfloat16, jnp.float32, 1.6e-2),
    (256, 32, 3, 2, jnp.float32, jnp.float32, 2e-6),
], ids=["f32-none-filled", "f32-some", "f32-all-odd-rows", "bf16-k3_gpu-width", "bf16-f32-gains",
        "f32-two-rows-per-program"])
def test_mix_norm_equals_float64_oracle(m, d, n, num_filled, dtype, gain_dtype, tol):
    live, bank, key_gain, query, out_gain = _inputs(m, d, n, dtype, gain_dtype, seed=m * 100 + num_filled)
    got = mix_norm(live, bank, num_filled, key_gain, query, out_gain, eps=1e-6, out_eps=1e-5, backend="interpret")
    assert got.shape == (m, d) and got.dtype == jnp.promote_types(gain_dtype, dtype)
    want = _oracle(live, bank, num_filled, key_gain, query, out_gain, 1e-6, 1e-5, dtype)
    # bf16: the kernel and the oracle may round the mix / the normalised row to different neighbours (1 ulp)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < tol, err


def test_bad_inputs_are_refused_by_name():
    live, bank, key_gain, query, out_gain = _inputs(4, 64, 3, jnp.float32, jnp.float32, seed=0)
    call = lambda *a, **k: mix_norm(*a, eps=1e-6, **{"backend": "interpret", **k})  # noqa: E731
    with pytest.raises(ValueError, match="expected live"):
        call(live, bank[:, :3], 1, key_gain, query, out_gain)
    with pytest.raises(ValueError, match="query must be"):
        call(live, bank, 1, key_gain, query[:32], out_gain)
    with pytest.raises(ValueError, match="num_filled"):
        call(live, bank, 4, key_gain, query, out_gain)
    with pytest.raises(ValueError, match="share a dtype"):
        call(live, bank.astype(jnp.bfloat16), 1, key_gain, query, out_gain)
    with pytest.raises(ValueError, match="power-of-two divisor"):
        call(live[:, :60], bank[..., :60], 1, key_gain[:60], query[:60], out_gain[:60])
    with pytest.raises(ValueError, match="unknown backend"):
        call(live, bank, 1, key_gain, query, out_gain, backend="tpu")
    wide = _inputs(4, 144, 3, jnp.float32, jnp.float32, seed=1)  # 9 slices of 16 columns: over MAX_CHUNKS
    with pytest.raises(ValueError, match="slices"):
        call(wide[0], wide[1], 1, *wide[2:])
    with pytest.raises(ValueError, match="block_rows"):
        call(live, bank, 1, key_gain, query, out_gain, block_rows=3)
    with pytest.raises(ValueError, match="warps"):
        call(live, bank, 1, key_gain, query, out_gain, warps=3)


def test_tuning_knobs_do_not_change_the_result():
    """Rows per program and warps only change how the work is laid out: 1, 2 and 4 rows per program agree (to f32
    rounding: the interpreter's row reductions may vectorise differently per block shape)."""
    live, bank, key_gain, query, out_gain = _inputs(8, 96, 4, jnp.float32, jnp.float32, seed=5)
    outs = [mix_norm(live, bank, 3, key_gain, query, out_gain, eps=1e-6, backend="interpret", block_rows=r, warps=w)
            for r, w in ((1, 4), (2, 1), (4, 8))]
    for got in outs[1:]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(outs[0]), rtol=1e-6, atol=1e-6)


def test_kernel_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for m, d, n, filled in ((64, 1536, 5, 5), (1, 4096, 8, 3)):  # k3_gpu; the widest D (8 slices)
        args = (s((m, d), bf), s((n, m, d), bf), s((d,), bf), s((d,), bf), s((d,), bf))
        count, names = triton_kernels(lambda *a: mix_norm(*a[:2], filled, *a[2:], eps=1e-6), *args,
                                      name_pattern=r"k3_[a-z_]+")
        assert count == 1 and names == ["k3_attn_res_mix_norm"]


# The default suite decodes a whole model with this kernel in test_decode_fusions.py (every opt-in decode
# fusion together, each kernel call counted); this one alone compiles ~40 s on 2 CPU cores: slow suite.
@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])  # scanned: the fallback
def test_model_decode_with_the_fused_reads_equals_xla(monkeypatch, scan_layers):
    import configs

    from k3jax.layers import attn_res
    from tests.conftest import DecodeHarness, max_rel_err

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(scan_layers=scan_layers)
    model = DecodeHarness(base, seed=3)
    calls = []
    real = attn_res._fused_read_norm
    monkeypatch.setattr(attn_res, "_fused_read_norm", lambda *a: calls.append(a[5]) or real(*a))
    ids, cache, valid = model.ids(2, 1), model.cache(2, 320), jnp.asarray([1, 1])
    want, want_cache = model.step(attn_res_impl="xla")(model.params, ids, cache, valid)
    got, got_cache = model.step(attn_res_impl="pallas")(model.params, ids, cache, valid)
    layers = base.num_hidden_layers
    snapshots = base.num_attn_res_snapshots
    if scan_layers:  # only the layers outside a scanned group and the final read know their fill statically
        unscanned = sum(len(g.pattern) for g in base.layer_groups() if g.num_repeats == 1)
        assert unscanned < layers and len(calls) == 2 * unscanned + 1 and calls[-1] == snapshots
    else:  # two reads per layer + the final one, with the bank filled as the layer index says
        assert len(calls) == 2 * layers + 1
        assert calls[:4] == [0, 1, 1, 1] and calls[-1] == snapshots
    assert max_rel_err(got, want) < 1e-5
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-5)
    calls.clear()
    prefill = model.step(attn_res_impl="pallas")  # 2 x 150 = 300 rows > DECODE_MAX_ROWS
    prefill(model.params, model.ids(2, 150), cache, jnp.asarray([150, 150]))
    assert not calls


def test_fused_read_gradient_is_the_xla_composites():
    """The custom VJP differentiates the XLA composite: gradients through the dispatch equal the XLA path's."""
    from k3jax.layers import attn_res

    live, bank, key_gain, query, out_gain = _inputs(4, 64, 3, jnp.float32, jnp.float32, seed=7)
    w = jnp.asarray(np.random.default_rng(8).standard_normal((4, 64)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * w)

    fused = loss(lambda *a: attn_res._fused_read_norm(*a, 2, 1e-6, 1e-6, "interpret"))
    xla = loss(lambda *a: attn_res._composite(*a, 2, 1e-6, 1e-6))
    args = (live, bank, key_gain, query, out_gain)
    np.testing.assert_allclose(fused(*args), xla(*args), rtol=1e-5)
    for g, r in zip(jax.grad(fused, argnums=range(5))(*args), jax.grad(xla, argnums=range(5))(*args)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_gpu_only_decode_kernels_take_xla_on_tpu_and_the_interpreter_on_cpu(monkeypatch):
    """The opt-in decode fusions have no Mosaic variant: traced for a TPU their dispatchers choose the XLA path
    (None), on a CPU the interpreter, on a GPU the Triton kernel."""
    import configs
    from flax import nnx

    import sharding.mesh as mesh_lib
    from k3jax.layers import attn_res
    from k3jax.layers.moe import LatentMoE
    from k3jax.ops import linear

    cfg = configs.get_config("tiny", ["attn_res_impl=pallas", "moe_route_impl=pallas", "decode_matmul_impl=pallas"])
    live, bank = jnp.zeros((4, 1, cfg.hidden_size)), jnp.zeros((3, 4, 1, cfg.hidden_size))
    moe = nnx.eval_shape(lambda: LatentMoE(cfg, rngs=nnx.Rngs(0)))
    for platform, want in (("tpu", None), (None, "interpret"), ("gpu", "gpu")):
        monkeypatch.setattr(mesh_lib, "traced_accelerator", lambda p=platform: p)
        assert attn_res._kernel_backend(cfg, live, bank, 2) == want
        assert moe._plan_backend(4, 1) == want
        assert linear._kernel_backend(cfg, 4, 64, 64) == want
