"""Kimi Delta Attention (KDA) cores in pure JAX (the XLA paths of `k3jax.ops.kda`).

Per (batch, head) the layer keeps an f32 state ``S`` of shape ``[K, V]``; for every token ``t``::

    S   = diag(exp(g_t)) S                         # per-channel decay first
    S   = S + k_t (beta_t (v_t - S^T k_t))^T       # delta rule against the decayed state
    o_t = S^T (scale * q_t)                        # read after the update

(docs/spec.md#kda, docs/kernels.md#kda-chunk.) Conventions shared by every function here:

* ``q`` and ``k`` arrive already L2-normalised; ``scale`` multiplies ``q`` inside the core.
* ``g`` is the already-activated per-channel log-decay (``<= 0``); ``beta`` is in ``(0, 1)``.
* Inputs may be any float dtype; all math runs in at least float32 (``k3jax.numerics.wide``: float64 when the
  inputs are float64). Outputs ``o`` and states come back in that compute dtype.
* Shape suffixes: b = batch, t = time, h = heads, k = key head dim, v = value head dim,
  n = chunk index, c = row within a chunk, s = sub-chunk index.
* Packed documents (``segment_ids_bt`` int ``[B, T]``, optional): a new document starts wherever the id
  changes from the previous token, and the state is reset to zero there, so no information flows
  between documents. Equal ids must therefore be contiguous (e.g. non-decreasing; a padding run of 0s is
  its own document). ``initial_state_bhkv`` belongs to the row's first document (the one at t = 0), and
  the final state is the state after the row's last token, i.e. of its last document. With
  ``segment_ids_bt=None`` nothing extra is computed.

Entry points (the dispatch between these and the Pallas kernels is ``k3jax.ops.kda.kda``):
:func:`kda_chunked` (chunkwise-parallel, the default for sequences off GPU), :func:`kda_recurrent`
(token-by-token reference) and :func:`kda_step` (one decode token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.numerics import wide

__all__ = ["SUB_CHUNK", "check_shapes", "document_index", "kda_chunked", "kda_recurrent", "kda_step", "l2_normalize"]

# Sub-chunk length for the intra-chunk decay factorisation (see _intra_chunk_decays).
SUB_CHUNK = 16

# f32 everywhere: ask accelerators for full-precision matmuls (a no-op on CPU).
_PREC = jax.lax.Precision.HIGHEST


def _compute_dtype(*xs):
    """At least float32: float64 inputs keep float64 (tests against float64 references)."""
    return wide(jnp.result_type(*xs))


def _einsum(spec, *operands):
    """``jnp.einsum`` at full f32 precision."""
    return jnp.einsum(spec, *operands, precision=_PREC)


# --------------------------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------------------------


def check_shapes(q, k, v, g, beta, state, *, has_time):
    """Validate shapes of (q, k, v, g, beta, state); return (B, H, K, V) (and T if ``has_time``)."""
    lead = 3 if has_time else 2
    names = "[B, T, H, *]" if has_time else "[B, H, *]"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.ndim != lead + 1:
            raise ValueError(f"KDA: {name} must have shape {names}, got {x.shape}")
    if q.shape != k.shape or g.shape != k.shape:
        raise ValueError(f"KDA: q, k, g must share a shape, got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:lead] != k.shape[:lead]:
        raise ValueError(f"KDA: v leading dims {v.shape[:lead]} != k leading dims {k.shape[:lead]}")
    if beta.shape != k.shape[:lead]:
        raise ValueError(f"KDA: beta must have shape {k.shape[:lead]}, got {beta.shape}")
    b, h, kd, vd = k.shape[0], k.shape[lead - 1], k.shape[-1], v.shape[-1]
    if state is not None and state.shape != (b, h, kd, vd):
        raise ValueError(f"KDA: state must have shape {(b, h, kd, vd)}, got {state.shape}")
    if has_time and k.shape[1] < 1:
        raise ValueError("KDA: sequence length T must be >= 1")
    return b, h, kd, vd


def _sub_chunk_size(chunk_size):
    """Return the sub-chunk length for ``chunk_size``; raise ValueError if it is not supported.

    ``chunk_size`` must be a positive int that is either <= SUB_CHUNK (one sub-chunk) or a
    multiple of SUB_CHUNK.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"KDA: chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_size <= SUB_CHUNK:
        return chunk_size
    if chunk_size % SUB_CHUNK:
        raise ValueError(
            f"KDA: chunk_size must be <= {SUB_CHUNK} or a multiple of {SUB_CHUNK}, got {chunk_size}"
        )
    return SUB_CHUNK


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """KDA q/k norm in float32: x / sqrt(sum(x^2) + eps) (eps added to the sum of squares, not clamped)."""
    x32 = x.astype(wide(x.dtype))
    return x32 / jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def document_index(segment_ids_bt):
    """int32 ``[B, T]``: 0 for the row's first document, +1 at each token whose id differs from the last.

    Documents are runs of equal ids; comparing these indices is how every packed-sequence mask in KDA
    (state resets, chunk masks, short-conv taps) decides "same document".
    """
    if segment_ids_bt.ndim != 2:
        raise ValueError(f"KDA: segment_ids must have shape [B, T], got {segment_ids_bt.shape}")
    starts_bt = segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]
    first_b1 = jnp.zeros_like(starts_bt[:, :1], jnp.int32)
    return jnp.concatenate([first_b1, jnp.cumsum(starts_bt, axis=1, dtype=jnp.int32)], axis=1)


def _check_segment_ids(segment_ids_bt, q_bthk):
    if segment_ids_bt is not None and segment_ids_bt.shape != q_bthk.shape[:2]:
        raise ValueError(
            f"KDA: segment_ids must have shape [B, T] = {q_bthk.shape[:2]}, got {segment_ids_bt.shape}"
        )


# --------------------------------------------------------------------------------------------
# Recurrent form
# --------------------------------------------------------------------------------------------


def kda_step(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv, *, scale):
    """One KDA token (decode step).

    Args:
      q_bhk, k_bhk: L2-normalised query / key, ``[B, H, K]``.
      v_bhv: value, ``[B, H, V]``.
      g_bhk: log-decay (<= 0), ``[B, H, K]``.
      beta_bh: delta-rule strength in (0, 1), ``[B, H]``.
      state_bhkv: state before the token, ``[B, H, K, V]``.
      scale: multiplier applied to q.

    Returns:
      ``(o_bhv, new_state_bhkv)``, both float32.
    """
    check_shapes(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv, has_time=False)
    cdt = _compute_dtype(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh)
    q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv = (
        x.astype(cdt) for x in (q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv)
    )
    state_bhkv = jnp.exp(g_bhk)[..., None] * state_bhkv
    pred_bhv = _einsum("bhk,bhkv->bhv", k_bhk, state_bhkv)
    delta_bhv = beta_bh[..., None] * (v_bhv - pred_bhv)
    state_bhkv = state_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
    o_bhv = _einsum("bhk,bhkv->bhv", q_bhk * scale, state_bhkv)
    return o_bhv, state_bhkv


def kda_recurrent(
    q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, *, scale, initial_state_bhkv=None, segment_ids_bt=None
):
    """Reference KDA over a sequence: ``lax.scan`` of :func:`kda_step` over tokens.

    Args:
      q_bthk, k_bthk: ``[B, T, H, K]``; v_bthv: ``[B, T, H, V]``; g_bthk: ``[B, T, H, K]``;
      beta_bth: ``[B, T, H]``; initial_state_bhkv: ``[B, H, K, V]`` or None (zeros).
      segment_ids_bt: int ``[B, T]`` or None: packed documents; the state is zeroed before the
        first token of every document but the first (see the module docstring).

    Returns:
      ``(o_bthv, final_state_bhkv)``, both float32.
    """
    b, h, kd, vd = check_shapes(
        q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, initial_state_bhkv, has_time=True
    )
    _check_segment_ids(segment_ids_bt, q_bthk)
    cdt = _compute_dtype(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth)
    if initial_state_bhkv is None:
        initial_state_bhkv = jnp.zeros((b, h, kd, vd), cdt)
    state_bhkv = initial_state_bhkv.astype(cdt)

    def time_major(x):
        return jnp.swapaxes(x.astype(cdt), 0, 1)

    xs = tuple(time_major(x) for x in (q_bthk, k_bthk, v_bthv, g_bthk, beta_bth))

    if segment_ids_bt is None:

        def body(state, x):
            o_bhv, state = kda_step(*x, state, scale=scale)
            return state, o_bhv

    else:
        doc_bt = document_index(segment_ids_bt)
        starts_bt = doc_bt != jnp.concatenate([doc_bt[:, :1], doc_bt[:, :-1]], axis=1)
        xs = xs + (jnp.swapaxes(starts_bt, 0, 1),)

        def body(state, x):
            *x, starts_b = x
            state = jnp.where(starts_b[:, None, None, None], jnp.zeros_like(state), state)
            o_bhv, state = kda_step(*x, state, scale=scale)
            return state, o_bhv

    final_state_bhkv, o_tbhv = jax.lax.scan(body, state_bhkv, xs)
    return jnp.swapaxes(o_tbhv, 0, 1), final_state_bhkv


# --------------------------------------------------------------------------------------------
# Chunked form
# --------------------------------------------------------------------------------------------


def _to_chunks(x_bth_, chunk_size):
    """``[B, T, H, ...]`` -> ``[B, H, N, C, ...]`` in the compute dtype, zero-padding T up to a multiple of C."""
    x_bth_ = x_bth_.astype(_compute_dtype(x_bth_))
    t = x_bth_.shape[1]
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    if pad:
        widths = [(0, 0)] * x_bth_.ndim
        widths[1] = (0, pad)
        x_bth_ = jnp.pad(x_bth_, widths)
    x_bnch_ = x_bth_.reshape(x_bth_.shape[0], n, chunk_size, *x_bth_.shape[2:])
    return jnp.moveaxis(x_bnch_, 3, 1)


def _intra_chunk_decays(g_bhnck, sub_size):
    """Decay factors ``exp(sum_{j < s <= i} g_s)`` for pairs inside a chunk, in factored form.

    Two rules keep this accurate to f32 rounding for ANY non-positive gate, however negative:

    1. Never form ``exp(G)`` and ``exp(-G)`` separately (a 64-token chunk can span thousands of
       nats). Pairs in the same sub-chunk get their own elementwise exponent, masked to ``-inf``
       before the ``exp``; pairs in sub-chunks ``I > J`` factor through the first row ``n`` of
       ``I``: ``exp(G_i - G_n) * exp(G_n - G_j)``, both exponents ``<= 0``.
    2. Every exponent is summed over exactly its own token range, never taken as a difference
       of two chunk-prefix sums: ``G_i - G_j`` with both prefixes near -1e4 would lose ~1e-3
       absolute (the f32 ulp at 1e4), i.e. a 1e-3 relative error in a decay factor of O(1).
       Sums of non-positive terms have only relative rounding error.

    Args:
      g_bhnck: log-decay ``[..., C, K]`` f32 (leading dims: chunks of all batches and heads),
        C a multiple of ``sub_size``.
      sub_size: sub-chunk length c.

    Returns a dict (S = C // c sub-chunks; capital I/J index sub-chunks, i/j rows inside them):
      ``diag_bhnsijk``: ``exp(sum_{j<s<=i} g_s)`` within a sub-chunk, 0 where ``j > i``;
      ``head_bhnsik``:  ``exp(sum_{n<s<=i} g_s)``, row i relative to its sub-chunk's first row n;
      ``tail_bhnIJjk``: ``exp(sum_{j<s<=n_I} g_s)`` for row j of sub-chunk J up to the first row
      of sub-chunk I, 0 unless ``I > J``.
    """
    *lead, c_full, kd = g_bhnck.shape
    ns = c_full // sub_size
    g_s = g_bhnck.reshape(*lead, ns, sub_size, kd)  # [.., S, c, K]

    # range_sum[.., S, i, j, K] = sum_{j < s <= i} g_s: per column j, a cumulative sum over s of g
    # with rows s <= j zeroed (adding exact zeros first keeps it a true range sum).
    rows = jnp.arange(sub_size)
    after_j_sj = rows[:, None] > rows[None, :]
    masked_sjk = jnp.where(after_j_sj[..., None], g_s[..., :, None, :], 0.0)
    range_sum_sijk = jnp.cumsum(masked_sjk, axis=-3)
    lower_ij = rows[:, None] >= rows[None, :]
    diag = jnp.exp(jnp.where(lower_ij[..., None], range_sum_sijk, -jnp.inf))

    head = jnp.exp(range_sum_sijk[..., :, 0, :])  # sum over (n, i]
    # Row j of sub-chunk J to the end of J: sum over (j, end_J]. Then whole sub-chunks strictly
    # between J and I, then the first row n_I of I.
    to_end_Jjk = range_sum_sijk[..., -1, :, :]
    total_Mk = jnp.sum(g_s, axis=-2)
    blocks = jnp.arange(ns)
    between_IJM = (blocks[None, :, None] < blocks[None, None, :]) & (
        blocks[None, None, :] < blocks[:, None, None]
    )
    between_IJk = jnp.sum(
        jnp.where(between_IJM[..., None], total_Mk[..., None, None, :, :], 0.0), axis=-2
    )
    expo_IJjk = (
        to_end_Jjk[..., None, :, :, :]
        + between_IJk[..., :, :, None, :]
        + g_s[..., :, 0, :][..., :, None, None, :]
    )
    later_IJ = blocks[:, None] > blocks[None, :]
    tail = jnp.exp(jnp.where(later_IJ[:, :, None, None], expo_IJjk, -jnp.inf))
    return {"diag_bhnsijk": diag, "head_bhnsik": head, "tail_bhnIJjk": tail}


def _decayed_gram_bhncc(a_bhnck, b_bhnck, decays):
    """``A[i, j] = sum_d a_i[d] b_j[d] exp(sum_{j<s<=i} g_s[d])`` for ``j <= i``, 0 above.

    Built sub-block by sub-block from :func:`_intra_chunk_decays`: diagonal sub-blocks use the
    exact pairwise factors, sub-blocks ``I > J`` use ``(a_i head_i) . (b_j tail_{I,J,j})``.

    Args:
      a_bhnck, b_bhnck: ``[..., C, K]`` f32, same leading dims as the gate given to
        :func:`_intra_chunk_decays`.
      decays: the dict returned by :func:`_intra_chunk_decays`.

    Returns:
      ``[..., C, C]`` f32 (lower triangular, diagonal included).
    """
    *lead, c_full, kd = a_bhnck.shape
    ns, sub_size = decays["head_bhnsik"].shape[-3:-1]
    a_s = a_bhnck.reshape(*lead, ns, sub_size, kd)
    b_s = b_bhnck.reshape(*lead, ns, sub_size, kd)

    diag_sij = _einsum("...sik,...sjk,...sijk->...sij", a_s, b_s, decays["diag_bhnsijk"])
    eye_IiJj = jnp.eye(ns, dtype=diag_sij.dtype)[:, None, :, None]
    gram_IiJj = diag_sij[..., :, :, None, :] * eye_IiJj  # diagonal sub-blocks, [.., I, i, J, j]
    if ns > 1:
        a_head_Iik = a_s * decays["head_bhnsik"]
        b_tail_IJjk = b_s[..., None, :, :, :] * decays["tail_bhnIJjk"]
        gram_IiJj = gram_IiJj + _einsum("...Iik,...IJjk->...IiJj", a_head_Iik, b_tail_IJjk)
    return gram_IiJj.reshape(*lead, c_full, c_full)


def _unit_lower_solve(l_bcc, rhs_bcd, block):
    """Solve ``(I + L) X = rhs`` for strictly lower-triangular ``L`` using only matmuls and slices.

    Blocked forward substitution: the ``block`` x ``block`` diagonal blocks are inverted by
    row-wise forward substitution (vectorised over all blocks), then block row ``I`` is
    ``X_I = inv(I + L_II) (rhs_I - L_{I,<I} X_{<I})``. Same arithmetic as a triangular solve,
    so f32-accurate even where a Neumann series would cancel badly.

    Deliberately NOT ``jax.scipy.linalg.solve_triangular``: on XLA:CPU (jaxlib 0.10.2) its LAPACK
    trsm FFI custom call splits the batch with ``jax::ParallelBatchMap`` over the intra-op thread
    pool and blocks a pool worker on a ``BlockingCounter``; when several such calls run at once
    (forward + backward solves under ``jit(grad)``) the executable intermittently deadlocks on a
    later call (all threads idle; gdb shows two workers in ``lapack_strsm_ffi`` -> ``ParallelBatchMap``
    -> ``BlockingCounter::Wait``).

    Args:
      l_bcc: ``[..., C, C]``; only its strictly lower triangle is read.
      rhs_bcd: ``[..., C, D]``.
      block: diagonal block size; C must be a multiple of it.

    Returns:
      ``[..., C, D]``.
    """
    c = l_bcc.shape[-1]
    ns = c // block
    # Diagonal blocks [.., S, c, c] and their inverses by row-wise forward substitution:
    # inv[i] = e_i - L[i, :i] inv[:i].
    l_diag_scc = jnp.stack(
        [l_bcc[..., i * block : (i + 1) * block, i * block : (i + 1) * block] for i in range(ns)],
        axis=-3,
    )
    eye_cc = jnp.eye(block, dtype=l_bcc.dtype)
    inv_rows = [jnp.broadcast_to(eye_cc[0], l_diag_scc.shape[:-1])]
    for i in range(1, block):
        prev_sic = jnp.stack(inv_rows, axis=-2)  # [.., S, i, c]
        inv_rows.append(eye_cc[i] - _einsum("...m,...mc->...c", l_diag_scc[..., i, :i], prev_sic))
    inv_diag_scc = jnp.stack(inv_rows, axis=-2)

    x_blocks = []
    for i in range(ns):
        rows = slice(i * block, (i + 1) * block)
        r_cd = rhs_bcd[..., rows, :]
        if i:
            x_prev = jnp.concatenate(x_blocks, axis=-2)  # [.., i*c, D]
            r_cd = r_cd - _einsum("...cm,...md->...cd", l_bcc[..., rows, : i * block], x_prev)
        x_blocks.append(_einsum("...cm,...md->...cd", inv_diag_scc[..., i, :, :], r_cd))
    return jnp.concatenate(x_blocks, axis=-2)


def _document_masks(segment_ids_bt, chunk_size):
    """Packed-document masks per chunk (bool), for :func:`_chunk_intermediates`.

    T is padded like the inputs; padded tokens join the last document (they are no-ops anyway).
    Returns a dict:
      ``same_bncc``: row i and column j of a chunk are in the same document;
      ``carry_bnc``: the token is in the document that was running before the chunk began (the
                     incoming state belongs to it; for chunk 0 that is the row's first document);
      ``last_bnc``:  the token is in the chunk's last document (the only one the outgoing state sees).
    """
    doc_bt = document_index(segment_ids_bt)
    b, t = doc_bt.shape
    n = -(-t // chunk_size)
    doc_bt = jnp.pad(doc_bt, ((0, 0), (0, n * chunk_size - t)), mode="edge")
    doc_bnc = doc_bt.reshape(b, n, chunk_size)
    before_bn = jnp.concatenate([doc_bnc[:, :1, 0], doc_bnc[:, :-1, -1]], axis=1)
    return {
        "same_bncc": doc_bnc[..., :, None] == doc_bnc[..., None, :],
        "carry_bnc": doc_bnc == before_bn[..., None],
        "last_bnc": doc_bnc == doc_bnc[..., -1:],
    }


def _chunk_intermediates(
    q_bhnck, k_bhnck, v_bhncv, g_bhnck, beta_bhnc, *, scale, sub_size, doc_masks=None
):
    """Everything that is parallel over chunks (docs/kernels.md#kda-chunk: all but the state pass).

    With ``G`` the inclusive within-chunk cumulative log-decay, returns a dict of f32 arrays:
      ``qdec_bhnck``  = scale * q * exp(G)            (reads the incoming state)
      ``aqk_bhncc``   = scale <q_i e^{G_i-G_j}, k_j>, j <= i
      ``w_bhnck``     = T (k * exp(G)),  ``u_bhncv`` = T v,  with T = (I + Akk)^{-1} diag(beta),
                        Akk[i, j] = beta_i <k_i e^{G_i-G_j}, k_j>, j < i
      ``kdec_bhnck``  = k * exp(G_last - G)           (keys decayed to the chunk end)
      ``decay_bhnk``  = exp(G_last)                   (whole-chunk state decay)
    All exponents are non-positive range sums of g (see :func:`_intra_chunk_decays`).

    With ``doc_masks`` (from :func:`_document_masks`) the chunk may hold several packed documents,
    and everything is masked (never an ``-inf`` gate) so that each behaves as if run alone:
    ``aqk``/``akk`` are zero across documents (so the solve is block-diagonal per document),
    ``qdec`` and ``w`` (the only readers of the incoming state) are zero outside the carried-in
    document, ``kdec`` is zero outside the chunk's last document, and ``decay`` is zero when the
    chunk starts a new document anywhere (the incoming state then does not survive the chunk).
    Decays are only ever applied within one document, where no reset occurs.

    Internally (B, H, N) are flattened into one batch axis. Besides keeping ranks low, this
    sidesteps an XLA:CPU crash (jaxlib 0.10.2: segfault inside the YNNPACK transpose of a
    high-rank intermediate in the backward pass, seen under jit(grad) with chunk_size=32).
    """
    lead = k_bhnck.shape[:-2]
    q_bhnck, k_bhnck, v_bhncv, g_bhnck, beta_bhnc = (
        x.reshape(-1, *x.shape[len(lead) :])
        for x in (q_bhnck, k_bhnck, v_bhncv, g_bhnck, beta_bhnc)
    )

    def keep(x, mask_bn_):
        """Zero ``x`` (flattened ``[B*H*N, ...]``) where the per-document mask ``[B, N, ...]`` is False."""
        if doc_masks is None:
            return x
        mask = mask_bn_[:, None]  # broadcast over heads
        x_full = x.reshape(*lead, *x.shape[1:])
        mask = mask.reshape(*mask.shape, *(1,) * (x_full.ndim - mask.ndim))
        return jnp.where(mask, x_full, 0.0).reshape(x.shape)

    c = k_bhnck.shape[-2]
    gcum_bhnck = jnp.cumsum(g_bhnck, axis=-2)  # sum over [0, i]
    # G_last - G_i = sum over (i, C-1]: an exclusive reverse cumulative sum, not a difference.
    grev_bhnck = jax.lax.cumsum(g_bhnck, axis=g_bhnck.ndim - 2, reverse=True)
    to_end_bhnck = jnp.concatenate(
        [grev_bhnck[..., 1:, :], jnp.zeros_like(grev_bhnck[..., :1, :])], axis=-2
    )
    qs_bhnck = q_bhnck * scale

    decays = _intra_chunk_decays(g_bhnck, sub_size)
    same = doc_masks["same_bncc"] if doc_masks is not None else None
    aqk_bhncc = keep(_decayed_gram_bhncc(qs_bhnck, k_bhnck, decays), same)
    strict_cc = jnp.tril(jnp.ones((c, c), k_bhnck.dtype), k=-1)
    akk_bhncc = beta_bhnc[..., :, None] * _decayed_gram_bhncc(k_bhnck, k_bhnck, decays) * strict_cc
    akk_bhncc = keep(akk_bhncc, same)

    # Solve (I + Akk) [u | w] = diag(beta) [v | k e^G] in one unit-lower-triangular solve.
    # (A matmul-only solve: see _unit_lower_solve for why not LAPACK's solve_triangular.)
    carry = doc_masks["carry_bnc"] if doc_masks is not None else None
    kg_bhnck = keep(k_bhnck * jnp.exp(gcum_bhnck), carry)
    rhs = beta_bhnc[..., None] * jnp.concatenate([v_bhncv, kg_bhnck], axis=-1)
    sol = _unit_lower_solve(akk_bhncc, rhs, sub_size)
    vd = v_bhncv.shape[-1]

    out = {
        "qdec_bhnck": keep(qs_bhnck * jnp.exp(gcum_bhnck), carry),
        "aqk_bhncc": aqk_bhncc,
        "u_bhncv": sol[..., :vd],
        "w_bhnck": sol[..., vd:],
        "kdec_bhnck": k_bhnck * jnp.exp(to_end_bhnck),
        "decay_bhnk": jnp.exp(gcum_bhnck[..., -1, :]),
    }
    if doc_masks is not None:
        out["kdec_bhnck"] = keep(out["kdec_bhnck"], doc_masks["last_bnc"])
        out["decay_bhnk"] = keep(out["decay_bhnk"], doc_masks["carry_bnc"][..., -1])
    return {name: x.reshape(*lead, *x.shape[1:]) for name, x in out.items()}


def _chunk_recurrence(inter, state_bhkv):
    """Sequential pass over chunks (docs/kernels.md#kda-chunk: the state pass) with the f32 state as ``lax.scan`` carry.

    Per chunk: ``v' = u - w S``; ``o = qdec S + Aqk v'``; ``S <- diag(decay) S + kdec^T v'``.

    ``state_bhkv=None`` (a zero start) reads no state in the first chunk: ``o = Aqk u``, ``S = kdec^T u``, the same
    values. A zero state known at compile time must not reach the state-pass matmuls: when a single chunk
    inlines the scan, XLA:CPU (jaxlib 0.10.2) fuses ``dot(x, broadcast(0.0))`` into a YNNPACK fusion that reads
    uninitialised memory, and the outputs were wrong, differing from compile to compile
    (tests/test_two_models_one_process.py).

    Returns ``(o_bhncv, final_state_bhkv)``.
    """
    xs = {name: jnp.moveaxis(x, 2, 0) for name, x in inter.items()}  # chunk axis first
    if state_bhkv is None:
        first = {name: x[0] for name, x in xs.items()}
        o_bhcv = _einsum("bhcd,bhdv->bhcv", first["aqk_bhncc"], first["u_bhncv"])
        state_bhkv = _einsum("bhck,bhcv->bhkv", first["kdec_bhnck"], first["u_bhncv"])
        if xs["u_bhncv"].shape[0] == 1:
            return o_bhcv[:, :, None], state_bhkv
        o_rest, state_bhkv = _chunk_recurrence({name: x[:, :, 1:] for name, x in inter.items()}, state_bhkv)
        return jnp.concatenate([o_bhcv[:, :, None], o_rest], axis=2), state_bhkv

    def body(s_bhkv, x):
        vnew_bhcv = x["u_bhncv"] - _einsum("bhck,bhkv->bhcv", x["w_bhnck"], s_bhkv)
        o_bhcv = _einsum("bhck,bhkv->bhcv", x["qdec_bhnck"], s_bhkv) + _einsum(
            "bhcd,bhdv->bhcv", x["aqk_bhncc"], vnew_bhcv
        )
        s_bhkv = x["decay_bhnk"][..., None] * s_bhkv + _einsum(
            "bhck,bhcv->bhkv", x["kdec_bhnck"], vnew_bhcv
        )
        return s_bhkv, o_bhcv

    final_state_bhkv, o_nbhcv = jax.lax.scan(body, state_bhkv, xs)
    return jnp.moveaxis(o_nbhcv, 0, 2), final_state_bhkv


def kda_chunked(
    q_bthk,
    k_bthk,
    v_bthv,
    g_bthk,
    beta_bth,
    *,
    scale,
    initial_state_bhkv=None,
    chunk_size=64,
    segment_ids_bt=None,
):
    """Chunkwise-parallel KDA (same result as :func:`kda_recurrent`).

    T is zero-padded to a multiple of ``chunk_size`` (q = k = v = beta = 0, g = 0: padded tokens
    neither decay nor write the state), and the output is sliced back to T.

    Args:
      q_bthk, k_bthk: ``[B, T, H, K]``; v_bthv: ``[B, T, H, V]``; g_bthk: ``[B, T, H, K]``;
      beta_bth: ``[B, T, H]``; initial_state_bhkv: ``[B, H, K, V]`` or None (zeros).
      scale: multiplier applied to q.
      chunk_size: static int, <= 16 or a multiple of 16.
      segment_ids_bt: int ``[B, T]`` or None: packed documents, reset by masks inside the chunk
        computation (see :func:`_chunk_intermediates` and the module docstring).

    Returns:
      ``(o_bthv, final_state_bhkv)``, both float32.
    """
    sub_size = _sub_chunk_size(chunk_size)
    b, h, kd, vd = check_shapes(
        q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, initial_state_bhkv, has_time=True
    )
    _check_segment_ids(segment_ids_bt, q_bthk)
    t = q_bthk.shape[1]
    cdt = _compute_dtype(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth)
    state_bhkv = None if initial_state_bhkv is None else initial_state_bhkv.astype(cdt)

    q_bhnck, k_bhnck, v_bhncv, g_bhnck = (
        _to_chunks(x.astype(cdt), chunk_size) for x in (q_bthk, k_bthk, v_bthv, g_bthk)
    )
    beta_bhnc = _to_chunks(beta_bth.astype(cdt), chunk_size)

    doc_masks = None if segment_ids_bt is None else _document_masks(segment_ids_bt, chunk_size)
    inter = _chunk_intermediates(
        q_bhnck, k_bhnck, v_bhncv, g_bhnck, beta_bhnc, scale=scale, sub_size=sub_size,
        doc_masks=doc_masks,
    )
    o_bhncv, final_state_bhkv = _chunk_recurrence(inter, state_bhkv)

    n = o_bhncv.shape[2]
    o_bthv = jnp.moveaxis(o_bhncv, 1, 3).reshape(b, n * chunk_size, h, vd)[:, :t]
    return o_bthv, final_state_bhkv
