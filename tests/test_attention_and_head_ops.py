"""The LM head's `project_wide` (f32 logits, backward in the compute dtype) against float64 NumPy references; the
cuDNN attention path's guard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3jax.ops.attention import causal_attention, document_runs, training_attention_impl
from k3jax.ops.linear import project_wide


def _head_grads_f64(x, w, g):
    return g @ w.T, np.einsum("btd,btv->dv", x, g)


def test_project_wide_gradients_equal_the_float64_reference_in_f32():
    rng = np.random.default_rng(0)
    x, w, g = rng.normal(size=(2, 5, 8)), rng.normal(size=(8, 11)), rng.normal(size=(2, 5, 11))
    out, vjp = jax.vjp(project_wide, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    dx, dw = vjp(jnp.asarray(g, jnp.float32))
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-5)
    want_dx, want_dw = _head_grads_f64(x, w, g)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)


def test_project_wide_bf16_keeps_f32_logits_and_rounds_only_the_cotangent():
    """bf16 operands: f32 logits; gradients are the reference's on the bf16-rounded cotangent (bf16 results)."""
    rng = np.random.default_rng(1)
    bf = jnp.bfloat16
    x, w = jnp.asarray(rng.normal(size=(3, 7, 16)), bf), jnp.asarray(rng.normal(size=(16, 24)), bf)
    g = jnp.asarray(rng.normal(size=(3, 7, 24)), jnp.float32)
    out, vjp = jax.vjp(project_wide, x, w)
    assert out.dtype == jnp.float32
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(out), x64 @ w64, rtol=1e-6, atol=1e-5)
    dx, dw = vjp(g)
    assert dx.dtype == bf and dw.dtype == bf
    want_dx, want_dw = _head_grads_f64(x64, w64, np.asarray(g.astype(bf), np.float64))
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=2e-2, atol=5e-2)


def test_cudnn_attention_names_misshapen_segment_ids():
    """Packed rows reach cuDNN as document runs of segment ids of the rows' shape (its numerics are checked on a
    GPU by benchmarks/attention_check.py)."""
    q = jnp.zeros((1, 4, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\] = \(1, 4\)"):
        causal_attention(q, q, q, scale=0.25, impl="cudnn", segment_ids_bt=jnp.ones((1, 5), jnp.int32))


def test_training_attention_auto_is_the_exact_xla_core_on_cpu_and_explicit_choices_pass_through():
    """"auto" (the default) picks cuDNN on a GPU with 16-bit compute and the blockwise core on a TPU; on a CPU the
    f32 XLA core, so the CPU checks of the whole model stay exact."""
    assert configs.get_config("k3_gpu").runtime.mla_attention_impl == "auto"
    assert training_attention_impl("auto", jnp.bfloat16) == training_attention_impl("auto", jnp.float32) == "xla"
    for impl in ("xla", "cudnn", "flash"):
        assert training_attention_impl(impl, jnp.float32) == impl


def _numpy_runs(seg, m):
    offsets = np.full((seg.shape[0], m + 1), -1)
    lengths = np.full((seg.shape[0], m), -1)
    runs = np.zeros(seg.shape[0], int)
    for b, row in enumerate(seg):
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
        ends = starts[1:] + [len(row)]
        runs[b] = len(starts)
        for i, (s, e) in enumerate(zip(starts, ends)):
            if i < m:
                offsets[b, i], lengths[b, i] = s, e - s
    return offsets, lengths, runs


def test_document_runs_give_cudnn_packed_offsets_and_lengths_like_numpy():
    """Runs of equal ids (documents and a padding tail) become cuDNN's offsets [B, M+1] and lengths [B, M], -1 past
    the last run; a row with more runs than M is counted (callers fall back) and its first M runs still listed."""
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0],
                    [5, 5, 5, 5, 5, 5, 5, 5],
                    [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
    for m in (3, 4, 8):
        got = [np.asarray(x) for x in document_runs(jnp.asarray(seg), m)]
        for g, w in zip(got, _numpy_runs(seg, m)):
            np.testing.assert_array_equal(g, w)
