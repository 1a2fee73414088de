"""The Pallas chunkwise KDA kernels (interpret mode), forward and backward, equal the token recurrence, and the
dispatch behaves.

References: ``k3jax.ops.kda.kda_recurrent`` (token-by-token ``lax.scan``; its ``jax.grad`` for the gradients) and a
float64 NumPy token loop written here, all independent of the chunked algebra in ``pallas_kernels/kda``. Shapes are
tiny: T not a multiple of the chunk (64), several chunks, an initial state, gates down to the -5 lower bound.
Gradients use random cotangents for both the output and the final state.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import KernelConfig, chunk_kda, chunk_kda_gated, kda_recurrent
from tests.helpers import layer_output_and_grads


def _unit(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _inputs(b, t, h, kd, vd, seed=0):
    """float32 numpy inputs: unit q/k, gates in (-5, 0) with a share pinned at the -5 bound, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = _unit(rng.standard_normal((b, t, h, kd)))
    k = _unit(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((b, t, h, kd))))
    g[rng.random(g.shape) < 0.1] = -5.0
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    h0 = 0.3 * rng.standard_normal((b, h, kd, vd))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, h0))


def _numpy_token_loop(q, k, v, g, beta, h0, scale):
    """float64 KDA, one token at a time: decay, delta-rule write, read (docs/spec.md#kda)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
    b, t, h, _ = q.shape
    o = np.zeros((b, t, h, v.shape[-1]))
    s = s.copy()
    for bi in range(b):
        for hi in range(h):
            st = s[bi, hi]
            for ti in range(t):
                st = np.exp(g[bi, ti, hi])[:, None] * st
                kt = k[bi, ti, hi]
                st = st + np.outer(kt, beta[bi, ti, hi] * (v[bi, ti, hi] - kt @ st))
                o[bi, ti, hi] = (scale * q[bi, ti, hi]) @ st
            s[bi, hi] = st
    return o, s


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


@jax.jit
def _interpret_fwd(q, k, v, g, beta, h0):
    return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="interpret")


@jax.jit
def _recurrent64(q, k, v, g, beta, h0):
    return kda_recurrent(q, k, v, g, beta, scale=64 ** -0.5, initial_state_bhkv=h0)


def test_f32_output_and_state_equal_token_recurrence_and_float64_loop():
    q, k, v, g, beta, h0 = _inputs(b=1, t=150, h=2, kd=64, vd=64)  # 3 chunks, last one partial
    o, s = _interpret_fwd(q, k, v, g, beta, h0)
    assert o.dtype == jnp.float32 and o.shape == v.shape and s.shape == h0.shape
    ro, rs = _recurrent64(q, k, v, g, beta, h0)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5
    no, ns = _numpy_token_loop(q, k, v, g, beta, h0, scale=64 ** -0.5)
    assert _rel_err(o, no) < 2e-5 and _rel_err(s, ns) < 2e-5


def test_bf16_inputs_match_token_recurrence_on_the_same_rounded_inputs():
    q, k, v, g, beta, h0 = _inputs(b=1, t=150, h=2, kd=64, vd=64, seed=1)  # f32 shapes of the first test: one compile
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o, s = _interpret_fwd(qb, kb, vb, g, beta, h0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    ro, rs = _recurrent64(qb, kb, vb, g, beta, h0)
    # bf16 intermediates and bf16 matmul operands (state included): ~1e-2 relative, like fla.
    assert _rel_err(o.astype(jnp.float32), ro) < 3e-2 and _rel_err(s, rs) < 3e-2
    # ...and the error is rounding, not a wrong formula: the f32 kernel on the same inputs is far closer.
    o32, _ = _interpret_fwd(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), g, beta, h0)
    assert _rel_err(o32, ro) < 2e-5


def test_doubling_solve_and_narrow_value_blocks_give_the_same_result():
    q, k, v, g, beta, h0 = _inputs(b=1, t=70, h=1, kd=64, vd=64, seed=8)
    config = KernelConfig(block_v=32, warps=(8, 2), solve="doubling")
    o, s = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, backend="interpret",
                                        config=config))(q, k, v, g, beta, h0)
    ro, rs = _recurrent64(q, k, v, g, beta, h0)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5
    with pytest.raises(ValueError, match="solve must be"):
        KernelConfig(solve="lu")


def _weighted_loss(core, w_o, w_s):
    """sum(o * w_o) + sum(final_state * w_s): random cotangents for the output and the final state."""
    def loss(*args):
        o, s = core(*args)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)
    return loss


def _grad_all(core, args, w_o, w_s):
    return jax.jit(jax.grad(_weighted_loss(core, w_o, w_s), argnums=tuple(range(6))))(*args)


def _pallas_core(bwd="pallas", config=None):
    def core(*a):
        return chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, backend="interpret", bwd=bwd,
                         config=config)
    return core


def _recurrent_core(kd):
    def core(*a):
        return kda_recurrent(*a[:5], scale=kd ** -0.5, initial_state_bhkv=a[5])
    return core


_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _cotangents(v, h0, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(v.shape).astype(np.float32), rng.standard_normal(h0.shape).astype(np.float32)


def test_pallas_backward_f32_gradients_equal_token_recurrence_gradients():
    # 3 chunks, the last one partial; two heads; an initial state; gates pinned at the -5 bound.
    q, k, v, g, beta, h0 = _inputs(b=1, t=150, h=2, kd=64, vd=64, seed=2)
    w_o, w_s = _cotangents(v, h0, seed=3)
    args = (q, k, v, g, beta, h0)
    got = _grad_all(_pallas_core(), args, w_o, w_s)
    want = _grad_all(_recurrent_core(64), args, w_o, w_s)
    for name, x, ref in zip(_GRAD_NAMES, got, want):
        assert x.shape == ref.shape and x.dtype == jnp.float32, name
        assert _rel_err(x, ref) < 2e-5, name


def test_pallas_backward_bf16_gradients_match_token_recurrence_on_the_same_rounded_inputs():
    q, k, v, g, beta, h0 = _inputs(b=1, t=100, h=1, kd=64, vd=64, seed=12)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    w_o, w_s = _cotangents(v, h0, seed=13)
    got = _grad_all(_pallas_core(), (qb, kb, vb, g, beta, h0), w_o, w_s)
    want = _grad_all(_recurrent_core(64), (qb, kb, vb, g, beta, h0), w_o, w_s)
    for name, x, ref in zip(_GRAD_NAMES, got, want):
        assert x.dtype == ref.dtype, name  # bf16 for q, k, v; f32 for g, beta, state
        # bf16 intermediates (states, v', dv', dS per chunk), bf16 matmul operands, bf16 dq/dk/dv: ~5e-3 here.
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < 1.5e-2, name


def test_xla_backend_matches_and_final_state_is_optional():
    q, k, v, g, beta, h0 = _inputs(b=1, t=20, h=2, kd=16, vd=32, seed=4)
    o, s = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], backend="xla"))(q, k, v, g, beta, h0)
    assert s is None
    ro, _ = jax.jit(lambda *a: kda_recurrent(*a[:5], scale=16 ** -0.5, initial_state_bhkv=a[5]))(q, k, v, g, beta, h0)
    assert _rel_err(o, ro) < 2e-5


def test_bad_inputs_are_rejected_with_clear_errors():
    q, k, v, g, beta, h0 = _inputs(b=1, t=8, h=1, kd=16, vd=16)
    with pytest.raises(ValueError, match="unknown backend"):
        chunk_kda(q, k, v, g, beta, backend="cuda")
    with pytest.raises(ValueError, match="unknown bwd"):
        chunk_kda(q, k, v, g, beta, backend="interpret", bwd="triton")
    with pytest.raises(ValueError, match="Only interpret mode"):  # the Mosaic kernels need a TPU (or tpu_interpret)
        chunk_kda(q, k, v, g, beta, backend="tpu")
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_kda(q, k, v, g, beta[..., None], backend="xla")
    with pytest.raises(ValueError, match="initial_state must have shape"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[:, :, :8], backend="xla")
    with pytest.raises(ValueError, match="powers of two"):
        chunk_kda(q[..., :12], k[..., :12], v, g[..., :12], beta, backend="interpret")


def test_varlen_packed_sequences_restart_from_their_own_state():
    cu = [0, 5, 5, 75, 140]  # short, empty, crossing a chunk boundary, ending mid-chunk
    q, k, v, g, beta, _ = _inputs(b=1, t=140, h=2, kd=64, vd=64, seed=6)
    h0 = 0.3 * np.random.default_rng(7).standard_normal((4, 2, 64, 64)).astype(np.float32)
    o, s = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,
                                        backend="interpret"))(q, k, v, g, beta, h0)
    assert o.shape == v.shape and s.shape == h0.shape
    for n, (start, end) in enumerate(itertools.pairwise(cu)):
        if start == end:
            np.testing.assert_array_equal(s[n], h0[n])
            continue
        sl = slice(start, end)
        ro, rs = _recurrent64(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0[n:n + 1])
        assert _rel_err(o[:, sl], ro) < 2e-5 and _rel_err(s[n], rs[0]) < 2e-5, n
    # The XLA backend (also the backward's forward) agrees.
    xo, xs = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                                          cu_seqlens=np.array(cu), backend="xla"))(q, k, v, g, beta, h0)
    assert _rel_err(xo, o) < 2e-5 and _rel_err(xs, s) < 2e-5
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 5, 139], backend="xla")
    with pytest.raises(ValueError, match="initial_state must have shape"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=cu, backend="xla")


def test_k128_two_heads_with_state_equal_token_recurrence():
    q, k, v, g, beta, h0 = _inputs(b=1, t=200, h=2, kd=128, vd=128, seed=5)
    o, s = _interpret_fwd(q, k, v, g, beta, h0)
    ro, rs = kda_recurrent(q, k, v, g, beta, scale=128 ** -0.5, initial_state_bhkv=h0)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5


@pytest.mark.parametrize("config,h,d,mild", [
    pytest.param(KernelConfig(), 1, 64, False, marks=pytest.mark.slow),
    (KernelConfig(block_k=16), 2, 32, True),
    (KernelConfig(block_k=16, intra_bwd="state_fused"), 2, 32, True)])
def test_varlen_pallas_backward_equals_per_sequence_recurrence_gradients(config, h, d, mild):
    """cu_seqlens (a sequence inside the first chunk, an empty one, one crossing a chunk boundary): the gradients
    of each sequence's own token recurrence, initial states included; `mild`: half the key columns get mild gates
    so the chunk decays' gradient path counts."""
    cu = [0, 30, 30, 100]
    q, k, v, g, beta, _ = _inputs(b=1, t=100, h=h, kd=d, vd=d, seed=9)
    if mild:
        g[..., : d // 2] *= 0.02
    h0 = 0.3 * np.random.default_rng(10).standard_normal((3, h, d, d)).astype(np.float32)
    w_o = np.random.default_rng(11).standard_normal(v.shape).astype(np.float32)

    def ours(q, k, v, g, beta, h0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         backend="interpret", config=config)
        return jnp.sum(o * w_o) + jnp.sum(s ** 2)

    def reference(q, k, v, g, beta, h0):
        total = 0.0
        for n, (start, end) in enumerate(itertools.pairwise(cu)):
            if start == end:  # empty sequence: final state = initial state
                total = total + jnp.sum(h0[n] ** 2)
                continue
            sl = slice(start, end)
            o, s = kda_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=d ** -0.5,
                                 initial_state_bhkv=h0[n:n + 1])
            total = total + jnp.sum(o * w_o[:, sl]) + jnp.sum(s ** 2)
        return total

    args = (q, k, v, g, beta, h0)
    got = jax.jit(jax.value_and_grad(ours, argnums=tuple(range(6))))(*args)
    want = jax.jit(jax.value_and_grad(reference, argnums=tuple(range(6))))(*args)
    assert _rel_err(got[0], want[0]) < 1e-5
    for name, x, ref in zip(_GRAD_NAMES, got[1], want[1]):
        assert _rel_err(x, ref) < 2e-5, name


@pytest.mark.slow
def test_k128_pallas_backward_equals_token_recurrence_and_xla_backward():
    q, k, v, g, beta, h0 = _inputs(b=1, t=80, h=1, kd=128, vd=128, seed=14)
    w_o, w_s = _cotangents(v, h0, seed=15)
    args = (q, k, v, g, beta, h0)
    # Narrow value blocks and the doubling solve: the tuning knobs do not change the gradients.
    single = KernelConfig(block_v=32, solve="doubling", intra="single", intra_bwd="auto")  # the single-kernel path
    got = _grad_all(_pallas_core(config=single), args, w_o, w_s)
    want = _grad_all(_recurrent_core(128), args, w_o, w_s)
    via_xla = _grad_all(_pallas_core(bwd="xla"), args, w_o, w_s)
    for name, x, ref, alt in zip(_GRAD_NAMES, got, want, via_xla):
        assert _rel_err(x, ref) < 2e-5, name
        assert _rel_err(alt, ref) < 2e-5, name


def _segment_ids(b, t, starts_per_row):
    """int32 [B, T] document ids: a new id at each listed start (per row)."""
    ids = np.zeros((b, t), np.int32)
    for row, starts in enumerate(starts_per_row):
        for s in starts:
            ids[row, s:] += 1
    return jnp.asarray(ids)


def test_traced_segment_ids_reset_state_like_the_token_recurrence_forward_and_gradients():
    # Two rows, 3 chunks (last partial). Documents start mid-chunk, exactly on a chunk start (64), inside the same
    # 16-row sub-chunk as another start (70, 75), and a one-token document (140); the second row has none.
    b, t, h, d = 2, 150, 2, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=21)
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 140, 141], []])
    w_o, w_s = _cotangents(v, h0, seed=22)

    def pallas(*a):
        return chunk_kda(*a[:5], initial_state=a[5], segment_ids=a[6], output_final_state=True,
                         backend="interpret", config=KernelConfig(block_k=16))

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=a[6])

    args = (q, k, v, g, beta, h0, seg)
    o, s = jax.jit(pallas)(*args)
    ro, rs = jax.jit(recurrent)(*args)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5
    # The masks matter: without segment ids the result differs.
    o_plain, _ = jax.jit(lambda *a: pallas(*a[:6], None))(*args)
    assert _rel_err(o_plain, ro) > 1e-2

    def grads(core):
        loss = _weighted_loss(lambda *a: core(*a, seg), w_o, w_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args[:6])

    for name, x, ref in zip(_GRAD_NAMES, grads(pallas), grads(recurrent)):
        assert _rel_err(x, ref) < 2e-5, name


def test_segment_ids_and_cu_seqlens_are_exclusive():
    q, k, v, g, beta, _ = _inputs(b=1, t=20, h=1, kd=16, vd=16)
    with pytest.raises(ValueError, match="not both"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 10, 20], segment_ids=jnp.zeros((1, 20), jnp.int32),
                  backend="interpret")
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        chunk_kda(q, k, v, g, beta, segment_ids=jnp.zeros((1, 19), jnp.int32), backend="interpret")


def test_kda_layer_with_the_kernel_equals_the_chunked_path_on_packed_documents():
    """The model's KDA layer (tiny config, f32) with kda_impl="pallas" (the kernel through the Pallas interpreter on
    CPU) gives the output and parameter/input gradients of kda_impl="chunked" on a packed batch with traced segment
    ids; "auto" picks the chunked path on CPU."""
    from flax import nnx

    import configs
    from k3jax.layers.kda import KDA
    from k3jax.ops.kda import resolve_impl

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"])
    assert resolve_impl(base) == "chunked"
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 40, base.hidden_size)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 2]], [9, 20, 11], axis=1).astype(np.int32))

    def output_and_grads(impl):
        return layer_output_and_grads(KDA(base.replace(kda_impl=impl), rngs=nnx.Rngs(7)), x, seg)

    y_kernel, g_kernel = output_and_grads("pallas")
    y_chunked, g_chunked = output_and_grads("chunked")
    assert _rel_err(y_kernel, y_chunked) < 2e-5
    assert len(g_kernel) == len(g_chunked) > 5
    for x_, ref in zip(g_kernel, g_chunked):
        assert _rel_err(x_, ref) < 2e-5


def test_kda_impl_pallas_is_refused_for_an_unbounded_gate():
    import configs
    from k3jax.config import ConfigError

    with pytest.raises(ConfigError, match="kda_impl='pallas' needs"):
        configs.get_config("tiny_kimi_linear", ["kda_impl=pallas"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_intra_kernels_equal_the_single_kernel_and_the_token_recurrence(dtype):
    """KernelConfig(intra="split") (cumulative gate in XLA, gram / solve / apply kernels) gives the single intra
    kernel's results: forward vs the token recurrence, and gradients (the backward recomputes through it), with
    packed documents."""
    b, t, h, d = 1, 150, 2, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=31)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 140, 141]])
    tol = 2e-5 if dtype == jnp.float32 else 1.5e-2
    # Split vs single gradients: both round their dot operands to the input dtype at different points, so bf16
    # gradients (themselves bf16) may differ by ~2 ulps of the largest entry; f32 must agree to rounding.
    grad_tol = 5e-6 if dtype == jnp.float32 else 1e-2

    def core(config):
        def f(*a):
            return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True,
                             backend="interpret", config=config)
        return f

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    split, single = core(KernelConfig(intra="split", intra_bwd="auto", block_k=16)), core(
        KernelConfig(intra="single", intra_bwd="auto"))
    args = (q, k, v, g, beta, h0)
    o, s = jax.jit(split)(*args)
    ro, rs = jax.jit(recurrent)(*args)
    assert _rel_err(o.astype(jnp.float32), ro) < tol and _rel_err(s, rs) < tol
    w_o, w_s = _cotangents(v, h0, seed=32)
    got = _grad_all(split, args, w_o, w_s)
    want = _grad_all(single, args, w_o, w_s)
    for name, x, ref in zip(_GRAD_NAMES, got, want):
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < grad_tol, name


@pytest.mark.slow
def test_kda_layer_kernel_under_a_mesh_runs_per_shard_and_equals_one_device():
    """Traced under a (data 2, expert 2, model 2) mesh, the KDA layer's kernel call runs inside shard_map (GSPMD
    cannot split a Pallas call), each device on its batch rows and heads, and gives the one-device chunked result
    with packed documents (output and input gradient)."""
    from flax import nnx

    import configs
    from k3jax.layers.kda import KDA
    from sharding.mesh import make_mesh

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"])
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 24, base.hidden_size)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 2], [1, 1], [3, 4], [5, 6]], [10, 14], axis=1).astype(np.int32))

    def run(impl, mesh=None):
        layer = KDA(base.replace(kda_impl=impl), rngs=nnx.Rngs(8))
        graph, state = nnx.split(layer)

        def f(state, x):
            def loss(x):
                y = nnx.merge(graph, state)(x, seg)
                return jnp.sum(jnp.sin(y)), y
            (_, y), dx = jax.value_and_grad(loss, has_aux=True)(x)
            return y, dx

        if mesh is None:
            return jax.jit(f)(state, x), None
        with (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh):
            jaxpr = jax.make_jaxpr(f)(state, x)
            return jax.jit(f)(state, x), str(jaxpr)

    mesh = make_mesh(data=2, expert=2, model=2)
    (y_mesh, dx_mesh), jaxpr = run("pallas", mesh)
    (y_ref, dx_ref), _ = run("chunked")
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    assert _rel_err(y_mesh, y_ref) < 2e-5 and _rel_err(dx_mesh, dx_ref) < 2e-5


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("t,intra,in_kernel", [pytest.param(70, "split", False, marks=_SLOW),
                                                pytest.param(128, "fused2", True, marks=_SLOW), (70, "fused2", False),
                                                pytest.param(128, "pairs", True, marks=_SLOW)])
def test_gated_entry_point_applies_k3_gate_l2_norm_and_beta_sigmoid(t, intra, in_kernel, monkeypatch):
    """chunk_kda_gated (raw q/k, raw gate + A_log + dt_bias with the -5 lower bound, beta logits) equals the token
    recurrence on inputs preprocessed here in float64 NumPy; gradients reach A_log and dt_bias and equal the
    recurrence's. With intra="fused2" / "pairs" and T a multiple of 64 the intra kernel activates the raw gate itself
    (the raw-gate custom VJP runs); with T = 70 (padded tokens must not decay) the gate is activated in XLA first."""
    from k3jax.ops import kda as kda_ops

    calls = []
    raw_gate = kda_ops.chunk_kda_raw_gate_kernel
    monkeypatch.setattr(kda_ops, "chunk_kda_raw_gate_kernel", lambda *a, **kw: calls.append(1) or raw_gate(*a, **kw))
    config = KernelConfig(block_k=16, intra=intra)
    rng = np.random.default_rng(41)
    b, h, d = 1, 2, 16
    q, k, v, g_raw = (rng.standard_normal((b, t, h, d)).astype(np.float32) for _ in range(4))
    beta_logits = rng.standard_normal((b, t, h)).astype(np.float32)
    a_log = np.log(rng.uniform(1, 16, h)).astype(np.float32)
    dt_bias = (0.1 * rng.standard_normal(h * d)).astype(np.float32)

    def numpy_inputs(q, k, g_raw, beta_logits, a_log, dt_bias):
        q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
        qn = q64 / np.sqrt((q64 ** 2).sum(-1, keepdims=True) + 1e-6)
        kn = k64 / np.sqrt((k64 ** 2).sum(-1, keepdims=True) + 1e-6)
        z = np.asarray(g_raw, np.float64) + dt_bias.reshape(h, d)
        g = -5.0 / (1.0 + np.exp(-np.exp(a_log)[:, None] * z))
        beta = 1.0 / (1.0 + np.exp(-np.asarray(beta_logits, np.float64)))
        return qn, kn, g, beta

    o, _ = jax.jit(lambda *a: chunk_kda_gated(*a[:5], A_log=a[5], dt_bias=a[6], backend="interpret",
                                              config=config))(q, k, v, g_raw, beta_logits, a_log, dt_bias)
    assert bool(calls) == in_kernel
    qn, kn, g, beta = numpy_inputs(q, k, g_raw, beta_logits, a_log, dt_bias)
    want, _ = _numpy_token_loop(qn, kn, v, g, beta, np.zeros((b, h, d, d)), scale=d ** -0.5)
    assert _rel_err(o, want) < 2e-5

    def reference(q, k, v, g_raw, beta_logits, a_log, dt_bias):  # the same math in jnp, through the recurrence
        qn = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        kn = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
        gate = -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (g_raw + dt_bias.reshape(h, d)))
        return kda_recurrent(qn, kn, v, gate, jax.nn.sigmoid(beta_logits), scale=d ** -0.5)[0]

    w_o = rng.standard_normal(v.shape).astype(np.float32)
    args = (q, k, v, g_raw, beta_logits, a_log, dt_bias)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(chunk_kda_gated(*a[:5], A_log=a[5], dt_bias=a[6],
                                                              backend="interpret", config=config)[0] * w_o),
                           argnums=tuple(range(7))))(*args)
    ref = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a) * w_o), argnums=tuple(range(7))))(*args)
    for name, x, r in zip(("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias"), got, ref):
        assert _rel_err(x, r) < 5e-5, name
    with pytest.raises(ValueError, match="lower_bound must be in"):
        chunk_kda_gated(q, k, v, g_raw, beta_logits, A_log=a_log, dt_bias=dt_bias, lower_bound=-8.0)


def test_auto_picks_the_kernel_on_accelerators_for_kernel_compatible_configs(monkeypatch):
    import configs
    from k3jax.ops.kda import resolve_impl

    k3_like, kimi_linear_like = configs.get_config("tiny"), configs.get_config("tiny_kimi_linear")
    for platform, want in (("gpu", "pallas"), ("tpu", "pallas"), ("cpu", "chunked")):
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        assert resolve_impl(k3_like) == want, platform
        assert resolve_impl(kimi_linear_like) == "chunked", platform  # softplus gate: outside the kernel's range
    assert resolve_impl(k3_like.replace(kda_impl="recurrent")) == "recurrent"


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_tiled_intra_backward_gradients_equal_token_recurrence_gradients_on_packed_documents(dtype):
    """KernelConfig(intra_bwd="tiled") (split recompute, then the solve-gradient and per-key-block pair-gradient
    kernels) gives the token recurrence's gradients: packed documents (starts mid-chunk, on a chunk start, two in
    one 16-row block, a one-token document), T not a multiple of 64, two key blocks per pair-gradient program."""
    b, t, h, d = 1, 150, 2, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=41)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 140, 141]])
    config = KernelConfig(block_k=16, intra_bwd="tiled")

    def tiled(*a):
        return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True, backend="interpret",
                         config=config)

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    args = (q, k, v, g, beta, h0)
    w_o, w_s = _cotangents(v, h0, seed=42)
    got = _grad_all(tiled, args, w_o, w_s)
    want = _grad_all(recurrent, args, w_o, w_s)
    tol = 2e-5 if dtype == jnp.float32 else 1.5e-2  # bf16: bf16 intermediates and dot operands, as the other paths
    for name, x, ref in zip(_GRAD_NAMES, got, want):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < tol, name
    with pytest.raises(ValueError, match="intra_bwd must be"):
        _grad_all(_pallas_core(config=KernelConfig(intra_bwd="fused")), tuple(np.asarray(x[:, :8], np.float32)
                  for x in (q, k, v, g, beta)) + (h0,), w_o[:, :8], w_s)


@pytest.mark.parametrize("config", [KernelConfig(block_k=16),  # split forward + tiled backward (defaults)
                                    pytest.param(KernelConfig(block_k=16, intra="single", intra_bwd="auto"),
                                                 marks=pytest.mark.slow)])
def test_kept_intra_residuals_give_the_recomputed_gradients_without_recomputing(config):
    """residuals="intra" (default) hands the forward's intra-chunk results to the backward: same gradients as
    residuals="inputs" (which recomputes them), with the intra-chunk kernels traced once instead of twice."""
    import dataclasses

    q, k, v, g, beta, h0 = _inputs(b=1, t=90, h=2, kd=32, vd=32, seed=41)
    w_o, w_s = _cotangents(v, h0, seed=42)
    args = (q, k, v, g, beta, h0)
    kept, recomputed = (dataclasses.replace(config, residuals=r) for r in ("intra", "inputs"))
    got = _grad_all(_pallas_core(config=kept), args, w_o, w_s)
    want = _grad_all(_pallas_core(config=recomputed), args, w_o, w_s)
    ref = _grad_all(_recurrent_core(32), args, w_o, w_s)
    for name, x, y, r in zip(_GRAD_NAMES, got, want, ref):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6, err_msg=name)
        assert _rel_err(x, r) < 2e-4, name

    def intra_kernel_calls(cfg):
        text = str(jax.make_jaxpr(jax.grad(_weighted_loss(_pallas_core(config=cfg), w_o, w_s),
                                           argnums=tuple(range(6))))(*args))
        return sum(text.count(n) for n in ("kda_chunk_gram", "kda_chunk_solve", "kda_chunk_apply", "kda_chunk_intra"))
    assert intra_kernel_calls(kept) > 0
    assert intra_kernel_calls(recomputed) == 2 * intra_kernel_calls(kept)
    with pytest.raises(ValueError, match="residuals must be"):
        KernelConfig(residuals="states")


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_state_fused_backward_gradients_equal_token_recurrence_gradients_on_packed_documents(dtype):
    """KernelConfig(intra_bwd="state_fused") (state-product gradients computed inside the solve / pair kernels,
    intra_bwd_fused.py) gives the token recurrence's gradients on packed documents (starts mid-chunk, on a chunk
    start, two in one 16-row block, a one-token document), T not a multiple of 64, two key blocks per program; and
    the same gradients as the tiled path it fuses (same products, so to f32 rounding). Half the key columns get
    mild gates so the chunk decays (2^G_L) are not negligible and their gradient path, with its document mask,
    counts (with gates in (-5, 0) a whole chunk's decay underflows to 0)."""
    b, t, h, d = 1, 150, 2, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=43)
    g[..., : d // 2] *= 0.02
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 140, 141]])

    def kernel(config):
        def core(*a):
            return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True,
                             backend="interpret", config=config)
        return core

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    args = (q, k, v, g, beta, h0)
    w_o, w_s = _cotangents(v, h0, seed=44)
    got = _grad_all(kernel(KernelConfig(block_k=16, intra_bwd="state_fused")), args, w_o, w_s)
    tiled = _grad_all(kernel(KernelConfig(block_k=16, intra_bwd="tiled")), args, w_o, w_s)
    want = _grad_all(recurrent, args, w_o, w_s)
    tol = 2e-5 if dtype == jnp.float32 else 1.5e-2  # bf16: bf16 intermediates and dot operands, as the other paths
    for name, x, alt, ref in zip(_GRAD_NAMES, got, tiled, want):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < tol, name
        assert _rel_err(x.astype(jnp.float32), alt.astype(jnp.float32)) < 1e-5, name


@pytest.mark.parametrize("intra,dtype", [("fused2", jnp.float32),
                                         pytest.param("fused2", jnp.bfloat16, marks=pytest.mark.slow)])
def test_fused_intra_kernels_equal_the_split_stage_and_the_token_recurrence(intra, dtype):
    """KernelConfig(intra="fused2") (cumulative gate, gram and solve in one kernel, then the apply kernel): the
    split stage's results including the backward's solve terms
    (kk, A, G), the token recurrence's outputs, final state and gradients (the tiled backward reads the fused
    solve terms), on packed documents (starts mid-chunk, on a chunk start, two in one 16-row block, a one-token
    document, a last chunk without a start), T not a multiple of 64, two key blocks per program; mild gates on
    half the key columns so the chunk decays are not negligible."""
    from pallas_kernels.kda.common import chunk_layout, document_layout
    from pallas_kernels.kda.intra_split import intra_chunk_split

    b, t, h, d = 1, 150, 2, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=51)
    g[..., : d // 2] *= 0.02
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 76]])
    config = KernelConfig(block_k=16, intra=intra)
    args = (q, k, v, g, beta, h0)

    # The intra-chunk stage itself vs the split kernels, on chunk-padded inputs.
    n, _, to_padded, _ = chunk_layout(b, t, None)
    padded = [to_padded(jnp.asarray(x)) for x in (q, k, v, g, beta)]

    def intra_stage(cfg):
        return jax.jit(lambda *a: intra_chunk_split(*a, scale=d ** -0.5, config=cfg, interpret=True,
                                                    documents=document_layout(seg, n), return_solve=True))(*padded)

    got, want = intra_stage(config), intra_stage(KernelConfig(block_k=16, intra="split"))
    names = ("qg", "kg", "w", "u", "aqk", "decay", "kk", "A", "G")
    # fused2 feeds 16-bit inputs to its dots as 16-bit operands (split: f32 operands), so with bf16 inputs the two
    # agree to a few bf16 roundings (2^-8 of the largest entry each), in f32 to accumulation order.
    stage_tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, x, ref in zip(names, (*got[:6], *got[6]), (*want[:6], *want[6])):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < stage_tol, name
    assert float(jnp.max(want[5])) > 1e-3  # some chunk decays matter

    def fused(*a):
        return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True, backend="interpret",
                         config=config)

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    tol = 2e-5 if dtype == jnp.float32 else 1.5e-2  # bf16: bf16 intermediates and dot operands, as the other paths
    o, s = jax.jit(fused)(*args)
    ro, rs = jax.jit(recurrent)(*args)
    assert _rel_err(o.astype(jnp.float32), ro) < tol and _rel_err(s, rs) < tol
    w_o, w_s = _cotangents(v, h0, seed=52)
    for name, x, ref in zip(_GRAD_NAMES, _grad_all(fused, args, w_o, w_s), _grad_all(recurrent, args, w_o, w_s)):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < tol, name
    with pytest.raises(ValueError, match="intra must be"):
        KernelConfig(intra="fused3")


@pytest.mark.parametrize("config", [KernelConfig(block_k=16),  # defaults: split forward, tiled backward
                                    KernelConfig(block_k=16, intra="single", intra_bwd="auto"),
                                    KernelConfig(block_k=16, intra="split", intra_bwd="auto"),
                                    KernelConfig(block_k=16, intra_bwd="state_fused")])
def test_chunk_decay_gradient_with_mild_gates_equals_token_recurrence(config):
    """Every backward path with gates mild enough (half the key columns near 0) that the
    chunk decays 2^G_L, and so their gradient term and its document mask, are not negligible (with gates in
    (-5, 0) a whole chunk's decay underflows to 0 and that term cannot fail a test)."""
    q, k, v, g, beta, h0 = _inputs(b=1, t=150, h=1, kd=32, vd=32, seed=48)
    g[..., :16] *= 0.02
    seg = _segment_ids(1, 150, [[20]])  # chunk 0 holds a document start (its decay is masked); chunks 1-2 do not

    def kernel(*a):
        return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True, backend="interpret",
                         config=config)

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=32 ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    args = (q, k, v, g, beta, h0)
    w_o, w_s = _cotangents(v, h0, seed=49)
    for name, x, ref in zip(_GRAD_NAMES, _grad_all(kernel, args, w_o, w_s), _grad_all(recurrent, args, w_o, w_s)):
        assert _rel_err(x, ref) < 2e-5, name


def test_sequential_kernels_pipeline_one_stage_with_f32_operands_and_the_configured_stages_with_bf16():
    """Three pipelined stages of f32 [64, 128] tiles need 288 KiB of shared memory (an H200 has 227 KiB: the f32
    forward failed to launch on the GPU), so f32 operands run the chunk loops with one stage; bf16 keeps
    `KernelConfig.stages`. Checked in the CUDA lowering of the forward and backward (no GPU needed)."""
    import re

    assert KernelConfig().stages > 1
    stages = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        qkv = [jax.ShapeDtypeStruct((1, 128, 2, 128), dtype)] * 3
        gates = [jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.float32), jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)]

        def loss(q, k, v, g, beta):
            o, _ = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="gpu")
            return jnp.sum(o.astype(jnp.float32))

        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*qkv, *gates).lower(
            lowering_platforms=("cuda",)).as_text()
        stages[jnp.dtype(dtype).name] = sorted({int(s) for s in re.findall(r"num_stages\s*=\s*(\d+)", text)})
    assert stages["float32"] == [1], stages
    assert KernelConfig().stages in stages["bfloat16"], stages
