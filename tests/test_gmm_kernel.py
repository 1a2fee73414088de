"""The Pallas grouped matmul (pallas_kernels.gmm) equals a float64 NumPy per-group loop: forward, d_lhs, d_rhs.

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

from pallas_kernels.gmm import gmm, tgmm
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


@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_tpu_kernels_compile_for_v5p():
    """Mosaic TPU: gmm forward + both gradients and tgmm lower and compile with libtpu (compile only)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "pallas_kernels.gmm.aot", "--topology=v5p:2x2x1", "--m=1000", "--k=1024",
           "--n=1536", "--groups=8"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device_kind"].startswith("TPU v5")
    assert result["gmm_fwd_bwd"]["mosaic_calls"] == 3 and result["tgmm"]["mosaic_calls"] == 1
