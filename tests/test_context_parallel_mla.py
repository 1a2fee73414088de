"""Context-parallel MLA attention (`sharding/context_parallel.py` over `k3jax/ops/latent_flash_attention.py`), on
8 emulated CPU devices:

- the zig-zag layout gives every context rank the same causal work, and its two `ppermute`s are permutations;
- the blockwise latent attention (keys expanded one block at a time, queries at explicit positions) equals a dense
  float64 reference, forward and gradients wrt q, the latent rows and kv_b_proj;
- the context-parallel attention equals the single-device attention (f32, tight tolerance, forward and gradients)
  with packed documents crossing rank and zig-zag chunk edges, for context 2 and 4 (with heads over 'model' too);
- its compiled forward + backward holds no array with two sequence-long dimensions (no T x T, nor T_local x T).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import causal_attention
from k3jax.ops.latent_flash_attention import expand_latent_rows, latent_flash_attention
from sharding import context_parallel
from sharding.mesh import make_mesh

H, R, ROPE, NOPE, VD = 2, 12, 4, 6, 5  # heads, kv_lora_rank, rope, nope, value width (tiny, all different)
C = R + ROPE


def _inputs(b, t, seed, dtype=np.float32):
    rng = np.random.RandomState(seed)
    return (rng.randn(b, t, H, NOPE + ROPE).astype(dtype), rng.randn(b, t, C).astype(dtype),
            (rng.randn(R, H, NOPE + VD) / np.sqrt(R)).astype(dtype))


def _dense(q_bthk, rows_btc, kv_b_rhe, seg_bt):
    """Single-device MLA attention: expand every latent row, dense causal attention (the XLA core)."""
    k_bhtk, v_bhtv = expand_latent_rows(rows_btc, kv_b_rhe, NOPE)
    return causal_attention(q_bthk, k_bhtk.transpose(0, 2, 1, 3), v_bhtv.transpose(0, 2, 1, 3),
                            scale=(NOPE + ROPE) ** -0.5, impl="xla", segment_ids_bt=seg_bt)


def _output_and_grads(fn, args, w):
    """fn(*args) and the gradients of sum(fn(*args) · w) wrt its three arguments."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return out, grads


# ------------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_layout_balances_causal_work(n):
    chunk = 16
    chunks = [context_parallel.zigzag_chunks(r, n) for r in range(n)]
    assert sorted(c for pair in chunks for c in pair) == list(range(2 * n))
    work = [sum(int(p) + 1 for c in pair for p in range(c * chunk, (c + 1) * chunk)) for pair in chunks]
    assert len(set(work)) == 1, work  # keys seen by each rank's queries
    contiguous = [sum(p + 1 for p in range(r * 2 * chunk, (r + 1) * 2 * chunk)) for r in range(n)]
    assert len(set(contiguous)) == n  # the test can fail: contiguous shards are unbalanced
    for j, perm in enumerate(context_parallel._zigzag_perms(n)):
        assert sorted(d for _, d in perm) == list(range(n)), perm
        for src, dst in perm:  # rank dst attends for chunk 2·src + j, and gets the even one through perm 0
            assert 2 * src + j in chunks[dst] and (2 * src + j) % 2 == j


# ------------------------------------------------------------------------------------------------------ the op
def test_latent_flash_equals_dense_float64_reference(x64):
    """Queries at two separate position ranges (a zig-zag pair: 5..11 and 27..33; 3-query blocks, one straddling
    the gap, the last padded), keys 0..35 in blocks of 5 (padded; the last never visited); document edges at 9
    (inside the first range), 18 and 27; forward and gradients to 1e-10."""
    b, s = 2, 36
    q_all, rows, kv_b = _inputs(b, s, 0, np.float64)
    pos = np.concatenate([np.arange(5, 12), np.arange(27, 34)])
    seg = np.repeat(np.array([[1, 2, 3, 4], [5, 5, 6, 6]]), 9, axis=1).astype(np.int32)
    w = np.random.RandomState(1).randn(b, len(pos), H, VD)

    def flash(q, rows, kv_b):
        return latent_flash_attention(q, jnp.asarray(pos), rows, kv_b, nope=NOPE, scale=0.3, block_q=3,
                                      block_k=5, seg_q_bt=jnp.asarray(seg[:, pos]), seg_k_bs=jnp.asarray(seg))

    def dense(q, rows, kv_b):  # every position queried; the chosen rows picked after
        q_full = jnp.zeros((b, s, H, NOPE + ROPE), q.dtype).at[:, pos].set(q)
        k, v = expand_latent_rows(rows, kv_b, NOPE)
        out = causal_attention(q_full, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=0.3, impl="xla",
                               segment_ids_bt=jnp.asarray(seg))
        return out[:, pos]

    args = (q_all[:, pos], rows, kv_b)
    (got, g_got), (want, g_want) = (_output_and_grads(f, args, w) for f in (flash, dense))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for name, a, r in zip(("q", "rows", "kv_b"), g_got, g_want):
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-12, err_msg=name)


def test_latent_flash_rejects_mismatched_shapes():
    q, rows, kv_b = _inputs(1, 8, 0)
    with pytest.raises(ValueError, match="q_pos must have shape"):
        latent_flash_attention(q, jnp.arange(7), rows, kv_b, nope=NOPE, scale=1.0)
    with pytest.raises(ValueError, match="do not fit nope"):
        latent_flash_attention(q, jnp.arange(8), rows, kv_b, nope=NOPE + 1, scale=1.0)


# ------------------------------------------------------------------------------------------------------ sharded
def _packed_ids(b, t):
    """T = 56. Row 0: document starts at 5, 13, 20, 21 (a 1-token document; 21 is a zig-zag half edge for 4 ranks),
    30 and 47, so documents cross rank edges (14, 28, 42) and half edges (7, 35, 49); row 1: a document that starts
    exactly at the rank edge 28."""
    ids = np.zeros((b, t), np.int32)
    for start in (5, 13, 20, 21, 30, 47):
        ids[0, start:] += 1
    ids[1, 28:] = 7
    return ids


@pytest.mark.parametrize("mesh_shape, zigzag", [(dict(data=2, context=2, model=2), True),
                                                 (dict(data=2, context=4), True),
                                                 (dict(data=2, context=4), False)],
                         ids=["context2-model2", "context4", "context4-contiguous"])
def test_context_parallel_mla_equals_single_device(mesh_shape, zigzag):
    """T = 56 (14 tokens per rank of 4, halves of 7) in blocks of 3 (padded): output and the gradients wrt q, the
    latent rows and kv_b_proj equal the single-device attention in f32."""
    b, t = 2, 56
    args = _inputs(b, t, 2)
    ids = jnp.asarray(_packed_ids(b, t))
    w = jnp.asarray(np.random.RandomState(3).randn(b, t, H, VD), jnp.float32)
    mesh = make_mesh(**mesh_shape)

    def cp(q, rows, kv_b):
        return context_parallel.mla_attention_context_parallel(q, rows, kv_b, ids, nope=NOPE,
                                                               scale=(NOPE + ROPE) ** -0.5, mesh=mesh, block=3,
                                                               zigzag=zigzag)

    got, g_got = _output_and_grads(cp, args, w)
    want, g_want = _output_and_grads(lambda *a: _dense(*a, ids), args, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    for name, a, r in zip(("q", "latent", "kv_b"), g_got, g_want):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=name)


# ------------------------------------------------------------------------------------------------------ memory
def _long_arrays(fn, t, tl):
    """Shapes in `fn`'s compiled forward + backward (per device) with two dimensions of at least `tl`."""
    q = jax.ShapeDtypeStruct((1, t, H, NOPE + ROPE), jnp.float32)
    rows = jax.ShapeDtypeStruct((1, t, C), jnp.float32)
    kv_b = jax.ShapeDtypeStruct((R, H, NOPE + VD), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda q, rows, kv_b, ids: jnp.sum(fn(q, rows, kv_b, ids)), argnums=(0, 1, 2))
    text = jax.jit(grad).lower(q, rows, kv_b, ids).compile().as_text()
    shapes = {tuple(int(d) for d in s.split(",") if d)
              for s in re.findall(r"\b(?:f32|f64|bf16|s32|u32|pred)\[([0-9,]*)\]", text)}
    return sorted(s for s in shapes if sum(d >= tl for d in s) >= 2)


def test_context_parallel_mla_holds_no_sequence_by_sequence_array():
    """T = 1024 over 4 context ranks (256 tokens each), blocks of 32: no per-device array has two dimensions of
    256 or more (the dense attention's [.., T, T] logits do: the check can fail)."""
    t, n = 1024, 4
    mesh = make_mesh(context=n, devices=jax.devices()[:n])

    def cp(q, rows, kv_b, ids):
        return context_parallel.mla_attention_context_parallel(q, rows, kv_b, ids, nope=NOPE, scale=0.2, mesh=mesh,
                                                               block=32)

    assert _long_arrays(cp, t, t // n) == []
    assert _long_arrays(_dense, t, t // n)
