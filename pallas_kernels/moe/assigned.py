"""Routed experts of decode-sized MoE calls straight from the top-k assignments: no expert-sorted row plan.

The dropless path sorts the N·k (token, expert) assignments by expert before its grouped matmuls (an argsort, its
inverse scatter, a bincount, the tiles' metadata and a row gather: about fifteen small XLA kernels per MoE layer,
all on the critical path between the router and the expert weights' stream; k3_gpu decode, RESULTS.md, 2026-12-01).
These two kernels take the router's ``experts [N, k]`` as they are:

- `assigned_glu`: one program per (expert e, output column tile, split). It finds the tokens that chose e (a
  compare over the [N, k] ids, an integer prefix sum over tokens for each token's rank among them: exact, in
  registers), walks them tm at a time (split s takes row tiles s, s + splits, ...), gathers their rows of z
  straight from HBM, accumulates the gate and up products in f32 over the contraction and stores act(gate, up) at
  the assignment's own row ``n * k + j``.
- `assigned_down`: the same walk over the [N·k, M] hidden rows (gathered at ``n * k + j``) times w_down[e], f32
  rows stored at ``n * k + j``.

Every assignment row is written by exactly one program (a token picks an expert at most once), so the result needs
no zero fill and no atomics; the caller's combine is ``Σ_j w_nj · out[n * k + j]`` over a reshape. Each row's
products are the same f32 sums in the same contraction order as the planned kernels' (on the GPU the MMA accumulates
16-deep slices in order, whatever tk), only the row order differs.

Triton backend on GPU (``backend="gpu"``), the Pallas interpreter on CPU (``"interpret"``, tests). Inference only
(no VJP): the MoE layer uses it in decode steps (`cfg.runtime.moe_decode_experts`: "auto" up to
`AUTO_MAX_ROWS_PER_EXPERT` rows per expert on average, or "assigned"; `k3jax.ops.moe.experts_assigned`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gmm import epilogue
from pallas_kernels.gmm.api import DECODE_TILING, Tiling
from pallas_kernels.gmm.gpu import dot_precision
from pallas_kernels.tiling import next_pow2

__all__ = ["ASSIGNED_TILING", "AUTO_MAX_ROWS_PER_EXPERT", "BACKENDS", "MAX_TOKENS", "ORDERS", "applies",
           "assigned_down", "assigned_glu", "fit_tiling"]

BACKENDS = ("gpu", "interpret")
MAX_TOKENS = 256  # each program holds [tm, N] selection tiles: decode sizes only
# "auto" takes these kernels up to this many assignment rows per expert on average (N·k <= 16·E): k3_gpu decode on an
# H200, split launch order, against the planned path's step time: 0.96x at B = 64 (8 rows per expert), 0.98x at
# B = 128 (16), 1.07x at B = 256 (32: each 16-row tile streams its expert's weights once more, without the planned
# walk's L2 bands). benchmarks/RESULTS.md, 2026-12-01 and 2026-12-02.
AUTO_MAX_ROWS_PER_EXPERT = 16
DEFAULT_SPLITS = 4  # programs per (expert, column tile): an expert with > tm rows is not walked by one program
# The kernels' default tiling: the decode tiling (tm 16, tk 64, tn 128, 4 warps, 4 stages). 32-deep contraction
# tiles measured 0.976x, then 1.002-1.014x the step time at k3_gpu B = 64 in two processes on an H200 (alone: GLU
# 41.9 vs 42.6 µs, down 23.6 vs 24.5): within the noise, not taken (RESULTS.md, 2026-12-02;
# `moe_assigned_glu_tiling` / `moe_assigned_down_tiling` set them per kernel).
ASSIGNED_TILING = DECODE_TILING


def fit_tiling(tiling: Tiling, k_in: int, n_out: int) -> Tiling:
    """`tiling` with tk / tn capped at the contraction / output widths (small test configs)."""
    return tiling._replace(tk=min(tiling.tk, k_in), tn=min(tiling.tn, n_out))


def applies(n_tokens: int, k_in: int, n_out: int, tiling: Tiling = ASSIGNED_TILING) -> bool:
    """Whether a call on N tokens with contraction `k_in` and `n_out` output columns fits these kernels: decode
    sizes, widths that the (capped, power-of-two) tiles divide."""
    t = fit_tiling(tiling, k_in, n_out)
    pow2 = all(v > 0 and not v & (v - 1) for v in (t.tk, t.tn))
    return n_tokens <= MAX_TOKENS and pow2 and k_in % t.tk == 0 and n_out % t.tn == 0


def _check(name, lhs, experts_nk, w, rows, backend, tiling, splits):
    if backend not in BACKENDS:
        raise ValueError(f"{name}: unknown backend {backend!r}; expected one of {BACKENDS}")
    if experts_nk.ndim != 2 or lhs.ndim != 2 or w.ndim != 3:
        raise ValueError(f"{name}: expected lhs [rows, K], experts [N, k], weights [E, K, N]; got {lhs.shape}, "
                         f"{experts_nk.shape}, {w.shape}")
    n, k = experts_nk.shape
    if lhs.shape[0] < rows(n, k) or lhs.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: lhs {lhs.shape} does not fit experts {experts_nk.shape} and weights {w.shape}")
    if not applies(n, w.shape[1], w.shape[2], tiling):
        raise ValueError(f"{name}: decode sizes only (N <= {MAX_TOKENS}, K and N_out divisible by power-of-two "
                         f"tiles <= {tiling.tk} / {tiling.tn}), got N={n}, weights {w.shape}")
    if k > w.shape[0]:
        raise ValueError(f"{name}: k={k} experts per token but only {w.shape[0]} experts")
    if splits < 1:
        raise ValueError(f"{name}: splits must be >= 1, got {splits}")


def _padded_ids(experts_nk):
    """int32 [Np, Kp] (powers of two >= 16 / >= 1), padding -1: padded tokens and slots choose no expert."""
    n, k = experts_nk.shape
    np_, kp = next_pow2(n, 16), next_pow2(k, 1)
    return jnp.pad(experts_nk.astype(jnp.int32), ((0, np_ - n), (0, kp - k)), constant_values=-1)


ORDERS = ("expert", "column")


def _assigned_call(tile_body, lhs, weights, experts_nk, *, lhs_by_token: bool, n_out: int, out_dtype, tiling,
                   splits: int, interpret: bool, name: str, order: str = "expert"):
    """The shared walk: grid (splits, E, n_out / tn); `tile_body(e, lhs_rows [tm], n0, lhs_ref, *weight_refs)`
    returns the [tm, tn] f32 block of those lhs rows (token rows if `lhs_by_token`, else assignment rows) through
    expert e's weights, stored at the assignment rows n * k + j. The first grid axis launches fastest, so the
    splits of one (expert, column tile) run side by side and an expert's second row tile reads the weight tile its
    first is streaming from L2 (expert-fastest order: 1.006-1.044x the step time at k3_gpu B = 64, ~1.05x at 128;
    RESULTS.md, 2026-12-02). `order`: which of the other two axes launches next, "expert" (default: the programs
    in flight stream many experts' same column tile) or "column" (an expert's column tiles side by side, so the
    programs in flight read whole weight rows)."""
    if order not in ORDERS:
        raise ValueError(f"{name}: unknown order {order!r}; expected one of {ORDERS}")
    n, k = experts_nk.shape
    ids = _padded_ids(experts_nk)
    np_, kp = ids.shape
    e_count = weights[0].shape[0]
    tm, tn = tiling.tm, tiling.tn

    def kernel(ids_ref, lhs_ref, *refs):
        *weight_refs, out_ref = refs
        split, e, col = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        if order == "column":
            e, col = col, e
        n0 = pl.multiple_of(col * tn, tn)
        match = ids_ref[...] == e  # [Np, Kp]
        hit = jnp.sum(match.astype(jnp.int32), axis=1)  # [Np]: 1 if token n chose e (at most once)
        slot = jnp.sum(jnp.where(match, jax.lax.broadcasted_iota(jnp.int32, (np_, kp), 1), 0), axis=1)
        rank = jnp.cumsum(hit) - hit  # [Np]: e's tokens before n
        count = jnp.sum(hit)
        tiles = (count + tm - 1) // tm
        mine = jnp.maximum(tiles - split + splits - 1, 0) // splits
        token_iota = jax.lax.broadcasted_iota(jnp.int32, (tm, np_), 1)

        def tile(i, carry):
            target = (split + i * splits) * tm + jax.lax.broadcasted_iota(jnp.int32, (tm,), 0)  # [tm] ranks
            sel = (hit[None, :] > 0) & (rank[None, :] == target[:, None])  # [tm, Np]: one token per valid row
            token = jnp.sum(jnp.where(sel, token_iota, 0), axis=1)
            row = token * k + jnp.sum(jnp.where(sel, slot[None, :], 0), axis=1)  # assignment rows (0 if invalid)
            block = tile_body(e, token if lhs_by_token else row, n0, lhs_ref, *weight_refs)
            # rows past the expert's last token go to the scratch rows n*k .. n*k + tm - 1 (an unmasked scatter
            # store: what those rows hold is never read)
            dest = jnp.where(target < count, row, n * k + jax.lax.broadcasted_iota(jnp.int32, (tm,), 0))
            out_ref[dest, pl.ds(n0, tn)] = block.astype(out_dtype)
            return carry

        jax.lax.fori_loop(0, mine, tile, 0)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n * k + tm, n_out), out_dtype),
        grid=(splits, e_count, n_out // tn) if order == "expert" else (splits, n_out // tn, e_count),
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=tiling.num_warps,
                                                                  num_stages=tiling.num_stages),
        name=name,
    )(ids, lhs, *weights)


@functools.partial(jax.jit, static_argnames=("activation", "beta1", "beta2", "tiling", "splits", "backend",
                                             "order"))
def assigned_glu(z_nl: jax.Array, experts_nk: jax.Array, w_gate_elm: jax.Array, w_up_elm: jax.Array, *,
                 activation: str = "situ", beta1: float | None = None, beta2: float | None = None,
                 tiling: Tiling = ASSIGNED_TILING, splits: int = DEFAULT_SPLITS, backend: str = "gpu",
                 order: str = "expert") -> jax.Array:
    """[N·k + tm, M] in z's dtype: row n * k + j = act(z[n] @ w_gate[e], z[n] @ w_up[e]) for e = experts[n, j]
    (f32 products and activation, `epilogue.glu_f32`); the last tm rows are scratch. z [N, L], experts int32
    [N, k] (distinct per token, in [0, E)), weights [E, L, M]."""
    _check("assigned_glu", z_nl, experts_nk, w_gate_elm, lambda n, k: n, backend, tiling, splits)
    if w_gate_elm.shape != w_up_elm.shape:
        raise ValueError(f"assigned_glu: gate {w_gate_elm.shape} and up {w_up_elm.shape} weights differ")
    tiling = fit_tiling(tiling, *w_gate_elm.shape[1:])
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    prec = dot_precision(z_nl.dtype)
    steps = z_nl.shape[1] // tk
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)

    def tile_body(e, rows, n0, z_ref, gate_ref, up_ref):
        def body(kk, accs):
            k0 = pl.multiple_of(kk * tk, tk)
            a = z_ref[rows, pl.ds(k0, tk)]  # [tm, tk]: the tokens' rows, gathered
            return (accs[0] + dot(a, gate_ref[e, pl.ds(k0, tk), pl.ds(n0, tn)]),
                    accs[1] + dot(a, up_ref[e, pl.ds(k0, tk), pl.ds(n0, tn)]))

        zeros = jnp.zeros((tm, tn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
        return epilogue.glu_f32(gate, up, activation, beta1, beta2)

    return _assigned_call(tile_body, z_nl, (w_gate_elm, w_up_elm), experts_nk, lhs_by_token=True,
                          n_out=w_gate_elm.shape[2], out_dtype=z_nl.dtype, tiling=tiling, splits=splits,
                          interpret=backend == "interpret", name="k3_assigned_glu", order=order)


@functools.partial(jax.jit, static_argnames=("tiling", "splits", "backend", "out_dtype", "order"))
def assigned_down(h_pm: jax.Array, experts_nk: jax.Array, w_down_eml: jax.Array, *,
                  tiling: Tiling = ASSIGNED_TILING, splits: int = DEFAULT_SPLITS, backend: str = "gpu",
                  out_dtype=jnp.float32, order: str = "expert") -> jax.Array:
    """[N·k + tm, L] in `out_dtype` (f32 accumulation): row p = n * k + j is h[p] @ w_down[experts[n, j]]; the
    last tm rows are scratch. h [>= N·k, M] (`assigned_glu`'s layout), experts int32 [N, k], w_down [E, M, L]."""
    _check("assigned_down", h_pm, experts_nk, w_down_eml, lambda n, k: n * k, backend, tiling, splits)
    tiling = fit_tiling(tiling, *w_down_eml.shape[1:])
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    prec = dot_precision(h_pm.dtype)
    steps = h_pm.shape[1] // tk

    def tile_body(e, rows, n0, h_ref, w_ref):
        def body(kk, acc):
            k0 = pl.multiple_of(kk * tk, tk)
            return acc + jax.lax.dot_general(h_ref[rows, pl.ds(k0, tk)], w_ref[e, pl.ds(k0, tk), pl.ds(n0, tn)],
                                             (((1,), (0,)), ((), ())), precision=prec,
                                             preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((tm, tn), jnp.float32))

    return _assigned_call(tile_body, h_pm, (w_down_eml,), experts_nk, lhs_by_token=False,
                          n_out=w_down_eml.shape[2], out_dtype=jnp.dtype(out_dtype), tiling=tiling, splits=splits,
                          interpret=backend == "interpret", name="k3_assigned_down", order=order)
