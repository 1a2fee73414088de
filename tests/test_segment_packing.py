"""Packed documents (segment ids): every document in a packed row computes exactly what it computes alone.

Semantics under test: a new document starts wherever the segment id changes (here ids are non-decreasing, plus a
trailing padding run of 0s that is a document of its own). KDA's recurrent state and short conv restart at each
document start and MLA attends only within the document; an initial KDA state belongs to the row's first document,
and the final state is the one after the row's last document.

References never use segment ids: each document is cut out of the packed row and run alone. For the KDA cores that
is `kda_recurrent` on the documents as separate batch rows (right-padded with q = k = v = beta = g = 0, which leaves
the state unchanged, so per-document final states are exact too); for the model it is the independent float64
NumPy reference (tests/reference/numpy_k3.py) on each document. The equality tests also check that the same data
WITHOUT segment separation gives a clearly different answer, so they could fail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.ops.kda import kda_chunked, kda_recurrent
from tests.conftest import build_model
from tests.reference import numpy_k3 as ref

# Document lengths of the two packed rows (T = 37, not a multiple of any chunk size used). With chunk 16: row 0 has
# boundaries inside a chunk (5), at a chunk edge (16, a 1-token document) and just after it; row 1 has a document
# filling the first chunk exactly, two 1-token documents, then padding (id 0) running across two chunk edges.
DOC_LENGTHS = ([5, 11, 1, 8, 12], [16, 1, 1, 19])
DOC_IDS = ([1, 2, 3, 4, 5], [1, 2, 3, 0])


def _segment_ids(lengths_rows, ids_rows):
    return np.stack([np.repeat(ids, lens) for lens, ids in zip(lengths_rows, ids_rows)]).astype(np.int32)


def _documents(lengths_rows):
    """(row, start, length, index in row) of every document."""
    docs = []
    for row, lens in enumerate(lengths_rows):
        start = 0
        for i, n in enumerate(lens):
            docs.append((row, start, n, i))
            start += n
    return docs


def _unpack(x_bt_, docs, max_len):
    """Cuts every document out of a packed [B, T, ...] array into [num_docs, max_len, ...], zero right-padded."""
    out = np.zeros((len(docs), max_len) + x_bt_.shape[2:], x_bt_.dtype)
    for d, (row, start, n, _) in enumerate(docs):
        out[d, :n] = x_bt_[row, start:start + n]
    return out


# --------------------------------------------------------------------------------------------
# KDA core
# --------------------------------------------------------------------------------------------


def _kda_inputs(seed, b, t, h, kd, vd, dtype):
    rng = np.random.default_rng(seed)

    def l2(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = l2(rng.standard_normal((b, t, h, kd)))
    k = l2(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    g = -5.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h, kd))))  # K3 gate range (-5, 0)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    s0 = rng.standard_normal((b, h, kd, vd))
    return [x.astype(dtype) for x in (q, k, v, g, beta, s0)]


def _per_document_reference(q, k, v, g, beta, s0, scale):
    """Each document run alone by kda_recurrent (no segment ids): outputs scattered back into the packed layout,
    and each row's final state (that of its last document). The row's first document starts from s0 (or zeros
    when s0 is None), every other one from zeros."""
    docs = _documents(DOC_LENGTHS)
    max_len = max(n for _, _, n, _ in docs)
    cut = [_unpack(x, docs, max_len) for x in (q, k, v, g, beta)]
    b, _, h, kd = q.shape
    init = np.zeros((len(docs), h, kd, v.shape[-1]), q.dtype)
    if s0 is not None:
        for d, (row, _, _, i) in enumerate(docs):
            if i == 0:
                init[d] = s0[row]
    o_doc, s_doc = jax.jit(functools.partial(kda_recurrent, scale=scale))(*cut, initial_state_bhkv=init)
    o_doc, s_doc = np.asarray(o_doc), np.asarray(s_doc)
    o = np.zeros(q.shape[:3] + (v.shape[-1],), o_doc.dtype)
    final = np.zeros((b, h, kd, v.shape[-1]), s_doc.dtype)
    for d, (row, start, n, i) in enumerate(docs):
        o[row, start:start + n] = o_doc[d, :n]
        if i == len(DOC_LENGTHS[row]) - 1:
            final[row] = s_doc[d]
    return o, final


def test_kda_cores_with_segments_equal_per_document_runs(x64):
    """float64, chunked (chunk 16: one sub-chunk; chunk 32: two) and recurrent cores with segment ids: outputs
    and final states equal each document run alone, to ~1e-12. Row 0 starts from an initial state (it belongs to
    row 0's first document only); row 1 from zeros."""
    q, k, v, g, beta, s0 = _kda_inputs(0, 2, 37, 2, 8, 6, np.float64)
    s0[1] = 0.0
    seg = jnp.asarray(_segment_ids(DOC_LENGTHS, DOC_IDS))
    scale = 8 ** -0.5
    want_o, want_s = _per_document_reference(q, k, v, g, beta, s0, scale)
    cores = {
        "recurrent": functools.partial(kda_recurrent, scale=scale),
        "chunked16": functools.partial(kda_chunked, scale=scale, chunk_size=16),
        "chunked32": functools.partial(kda_chunked, scale=scale, chunk_size=32),
    }
    for name, core in cores.items():
        o, s = jax.jit(core)(q, k, v, g, beta, initial_state_bhkv=s0, segment_ids_bt=seg)
        np.testing.assert_allclose(np.asarray(o), want_o, rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=0, atol=1e-12, err_msg=name)
    # Without segment ids information crosses documents: clearly different.
    o_unpacked, _ = jax.jit(cores["chunked16"])(q, k, v, g, beta, initial_state_bhkv=s0)
    assert np.abs(np.asarray(o_unpacked) - want_o).max() > 1e-2


def test_kda_chunked_segments_float32_extreme_gates_and_gradients():
    """float32 with an unbounded (Kimi-Linear-style) gate down to -60 per token, no -inf anywhere: the chunked core
    with segment ids stays finite and matches the recurrent core with segment ids to f32 accuracy, in value and in
    the gradients with respect to every input (q, k, v, g, beta, initial state)."""
    q, k, v, _, beta, s0 = _kda_inputs(1, 2, 37, 2, 8, 6, np.float32)
    g = -60.0 * np.random.default_rng(2).uniform(size=q.shape).astype(np.float32)
    g[:, ::5] *= 1e-3  # nearly non-decaying tokens, so information would survive a missing reset
    seg = jnp.asarray(_segment_ids(DOC_LENGTHS, DOC_IDS))
    scale = 8 ** -0.5

    def loss(core, q, k, v, g, beta, s0):
        o, s = core(q, k, v, g, beta, scale=scale, initial_state_bhkv=s0, segment_ids_bt=seg)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape))) + jnp.sum(jnp.sin(s))

    chunked = functools.partial(kda_chunked, chunk_size=16)
    args = (q, k, v, g, beta, s0)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, chunked), argnums=range(6)))(*args)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, kda_recurrent), argnums=range(6)))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(1.0, np.abs(b).max()))


# --------------------------------------------------------------------------------------------
# Whole model
# --------------------------------------------------------------------------------------------

# Packed model rows (T = 52; tiny's KDA chunk is 32): row 0 = [A 13 | B 30 | C 9], boundaries inside both chunks;
# row 1 = [E 30 | D 1 | F 13 | padding 8 (id 0)], a 1-token document and the padding a document of its own.
MODEL_DOC_LENGTHS = ([13, 30, 9], [30, 1, 13, 8])
MODEL_DOC_IDS = ([1, 2, 3], [1, 2, 3, 0])
FIRST_DOC_VOCAB = 100  # document A alone uses token ids [0, 100); every other document uses [100, vocab)


@functools.lru_cache(maxsize=None)
def _packed_model_run(name):
    """One jitted value_and_grad of a next-token loss on the packed batch, in float64, returning the logits too.

    The loss skips targets across a boundary and every prediction made inside document A. Returns
    (cfg, weights, ids, logits, loss, param grads), all NumPy; shared by the tests below (one compile).
    """
    with jax.enable_x64(True):
        cfg = configs.get_config(name, ["param_dtype=float64", "dtype=float64"])
        model, weights = build_model(cfg)
        rng = np.random.RandomState(3)
        lengths = [n for lens in MODEL_DOC_LENGTHS for n in lens]
        first = [rng.randint(0, FIRST_DOC_VOCAB, lengths[0])]
        rest = [rng.randint(FIRST_DOC_VOCAB, cfg.vocab_size, n) for n in lengths[1:]]
        ids = np.concatenate(first + rest).reshape(2, -1).astype(np.int32)
        seg = _segment_ids(MODEL_DOC_LENGTHS, MODEL_DOC_IDS)
        use = seg[:, 1:] == seg[:, :-1]  # no target across a boundary
        use[0, :MODEL_DOC_LENGTHS[0][0]] = False  # nor any prediction inside document A

        def next_token_loss(m, ids_bt, seg_bt):
            logits = m(ids_bt, seg_bt)
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            nll = -jnp.take_along_axis(logp, ids_bt[:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(jnp.where(use, nll, 0.0)) / use.sum(), logits

        (loss, logits), grads = nnx.jit(nnx.value_and_grad(next_token_loss, has_aux=True))(
            model, jnp.asarray(ids), jnp.asarray(seg))
        grads = jax.tree.map(np.asarray, nnx.state(grads, nnx.Param))
        return cfg, weights, ids, np.asarray(logits), float(loss), grads


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_packed_row_logits_equal_each_document_alone(name):
    """float64 `tiny` (KDA + MLA + AttnRes + MoE + dense layer): the logits of every document in a packed row
    equal the NumPy reference's logits for that document alone (~1e-9 of the logit scale)."""
    cfg, weights, ids, packed, _, _ = _packed_model_run(name)
    want = np.zeros_like(packed)
    for row, start, n, _ in _documents(MODEL_DOC_LENGTHS):
        want[row, start:start + n] = ref.forward(weights, cfg, ids[row:row + 1, start:start + n])[0]
    np.testing.assert_allclose(packed, want, rtol=0, atol=1e-9 * np.abs(want).max())
    # The same rows as single documents: later documents see earlier ones and their logits differ.
    joined = ref.forward(weights, cfg, ids[:1])
    assert np.abs(joined[0, 13:] - want[0, 13:]).max() > 1e-2 * np.abs(want).max()


@pytest.mark.slow
def test_gradient_with_segment_ids_is_finite_and_blocked_across_documents():
    """float64 `tiny`: the gradient of a next-token loss on the packed batch is finite; and since the loss makes no
    prediction inside document A, the embedding rows of the tokens only A uses get exactly zero gradient, while the
    other documents' rows do not: nothing crosses a document boundary in the backward pass either."""
    _, _, _, _, loss, grads = _packed_model_run("tiny")
    assert np.isfinite(loss)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.all(np.isfinite(x)) for x in leaves)
    grad_embed = np.asarray(grads["embed_tokens"][...])
    assert np.abs(grad_embed[FIRST_DOC_VOCAB:]).max() > 0.0
    np.testing.assert_array_equal(grad_embed[:FIRST_DOC_VOCAB], 0.0)
