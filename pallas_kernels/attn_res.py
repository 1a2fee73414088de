"""A Block Attention Residuals read and the RMSNorm after it in one kernel each way (Pallas, Triton GPU backend; the
interpreter on CPU).

Each decoder layer reads its input twice as ``norm(mix(live, bank))``: a per-token softmax over the N filled bank
rows and the live partial sum, scored against a learned pseudo-query, then the layer's RMSNorm. In XLA that is a
chain of memory-bound fusions over N + 1 source rows and several f32 temporaries per read and direction (AttnRes
scores, RMS norms and f32 converts ~8% of the `k3_gpu` training step: benchmarks/RESULTS.md 2026-12-04). Here one
program per block of `block_t` tokens walks the hidden dimension in `block_d` columns a few times (the row
reductions first, then the outputs), reading the sources from L2 after the first pass and writing only the result.

Numerics (the model's XLA path, `k3jax.layers.attn_res.read_normed`), per token, sources v_0..v_{N-1} = bank rows,
v_N = live, all f32 inside:
    a_s = (v_s · q) · rsqrt(mean(v_s²) + eps_read)          p = softmax(a)        m = round(Σ_s p_s v_s)
    out = round(gain · round(m · rsqrt(mean(m²) + eps_norm)))        (round: to the activation dtype)
The backward is that chain's gradient, rounding where the XLA gradient rounds (the transposes of the casts).

Layout: rows = tokens (B·T flattened): ``live [M, D]``, ``bank [N_rows, M, D]`` of which the first `n_filled` rows
are read, ``query [D]`` f32 (norm gain ⊙ projection), ``gain [D]`` f32 (the RMSNorm weight's values). `n_filled` is
a static int, or None with ``count [1]`` int32 (a traced count inside a scan over layers): then every bank row is
read and rows at or past the count get softmax weight 0 (and zero gradient), as the XLA path masks them. The
wrapper with the gradient rule is `k3jax.ops.attn_res`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tiling import is_pow2, largest_pow2_divisor, triton_params

__all__ = ["block_d_for", "read_norm_bwd", "read_norm_fwd", "supported"]

_F32 = jnp.float32


def block_d_for(d: int) -> int:
    """Columns per step of the hidden-dimension loop: the largest power of two <= 256 dividing D (0: none >= 16)."""
    return largest_pow2_divisor(d, 256, 16)


def supported(m: int, d: int, n_filled: int | None, block_t: int, bank_rows: int) -> str | None:
    """None when the kernels take M tokens of width D reading `n_filled` (None: a traced count of) bank rows of
    `bank_rows`, else why not."""
    if n_filled is None and bank_rows < 1:
        return "a traced bank count needs a bank with at least one row"
    if n_filled is not None and (not isinstance(n_filled, int) or not 1 <= n_filled <= bank_rows):
        return f"the number of filled bank rows must be an int in [1, {bank_rows}] or traced, got {n_filled!r}"
    if not block_d_for(d):
        return f"the width D={d} needs a power-of-two divisor >= 16"
    if not is_pow2(block_t, 16):
        return f"block_t={block_t} must be a power of two >= 16"
    if m % block_t:
        return f"the token count {m} must be a multiple of block_t={block_t}"
    return None


def _loop(n_steps, body, init):
    return jax.lax.fori_loop(0, n_steps, body, init)


def _softmax_parts(src, q_ref, n_src, d, bd, eps_read, block_t, count):
    """Per source: rsqrt(mean(v²) + eps) and v·q over the hidden dimension; the softmax weights p (`count`: bank
    rows at or past it weigh 0)."""
    def step(j, carry):
        dots, sqs = carry
        cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
        q = q_ref[cols][None, :]
        vs = [src(s, cols) for s in range(n_src)]  # each source loaded once per column block
        return (tuple(dots[s] + jnp.sum(vs[s] * q, axis=1) for s in range(n_src)),
                tuple(sqs[s] + jnp.sum(vs[s] * vs[s], axis=1) for s in range(n_src)))

    zero = tuple(jnp.zeros((block_t,), _F32) for _ in range(n_src))
    dots, sqs = _loop(d // bd, step, (zero, zero))
    r = tuple(jax.lax.rsqrt(sqs[s] / d + eps_read) for s in range(n_src))
    a = tuple(dots[s] * r[s] for s in range(n_src))
    if count is not None:
        a = tuple(jnp.where(s < count, a[s], -jnp.inf) for s in range(n_src - 1)) + (a[n_src - 1],)
    top = a[n_src - 1]
    for s in range(n_src - 1):
        top = jnp.maximum(top, a[s])
    w = tuple(jnp.exp(a[s] - top) for s in range(n_src))
    total = w[0]
    for s in range(1, n_src - 1):
        total = total + w[s]
    inv = 1.0 / (total + w[n_src - 1]) if n_src > 1 else 1.0 / w[0]
    return tuple(w[s] * inv for s in range(n_src)), r, dots


def _mixed(src, p, cols, n_src, act):
    """round(Σ_s p_s v_s) on these columns: the bank rows in order, then the live partial sum (the XLA order)."""
    m = p[0][:, None] * src(0, cols)
    for s in range(1, n_src - 1):
        m = m + p[s][:, None] * src(s, cols)
    if n_src > 1:
        m = m + p[n_src - 1][:, None] * src(n_src - 1, cols)
    return m.astype(act).astype(_F32)


def read_norm_fwd(live_md, bank_nmd, query_d, gain_d, count=None, *, n_filled: int | None, eps_read: float,
                  eps_norm: float, block_t: int = 16, warps: int = 4, interpret: bool = False):
    """``out [M, D]`` in the promoted type of live's and the gain's dtypes (the XLA norm's ``gain * round(n)``).
    `n_filled` None: `count` ([1] int32) is the traced number of filled rows."""
    out_dtype = jnp.result_type(live_md.dtype, gain_d.dtype)
    return _fwd_call(live_md, bank_nmd, query_d.astype(_F32), gain_d.astype(_F32), _count(count, n_filled),
                     n_read=_rows_read(bank_nmd, n_filled),
                     eps_read=float(eps_read), eps_norm=float(eps_norm), out_dtype=jnp.dtype(out_dtype),
                     block_t=block_t, warps=warps, interpret=interpret)


def _count(count, n_filled):
    if (count is None) == (n_filled is None):
        raise ValueError("attn_res read_norm: give n_filled (static) or count (traced), exactly one")
    return None if count is None else jnp.asarray(count, jnp.int32).reshape(1)


def _rows_read(bank, n_filled):
    return bank.shape[0] if n_filled is None else n_filled


def _sources(live_ref, bank_ref, rows, n_filled):
    def src(s, cols):
        if s < n_filled:
            return bank_ref[s, rows, cols].astype(_F32)
        return live_ref[rows, cols].astype(_F32)
    return src


@functools.partial(jax.jit, static_argnames=("n_read", "eps_read", "eps_norm", "out_dtype", "block_t", "warps",
                                             "interpret"))
def _fwd_call(live, bank, query, gain, count, *, n_read, eps_read, eps_norm, out_dtype, block_t, warps, interpret):
    m, d = live.shape
    act = live.dtype
    bd = block_d_for(d)
    n_src = n_read + 1
    traced = count is not None

    def body(live_ref, bank_ref, q_ref, g_ref, *rest):
        c_ref, o_ref = rest if traced else (None, rest[0])
        rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_t, block_t), block_t)
        src = _sources(live_ref, bank_ref, rows, n_read)
        p, _, _ = _softmax_parts(src, q_ref, n_src, d, bd, eps_read, block_t, c_ref[0] if traced else None)

        def sum_sq(j, ss):
            mb = _mixed(src, p, pl.ds(pl.multiple_of(j * bd, bd), bd), n_src, act)
            return ss + jnp.sum(mb * mb, axis=1)

        rn = jax.lax.rsqrt(_loop(d // bd, sum_sq, jnp.zeros((block_t,), _F32)) / d + eps_norm)

        def write(j, carry):
            cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
            n = (_mixed(src, p, cols, n_src, act) * rn[:, None]).astype(act).astype(_F32)
            o_ref[rows, cols] = (g_ref[cols][None, :] * n).astype(out_dtype)
            return carry

        _loop(d // bd, write, 0)

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((m, d), out_dtype), grid=(m // block_t,), interpret=interpret,
        compiler_params=triton_params(interpret, warps), name="attn_res_read_norm_fwd",
    )(live, bank, query, gain, *(() if count is None else (count,)))


def read_norm_bwd(live_md, bank_nmd, query_d, gain_d, dout_md, count=None, *, n_filled: int | None, eps_read: float,
                  eps_norm: float, block_t: int = 16, warps: int = 4, interpret: bool = False):
    """``(d_live [M, D], d_bank [rows read, M, D]`` in live's dtype (rows read: `n_filled`, or all with a traced
    `count`), ``d_query_part, d_gain_part [M / block_t, D]`` f32 per-block partial sums the caller adds up)."""
    return _bwd_call(live_md, bank_nmd, query_d.astype(_F32), gain_d.astype(_F32), dout_md, _count(count, n_filled),
                     n_read=_rows_read(bank_nmd, n_filled),
                     eps_read=float(eps_read), eps_norm=float(eps_norm), block_t=block_t, warps=warps,
                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("n_read", "eps_read", "eps_norm", "block_t", "warps", "interpret"))
def _bwd_call(live, bank, query, gain, dout, count, *, n_read, eps_read, eps_norm, block_t, warps, interpret):
    m, d = live.shape
    act = live.dtype
    bd = block_d_for(d)
    n_src = n_read + 1
    n_blocks = m // block_t
    traced = count is not None

    def body(live_ref, bank_ref, q_ref, g_ref, dout_ref, *rest):
        c_ref, (dlive_ref, dbank_ref, dq_ref, dg_ref) = (rest[0], rest[1:]) if traced else (None, rest)
        i = pl.program_id(0)
        rows = pl.ds(pl.multiple_of(i * block_t, block_t), block_t)
        src = _sources(live_ref, bank_ref, rows, n_read)
        p, r, dots = _softmax_parts(src, q_ref, n_src, d, bd, eps_read, block_t, c_ref[0] if traced else None)

        def dn32(cols):  # the gradient reaching the normalised value: round(dout · gain), f32
            return (dout_ref[rows, cols].astype(_F32) * g_ref[cols][None, :]).astype(act).astype(_F32)

        def sums(j, carry):
            ss, c = carry
            cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
            mb = _mixed(src, p, cols, n_src, act)
            return ss + jnp.sum(mb * mb, axis=1), c + jnp.sum(mb * dn32(cols), axis=1)

        zero = jnp.zeros((block_t,), _F32)
        ss, c = _loop(d // bd, sums, (zero, zero))
        rn = jax.lax.rsqrt(ss / d + eps_norm)
        coef = rn * rn * rn * c / d

        def d_mixed(cols):  # round(d m): the RMSNorm's input gradient rounded as the transposed casts round it
            mb = _mixed(src, p, cols, n_src, act)
            return (rn[:, None] * dn32(cols) - mb * coef[:, None]).astype(act).astype(_F32), mb

        def grads_p(j, dps):
            cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
            dm, mb = d_mixed(cols)
            n = (mb * rn[:, None]).astype(act).astype(_F32)
            dg_ref[i, cols] = jnp.sum(dout_ref[rows, cols].astype(_F32) * n, axis=0)
            return tuple(dps[s] + jnp.sum(dm * src(s, cols), axis=1) for s in range(n_src))

        dps = _loop(d // bd, grads_p, tuple(zero for _ in range(n_src)))
        mean_dp = p[0] * dps[0]
        for s in range(1, n_src):
            mean_dp = mean_dp + p[s] * dps[s]
        da = tuple(p[s] * (dps[s] - mean_dp) for s in range(n_src))

        def write(j, carry):
            cols = pl.ds(pl.multiple_of(j * bd, bd), bd)
            dm, _ = d_mixed(cols)
            q = q_ref[cols][None, :]
            dq = jnp.zeros((bd,), _F32)
            for s in range(n_src):
                v = src(s, cols)
                dv = p[s][:, None] * dm + da[s][:, None] * (r[s][:, None] * q
                                                             - (dots[s] * r[s] * r[s] * r[s] / d)[:, None] * v)
                if s < n_read:
                    dbank_ref[s, rows, cols] = dv.astype(act)
                else:
                    dlive_ref[rows, cols] = dv.astype(act)
                dq = dq + jnp.sum((da[s] * r[s])[:, None] * v, axis=0)
            dq_ref[i, cols] = dq
            return carry

        _loop(d // bd, write, 0)

    return pl.pallas_call(
        body,
        out_shape=(jax.ShapeDtypeStruct((m, d), act), jax.ShapeDtypeStruct((n_read, m, d), act),
                   jax.ShapeDtypeStruct((n_blocks, d), _F32), jax.ShapeDtypeStruct((n_blocks, d), _F32)),
        grid=(n_blocks,), interpret=interpret, compiler_params=triton_params(interpret, warps),
        name="attn_res_read_norm_bwd",
    )(live, bank, query, gain, dout, *(() if count is None else (count,)))
