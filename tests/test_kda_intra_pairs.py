"""KernelConfig(intra="pairs") (pallas_kernels/kda/intra_pairs.py, interpret mode): the intra-chunk stage equals
the split stage (including the backward's solve terms kk, A, G), and chunk_kda through it equals the token
recurrence (``k3jax.ops.kda.kda_recurrent``, independent of the chunked algebra) in outputs, final state and
gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import KernelConfig, chunk_kda, kda_recurrent
from pallas_kernels.kda.common import activate_gate, chunk_layout, document_layout
from pallas_kernels.kda.intra_split import intra_chunk_split
from tests.test_kda_kernel import (
    _cotangents,
    _grad_all,
    _inputs,
    _rel_err,
    _segment_ids,
)

_NAMES = ("qg", "kg", "w", "u", "aqk", "decay", "kk", "A", "G")
_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
_PAIRS = KernelConfig(block_k=16, intra="pairs")
_SPLIT = KernelConfig(block_k=16, intra="split")


def _intra_stage(padded, config, d, documents=None, gate=None):
    return jax.jit(lambda *a: intra_chunk_split(*a, scale=d ** -0.5, config=config, interpret=True,
                                                documents=documents, return_solve=True, gate=gate))(*padded)


def _assert_stage_equal(got, want, tol_16bit=None):
    """Every output incl. the solve terms: same shape / dtype, rel err < 1e-5 (16-bit outputs: ``tol_16bit``, the
    pairs kernel rounds its decay factors differently, so a bf16 value may round to its neighbour)."""
    for name, x, ref in zip(_NAMES, (*got[:6], *got[6]), (*want[:6], *want[6])):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        x32, ref32 = np.asarray(x.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        assert np.all(np.isfinite(x32)), name
        tol = 1e-5 if x.dtype == jnp.float32 else tol_16bit
        if not np.any(ref32):  # e.g. chunk decays that underflow under strong gates
            assert not np.any(x32), name
        else:
            assert _rel_err(x32, ref32) < tol, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pairs_intra_stage_equals_the_split_stage_on_packed_documents(dtype):
    """Packed documents (starts mid-chunk, on a chunk start, two in one 16-row block, a one-token document, a last
    chunk without a start), T not a multiple of 64, two key blocks per program, mild gates on half the key columns
    (chunk decays not negligible)."""
    b, t, h, d = 1, 150, 2, 32
    q, k, v, g, beta, _ = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=51)
    g[..., : d // 2] *= 0.02
    seg = _segment_ids(b, t, [[5, 64, 70, 75, 76]])
    n, _, to_padded, _ = chunk_layout(b, t, None)
    padded = [to_padded(jnp.asarray(x, dt)) for x, dt in zip((q, k, v, g, beta), (dtype,) * 3 + (jnp.float32,) * 2)]
    documents = document_layout(seg, n)
    got = _intra_stage(padded, _PAIRS, d, documents)
    want = _intra_stage(padded, _SPLIT, d, documents)
    _assert_stage_equal(got, want, tol_16bit=8e-3)  # one bf16 ulp is 2^-8 relative
    assert float(jnp.max(want[5])) > 1e-3  # some chunk decays matter


@pytest.mark.slow
def test_pairs_intra_stage_at_the_gate_bound_and_with_the_in_kernel_gate():
    """g = -5 (the K3 lower bound) on every token of a quarter of the key channels, and > -5 nats/token elsewhere:
    the pair factors' exponents reach their extremes (+-15 tokens of decay inside a sub-chunk, far pairs
    underflowing to 0); results are finite and equal the split stage. Then K3's raw gate activated in-kernel
    (``gate``) equals the split stage on the gate activated in XLA."""
    b, t, h, d = 1, 128, 1, 32
    q, k, v, g, beta, _ = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=61)
    g[..., : d // 4] = -5.0
    padded = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    _assert_stage_equal(_intra_stage(padded, _PAIRS, d), _intra_stage(padded, _SPLIT, d))

    rng = np.random.default_rng(62)
    g_raw = jnp.asarray(3.0 * rng.standard_normal((b, t, h, d)), jnp.float32)
    gate = (jnp.asarray(np.exp(rng.standard_normal((h, d))), jnp.float32),
            jnp.asarray(rng.standard_normal((h, d)), jnp.float32), -5.0)
    got = _intra_stage(padded[:3] + [g_raw, padded[4]], _PAIRS, d, gate=gate)
    want = _intra_stage(padded[:3] + [activate_gate(g_raw, gate), padded[4]], _SPLIT, d)
    _assert_stage_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_chunk_kda_through_pairs_equals_token_recurrence_outputs_state_and_gradients(dtype):
    """The whole kernel path (forward with the pairs stage, tiled backward reading its solve terms) vs the token
    recurrence, on packed documents with an initial state."""
    b, t, h, d = 1, 150, 1, 32
    q, k, v, g, beta, h0 = _inputs(b=b, t=t, h=h, kd=d, vd=d, seed=71)
    g[..., : d // 2] *= 0.02
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    seg = _segment_ids(b, t, [[20, 64, 75]])
    args = (q, k, v, g, beta, h0)

    def pairs(*a):
        return chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True, backend="interpret",
                         config=_PAIRS)

    def recurrent(*a):
        return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg)

    tol = 2e-5 if dtype == jnp.float32 else 1.5e-2  # bf16: bf16 intermediates and dot operands, as the other paths
    o, s = jax.jit(pairs)(*args)
    ro, rs = jax.jit(recurrent)(*args)
    assert o.dtype == dtype and s.dtype == jnp.float32
    assert _rel_err(o.astype(jnp.float32), ro) < tol and _rel_err(s, rs) < tol
    w_o, w_s = _cotangents(v, h0, seed=72)
    for name, x, ref in zip(_GRAD_NAMES, _grad_all(pairs, args, w_o, w_s), _grad_all(recurrent, args, w_o, w_s)):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert _rel_err(x.astype(jnp.float32), ref.astype(jnp.float32)) < tol, name
