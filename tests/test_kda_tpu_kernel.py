"""The Mosaic TPU chunkwise KDA kernels (``pallas_kernels/kda/tpu.py``), run by the TPU interpreter
(``pltpu.InterpretParams``), equal the token recurrence ``k3jax.ops.kda.kda_recurrent`` (an independent ``lax.scan``
over tokens): outputs and final states for T not a multiple of the chunk (64), an initial state, one and two heads,
K = V = 64 (transposed layout) and 128 (in-place lane-aligned layout), bf16 and f32, traced segment ids and
cu_seqlens; the gradients of ``chunk_kda(backend="tpu_interpret")`` (the TPU backward kernels, and ``bwd="xla"``)
equal ``jax.grad`` of the recurrence. The kernels also compile for a real TPU topology with libtpu (compile only;
skipped without it).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.backend import default_kernel_backend
from k3jax.ops.kda import chunk_kda, kda_recurrent
from pallas_kernels.kda.tpu import chunk_kda_fwd_tpu
from sharding.aot import libtpu_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _unit(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _inputs(b, t, h, kd, vd, seed=0, n_states=None):
    """float32 numpy inputs: unit q/k, gates in (-5, 0) with a share pinned at the -5 bound, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = _unit(rng.standard_normal((b, t, h, kd)))
    k = _unit(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((b, t, h, kd))))
    g[rng.random(g.shape) < 0.1] = -5.0
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    h0 = 0.3 * rng.standard_normal((n_states or b, h, kd, vd))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, h0))


def _rel_err(x, ref):
    x, ref = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, ref))
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


def _races_found():
    """The TPU interpreter's race detector verdict for the calls since the last reset (private jax state)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as state

    return bool(state.races is not None and state.races.races_found)


def _tpu(*args, **kw):
    kd = args[0].shape[-1]
    return chunk_kda_fwd_tpu(*args, scale=kd ** -0.5, interpret=True, **kw)


def _recurrent(q, k, v, g, beta, h0, segment_ids=None):
    return kda_recurrent(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state_bhkv=h0,
                         segment_ids_bt=segment_ids)


def test_f32_two_heads_with_state_equal_token_recurrence_and_no_races():
    q, k, v, g, beta, h0 = _inputs(b=2, t=150, h=2, kd=64, vd=64)  # 3 chunks, the last one partial; two rows
    pltpu.reset_tpu_interpret_mode_state()
    o, s = _tpu(q, k, v, g, beta, h0, detect_races=True, interpret_cores=2)  # megacore: parallel axes split
    assert not _races_found()
    assert o.dtype == jnp.float32 and o.shape == v.shape and s.shape == h0.shape and s.dtype == jnp.float32
    ro, rs = _recurrent(q, k, v, g, beta, h0)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5


def test_k128_bf16_matches_token_recurrence_on_the_same_rounded_inputs():
    q, k, v, g, beta, h0 = _inputs(b=1, t=100, h=1, kd=128, vd=128, seed=1)  # lane-aligned in-place layout
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o, s = _tpu(qb, kb, vb, g, beta, h0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    ro, rs = _recurrent(qb, kb, vb, g, beta, h0)
    # bf16 matmul operands (the state included) with f32 accumulation: ~7e-3 relative here.
    assert _rel_err(o, ro) < 3e-2 and _rel_err(s, rs) < 3e-2
    # ...and that is rounding, not a wrong formula: the f32 kernel on the same rounded inputs is exact to f32.
    o32, s32 = _tpu(*(jnp.asarray(x, jnp.float32) for x in (qb, kb, vb)), g, beta, h0)
    assert _rel_err(o32, ro) < 2e-5 and _rel_err(s32, rs) < 2e-5


def test_traced_segment_ids_reset_the_state_like_the_token_recurrence():
    # Documents start mid-chunk, exactly on a chunk start (64), twice inside one 16-row sub-chunk (70, 75) and a
    # one-token document (140); the second row has none. Substitution solve: both inverses give the same result.
    b, t, h, d = 2, 150, 2, 64
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=21)
    ids = np.zeros((b, t), np.int32)
    for start in (5, 64, 70, 75, 140, 141):
        ids[0, start:] += 1
    seg = jnp.asarray(ids)
    o, s = _tpu(q, k, v, g, beta, h0, segment_ids=seg, solve="substitution")
    ro, rs = _recurrent(q, k, v, g, beta, h0, segment_ids=seg)
    assert _rel_err(o, ro) < 2e-5 and _rel_err(s, rs) < 2e-5
    assert _rel_err(o, _recurrent(q, k, v, g, beta, h0)[0]) > 1e-2  # the masks matter


def test_cu_seqlens_sequences_restart_from_their_own_state():
    cu = (0, 5, 5, 75, 140)  # short, empty, crossing a chunk boundary, ending mid-chunk
    q, k, v, g, beta, h0 = _inputs(b=1, t=140, h=2, kd=128, vd=128, seed=6, n_states=4)
    o, s = _tpu(q, k, v, g, beta, h0, cu_seqlens=cu)
    assert o.shape == v.shape and s.shape == h0.shape
    for n, (start, end) in enumerate(itertools.pairwise(cu)):
        if start == end:
            np.testing.assert_array_equal(s[n], h0[n])
            continue
        sl = slice(start, end)
        ro, rs = _recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0[n:n + 1])
        assert _rel_err(o[:, sl], ro) < 2e-5 and _rel_err(s[n], rs[0]) < 2e-5, n


_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _grads(core, args, seed):
    """Value and gradients (all six inputs) of ``sum(o * w_o) + sum(final_state * w_s)``, random weights."""
    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal(args[2].shape).astype(np.float32)
    w_s = rng.standard_normal(args[5].shape).astype(np.float32)

    def loss(*a):
        o, s = core(*a)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))(*args)


def _tpu_core(bwd="pallas", **kw):
    def core(*a):
        return chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, backend="tpu_interpret", bwd=bwd,
                         **kw)
    return core


def _assert_grads_close(got, want, tol):
    assert _rel_err(got[0], want[0]) < tol
    for name, x, ref in zip(_GRAD_NAMES, got[1], want[1]):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x, ref) < tol, name


def test_tpu_backward_and_xla_backward_f32_gradients_equal_token_recurrence():
    assert default_kernel_backend() == "xla"  # CPU: the TPU kernels are only picked on a TPU
    args = _inputs(b=2, t=130, h=2, kd=64, vd=64, seed=3)  # 3 chunks (the reverse loop), last one partial
    want = _grads(_recurrent, args, seed=4)
    _assert_grads_close(_grads(_tpu_core(), args, seed=4), want, 2e-5)
    _assert_grads_close(_grads(_tpu_core(bwd="xla"), args, seed=4), want, 2e-5)


def test_tpu_backward_k128_bf16_gradients_match_token_recurrence_on_the_same_rounded_inputs():
    q, k, v, g, beta, h0 = _inputs(b=1, t=100, h=1, kd=128, vd=128, seed=12)
    args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)) + (g, beta, h0)
    # bf16 states, v' and matmul operands with f32 accumulation: ~5e-3 here (the GPU kernels' bound is 1.5e-2).
    _assert_grads_close(_grads(_tpu_core(), args, seed=13), _grads(_recurrent, args, seed=13), 1.5e-2)


def test_tpu_backward_with_segment_ids_equals_token_recurrence_gradients():
    b, t, h, d = 2, 150, 1, 64
    args = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=22)
    ids = np.zeros((b, t), np.int32)
    for start in (5, 64, 70, 75, 140, 141):
        ids[0, start:] += 1
    seg = jnp.asarray(ids)
    got = _grads(_tpu_core(segment_ids=seg), args, seed=23)
    want = _grads(lambda *a: _recurrent(*a, segment_ids=seg), args, seed=23)
    _assert_grads_close(got, want, 2e-5)


def test_tpu_backward_with_cu_seqlens_equals_per_sequence_recurrence_gradients():
    cu = (0, 30, 30, 100)  # one sequence inside the first chunk, an empty one, one crossing a chunk boundary
    args = _inputs(b=1, t=100, h=1, kd=64, vd=64, seed=9, n_states=3)

    def per_sequence(q, k, v, g, beta, h0):
        outs, finals = [], []
        for n, (start, end) in enumerate(itertools.pairwise(cu)):
            if start == end:  # an empty sequence keeps its initial state
                finals.append(h0[n])
                continue
            sl = slice(start, end)
            o, s = _recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0[n:n + 1])
            outs.append(o)
            finals.append(s[0])
        return jnp.concatenate(outs, axis=1), jnp.stack(finals)

    _assert_grads_close(_grads(_tpu_core(cu_seqlens=cu), args, seed=10), _grads(per_sequence, args, seed=10), 2e-5)


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_tpu_kernel_compiles_for_v5p():
    """Mosaic TPU: forward + backward kernels (bf16; f32 with segment ids; bf16 with cu_seqlens; f32 at
    K = V = 64) lower and compile with libtpu for one v5p chip (compile only)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    code = "from benchmarks.kda_tpu_aot import main; main(['--topology=v5p:2x2x1', '--t=200'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device_kind"].startswith("TPU v5")
    for case in ("bf16_fwd_bwd", "f32_segment_ids_fwd_bwd", "bf16_cu_seqlens_fwd_bwd", "f32_k64_fwd_bwd"):
        assert result[case]["mosaic_calls"] == 3, case  # forward, forward saving the states, reverse kernel


def test_tpu_backward_chunk_decay_gradient_with_mild_gates_equals_token_recurrence():
    """Half the key columns with mild gates, so the chunk decays (and their gradient and document mask) are not
    negligible — with gates in (-5, 0) a whole chunk's decay underflows to 0; a document starts in chunk 0 only."""
    q, k, v, g, beta, h0 = _inputs(b=1, t=150, h=1, kd=64, vd=64, seed=21)
    g[..., :32] *= 0.02
    ids = np.zeros((1, 150), np.int32)
    ids[:, 20:] = 1
    seg = jnp.asarray(ids)
    args = (q, k, v, g, beta, h0)

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=64 ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    _assert_grads_close(_grads(_tpu_core(segment_ids=seg), args, seed=22), _grads(recurrent, args, seed=22), 2e-5)
