"""Context parallelism: the sequence split over the 'context' mesh axis, with `shard_map` for the three places where
tokens talk to earlier tokens (docs/spec.md#kda-context-parallel, issue 4). Everything else in the model (norms,
projections, AttnRes, MoE) is per token and runs under GSPMD with the sequence sharded.

KDA (KCP, affine state passing). Per head the KDA token step (`k3jax.ops.kda`) is

    S_t = A_t S_{t-1} + β_t k_t v_tᵀ,   A_t = (I − β_t k_t k_tᵀ) Diag(exp g_t)   (dk×dk)

and at a document start (packed segment ids) the state is zeroed first: A_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) · 0.
So the state after a shard is affine in the state before it: S_out = M_i S_in + S_i, M_i = A_T ··· A_1 (dk×dk per
head, 0 once a document starts inside the shard), S_i the shard's state from zero. Three steps per shard:
(1) a state-only pre-pass (`kda_shard_transition`, f32, rematerialised) computes (M_i, S_i) from the chunked core's
WY factors: no outputs, no query reads, about T·dk·(dk+dv) per head beyond the factors; (2) the pieces (fixed size:
B·H·dk·(dk+dv) per shard, independent of T) are prefix-composed in f32 (S_in(0) = initial state; S_in(i+1) =
M_i S_in(i) + S_i) by a log-depth scan over the ranks (`incoming_state_by_doubling`: log2 n `ppermute`s of one
piece, not an all-gather of n); a document that starts exactly at a shard edge (first id of shard i != last id of
shard i−1) zeroes that shard's S_in; (3) the main pass runs the
configured core (`impl="pallas"`: the Pallas chunk kernel) on the shard from S_in at the original value width,
giving the outputs and the final state directly. Gradients: the kernel's custom VJP (its initial-state gradient
goes back through the composition and the ppermutes to the other shards' pre-passes), autodiff elsewhere.
Compared with extending the values to [v | 0] from an initial state [0 | I] (one pass at value width dv+dk, whose
outputs [B, T/n, H, dv+dk] and core residuals at that width stay live for the backward), nothing of width dv+dk
is kept per token: the main pass is the kernel at width dv, and the pre-pass saves only its inputs.

Short conv: the W−1 pre-conv inputs (and their segment ids) before a shard come from the left neighbour (a
`ppermute` halo); shard 0 gets zeros, like the unsharded conv's empty history.

MLA: the 576-wide latent rows `[kv_a_layernorm(latent) | k_r]` and the segment ids are all-gathered over 'context'
(the expanded keys/values are H·(192+128) wide per token, the latent is small) and attended blockwise
(`k3jax/ops/latent_flash_attention.py`): one key block of rows expanded with kv_b_proj at a time, an online softmax
over global positions, a recomputing custom VJP; no T x T (nor T_local x T) array and no expanded keys for the
whole sequence. Load balance (zig-zag): the sequence is cut into 2n chunks and rank r attends for chunks r and
2n−1−r, so every rank's queries see the same number of causal keys. The layer's tokens stay contiguous (KDA's
state passing and the conv halo need that): only the queries (and their segment ids) move, the shard's two halves
to the ranks attending for them by two `ppermute`s, and the f32 outputs come back the same way. Per rank the
largest arrays are the gathered rows [B, T, 576] (compute dtype), their f32 gradient, and query-sized ones
([B, T/n, H, 192], [B, T/n, H, 128] f32); a tile is [B, H, block, block].

Backward: plain autodiff through `shard_map` and the collectives (all_gather ↔ psum_scatter, ppermute ↔ reverse
ppermute); the custom VJPs are the blockwise attention's and the KDA kernel's (its `shard_map` runs with
`check_vma=False`: a Pallas call's outputs carry no varying-axes type). The layers (`k3jax/layers/kda.py`,
`k3jax/layers/mla.py`) take these paths in their training `__call__` when traced under a mesh (`jax.set_mesh`) whose
'context' axis is > 1 (`context_mesh`).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.numerics import wide
from k3jax.ops import kda as kda_ops
from k3jax.ops.conv import causal_depthwise_conv
from k3jax.ops.flash_attention import DEFAULT_BLOCK
from k3jax.ops.kda_xla import _chunk_intermediates, _document_masks, _sub_chunk_size, _to_chunks
from k3jax.ops.latent_flash_attention import latent_flash_attention

log = logging.getLogger(__name__)

CONTEXT_AXIS = "context"  # the rules' 'seq'
BATCH_AXES = ("data", "expert")  # the rules' 'batch'
MODEL_AXIS = "model"  # heads / channels (the rules' 'kda_heads', 'kda_proj', 'heads')
_PREC = jax.lax.Precision.HIGHEST


class ContextParallelError(ValueError):
    """Context parallelism was asked for on a mesh or shapes it cannot run on."""


# ---------------------------------------------------------------------------------------------------- mesh checks
def _axis(mesh, name: str) -> int:
    return mesh.shape[name] if name in mesh.axis_names else 1


def context_mesh(seq_len: int, min_local_len: int = 1):
    """The context mesh (`jax.sharding.get_abstract_mesh()`) when a layer traced now should run context-parallel
    over `seq_len` tokens, else None: no mesh, 'context' size 1, or already inside a `shard_map`. A sequence the
    axis cannot split evenly into pieces of at least `min_local_len` tokens falls back to GSPMD (logged)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _axis(mesh, CONTEXT_AXIS) == 1 or mesh.manual_axes:
        return None
    problem = _shape_problem(mesh, seq_len, min_local_len)
    if problem:
        log.warning("context parallelism off for this layer call: %s", problem)
        return None
    return mesh


def _shape_problem(mesh, seq_len: int, min_local_len: int = 1) -> str | None:
    n = _axis(mesh, CONTEXT_AXIS)
    if seq_len % n:
        return f"sequence length {seq_len} is not divisible by the context axis size {n}"
    if seq_len // n < min_local_len:
        return f"{seq_len // n} tokens per context shard is fewer than the {min_local_len} needed"
    return None


def _resolve_mesh(mesh, seq_len: int, min_local_len: int = 1):
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        raise ContextParallelError(f"context parallelism needs a mesh with a {CONTEXT_AXIS!r} axis, got {mesh}")
    problem = _shape_problem(mesh, seq_len, min_local_len)
    if problem:
        raise ContextParallelError(problem)
    return mesh


def batch_axes(mesh, batch: int):
    """The batch mesh axes (in rule order) that split `batch` evenly; others leave the batch replicated."""
    kept = []
    for a in BATCH_AXES:
        if a in mesh.axis_names and batch % (math.prod(_axis(mesh, k) for k in kept) * _axis(mesh, a)) == 0:
            kept.append(a)
    return tuple(kept) or None


def model_axis(mesh, size: int):
    """'model' for a heads/channels dim it divides, else None (replicated)."""
    m = _axis(mesh, MODEL_AXIS)
    return MODEL_AXIS if MODEL_AXIS in mesh.axis_names and m > 1 and size % m == 0 else None


def _shard_map(body, mesh, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _vary_like(x, *refs):
    """`x` typed as varying over every mesh axis any of `refs` varies over: inside `shard_map`, a constant or
    replicated value used as a `scan` carry next to sharded data must carry the same axes. Adds zero scalars made
    from `refs` (they inherit the varying axes on every jax version, unlike spelling the type out for `pcast`);
    outside `shard_map` it is just `x + 0`."""
    zero = sum(jnp.zeros_like(r, dtype=x.dtype, shape=()) for r in refs)
    return x + zero


# ---------------------------------------------------------------------------------------------------- KDA (KCP)
def kda_shard_transition(k_bthk, v_bthv, g_bthk, beta_bth, *, impl="chunked", chunk_size=64, segment_ids_bt=None):
    """This shard's affine transition, state only (no outputs): ``(m [B, H, K, K], s [B, H, K, V])`` in the
    compute dtype (at least f32) with final state = m @ S_in + s for any incoming state S_in of the shard's first
    document (m = 0 once a document starts inside the shard; s is the final state from zero).

    Chunked (for "chunked" and "pallas"): the chunked core's per-chunk WY factors (`k3jax.ops.kda_xla`: u = T v,
    w = T (k e^G), keys decayed to the chunk end, the whole-chunk decay; document masks included) give each chunk's
    transition ``diag(decay) − kdecᵀ w`` and offset ``kdecᵀ u``; one `lax.scan` over the chunks applies them to
    (m, s) without forming per-chunk K×K matrices. No query, no C×C read-out: about T·K·(K+V) multiply-adds per
    head beyond the factors. "recurrent": the token steps on (m, s). Rematerialised (`jax.checkpoint`): the
    forward keeps none of its intermediates for the backward.
    """
    if impl == "recurrent":
        return _token_transition(k_bthk, v_bthv, g_bthk, beta_bth, segment_ids_bt)
    return _chunk_transition(k_bthk, v_bthv, g_bthk, beta_bth, segment_ids_bt, chunk_size)


@jax.checkpoint
def _token_transition(k_bthk, v_bthv, g_bthk, beta_bth, segment_ids_bt):
    cdt = wide(jnp.result_type(k_bthk, v_bthv, g_bthk, beta_bth))
    b, t, h, kd = k_bthk.shape
    starts_bt = jnp.zeros((b, t), bool) if segment_ids_bt is None else jnp.concatenate(
        [jnp.zeros((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (k_bthk.astype(cdt), v_bthv.astype(cdt), g_bthk.astype(cdt),
                                                  beta_bth.astype(cdt), starts_bt))

    def step(carry, x):  # [m | s] <- (I − β k kᵀ) diag(e^g) [m | s] + [0 | β k vᵀ], zeroed first at a start
        k_bhk, v_bhv, g_bhk, beta_bh, start_b = x
        keep = jnp.where(start_b[:, None, None, None], 0.0, jnp.exp(g_bhk)[..., None])
        m_bhkk, s_bhkv = (keep * c for c in carry)
        bk_bhk = beta_bh[..., None] * k_bhk
        m_bhkk = m_bhkk - bk_bhk[..., None] * jnp.einsum("bhk,bhkj->bhj", k_bhk, m_bhkk, precision=_PREC)[..., None, :]
        v_new = v_bhv - jnp.einsum("bhk,bhkv->bhv", k_bhk, s_bhkv, precision=_PREC)
        return (m_bhkk, s_bhkv + bk_bhk[..., None] * v_new[..., None, :]), None

    eye = _vary_like(jnp.broadcast_to(jnp.eye(kd, dtype=cdt), (b, h, kd, kd)), *xs)
    zero = _vary_like(jnp.zeros((b, h, kd, v_bthv.shape[-1]), cdt), *xs)
    return jax.lax.scan(step, (eye, zero), xs)[0]


@functools.partial(jax.checkpoint, static_argnums=(5,))
def _chunk_transition(k_bthk, v_bthv, g_bthk, beta_bth, segment_ids_bt, chunk_size):
    cdt = wide(jnp.result_type(k_bthk, v_bthv, g_bthk, beta_bth))
    k_bhnck, v_bhncv, g_bhnck = (_to_chunks(x.astype(cdt), chunk_size) for x in (k_bthk, v_bthv, g_bthk))
    beta_bhnc = _to_chunks(beta_bth.astype(cdt), chunk_size)
    masks = None if segment_ids_bt is None else _document_masks(segment_ids_bt, chunk_size)
    inter = _chunk_intermediates(k_bhnck, k_bhnck, v_bhncv, g_bhnck, beta_bhnc, scale=1.0,
                                 sub_size=_sub_chunk_size(chunk_size), doc_masks=masks)
    xs = {n: jnp.moveaxis(inter[n], 2, 0) for n in ("u_bhncv", "w_bhnck", "kdec_bhnck", "decay_bhnk")}

    def chunk(x):  # the first chunk from zero: m = diag(decay) − kdecᵀ w, s = kdecᵀ u (no zero-state matmul)
        m = jnp.vectorize(jnp.diag, signature="(k)->(k,k)")(x["decay_bhnk"])
        m = m - jnp.einsum("bhck,bhcj->bhkj", x["kdec_bhnck"], x["w_bhnck"], precision=_PREC)
        return m, jnp.einsum("bhck,bhcv->bhkv", x["kdec_bhnck"], x["u_bhncv"], precision=_PREC)

    @jax.checkpoint
    def step(carry, x):  # [m | s] <- diag(decay) [m | s] − kdecᵀ (w [m | s]) + [0 | kdecᵀ u]
        m_bhkk, s_bhkv = carry
        w_m = jnp.einsum("bhck,bhkj->bhcj", x["w_bhnck"], m_bhkk, precision=_PREC)
        v_new = x["u_bhncv"] - jnp.einsum("bhck,bhkv->bhcv", x["w_bhnck"], s_bhkv, precision=_PREC)
        decay = x["decay_bhnk"][..., None]
        m_bhkk = decay * m_bhkk - jnp.einsum("bhck,bhcj->bhkj", x["kdec_bhnck"], w_m, precision=_PREC)
        s_bhkv = decay * s_bhkv + jnp.einsum("bhck,bhcv->bhkv", x["kdec_bhnck"], v_new, precision=_PREC)
        return (m_bhkk, s_bhkv), None

    first = chunk({n: x[0] for n, x in xs.items()})
    if xs["u_bhncv"].shape[0] == 1:
        return first
    return jax.lax.scan(step, first, {n: x[1:] for n, x in xs.items()})[0]


def incoming_state_by_doubling(m_bhkk, s_bhkv, continues_b, initial_bhkv, *, axis_name=CONTEXT_AXIS):
    """The state entering this shard, by a log-depth scan over the context ranks (inside `shard_map`).

    Shard r maps its incoming state to S_out(r) = M'_r S_in(r) + S_r, with M'_r = M_r where the row's document
    continues across the shard edge and 0 where one starts there (S_in zeroed), and on rank 0 the initial state
    folded in (S'_0 = M_0 initial + S_0, M'_0 = 0). These affine maps compose associatively, (M_b, S_b) ∘ (M_a,
    S_a) = (M_b M_a, M_b S_a + S_b), so ceil(log2 n) rounds of `ppermute` by distance 1, 2, 4, ... (Hillis–Steele)
    leave each rank with S_out(r); one more shift gives S_in(r) = S_out(r − 1) (rank 0: the initial state), zeroed
    where a document starts at the edge. Per rank this moves and keeps log2 n pieces of one shard's size instead
    of all-gathering n of them (context 256, K3: 3.2 GB f32 per KDA layer gathered, its gradient as large).
    Same values as the sequential chain S_in(i+1) = M_i S_in(i) + S_i up to f32 summation order."""
    n = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    mm = functools.partial(jnp.einsum, precision=_PREC)
    initial = _vary_like(initial_bhkv.astype(s_bhkv.dtype), m_bhkk, s_bhkv)
    on_first = rank == 0
    s_acc = jnp.where(on_first, mm("bhkj,bhjv->bhkv", m_bhkk, initial) + s_bhkv, s_bhkv)
    cut = continues_b[:, None, None, None] & ~on_first
    m_acc = jnp.where(cut, m_bhkk, jnp.zeros_like(m_bhkk))
    d = 1
    while d < n:
        m_prev, s_prev = jax.lax.ppermute((m_acc, s_acc), axis_name, [(i, i + d) for i in range(n - d)])
        has_prev = rank >= d
        s_acc = jnp.where(has_prev, mm("bhkj,bhjv->bhkv", m_acc, s_prev) + s_acc, s_acc)
        m_acc = jnp.where(has_prev, mm("bhkj,bhjl->bhkl", m_acc, m_prev), m_acc)
        d *= 2
    s_before = jax.lax.ppermute(s_acc, axis_name, [(i, i + 1) for i in range(n - 1)])
    s_in = jnp.where(on_first, initial, s_before)
    return jnp.where(continues_b[:, None, None, None] | on_first, s_in, jnp.zeros_like(s_in))


def kda_shard(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, segment_ids_bt, initial_state_bhkv, *, scale,
              impl="chunked", chunk_size=64, axis_name=CONTEXT_AXIS):
    """KCP body, called inside a `shard_map` over `axis_name` on this shard's tokens (in sequence order along the
    axis). `segment_ids_bt` may be None; `initial_state_bhkv` is the state before the whole sequence (same on every
    shard). Pre-pass (`kda_shard_transition`), all-gather and f32 prefix composition of the (m, s) pieces, then one
    `k3jax.ops.kda.kda` pass (`impl`: the Pallas chunk kernel with "pallas") from the incoming state. Returns
    (o [B, T_local, H, V] (q's dtype for the kernel, else the compute dtype), the state after this shard
    [B, H, K, V] (f32 or wider))."""
    m, s_loc = kda_shard_transition(k_bthk, v_bthv, g_bthk, beta_bth, impl=impl, chunk_size=chunk_size,
                                    segment_ids_bt=segment_ids_bt)
    b = q_bthk.shape[0]
    if segment_ids_bt is None:
        ends_b2 = jnp.zeros((b, 2), jnp.int32)
    else:
        ends_b2 = jnp.stack([segment_ids_bt[:, 0], segment_ids_bt[:, -1]], axis=1).astype(jnp.int32)
    # Shard i continues the running document iff its first id equals shard i-1's last id; shard 0 always does
    # (the initial state belongs to the row's first document).
    n = jax.lax.axis_size(axis_name)
    prev_last_b = jax.lax.ppermute(ends_b2[:, 1], axis_name, [(i, i + 1) for i in range(n - 1)])
    continues_b = (ends_b2[:, 0] == prev_last_b) | (jax.lax.axis_index(axis_name) == 0)
    s_in = incoming_state_by_doubling(m, s_loc, continues_b, initial_state_bhkv, axis_name=axis_name)
    return kda_ops.kda(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, scale=scale, initial_state=s_in, impl=impl,
                       chunk_size=chunk_size, segment_ids=segment_ids_bt)


def kda_context_parallel(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, *, scale, initial_state=None, impl="chunked",
                         chunk_size=64, segment_ids=None, mesh=None):
    """`k3jax.ops.kda.kda` (same arguments) with the sequence split over the 'context' axis of `mesh` (default: the
    context mesh) (KCP). Global arrays in and out; batch over ('data', 'expert') and heads over 'model' where they
    divide. Returns (o [B, T, H, V], final state [B, H, K, V]): o in q's dtype with the kernel ("pallas"), else
    in the compute dtype; the state in the compute dtype (at least f32)."""
    segment_ids_bt, initial_state_bhkv = segment_ids, initial_state
    b, t, h, kd = k_bthk.shape
    vd = v_bthv.shape[-1]
    mesh = _resolve_mesh(mesh, t)
    ba, ma = batch_axes(mesh, b), model_axis(mesh, h)
    cdt = wide(jnp.result_type(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth))
    if initial_state_bhkv is None:
        initial_state_bhkv = jnp.zeros((b, h, kd, vd), cdt)
    tok4, tok3, state = P(ba, CONTEXT_AXIS, ma, None), P(ba, CONTEXT_AXIS, ma), P(ba, ma, None, None)
    has_ids = segment_ids_bt is not None

    def body(q, k, v, g, beta, ids, s0):
        o, s_out = kda_shard(q, k, v, g, beta, ids if has_ids else None, s0, scale=scale, impl=impl,
                             chunk_size=chunk_size)
        return o, s_out.astype(cdt)[None]

    ids = segment_ids_bt if has_ids else jnp.zeros((b, t), jnp.int32)
    # The kernel's outputs carry no varying-axes type, so its shard_map runs unchecked (as `sharding.kda_kernel`).
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok4, tok4, tok4, tok4, tok3, P(ba, CONTEXT_AXIS), state),
                       out_specs=(tok4, P(CONTEXT_AXIS, ba, ma, None, None)), check_vma=impl != "pallas")
    o, s_per_shard = fn(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, ids, initial_state_bhkv.astype(cdt))
    return o, s_per_shard[-1]


# ---------------------------------------------------------------------------------------------------- short conv
def short_conv_shard(x_btp, kernel_wp, segment_ids_bt, *, axis_name=CONTEXT_AXIS):
    """Causal depthwise conv + SiLU (`k3jax.ops.conv.causal_depthwise_conv`) on one shard inside a `shard_map`,
    with the W−1 previous inputs (and their segment ids) taken from the left neighbour. Returns f32 [B, T_local, P]."""
    halo = kernel_wp.shape[0] - 1
    if halo == 0:
        return causal_depthwise_conv(x_btp, kernel_wp, None, segment_ids_bt)[0]
    if x_btp.shape[1] < halo:
        raise ContextParallelError(f"short conv halo: {x_btp.shape[1]} tokens per context shard < W-1 = {halo}")
    n = jax.lax.axis_size(axis_name)
    to_right = [(i, i + 1) for i in range(n - 1)]  # shard 0 receives zeros: the empty history
    x_halo = jax.lax.ppermute(x_btp[:, -halo:], axis_name, to_right)
    ids = None
    if segment_ids_bt is not None:
        ids_halo = jax.lax.ppermute(segment_ids_bt[:, -halo:], axis_name, to_right)
        first = jnp.broadcast_to(segment_ids_bt[:, :1], ids_halo.shape)  # shard 0: zero halo in the first document
        ids_halo = jnp.where(jax.lax.axis_index(axis_name) == 0, first, ids_halo)
        ids = jnp.concatenate([ids_halo, segment_ids_bt], axis=1)
    y, _ = causal_depthwise_conv(jnp.concatenate([x_halo, x_btp], axis=1), kernel_wp, None, ids)
    return y[:, halo:]


def short_conv_context_parallel(x_btp, kernel_wp, segment_ids_bt=None, *, mesh=None):
    """The KDA short conv (+ SiLU) with the sequence split over 'context' (global arrays; channels over 'model'
    where they divide). Returns f32 (wide) [B, T, P] like `causal_depthwise_conv`'s first output."""
    b, t, p = x_btp.shape
    mesh = _resolve_mesh(mesh, t, kernel_wp.shape[0] - 1)
    ba, ma = batch_axes(mesh, b), model_axis(mesh, p)
    has_ids = segment_ids_bt is not None

    def body(x, kernel, ids):
        return short_conv_shard(x, kernel, ids if has_ids else None)

    ids = segment_ids_bt if has_ids else jnp.zeros((b, t), jnp.int32)
    fn = _shard_map(body, mesh, in_specs=(P(ba, CONTEXT_AXIS, ma), P(None, ma), P(ba, CONTEXT_AXIS)),
                    out_specs=P(ba, CONTEXT_AXIS, ma))
    return fn(x_btp, kernel_wp, ids)


# ---------------------------------------------------------------------------------------------------- MLA
def zigzag_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two sequence chunks (of 2n equal ones) context rank `rank` attends for: `rank` and 2n-1-rank, so every
    rank's queries see the same number of causal keys."""
    return rank, 2 * n - 1 - rank


def _zigzag_owner(chunk: int, n: int) -> int:
    return chunk if chunk < n else 2 * n - 1 - chunk


def _zigzag_perms(n: int):
    """Two permutations of the ranks: perm j sends rank s's held chunk 2s + j (its first / second half) to the rank
    that attends for it. Each is a permutation (chunks of one parity go to distinct ranks), and rank r receives the
    even one of its two chunks through perm 0 and the odd one through perm 1."""
    return [[(src, _zigzag_owner(2 * src + j, n)) for src in range(n)] for j in (0, 1)]


def _inverse(perm):
    return [(dst, src) for src, dst in perm]


def mla_attention_shard(q_bthk, latent_btc, kv_b_rhe, segment_ids_bt, *, nope, scale, block=DEFAULT_BLOCK,
                        zigzag=True, axis_name=CONTEXT_AXIS):
    """MLA attention for this shard's queries inside a `shard_map`: all-gathers the latent rows [lat | k_r] (and the
    segment ids) and runs `latent_flash_attention` (keys expanded one block at a time, online softmax, no T x T
    array) on global positions. With `zigzag` (and an even shard length) the queries move first: the shard's two
    halves go to the ranks that attend for them (`zigzag_chunks`) by two `ppermute`s, and the outputs come back the
    same way, so the causal work is even across ranks while the layer's tokens stay contiguous. Returns f32 (wide)
    [B, T_local, H, V]."""
    tl = q_bthk.shape[1]
    rows_bsc = jax.lax.all_gather(latent_btc, axis_name, axis=1, tiled=True)
    ids_bt = jnp.zeros(q_bthk.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    ids_bs = jax.lax.all_gather(ids_bt, axis_name, axis=1, tiled=True)
    rank = jax.lax.axis_index(axis_name)

    def attend(q, pos, ids):
        return latent_flash_attention(q, pos, rows_bsc, kv_b_rhe, nope=nope, scale=scale, seg_q_bt=ids,
                                      seg_k_bs=ids_bs, block_q=block, block_k=block)

    if not zigzag or tl % 2:
        return attend(q_bthk, rank * tl + jnp.arange(tl), ids_bt)
    n, half = jax.lax.axis_size(axis_name), tl // 2
    perms = _zigzag_perms(n)
    got = [jax.lax.ppermute((q_bthk[:, j * half:(j + 1) * half], ids_bt[:, j * half:(j + 1) * half]), axis_name,
                            perms[j]) for j in (0, 1)]
    # This rank attends for chunks `rank` (the earlier one) and 2n-1-rank; the even one arrived through perm 0.
    even_first = rank % 2 == 0
    (q_a, ids_a), (q_b, ids_b) = (jax.tree.map(lambda x, y: jnp.where(even_first, x, y), got[k], got[1 - k])
                                  for k in (0, 1))
    pos = jnp.concatenate([rank * half + jnp.arange(half), (2 * n - 1 - rank) * half + jnp.arange(half)])
    o_bthv = attend(jnp.concatenate([q_a, q_b], axis=1), pos, jnp.concatenate([ids_a, ids_b], axis=1))
    o_a, o_b = o_bthv[:, :half], o_bthv[:, half:]
    o_even, o_odd = jnp.where(even_first, o_a, o_b), jnp.where(even_first, o_b, o_a)
    back = [jax.lax.ppermute(o, axis_name, _inverse(perms[j])) for j, o in enumerate((o_even, o_odd))]
    return jnp.concatenate(back, axis=1)


def mla_attention_context_parallel(q_bthk, latent_btc, kv_b_rhe, segment_ids_bt=None, *, nope, scale, mesh=None,
                                   block=DEFAULT_BLOCK, zigzag=True):
    """MLA's training attention with the sequence split over 'context' (global arrays; heads over 'model' where they
    divide): q [B, T, H, nope + rope], latent rows [B, T, r + rope], kv_b_proj [r, H, nope + v] in the compute
    dtype; `block` tokens per query / key block. Returns f32 (wide) [B, T, H, V], equal to `causal_attention` on
    the expanded keys/values."""
    b, t, h, _ = q_bthk.shape
    mesh = _resolve_mesh(mesh, t)
    ba, ma = batch_axes(mesh, b), model_axis(mesh, h)
    has_ids = segment_ids_bt is not None

    def body(q, lat, kv_b, ids):
        return mla_attention_shard(q, lat, kv_b, ids if has_ids else None, nope=nope, scale=scale, block=block,
                                   zigzag=zigzag)

    ids = segment_ids_bt if has_ids else jnp.zeros((b, t), jnp.int32)
    tok4 = P(ba, CONTEXT_AXIS, ma, None)
    fn = _shard_map(body, mesh, in_specs=(tok4, P(ba, CONTEXT_AXIS, None), P(None, ma, None), P(ba, CONTEXT_AXIS)),
                    out_specs=tok4)
    return fn(q_bthk, latent_btc, kv_b_rhe, ids)
