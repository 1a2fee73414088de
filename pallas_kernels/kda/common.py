"""Helpers shared by the KDA Pallas kernels (GPU forward / backward stages and the TPU kernels): the chunk
geometry, `KernelConfig`, in-kernel dot and row helpers, the unit-lower-triangular inverses, the K3 gate activation,
packed-document and varlen layouts, and the block specs of the chunk-parallel and chunk-loop grids."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tiling import is_pow2

_F32 = jnp.float32
CHUNK = 64
SUB_CHUNK = 16
_N_SUB = CHUNK // SUB_CHUNK
LOG2E = 1.4426950408889634

INTRA_MODES = ("single", "split", "fused2", "pairs")
GATE_IN_KERNEL = ("fused2", "pairs")  # intra modes that can apply K3's gate activation while loading g
SPLIT_FAMILY = ("split", "fused2", "pairs")  # intra modes producing the split stage's solve terms


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """GPU tuning knobs (results do not depend on them beyond rounding).

    block_v: value columns per program of the sequential (chunk-loop) kernels (power of two >= 16).
    warps: Triton warps per program of (parallel kernels, sequential kernels).
    solve: inverse of the 16x16 diagonal blocks of I + Akk: "substitution" (row by row) or "doubling" (matmuls).
    stages: Triton ``num_stages`` of the sequential kernels (> 1 lets Triton software-pipeline the chunk loop's
      loads).
    block_k: key / value columns per step of the intra-chunk kernel's column loops (power of two >= 16).
    intra: "fused2" (intra_fused.py: cumulative gate, gram products and 64x64 solve in one kernel, then the split
      apply kernel; can activate K3's raw gate in-kernel), "pairs" (intra_pairs.py: as "fused2" with the gram
      products formed per pair of 16-row sub-chunks, 43% fewer exp2), "split" (intra_split.py: cumulative gate
      in XLA, then gram / solve / apply kernels) or "single" (one intra-chunk kernel per chunk and head).
    intra_bwd: backward intra-chunk kernels: "auto" (the one kernel matching ``intra``) or "tiled" (recompute
      through the split kernels, then two kernels: solve gradients per chunk, then per key block the dq / dk / dg
      products in 16-row steps; intra_bwd_tiled.py) or "state_fused" (as "tiled" with the state-product gradients
      computed inside its two kernels instead of a separate state_grads kernel; intra_bwd_fused.py).
    residuals: what the forward keeps for the backward: "intra" (its intra-chunk results ``qg, kg, w, u, aqk``,
      the chunk decays and the split solve terms — already written to HBM by the forward, so keeping them costs
      memory, ~2.3 KB per token and head at K = V = 128 bf16, and saves the backward's recompute of the intra
      stage) or "inputs" (q, k, v, g, beta only; the backward recomputes the intra stage).

    Defaults = the fastest measured on an H200 at 1x8192x96 bf16 (``benchmarks/kda_stages.py``, RESULTS.md):
    forward intra fused2 (block_k 64) 2.46 ms, split 3.92, single 4.53; tiled backward intra 1.80 + 3.42 ms at
    block_k 64 (2.20 + 3.92 at 32; single 18.1). Whole op (``kda_bench.py``, pipelined): stages 3 vs 1 forward
    2.49 vs 2.64 ms at 1x8192x96 and 1.57 vs 1.94 ms at 1x8192x64 (block_v 32: 2.72 / 1.79).
    """

    block_v: int = 64
    warps: tuple[int, int] = (4, 4)
    solve: str = "doubling"
    stages: int = 3
    block_k: int = 64
    intra: str = "fused2"
    intra_bwd: str = "tiled"
    residuals: str = "intra"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``block_v-warps-warps[-solve[-stages[-block_k[-intra[-intra_bwd]]]]]``, e.g. ``64-4-4`` or
        ``32-4-4-doubling-2-64-split-tiled`` (the benchmarks' variant syntax)."""
        parts = text.split("-")
        if len(parts) < 3 or len(parts) > 8:
            raise ValueError("KernelConfig.parse: expected block_v-warps-warps[-solve[-stages[-block_k[-intra"
                             f"[-intra_bwd]]]]], got {text!r}")
        kw = dict(block_v=int(parts[0]), warps=(int(parts[1]), int(parts[2])))
        for name, value in zip(("solve", "stages", "block_k", "intra", "intra_bwd"), parts[3:]):
            kw[name] = int(value) if name in ("stages", "block_k") else value
        return cls(**kw)

    def stages_for(self, dtype) -> int:
        """``stages`` for operands of ``dtype``: 16-bit as configured; 32-bit operands pipeline one stage (three
        stages of f32 [64, 128] tiles need 288 KiB of shared memory, over an H200's 227 KiB)."""
        return self.stages if jnp.dtype(dtype).itemsize <= 2 else 1

    def __post_init__(self):
        if self.solve not in ("substitution", "doubling"):
            raise ValueError(f"KernelConfig.solve must be 'substitution' or 'doubling', got {self.solve!r}")
        if self.intra not in INTRA_MODES:
            raise ValueError(f"KernelConfig.intra must be one of {INTRA_MODES}, got {self.intra!r}")
        if self.intra_bwd not in ("auto", "tiled", "state_fused"):
            raise ValueError("KernelConfig.intra_bwd must be 'auto', 'tiled' or 'state_fused', got "
                             f"{self.intra_bwd!r}")
        if self.residuals not in ("intra", "inputs"):
            raise ValueError(f"KernelConfig.residuals must be 'intra' or 'inputs', got {self.residuals!r}")
        if self.stages < 1:
            raise ValueError(f"KernelConfig.stages must be >= 1, got {self.stages}")


def dot(a, b, precision):
    """``a @ b`` with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)


def dot_nt(a, b, precision):
    """``a @ b^T`` with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32)


def dot_tn(a, b, precision):
    """``a^T @ b`` with f32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)


def take_row(x_ck, r):
    """Row ``r`` (static) of a register tile ``[c, K]`` as ``[K]`` (masked sum: tiles cannot be indexed)."""
    rows_c1 = jnp.arange(x_ck.shape[0], dtype=jnp.int32)[:, None]
    return jnp.sum(jnp.where(rows_c1 == r, x_ck, 0.0), axis=0)


def _unit_lower_inverse(l_cc):
    """``(I + L)^-1`` for a strictly lower-triangular ``[c, c]`` tile, by forward substitution.

    Row ``i`` of ``X = (I + L)^-1`` is ``e_i - L[i, :i] X[:i]`` (rows above ``i`` are final when it is formed).
    """
    c = l_cc.shape[0]
    rows_c1 = jnp.arange(c, dtype=jnp.int32)[:, None]
    cols_1c = jnp.arange(c, dtype=jnp.int32)[None, :]
    x_cc = jnp.where(rows_c1 == cols_1c, 1.0, 0.0).astype(_F32)
    for i in range(1, c):
        l_row_c = take_row(l_cc, i)
        new_row_c = jnp.where(cols_1c[0] == i, 1.0, 0.0) - jnp.sum(l_row_c[:, None] * x_cc, axis=0)
        x_cc = jnp.where(rows_c1 == i, new_row_c[None, :], x_cc)
    return x_cc


def unit_lower_inverse_doubling(l_cc):
    """``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)`` for ``L^16 = 0``: a strictly lower ``[16, 16]`` tile,
    or a block-diagonal of such tiles (the TPU kernel inverts its four diagonal blocks at once).

    Six matmuls instead of 15 dependent row steps (full f32 matmuls).
    """
    c = l_cc.shape[0]
    if c % SUB_CHUNK:
        raise ValueError(f"doubling inverse needs a multiple of {SUB_CHUNK} rows (L^16 = 0), got {c}")
    rows_c1 = jnp.arange(c, dtype=jnp.int32)[:, None]
    eye_cc = jnp.where(rows_c1 == jnp.arange(c, dtype=jnp.int32)[None, :], 1.0, 0.0).astype(_F32)
    hi = lax.Precision.HIGHEST
    x_cc = eye_cc - l_cc
    power_cc = dot(l_cc, l_cc, hi)  # L^2
    for step in range(3):
        x_cc = x_cc + dot(x_cc, power_cc, hi)
        if step < 2:
            power_cc = dot(power_cc, power_cc, hi)
    return x_cc

UNIT_LOWER_INVERSES = {"substitution": _unit_lower_inverse, "doubling": unit_lower_inverse_doubling}


def rows_masked(x_rc, mask_r1):
    """``x`` with rows zeroed where the ``[rows, 1]`` 0/1 mask is 0 (``mask=None``: unchanged)."""
    return x_rc if mask_r1 is None else x_rc * mask_r1


def document_masks(doc_ref, carry_ref, last_ref):
    """Per sub-chunk row masks of one chunk (packed documents): ``carry``/``last`` ``[16, 1]`` f32 and ``same``
    ``{(i, j): [16, 16] bool}`` for the sub-chunk pairs ``j <= i``."""
    s = SUB_CHUNK
    doc = [doc_ref[pl.ds(i * s, s)] for i in range(_N_SUB)]
    return {
        "carry": [carry_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in range(_N_SUB)],
        "last": [last_ref[pl.ds(i * s, s)].astype(_F32)[:, None] for i in range(_N_SUB)],
        "same": {(i, j): doc[i][:, None] == doc[j][None, :] for i in range(_N_SUB) for j in range(i + 1)},
    }


def document_layout(segment_ids, n_chunks):
    """Packed-document masks for the kernels from traced segment ids ``[B, T]`` (a document starts wherever the
    id changes; T <= n_chunks * 64, padding joins the last document).

    Returns f32/int32 arrays: ``doc [B, Tp]`` document index, ``carry [B, Tp]`` (token is in the document running
    before its chunk began: it may read the incoming state), ``last [B, Tp]`` (token is in its chunk's last
    document: it writes the outgoing state) and ``keep [B, N]`` (no document starts inside the chunk: the
    incoming state survives it), the same masks as ``k3jax.ops.kda``'s chunked path.
    """
    b, t = segment_ids.shape
    tp = n_chunks * CHUNK
    starts = jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    doc = jnp.pad(jnp.cumsum(starts, axis=1, dtype=jnp.int32), ((0, 0), (0, tp - t)), mode="edge")
    doc_bnc = doc.reshape(b, n_chunks, CHUNK)
    before_bn = jnp.concatenate([doc_bnc[:, :1, 0], doc_bnc[:, :-1, -1]], axis=1)
    return {"doc": doc,
            "carry": (doc_bnc == before_bn[..., None]).astype(_F32).reshape(b, tp),
            "last": (doc_bnc == doc_bnc[..., -1:]).astype(_F32).reshape(b, tp),
            "keep": (doc_bnc[..., -1] == before_bn).astype(_F32)}


def varlen_layout(cu_seqlens, t):
    """Host-side layout for packed sequences: each sequence padded to whole chunks, starting on a chunk.

    Args:
      cu_seqlens: host ints ``[N_seq + 1]``: 0, cumulative lengths, T.
      t: packed length T.

    Returns a dict of numpy int32 arrays: ``dest [T]`` (padded position of each token), ``chunk_seq``,
    ``chunk_first``, ``chunk_last`` (per padded chunk) and ``lens [N_seq]``.
    """
    cu = np.asarray(cu_seqlens, np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 0):
        raise ValueError(f"chunk_kda: cu_seqlens must be [0, ..., T={t}] non-decreasing, got {cu.tolist()}")
    lens = np.diff(cu)
    n_chunks_seq = -(-lens // CHUNK)
    start_chunk = np.concatenate([[0], np.cumsum(n_chunks_seq)])
    seq_of_token = np.repeat(np.arange(lens.size), lens)
    dest = start_chunk[seq_of_token] * CHUNK + np.arange(t) - cu[seq_of_token]
    n_chunks = max(int(start_chunk[-1]), 1)
    chunk_seq = np.repeat(np.arange(lens.size), n_chunks_seq)
    chunk_first = np.zeros(n_chunks, np.int32)
    chunk_last = np.zeros(n_chunks, np.int32)
    nonempty = n_chunks_seq > 0
    chunk_first[start_chunk[:-1][nonempty]] = 1
    chunk_last[start_chunk[1:][nonempty] - 1] = 1
    chunk_seq = np.pad(chunk_seq, (0, n_chunks - chunk_seq.size))
    return {"dest": dest.astype(np.int32), "chunk_seq": chunk_seq.astype(np.int32), "chunk_first": chunk_first,
            "chunk_last": chunk_last, "lens": lens.astype(np.int32)}


def activate_gate(g_raw, gate):
    """K3's lower-bounded gate in f32, ``lower_bound * sigmoid(a_hk * (g_raw + bias_hk))`` with ``gate = (a_hk,
    bias_hk, lower_bound)`` (``a_hk = exp(A_log)`` broadcast to ``[H, K]``); the in-kernel gate computes the same
    expression as each tile of ``g_raw [B, T, H, K]`` is loaded."""
    a_hk, bias_hk, lower_bound = gate
    return lower_bound / (1.0 + jnp.exp(-(a_hk * (g_raw.astype(_F32) + bias_hk))))


@dataclasses.dataclass(frozen=True)
class ChunkSpecs:
    """Block specs on the parallel (chunk, batch*head) grid, shared by every per-chunk kernel: ``tile(width)`` is one
    chunk of one (batch, head) of a ``[B, Tp, H, width]`` array, ``rows`` its ``[C]`` of a ``[B, Tp, H]`` array
    (beta), ``per_chunk(width)`` its row of a ``[B, H, N, width]`` array (decay)."""

    h: int

    def tile(self, width):
        h = self.h
        return pl.BlockSpec((None, CHUNK, None, width), lambda c, bh: (bh // h, c, bh % h, 0))

    @property
    def rows(self):
        h = self.h
        return pl.BlockSpec((None, CHUNK, None), lambda c, bh: (bh // h, c, bh % h))

    def per_chunk(self, width):
        h = self.h
        return pl.BlockSpec((None, None, None, width), lambda c, bh: (bh // h, bh % h, c, 0))


def cumulative_gate_tile(g_ref, c, gate_refs=None):
    """``[64, BK]`` f32 in-kernel: inclusive cumulative sum of ``g * log2(e)`` over the chunk's rows (columns ``c``).

    ``gate_refs = (a_ref, bias_ref, lower_bound)``: ``g_ref`` holds K3's raw gate input, activated here as
    ``activate_gate`` (``lower_bound * sigmoid(a * (g_raw + bias))``, this head's ``[K]`` rows)."""
    g = g_ref[:, c].astype(_F32)
    if gate_refs is not None:
        a_ref, bias_ref, lower_bound = gate_refs
        g = activate_gate(g, (a_ref[c][None, :], bias_ref[c][None, :], lower_bound))
    return jnp.cumsum(g * LOG2E, axis=0)


def gate_operands(gate, h):
    """``(operands, block specs)`` of an in-kernel gate's ``[H, K]`` coefficients (``intra_chunk``'s ``gate``)
    for the (chunk, batch*head) grid: each program reads its head's ``a`` and ``bias`` rows."""
    if gate is None:
        return [], []
    a_hk, bias_hk, _ = gate
    spec = pl.BlockSpec((None, a_hk.shape[-1]), lambda c, bh: (bh % h, 0))
    return [a_hk, bias_hk], [spec, spec]


def document_operands(documents, h):
    """``(operands, block specs)`` of the per-row document masks for the (chunk, batch*head) grid."""
    if documents is None:
        return [], []
    spec = pl.BlockSpec((None, CHUNK), lambda c, bh: (bh // h, c))
    return [documents["doc"], documents["carry"], documents["last"]], [spec] * 3


def block_lower_inverse(akk, *, solve, precision):
    """``{(i, j): [16, 16]}`` blocks (``j <= i``) of ``(I + akk)^-1`` from the 16x16 blocks ``akk[i, j]`` (``j <=
    i``) of a strictly lower-triangular 64x64 ``akk``: diagonal blocks by ``UNIT_LOWER_INVERSES[solve]``, the others by
    blocked forward substitution ``A_ij = -inv_i sum_{j <= m < i} akk_im A_mj``."""
    n_sub = CHUNK // SUB_CHUNK
    inv = [UNIT_LOWER_INVERSES[solve](akk[i, i]) for i in range(n_sub)]
    blocks = {}
    for j in range(n_sub):
        blocks[j, j] = inv[j]
        for i in range(j + 1, n_sub):
            acc = dot(akk[i, j], inv[j], precision)
            for m in range(j + 1, i):
                acc = acc + dot(akk[i, m], blocks[m, j], precision)
            blocks[i, j] = -dot(inv[i], acc, precision)
    return blocks


def matmul_policy(dtype):
    """(intermediate dtype, matmul precision): bf16/f16 inputs keep 16-bit intermediates and TF32/bf16 matmuls;
    f32 inputs keep f32 intermediates and full-f32 matmuls."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return dtype, lax.Precision.DEFAULT
    return _F32, lax.Precision.HIGHEST


def check_dims(kd: int, vd: int, config) -> int:
    """The value-block width for K = kd, V = vd (all powers of two, as the kernels' tiles need)."""
    block_v = min(config.block_v, vd)
    block_k = min(config.block_k, kd, vd)
    if not all(is_pow2(d, 16) for d in (kd, vd, block_v, block_k)):
        raise ValueError(f"chunk_kda (Pallas): K={kd}, V={vd}, block_v={block_v}, block_k={block_k} must be "
                         "powers of two >= 16")
    return block_v


def chunk_layout(b: int, t: int, cu_seqlens):
    """How tokens sit on whole chunks: `(n_chunks, varlen layout or None, to_padded, from_padded)`.

    Without `cu_seqlens` the sequence is zero-padded to a chunk multiple; with it (B = 1) each packed sequence is
    scattered to start on its own chunk, the gaps being zero tokens. `from_padded` undoes `to_padded` on [B, T', ...].
    """
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"chunk_kda: cu_seqlens needs batch size 1 (packed sequences), got B={b}")
        layout = varlen_layout(cu_seqlens, t)
        n = layout["chunk_seq"].size
        dest = jnp.asarray(layout["dest"])

        def to_padded(x):
            return jnp.zeros((1, n * CHUNK) + x.shape[2:], x.dtype).at[0, dest].set(x[0])

        def from_padded(x):
            return x[:, dest]

        return n, layout, to_padded, from_padded
    n = -(-t // CHUNK)
    pad = n * CHUNK - t

    def to_padded(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x

    def from_padded(x):
        return x[:, :t]

    return n, None, to_padded, from_padded


@dataclasses.dataclass(frozen=True)
class SequentialSpecs:
    """Block specs of the chunk-loop kernels (grid: batch*head x value block), shared by forward and backward.

    ``state`` is one (batch, head)'s ``[K, BV]`` state block (all ``[N_seq, K, BV]`` with varlen); ``meta_ops`` /
    ``meta_specs`` are the varlen per-chunk (sequence, first, last) arrays (empty without varlen).
    """

    b: int
    h: int
    n: int
    kd: int
    vd: int
    block_v: int
    layout: dict | None

    @property
    def grid(self):
        return (self.b * self.h, self.n_value_blocks)

    @property
    def n_value_blocks(self):
        return self.vd // self.block_v

    def seq(self, width, col_block=False):
        """A whole (batch, head) sequence ``[Tp, width]``; value-blocked when ``col_block``."""
        h, tp = self.h, self.n * CHUNK
        if col_block:
            return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, j))
        return pl.BlockSpec((None, tp, None, width), lambda bh, j: (bh // h, 0, bh % h, 0))

    @property
    def per_chunk_states(self):
        h = self.h
        return pl.BlockSpec((None, None, self.n * self.kd, self.block_v), lambda bh, j: (bh // h, bh % h, 0, j))

    @property
    def decay(self):
        h = self.h
        return pl.BlockSpec((None, None, self.n, self.kd), lambda bh, j: (bh // h, bh % h, 0, 0))

    @property
    def n_states(self):
        return self.b if self.layout is None else self.layout["lens"].size

    @property
    def state(self):
        h = self.h
        if self.layout is None:
            return pl.BlockSpec((None, None, self.kd, self.block_v), lambda bh, j: (bh // h, bh % h, 0, j))
        return pl.BlockSpec((self.n_states, None, self.kd, self.block_v), lambda bh, j: (0, bh, 0, j))

    @property
    def meta_ops(self):
        if self.layout is None:
            return []
        return [jnp.asarray(self.layout[name]) for name in ("chunk_seq", "chunk_first", "chunk_last")]

    @property
    def meta_specs(self):
        return [] if self.layout is None else [pl.BlockSpec((self.n,), lambda bh, j: (0,))] * 3


def block_cols(block, width):
    """The ``width`` columns of column block ``block`` (a ref slice)."""
    return pl.ds(pl.multiple_of(block * width, width), width)
