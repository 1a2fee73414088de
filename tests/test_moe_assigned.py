"""The plan-free decode expert kernels (`pallas_kernels.moe.assigned`, the Pallas interpreter standing in for the
GPU) equal a float64 NumPy walk over the assignments, including experts with more rows than one tile; the MoE
layer's `experts_assigned` equals every expert on every token; and a tiny model decodes with
`moe_decode_experts="assigned"` to the planned path's logits, using the kernels only in decode steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.gmm import DECODE_TILING, epilogue
from pallas_kernels.moe import assigned


def _routing(rng, n, k, e, hot=None, hot_tokens=0):
    """Distinct experts per token; the first `hot_tokens` tokens all pick expert `hot` (a skewed expert)."""
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)])
    for t in range(hot_tokens):
        ids[t] = [hot] + [x for x in rng.permutation(e) if x != hot][:k - 1]
    return ids.astype(np.int32)


def _glu64(z, ids, w1, w3):
    """float64 per-assignment products, then the kernel's f32 activation: [N·k, M]."""
    g = np.einsum("nl,nklm->nkm", z.astype(np.float64), w1[ids].astype(np.float64))
    u = np.einsum("nl,nklm->nkm", z.astype(np.float64), w3[ids].astype(np.float64))
    act = epilogue.glu_f32(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32), "situ", 4.0, 25.0)
    return np.asarray(act, np.float64).reshape(-1, w1.shape[2])


@pytest.mark.parametrize("n,k,e,lat,m,hot_tokens,splits", [
    (37, 4, 8, 64, 128, 20, 2),  # expert 3 gets 20 + rows: two row tiles, one per split
    (5, 3, 6, 32, 32, 0, 1),  # k not a power of two, one split, tiny widths (capped tiles)
    (64, 8, 16, 128, 256, 40, 3),  # three row tiles of the hot expert over three splits; wide outputs (2 tn)
])
def test_kernels_equal_a_float64_walk_of_the_assignments(n, k, e, lat, m, hot_tokens, splits):
    rng = np.random.default_rng(n + k)
    z = rng.standard_normal((n, lat)).astype(np.float32)
    ids = _routing(rng, n, k, e, hot=3, hot_tokens=hot_tokens)
    w1, w3 = (rng.standard_normal((e, lat, m)).astype(np.float32) / np.sqrt(lat) for _ in range(2))
    w2 = rng.standard_normal((e, m, lat)).astype(np.float32) / np.sqrt(m)
    h = assigned.assigned_glu(jnp.asarray(z), jnp.asarray(ids), jnp.asarray(w1), jnp.asarray(w3),
                              activation="situ", beta1=4.0, beta2=25.0, splits=splits, backend="interpret")
    assert h.shape == (n * k + DECODE_TILING.tm, m) and h.dtype == jnp.float32
    want_h = _glu64(z, ids, w1, w3)
    np.testing.assert_allclose(np.asarray(h[:n * k]), want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    out = assigned.assigned_down(h, jnp.asarray(ids), jnp.asarray(w2), splits=splits, backend="interpret")
    want = np.einsum("nkm,nkml->nkl", np.asarray(h[:n * k], np.float64).reshape(n, k, m),
                     w2[ids].astype(np.float64)).reshape(n * k, lat)
    np.testing.assert_allclose(np.asarray(out[:n * k]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_column_launch_order_gives_the_same_rows():
    """order="column" only permutes which program computes which (expert, column tile): identical results, here
    with two column tiles and a hot expert walked by three splits."""
    rng = np.random.default_rng(11)
    n, k, e, lat, m = 64, 8, 16, 128, 256
    z = jnp.asarray(rng.standard_normal((n, lat)), jnp.float32)
    ids = jnp.asarray(_routing(rng, n, k, e, hot=3, hot_tokens=40))
    w1, w3 = (jnp.asarray(rng.standard_normal((e, lat, m)) / np.sqrt(lat), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((e, m, lat)) / np.sqrt(m), jnp.float32)
    outs = {}
    for order in assigned.ORDERS:
        h = assigned.assigned_glu(z, ids, w1, w3, activation="situ", beta1=4.0, beta2=25.0, splits=3,
                                  backend="interpret", order=order)
        outs[order] = (h[:n * k], assigned.assigned_down(h, ids, w2, splits=3, backend="interpret",
                                                         order=order)[:n * k])
    for a, b in zip(outs["expert"], outs["column"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="unknown order"):
        assigned.assigned_down(outs["expert"][0], ids, w2, backend="interpret", order="row")


def test_bf16_rows_match_the_planned_kernels_rounding():
    """bf16 z and weights: f32 products, the activation in f32, bf16 hidden rows, as `gmm_glu`'s decode call."""
    from pallas_kernels.gmm import gmm_glu

    rng = np.random.default_rng(5)
    n, k, e, lat, m = 16, 4, 8, 64, 128
    ids = _routing(rng, n, k, e)
    z = jnp.asarray(rng.standard_normal((n, lat)), jnp.bfloat16)
    w1, w3 = (jnp.asarray(rng.standard_normal((e, lat, m)) / 8, jnp.bfloat16) for _ in range(2))
    got = assigned.assigned_glu(z, jnp.asarray(ids), w1, w3, activation="situ", beta1=4.0, beta2=25.0,
                                backend="interpret")[:n * k]
    order = np.argsort(ids.reshape(-1), kind="stable")
    sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=e), jnp.int32)
    planned = gmm_glu(z[order // k], w1, w3, sizes, activation="situ", beta1=4.0, beta2=25.0,
                      tiling=DECODE_TILING, backend="interpret")
    want = np.empty((n * k, m), np.float32)
    want[order] = np.asarray(planned, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    assert np.mean(np.asarray(got, np.float32) == want) > 0.99  # the same f32 sums, one bf16 rounding


def test_layer_combine_equals_every_expert_on_every_token():
    from k3jax.layers import moe
    from tests.conftest import moe_problem

    p = moe_problem(9, seed=2)
    got = moe.experts_assigned(p.z, p.weights, p.experts, p.w1, p.w3, p.w2, p.cfg, "interpret")
    want = moe.experts_dense(p.z, p.weights, p.experts, p.w1, p.w3, p.w2, p.cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_configured_load_tiles_reach_both_kernels_and_keep_the_result():
    from k3jax.config import ConfigError
    from k3jax.layers import moe
    from k3jax.ops import moe as moe_ops
    from tests.conftest import moe_problem

    p = moe_problem(9, seed=2)
    cfg = p.cfg.replace(moe_assigned_glu_tiling="16-16-2-2", moe_assigned_down_tiling="16-32-1-3")
    glu, down = moe_ops.assigned_tilings(cfg)
    assert (glu.tk, glu.tn, glu.num_warps, glu.num_stages) == (16, 16, 2, 2)
    assert (down.tk, down.tn, down.num_warps, down.num_stages, down.tm) == (
        16, 32, 1, 3, cfg.runtime.moe_decode_row_tile)
    assert moe_ops.assigned_tilings(p.cfg) == (assigned.ASSIGNED_TILING,) * 2
    got = moe.experts_assigned(p.z, p.weights, p.experts, p.w1, p.w3, p.w2, cfg, "interpret")
    want = moe.experts_dense(p.z, p.weights, p.experts, p.w1, p.w3, p.w2, p.cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    for bad in ("64-128-4", "48-128-4-4", "64-128-4-0", "a-b-c-d"):
        with pytest.raises(ConfigError, match="moe_assigned_glu_tiling"):
            p.cfg.replace(moe_assigned_glu_tiling=bad)


def test_differentiating_through_the_assigned_kernels_is_refused_by_name():
    from k3jax.layers import moe
    from k3jax.ops.gmm import InferenceOnlyError
    from tests.conftest import moe_problem

    p = moe_problem(4, seed=1)
    loss = lambda z: moe.experts_assigned(z, p.weights, p.experts, p.w1, p.w3, p.w2, p.cfg, "interpret").sum()
    with pytest.raises(InferenceOnlyError, match="moe_decode_experts='planned'"):
        jax.grad(loss)(p.z)


def test_bad_inputs_are_refused_by_name():
    z, ids = jnp.zeros((4, 64), jnp.float32), jnp.zeros((4, 2), jnp.int32)
    w = jnp.zeros((8, 64, 128), jnp.float32)
    with pytest.raises(ValueError, match="unknown backend"):
        assigned.assigned_glu(z, ids, w, w, backend="tpu", beta1=4.0, beta2=25.0)
    with pytest.raises(ValueError, match="does not fit"):
        assigned.assigned_glu(z[:3], ids, w, w, backend="interpret", beta1=4.0, beta2=25.0)
    with pytest.raises(ValueError, match="decode sizes only"):
        assigned.assigned_glu(jnp.zeros((300, 64)), jnp.zeros((300, 2), jnp.int32), w, w, backend="interpret",
                              beta1=4.0, beta2=25.0)
    with pytest.raises(ValueError, match="differ"):
        assigned.assigned_glu(z, ids, w, w[:, :, :64], backend="interpret", beta1=4.0, beta2=25.0)
    with pytest.raises(ValueError, match="does not fit"):
        assigned.assigned_down(jnp.zeros((7, 128)), ids, jnp.zeros((8, 128, 64)), backend="interpret")


def test_kernels_lower_for_cuda():
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    glu = lambda z, i, a, b: assigned.assigned_glu(z, i, a, b, activation="situ", beta1=4.0, beta2=25.0)
    count, names = triton_kernels(glu, s((64, 768), bf), s((64, 8), jnp.int32), s((64, 768, 768), bf),
                                  s((64, 768, 768), bf), name_pattern=r"k3_[a-z_]+")
    assert count == 1 and names == ["k3_assigned_glu"]
    count, names = triton_kernels(assigned.assigned_down, s((528, 768), bf), s((64, 8), jnp.int32),
                                  s((64, 768, 768), bf), name_pattern=r"k3_[a-z_]+")
    assert count == 1 and names == ["k3_assigned_down"]


@pytest.mark.slow
def test_model_decode_with_assigned_experts_equals_the_planned_path(monkeypatch):
    import configs
    from k3jax.layers import moe
    from k3jax.ops import backend as backend_lib
    from tests.conftest import DecodeHarness, max_rel_err

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"]).replace(
        scan_layers=False, num_hidden_layers=4, full_attn_layers=(3,))  # dense layer 0, KDA, MLA, 3 MoE layers
    model = DecodeHarness(base, seed=6)
    monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda: "interpret")
    calls = []
    real = moe.experts_assigned
    monkeypatch.setattr(moe, "experts_assigned", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ids, cache, valid = model.ids(3, 1), model.cache(3, 16), jnp.asarray([1, 1, 1])
    want, _ = model.step(moe_decode_experts="planned")(model.params, ids, cache, valid)
    assert not calls
    moe_layers = base.num_hidden_layers - base.first_k_dense_replace
    for mode in ("assigned", "auto"):  # auto: 3 tokens x top-2 = 6 rows <= 8 per expert x 8 experts
        got, _ = model.step(moe_decode_experts=mode)(model.params, ids, cache, valid)
        assert len(calls) == moe_layers, mode
        assert max_rel_err(got, want) < 1e-5
        calls.clear()
    model.step(moe_decode_experts="assigned")(model.params, model.ids(3, 4), cache, jnp.asarray([4, 4, 4]))
    assert not calls  # prefill (4 tokens per sequence): the planned path


def test_auto_takes_the_assigned_kernels_up_to_sixteen_rows_per_expert(monkeypatch):
    import configs
    from k3jax.ops import backend as backend_lib
    from k3jax.ops import moe as moe_ops

    cfg = configs.get_config("tiny")  # 8 experts, top-2, latent 32 and expert width 32
    monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda: "gpu")
    assert moe_ops.assigned_backend(cfg, (64, 32), 1) == "gpu"  # 128 rows = 16 per expert
    assert moe_ops.assigned_backend(cfg, (65, 32), 1) is None  # 130 rows: the planned path
    assert moe_ops.assigned_backend(cfg, (4, 32), 4) is None  # not a decode step
    for mode, want in (("assigned", "gpu"), ("planned", None)):
        assert moe_ops.assigned_backend(cfg.replace(moe_decode_experts=mode), (65, 32), 1) == want
    monkeypatch.setattr(backend_lib, "kernel_backend_here", lambda: "tpu")
    assert moe_ops.assigned_backend(cfg, (32, 32), 1) is None
    from k3jax.config import ConfigError

    with pytest.raises(ConfigError, match="moe_assigned_splits"):
        configs.get_config("tiny", ["moe_assigned_splits=0"])
    with pytest.raises(ConfigError, match="moe_decode_experts"):
        configs.get_config("tiny", ["moe_decode_experts=sorted"])
