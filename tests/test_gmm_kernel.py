"""The Pallas grouped matmul (pallas_kernels.gmm) equals a float64 NumPy per-group loop: forward, d_lhs, d_rhs;
the fused up-projection `gmm_glu` (SiTU / SiLU epilogue; forward and the three gradients) and the MXFP4 variant
`gmm_mxfp4` (equals dequantize-then-matmul with the converter's LUT decoder) likewise.

Both kernel families run on CPU in interpret mode ('interpret' = the GPU/Triton kernels, 'tpu_interpret' = the
Mosaic TPU kernels under the TPU interpreter) with tiles small enough that every case spans several tiles: groups
that are empty, one group holding every row, rows past sum(group_sizes) (must be zeros, as in ragged_dot), many
1-row groups (tiles split at every row), m / k / n not multiples of the tiles; f32 and bf16. One fixed shape per
dtype, so each backend compiles once and the cases only change the group sizes.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import mxfp4 as mxfp4_lut
from pallas_kernels.gmm import gmm, gmm_glu, gmm_mxfp4, tgmm
from sharding.aot import libtpu_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, K, N, G = 50, 40, 24, 6  # m, k, n not multiples of the tiles below
TILING = {"interpret": (16, 16, 16), "tpu_interpret": (16, 128, 128)}
GROUP_CASES = {
    "random with empty groups and a tail": [7, 0, 20, 13, 0, 4],  # sum 44 < 50: rows 44..49 -> zeros
    "one group holds every row": [0, 0, 50, 0, 0, 0],
    "many one-row groups then a big one": [1, 1, 0, 1, 2, 45],
    "all empty": [0, 0, 0, 0, 0, 0],
}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max error relative to max |reference|


def reference_f64(x, w, group_sizes, dy):
    """Per-group loop in float64: out = x_g @ w_g, d_lhs = dy_g @ w_gᵀ, d_rhs = x_gᵀ @ dy_g; other rows zero."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    row = 0
    for i, size in enumerate(group_sizes):
        rows = slice(row, row + size)
        out[rows] = x[rows] @ w[i]
        dx[rows] = dy[rows] @ w[i].T
        dw[i] = x[rows].T @ dy[rows]
        row += size
    return out, dx, dw


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    dy = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return x, w, dy


def _assert_close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = max(np.abs(want).max(), 1.0)
    err = np.abs(got - want).max() / scale
    assert err < TOL[dtype], f"{what}: max error {err:.3g} (relative to {scale:.3g}) >= {TOL[dtype]}"


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gmm_forward_and_gradients_match_float64_loop(backend, dtype):
    x, w, dy = _inputs(dtype)

    @jax.jit
    def fwd_bwd(x, w, gs, dy):
        out, pull = jax.vjp(lambda a, b: gmm(a, b, gs, backend=backend, tiling=TILING[backend]), x, w)
        return (out, *pull(dy))

    cases = GROUP_CASES if dtype == jnp.float32 else {k: GROUP_CASES[k] for k in list(GROUP_CASES)[:2]}
    for name, sizes in cases.items():
        sizes = np.array(sizes, np.int32)
        out, dx, dw = fwd_bwd(x, w, jnp.asarray(sizes), dy)
        assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
        want = reference_f64(np.asarray(x, np.float32), np.asarray(w, np.float32), sizes,
                             np.asarray(dy, np.float32))
        for label, got, ref in zip(("out", "d_lhs", "d_rhs"), (out, dx, dw), want):
            _assert_close(got, ref, dtype, f"{backend} {name}: {label}")
        assert not np.asarray(out[sizes.sum():]).any(), f"{name}: rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_tgmm_and_f32_output_from_bf16(backend):
    """Standalone tgmm (empty groups -> zero blocks) and preferred_element_type=f32 on bf16 inputs (MoE down)."""
    x, w, dy = _inputs(jnp.bfloat16, seed=1)
    sizes = np.array([9, 0, 0, 30, 11, 0], np.int32)
    want_out, _, want_dw = reference_f64(np.asarray(x, np.float32), np.asarray(w, np.float32), sizes,
                                         np.asarray(dy, np.float32))
    dw = tgmm(x, dy, jnp.asarray(sizes), backend=backend, tiling=TILING[backend],
              preferred_element_type=jnp.float32)
    assert dw.shape == (G, K, N) and dw.dtype == jnp.float32
    _assert_close(dw, want_dw, jnp.bfloat16, "tgmm")
    assert not np.asarray(dw)[[1, 2, 5]].any(), "empty groups must give zero weight gradients"
    out = gmm(x, w, jnp.asarray(sizes), backend=backend, tiling=TILING[backend], preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    _assert_close(out, want_out, jnp.bfloat16, "gmm f32 out")


def test_xla_backend_and_ops_dispatch():
    """'xla' is ragged_dot; k3jax.ops.gmm: 'auto' is ragged_dot on CPU, 'pallas' runs the kernel, bad names fail."""
    from k3jax.ops.gmm import gmm as ops_gmm

    x, w, _ = _inputs(jnp.float32, seed=2)
    sizes = jnp.asarray([5, 0, 20, 10, 3, 1], jnp.int32)
    want = jax.lax.ragged_dot(x, w, sizes)
    np.testing.assert_array_equal(gmm(x, w, sizes, backend="xla"), want)
    np.testing.assert_array_equal(ops_gmm(x, w, sizes), want)  # auto on CPU
    np.testing.assert_array_equal(ops_gmm(x, w, sizes, impl="ragged_dot"), want)
    np.testing.assert_allclose(ops_gmm(x, w, sizes, impl="pallas"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown gmm impl"):
        ops_gmm(x, w, sizes, impl="cublas")
    with pytest.raises(ValueError, match="unknown gmm backend"):
        gmm(x, w, sizes, backend="cuda")
    with pytest.raises(ValueError, match="shape mismatch"):
        gmm(x, w[:, :-1], sizes, backend="interpret")


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_tpu_kernels_compile_for_v5p():
    """Mosaic TPU: gmm forward + both gradients, tgmm, gmm_glu forward + backward and gmm_mxfp4 lower and compile
    with libtpu (compile only)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "benchmarks.gmm_tpu_aot", "--topology=v5p:2x2x1", "--m=1000", "--k=1024",
           "--n=1536", "--groups=8"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device_kind"].startswith("TPU v5")
    assert result["gmm_fwd_bwd"]["mosaic_calls"] == 3 and result["tgmm"]["mosaic_calls"] == 1
    assert result["glu_fwd_bwd"]["mosaic_calls"] >= 3  # fused forward; backward gmm, gmm_t, tgmm (deduplicated)
    assert result["mxfp4"]["mosaic_calls"] == 1


# ---- gmm_glu: act(x @ w_gate, x @ w_up) per group --------------------------------------------------------------

GLU_BETAS = (2.0, 3.0)  # small betas so both tanh caps bend at the test's pre-activation scale (std ~2)


def glu_reference_f64(x, w_gate, w_up, group_sizes, dy, activation, beta1, beta2):
    """Float64 loop: out = A(x_g w_gate) · B(x_g w_up) with SiTU A = b1·tanh(g/b1)·sigmoid(g), B = b2·tanh(u/b2)
    (SiLU: A = g·sigmoid(g), B = u), and its gradients from the closed-form derivatives."""
    x, w_gate, w_up, dy = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, dy))
    out, dx = np.zeros((x.shape[0], w_gate.shape[2])), np.zeros_like(x)
    dwg, dwu = np.zeros_like(w_gate), np.zeros_like(w_up)
    row = 0
    for i, size in enumerate(group_sizes):
        r = slice(row, row + size)
        g, u = x[r] @ w_gate[i], x[r] @ w_up[i]
        sig = 1.0 / (1.0 + np.exp(-g))
        if activation == "situ":
            tg, tu = np.tanh(g / beta1), np.tanh(u / beta2)
            a, b = beta1 * tg * sig, beta2 * tu
            da = (1.0 - tg ** 2) * sig + beta1 * tg * sig * (1.0 - sig)
            db = 1.0 - tu ** 2
        else:
            a, b = g * sig, u
            da, db = sig * (1.0 + g * (1.0 - sig)), np.ones_like(u)
        out[r] = a * b
        d_gate, d_up = dy[r] * b * da, dy[r] * a * db
        dx[r] = d_gate @ w_gate[i].T + d_up @ w_up[i].T
        dwg[i], dwu[i] = x[r].T @ d_gate, x[r].T @ d_up
        row += size
    return out, dx, dwg, dwu


@pytest.mark.parametrize("backend,activation,dtype", [
    ("interpret", "situ", jnp.float32), ("interpret", "silu", jnp.bfloat16), ("tpu_interpret", "situ", jnp.float32),
    pytest.param("tpu_interpret", "silu", jnp.bfloat16, marks=pytest.mark.slow),  # default-suite time budget
], ids=["interpret-situ-f32", "interpret-silu-bf16", "tpu_interpret-situ-f32", "tpu_interpret-silu-bf16"])
def test_gmm_glu_forward_and_gradients_match_float64_loop(backend, activation, dtype):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w_gate, w_up = (jnp.asarray(2.0 * rng.standard_normal((G, K, N)) / np.sqrt(K), dtype) for _ in range(2))
    dy = jnp.asarray(rng.standard_normal((M, N)), dtype)
    beta1, beta2 = GLU_BETAS

    @jax.jit
    def fwd_bwd(x, wg, wu, gs, dy):
        out, pull = jax.vjp(lambda a, b, c: gmm_glu(a, b, c, gs, activation=activation, beta1=beta1, beta2=beta2,
                                                    backend=backend, tiling=TILING[backend]), x, wg, wu)
        return (out, *pull(dy))

    for name in list(GROUP_CASES)[:2]:
        sizes = np.array(GROUP_CASES[name], np.int32)
        got = fwd_bwd(x, w_gate, w_up, jnp.asarray(sizes), dy)
        assert all(a.dtype == dtype for a in got)
        want = glu_reference_f64(*(np.asarray(a, np.float32) for a in (x, w_gate, w_up)), sizes,
                                 np.asarray(dy, np.float32), activation, beta1, beta2)
        for label, g, ref in zip(("out", "d_lhs", "d_w_gate", "d_w_up"), got, want):
            _assert_close(g, ref, dtype, f"{backend} {activation} {name}: {label}")
        assert not np.asarray(got[0][sizes.sum():]).any(), f"{name}: rows past sum(group_sizes) must be zero"


def test_gmm_glu_xla_backend_matches_float64_loop():
    """'xla' (ragged_dot twice + f32 SiTU) against the same reference, forward and gradients, K3 betas."""
    x, w_gate, dy = _inputs(jnp.float32, seed=4)
    w_up = 3.0 * w_gate[::-1]
    sizes = np.array(GROUP_CASES["random with empty groups and a tail"], np.int32)
    out, pull = jax.vjp(lambda a, b, c: gmm_glu(a, b, c, jnp.asarray(sizes), beta1=4.0, beta2=25.0, backend="xla"),
                        x, w_gate, w_up)
    want = glu_reference_f64(x, w_gate, w_up, sizes, dy, "situ", 4.0, 25.0)
    for label, g, ref in zip(("out", "d_lhs", "d_w_gate", "d_w_up"), (out, *pull(dy)), want):
        _assert_close(g, ref, jnp.float32, f"xla: {label}")


# ---- gmm_mxfp4: x @ dequant(packed, scales)ᵀ per group ---------------------------------------------------------

MX_M, MX_K, MX_N, MX_G = 50, 480, 24, 5  # 15 scale groups; m, k, n not multiples of the tiles below
MX_SIZES = {"empty groups and a tail": [7, 0, 20, 13, 0], "one group holds every row": [0, 50, 0, 0, 0]}


def _mxfp4_inputs(seed=5):
    """Random bytes (all 16 codes in both nibbles) and per-row base exponents spread over 2^-17 .. 2^8 with ±2
    across a row's scale groups, so every output column has one magnitude (column-relative errors are meaningful
    at every scale) while a wrong scale-to-group mapping still changes it by up to 16×."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (MX_G, MX_N, MX_K // 2)).astype(np.uint8)
    base = np.linspace(127 - 15, 127 + 6, MX_N).round().astype(np.int64)  # 2^-15 .. 2^6
    scales = base[None, :, None] + rng.integers(-2, 3, (MX_G, MX_N, MX_K // 32))
    scales[0, 0, 0], scales[0, -1, -1] = 127 - 17, 127 + 8  # the extremes 2^-17 and 2^8
    scales = scales.astype(np.uint8)
    assert set(np.unique(packed & 15)) == set(range(16)) and set(np.unique(packed >> 4)) == set(range(16))
    x = rng.standard_normal((MX_M, MX_K)).astype(np.float32)
    x[: MX_M // 2] = np.eye(MX_K, dtype=np.float32)[np.arange(MX_M // 2) * 19 % MX_K]  # one-hot rows: single
    # weights read back exactly, from columns spread over every scale group
    return jnp.asarray(x, jnp.bfloat16), packed, scales


def mxfp4_reference_f64(x, packed, scales, group_sizes):
    """Dequantize each expert with the converter's LUT decoder (k3jax.convert.mxfp4), then a float64 loop."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out, row = np.zeros((x.shape[0], packed.shape[1])), 0
    for i, size in enumerate(group_sizes):
        w_nk = mxfp4_lut.decode(packed[i], scales[i], np.float32).astype(np.float64)
        out[row:row + size] = x[row:row + size] @ w_nk.T
        row += size
    return out


@pytest.mark.parametrize("backend,tiling", [
    ("interpret", (16, 32, 16)),  # one scale group per k step, 15 steps
    ("interpret", (32, 64, 32)),  # two per step, k padded 480 -> 512 (padding: code 0, scale 127)
    ("tpu_interpret", (16, 256, 128)),  # Mosaic form: even/odd lhs split, scale expansion matmul, 2 k steps
    ("xla", None),
], ids=["interpret-tk32", "interpret-tk64-padded", "tpu_interpret-tk256", "xla"])
def test_gmm_mxfp4_matches_dequantize_then_matmul(backend, tiling):
    x, packed, scales = _mxfp4_inputs()
    run = jax.jit(lambda x, p, s, gs: gmm_mxfp4(x, p, s, gs, preferred_element_type=jnp.float32, backend=backend,
                                                tiling=tiling))
    for name, sizes in MX_SIZES.items():
        sizes = np.array(sizes, np.int32)
        got = np.asarray(run(x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(sizes)), np.float64)
        want = mxfp4_reference_f64(x, packed, scales, sizes)
        col_scale = np.abs(want).max(0) + 1e-30
        err = (np.abs(got - want).max(0) / col_scale).max()
        assert err < 1e-5, f"{backend} {tiling} {name}: max column-relative error {err:.3g}"
        one_hot = np.arange(MX_M) < min(MX_M // 2, sizes.sum())  # rows x = e_j: the weights themselves, exactly
        np.testing.assert_array_equal(got[one_hot], want[one_hot], err_msg=f"{name}: one-hot rows")
        assert not got[sizes.sum():].any(), f"{name}: rows past sum(group_sizes) must be zero"
    if tiling is None or tiling[1] != 32:  # default output dtype = lhs dtype (bf16), one more compile
        out = gmm_mxfp4(x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(sizes), backend=backend,
                        tiling=tiling)
        assert out.dtype == jnp.bfloat16 and out.shape == (MX_M, MX_N)
        want = mxfp4_reference_f64(x, packed, scales, sizes)
        err = (np.abs(np.asarray(out, np.float64) - want).max(0) / (np.abs(want).max(0) + 1e-30)).max()
        assert err < 1e-2, f"bf16 output: max column-relative error {err:.3g}"


def test_glu_and_mxfp4_reject_bad_input():
    x, w, _ = _inputs(jnp.float32)
    sizes = jnp.asarray([5, 0, 20, 10, 3, 1], jnp.int32)
    with pytest.raises(ValueError, match="needs positive beta1 and beta2"):
        gmm_glu(x, w, w, sizes, activation="situ")
    with pytest.raises(ValueError, match="unknown gmm_glu activation"):
        gmm_glu(x, w, w, sizes, activation="gelu", beta1=4.0, beta2=25.0)
    with pytest.raises(ValueError, match="one shape"):
        gmm_glu(x, w, w[:, :, :-1], sizes, activation="silu")
    packed, scales = jnp.zeros((6, N, K // 2), jnp.uint8), jnp.zeros((6, N, K // 32), jnp.uint8)
    with pytest.raises(ValueError, match="k divisible by the MXFP4 group"):
        gmm_mxfp4(x, packed, scales, sizes)  # K = 40
    x64 = jnp.zeros((M, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="shape mismatch"):
        gmm_mxfp4(x64, jnp.zeros((6, N, 16), jnp.uint8), jnp.zeros((6, N, 2), jnp.uint8), sizes)
    with pytest.raises(ValueError, match="uint8"):
        gmm_mxfp4(x64, jnp.zeros((6, N, 32), jnp.int8), jnp.zeros((6, N, 2), jnp.uint8), sizes)


def test_decode_sized_calls_take_the_thin_tiling_and_match_float64_loop():
    """GPU gmm calls with <= 32 rows per group (decode: B=64 routes ~8 rows to each of 64 experts) default to the
    measured decode tiling; bigger calls and TPU keep theirs. A decode-sized call with the default tiling (uneven
    and empty groups, N not a tile multiple) equals the float64 loop through the interpreter."""
    from pallas_kernels.gmm import api

    assert api._default_tiling("gpu", "gmm", 512, 64) == api._GPU_DECODE
    assert api._default_tiling("gpu", "gmm_t", 512, 64) == api._GPU_DECODE
    assert api._default_tiling("gpu", "gmm", 8192, 64) == api._DEFAULTS["gpu"]["gmm"]
    assert api._default_tiling("gpu", "glu", 512, 64) == api._GPU_DECODE
    assert api._default_tiling("gpu", "glu", 8192, 64) == api._DEFAULTS["gpu"]["glu"]
    assert api._default_tiling("tpu", "gmm", 512, 64) == api._DEFAULTS["tpu"]["gmm"]
    rng = np.random.default_rng(3)
    sizes = np.array([5, 0, 9, 3, 7, 6, 4, 6], np.int32)
    x = rng.standard_normal((int(sizes.sum()), 64)).astype(np.float32)
    w = (rng.standard_normal((len(sizes), 64, 96)) / 8).astype(np.float32)
    out = jax.jit(lambda a, b, gs: gmm(a, b, gs, backend="interpret"))(x, w, jnp.asarray(sizes))
    want, _, _ = reference_f64(x, w, sizes, np.zeros((x.shape[0], 96), np.float32))
    _assert_close(out, want, jnp.float32, "decode-sized gmm")


@pytest.mark.parametrize("rows,fused", [(44, True), (200, False)], ids=["decode-sized-fused", "large-two-gmm"])
def test_grouped_glu_takes_the_fused_kernel_only_for_decode_sized_calls(rows, fused, monkeypatch):
    """The MoE's expert up-projection (`k3jax.ops.glu.grouped_glu`): a call with <= 32 rows per expert runs the
    fused `gmm_glu` kernel, a bigger one two gmm calls + the activation; both equal the float64 loop of
    SiTU(x @ w_gate, x @ w_up) per group (interpreted kernels, f32). MXFP4 weights and impl='ragged_dot' never
    take the fused kernel."""
    from configs import get_config
    from k3jax.ops import glu as glu_ops
    from k3jax.ops import gmm as gmm_ops

    cfg = get_config("tiny")
    calls = []
    real = gmm_ops.gmm_glu
    monkeypatch.setattr(gmm_ops, "gmm_glu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(5)
    sizes = np.array([rows // 4, 0, rows // 2, rows - rows // 4 - rows // 2], np.int32)  # uneven, one empty
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    w_gate, w_up = ((2.0 * rng.standard_normal((len(sizes), 64, 48)) / 8).astype(np.float32) for _ in range(2))
    got = glu_ops.grouped_glu(jnp.asarray(x), jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(sizes), cfg,
                              impl="pallas")
    assert bool(calls) == fused
    beta1, beta2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    want = glu_reference_f64(x, w_gate, w_up, sizes, np.zeros((rows, 48), np.float32), "situ", beta1, beta2)[0]
    _assert_close(got, want, jnp.float32, f"grouped_glu rows={rows}")
    assert not gmm_ops.fused_glu_applies(rows, jnp.asarray(w_gate), "ragged_dot")
    packed = gmm_ops.MXFP4Experts.quantize(jnp.asarray(w_gate))
    assert not gmm_ops.fused_glu_applies(rows, packed, "pallas")
