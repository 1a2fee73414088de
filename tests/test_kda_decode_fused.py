"""The KDA decode kernel with its prologue fused (`pallas_kernels.kda.decode_fused`: short conv, SiLU, L2 norms,
gate and β activations, padding masks, delta step) through the Pallas interpreter equals a float64 NumPy oracle of
the same math (f32 and bf16 activations, a padded slot keeps its state), refuses bad shapes by name and lowers for
CUDA; with the output epilogue (RMSNorm and gate) it equals the oracle's gated output; the KDA layer's cached
one-token decode with kda_decode_fusion="prologue" / "prologue_output" equals the XLA recurrent path
(outputs, recurrent state, conv history), and a full tiny model decodes with "prologue_output" to the same logits
as with "step"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_ops
from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.kda.decode_fused import kda_decode_fused


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


def _round(x, dtype):
    return np.asarray(jnp.asarray(x, dtype), np.float64)


def _oracle(proj, hist, conv_w, z, a_log, dt_bias, b_raw, valid, state, scale, lower_bound, act_dtype):
    """float64: conv over [hist; proj] per channel, SiLU, rounding to the activation dtype where the model rounds,
    L2 norms, the lower-bounded gate and β (zero where not valid), then the delta-rule step per (batch, head)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    b, h, kd = np.shape(z)
    window = np.concatenate([f(hist), f(proj)[:, None]], axis=1)  # [B, W, 3, P]
    c = np.einsum("bwcp,wcp->bcp", window, f(conv_w))
    y = _round(c / (1 + np.exp(-c)), act_dtype).reshape(b, 3, h, kd)
    q, k, v = y[:, 0], y[:, 1], y[:, 2]
    q = _round(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), act_dtype)
    k = _round(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), act_dtype)
    ok = f(valid)[:, None] != 0
    g = lower_bound / (1 + np.exp(-np.exp(f(a_log))[None, :, None] * (f(z) + f(dt_bias)[None])))
    g = np.where(ok[..., None], g, 0.0)
    beta = np.where(ok, 1 / (1 + np.exp(-f(b_raw))), 0.0)
    s = np.exp(g)[..., None] * f(state)
    pred = np.einsum("bhk,bhkv->bhv", k, s)
    s = s + k[..., None] * (beta[..., None] * (v - pred))[:, :, None, :]
    o = np.einsum("bhk,bhkv->bhv", q * scale, s)
    return o, s


def _unstacked(args):
    """The kernel's argument form of `_inputs` (stacked, as the oracle takes them): q, k, v projections and conv
    kernels as triples."""
    proj, hist, conv_w, *rest = args
    return (tuple(proj[:, c] for c in range(3)), hist, tuple(conv_w[:, c] for c in range(3)), *rest)


def _inputs(b, h, kd, wm1, dtype, seed):
    rng = np.random.default_rng(seed)
    p = h * kd
    proj = jnp.asarray(rng.standard_normal((b, 3, p)), dtype)
    hist = jnp.asarray(rng.standard_normal((b, wm1, 3, p)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((wm1 + 1, 3, p)) / 2, jnp.float32)
    z = jnp.asarray(rng.standard_normal((b, h, kd)), dtype)
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((h, kd)) * 0.5 - 3, jnp.float32)
    b_raw = jnp.asarray(rng.standard_normal((b, h)), dtype)
    valid = jnp.asarray([0] + [1] * (b - 1), jnp.int32)
    state = jnp.asarray(rng.standard_normal((b, h, kd, kd)), jnp.float32)
    return proj, hist, conv_w, z, a_log, dt_bias, b_raw, valid, state


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)], ids=["f32", "bf16"])
def test_fused_decode_equals_float64_oracle(dtype, tol):
    args = _inputs(b=3, h=2, kd=32, wm1=3, dtype=dtype, seed=5)
    scale = 32 ** -0.5
    o, s = kda_decode_fused(*_unstacked(args), scale=scale, lower_bound=-5.0, backend="interpret", block_v=16)
    want_o, want_s = _oracle(*args, scale, -5.0, dtype)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert _rel_err(o, want_o) < tol and _rel_err(s, want_s) < tol
    # slot 0 is padding: its state comes back bit-identical
    np.testing.assert_array_equal(np.asarray(s)[0].view(np.uint32), np.asarray(args[-1])[0].view(np.uint32))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)], ids=["f32", "bf16"])
def test_fused_output_epilogue_equals_float64_oracle(dtype, tol):
    """out_gate / out_norm: the layer's per-head RMSNorm (of o rounded to the activation dtype) times the gain and
    the sigmoid gate, rounded to the activation dtype; one program per head whatever block_v asked."""
    args = _inputs(b=3, h=2, kd=32, wm1=3, dtype=dtype, seed=7)
    rng = np.random.default_rng(8)
    gate = jnp.asarray(rng.standard_normal((3, 2 * 32)), dtype)
    gain = jnp.asarray(rng.uniform(0.5, 1.5, 32), jnp.float32)
    scale = 32 ** -0.5
    o, s = kda_decode_fused(*_unstacked(args), scale=scale, lower_bound=-5.0, backend="interpret", block_v=16,
                            out_gate_bp=gate, out_norm_v=gain, out_eps=1e-5)
    want_o, want_s = _oracle(*args, scale, -5.0, dtype)
    o_r = _round(want_o, dtype)
    normed = o_r / np.sqrt((o_r * o_r).mean(-1, keepdims=True) + 1e-5) * np.asarray(gain, np.float64)
    sig = 1 / (1 + np.exp(-np.asarray(gate, np.float64).reshape(3, 2, 32)))
    assert o.dtype == dtype and o.shape == (3, 2, 32)
    assert _rel_err(o, normed * sig) < tol and _rel_err(s, want_s) < tol
    with pytest.raises(ValueError, match="needs both"):
        kda_decode_fused(*_unstacked(args), scale=scale, lower_bound=-5.0, backend="interpret", out_gate_bp=gate)
    with pytest.raises(ValueError, match="out_gate_bp must have shape"):
        kda_decode_fused(*_unstacked(args), scale=scale, lower_bound=-5.0, backend="interpret",
                         out_gate_bp=gate[:, :32], out_norm_v=gain)


def test_bad_shapes_are_refused_by_name():
    args = list(_unstacked(_inputs(b=2, h=2, kd=32, wm1=3, dtype=jnp.float32, seed=0)))
    bad = list(args)
    bad[5] = bad[5][:, :16]
    with pytest.raises(ValueError, match="dt_bias must have shape"):
        kda_decode_fused(*bad, scale=1.0, lower_bound=-5.0, backend="interpret")
    bad = list(args)
    bad[1] = bad[1].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="share the activation dtype"):
        kda_decode_fused(*bad, scale=1.0, lower_bound=-5.0, backend="interpret")
    with pytest.raises(ValueError, match="unknown backend"):
        kda_decode_fused(*args, scale=1.0, lower_bound=-5.0, backend="tpu")
    with pytest.raises(ValueError, match="block_v must be"):
        kda_decode_fused(*args, scale=1.0, lower_bound=-5.0, backend="interpret", block_v=24)
    bad = list(args)
    bad[1], bad[2] = bad[1][:, :0], tuple(w[:1] for w in bad[2])
    with pytest.raises(ValueError, match="W-1 >= 1"):
        kda_decode_fused(*bad, scale=1.0, lower_bound=-5.0, backend="interpret")
    bad = list(args)
    bad[0] = bad[0][:2]
    with pytest.raises(ValueError, match=r"\(q, k, v\) triples"):
        kda_decode_fused(*bad, scale=1.0, lower_bound=-5.0, backend="interpret")
    bad = list(args)
    bad[2] = (bad[2][0], bad[2][1][:, :16], bad[2][2])
    with pytest.raises(ValueError, match=r"conv_w\[k\] must have shape"):
        kda_decode_fused(*bad, scale=1.0, lower_bound=-5.0, backend="interpret")


def test_kernel_lowers_for_cuda():
    s, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    b, h, k, w = 64, 12, 128, 4
    args = ((s((b, h * k), bf),) * 3, s((b, w - 1, 3, h * k), bf), (s((w, h * k), f32),) * 3, s((b, h, k), bf),
            s((h,), f32), s((h, k), f32), s((b, h), bf), s((b,), jnp.int32), s((b, h, k, k), f32))
    count, names = triton_kernels(lambda *a: kda_decode_fused(*a, scale=k ** -0.5, lower_bound=-5.0), *args,
                                  name_pattern=r"kda_[a-z_]+")
    assert count == 1 and names == ["kda_decode_fused"]
    # the output-epilogue form (one program per head), at 8 warps
    count, names = triton_kernels(
        lambda *a: kda_decode_fused(*a[:-2], scale=k ** -0.5, lower_bound=-5.0, warps=8, out_gate_bp=a[-2],
                                    out_norm_v=a[-1]),
        *args, s((b, h * k), bf), s((k,), f32), name_pattern=r"kda_[a-z_]+")
    assert count == 1 and names == ["kda_decode_fused"]


@pytest.mark.parametrize("block_v,fusion", [(32, "prologue"), (16, "prologue"), (16, "prologue_output")],
                         ids=["whole_head", "two_value_blocks", "output_epilogue"])
def test_layer_decode_with_the_fused_prologue_equals_the_recurrent_path(monkeypatch, block_v, fusion):
    import pallas_kernels.kda.decode_fused as fused_mod
    from tests.conftest import KDALayerDecode

    setup = KDALayerDecode(seed=13)
    params, x, state, valid = setup.args
    decode = setup.decode
    calls = []
    real = fused_mod.kda_decode_fused
    monkeypatch.setattr(fused_mod, "kda_decode_fused",
                        lambda *a, **kw: calls.append((kw["block_v"], "out_gate_bp" in kw)) or real(*a, **kw))
    y_ref, st_ref = jax.jit(decode(kda_impl="chunked"))(params, x, state, valid)
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "interpret")
    y, st = jax.jit(decode(kda_impl="pallas", kda_decode_fusion=fusion, kda_decode_block_v=block_v))(
        params, x, state, valid)
    assert calls == [(block_v, fusion == "prologue_output")]
    rows = np.asarray(valid) == 1
    assert _rel_err(np.asarray(y)[rows], np.asarray(y_ref)[rows]) < 2e-5
    assert _rel_err(st.state_bhkv, st_ref.state_bhkv) < 2e-5
    np.testing.assert_array_equal(np.asarray(st.conv_bwcp), np.asarray(st_ref.conv_bwcp))
    np.testing.assert_array_equal(np.asarray(st.state_bhkv)[1].view(np.uint32),
                                  np.asarray(state.state_bhkv)[1].view(np.uint32))


@pytest.mark.slow
def test_model_decode_with_the_fused_prologue_equals_the_step_kernel(monkeypatch):
    import configs
    import pallas_kernels.kda.decode_fused as fused_mod
    from tests.conftest import DecodeHarness

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(
        scan_layers=False, kda_impl="pallas")
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "interpret")
    calls = []
    real = fused_mod.kda_decode_fused
    monkeypatch.setattr(fused_mod, "kda_decode_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = DecodeHarness(base, seed=6)
    cache = jax.tree.map(lambda x: jnp.asarray(model.rng.standard_normal(x.shape), x.dtype)
                         if jnp.issubdtype(x.dtype, jnp.floating) else x, model.cache(2, 64))
    ids, valid = model.ids(2, 1), jnp.asarray([1, 1])
    out = {}
    for fusion in ("step", "prologue_output"):  # the default fused form ("prologue": the layer test above)
        calls.clear()
        out[fusion] = model.step(kda_decode_fusion=fusion)(model.params, ids, cache, valid)
        kda_layers = base.num_hidden_layers - len(base.full_attn_layers)
        assert len(calls) == (0 if fusion == "step" else kda_layers)
    (want, want_cache), (got, got_cache) = out["step"], out["prologue_output"]
    assert _rel_err(got, want) < 1e-5
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        assert _rel_err(a, b) < 1e-5 if jnp.issubdtype(a.dtype, jnp.floating) else np.array_equal(a, b)
