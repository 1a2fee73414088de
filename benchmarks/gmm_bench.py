"""Grouped matmul on one GPU: our Pallas kernel vs `jax.lax.ragged_dot` vs one dense XLA matmul of the same FLOPs.

    python -m benchmarks.gmm_bench [--shapes=32768x3584x6144x56,...] [--routing=balanced,skewed] [--iters=20]
                                   [--check] [--ragged_max_rows=32768] [--sweep] [--glu | --mxfp4]
    python -m benchmarks.gmm_bench --chain=50 --shapes=512x768x768x64 --tilings=16-64-128-4-4-groups,...  # decode
    python -m benchmarks.gmm_bench --chain=50 --glu --shapes=512x768x768x64 --tilings=16-64-64-4-4  # decode GLU

Shapes are rows×k×n×groups (K3 latent experts: up k=3584 n=2·3072, down k=3072 n=3584; rows per rank 8k–64k,
groups = 896 / expert-parallel degree). bf16 inputs, f32 accumulation, bf16 outputs for all three. Forward and
forward+backward (both gradients, through `jax.vjp`), median of `--iters` calls after warm-up; TFLOP/s counts
2·m·k·n per matmul (forward 1, backward 2). Routing: 'balanced' (equal groups) or 'skewed' (Zipf-like sizes with
~1/8 of the groups empty). `--check` first compares the GPU kernels with a float64 NumPy per-group loop (forward,
d_lhs, d_rhs; f32 and bf16; empty groups, one group holding all rows, rows past sum(group_sizes)) and exits
non-zero on a mismatch. `--sweep` times a few tilings of our kernels on the first shape (every mode).
Prints one JSON line per measurement (flushed; filter with `grep --line-buffered` so a timeout keeps them) and a
Markdown table at the end.

`--glu`: the fused expert up-projection `gmm_glu` (SiTU, β = 4, 25; shapes rows×k×n×groups with n = the width of
ONE of gate/up, default K3 latent k=3584, n=3072) vs the unfused pair our `gmm` ×2 + SiTU and `ragged_dot` ×2 +
SiTU (the MoE layer's current path), forward and forward+backward (gmm_glu's backward recomputes the two
products); TFLOP/s count 4·m·k·n forward, 3× that forward+backward (recompute not counted). `--check` first
compares gmm_glu forward and gradients with a float64 NumPy loop on the GPU.
`--mxfp4`: inference `gmm_mxfp4` (weights packed u8 [g, n, k/2] + E8M0 scales, decoded in the kernel) vs our bf16
`gmm` on the pre-dequantized weights vs dequantize-then-`ragged_dot` and dequantize-then-our-`gmm` (dequantize
inside the timed call, as a server without the kernel would). Forward only; reports ms, TFLOP/s and the weight
bytes read per second (4.25 bits per MXFP4 value, 16 per bf16). Default shapes cover decode (256 rows),
mid-size and prefill batches at expert-parallel degrees 8 and 16. `--check` first compares gmm_mxfp4 with
dequantize (k3jax.convert.mxfp4's LUT decoder) then a float64 loop.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_ms
from k3jax.convert import mxfp4 as lut  # the converter's LUT decoder, independent of the kernel's bit decode
from pallas_kernels.gmm import Tiling, gmm, gmm_glu, gmm_mxfp4
from pallas_kernels.gmm import mxfp4 as mxfp4_jnp
from pallas_kernels.gmm.epilogue import glu_f32
from pallas_kernels.gmm.quantized import gmm_mxfp4_reference_xla


def group_sizes_for(m: int, g: int, routing: str, seed: int = 0) -> np.ndarray:
    if routing == "balanced":
        sizes = np.full(g, m // g, np.int64)
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, g + 1) ** 1.1
    weights[rng.choice(g, max(1, g // 8), replace=False)] = 0.0  # empty experts
    weights = rng.permutation(weights)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
    sizes[np.argmax(weights)] += m - sizes.sum()
    return sizes.astype(np.int32)


def _reference_f64(x, w, gs, dy):
    """Per-group float64 loop: out, d_lhs, d_rhs (independent of every fast path)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    s = 0
    for i, c in enumerate(gs):
        out[s:s + c] = x[s:s + c] @ w[i]
        dx[s:s + c] = dy[s:s + c] @ w[i].T
        dw[i] = x[s:s + c].T @ dy[s:s + c]
        s += c
    return out, dx, dw


def check(backend: str) -> bool:
    rng = np.random.default_rng(1)
    m, k, n, g = 1000, 320, 384, 8
    cases = {"random+empty+tail": np.array([130, 0, 257, 3, 0, 311, 64, 100], np.int32),
             "one group all rows": np.array([0, 0, 1000, 0, 0, 0, 0, 0], np.int32)}
    ok = True
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
        dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
        for name, gs in cases.items():
            with jax.default_matmul_precision("float32"):
                out, pull = jax.vjp(lambda a, b: gmm(a, b, jnp.asarray(gs), backend=backend), x, w)
                dx, dw = pull(dy)
            ref = _reference_f64(x.astype(jnp.float32), w.astype(jnp.float32), gs, dy.astype(jnp.float32))
            for label, got, want in zip(("out", "d_lhs", "d_rhs"), (out, dx, dw), ref):
                got = np.asarray(got.astype(jnp.float32), np.float64)
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                good = err < tol and bool(np.isfinite(got).all())
                ok &= good
                print(json.dumps({"check": backend, "dtype": jnp.dtype(dtype).name, "case": name, "value": label,
                                  "max_rel_err": err, "ok": bool(good)}), flush=True)
    return ok


def bench_shape(m, k, n, g, routing, iters, ragged, backend, tiling=None):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.asarray(group_sizes_for(m, g, routing))
    w_dense = w[0]
    flop = 2.0 * m * k * n

    def fwd_bwd(f):
        def run(x, w, dy):
            out, pull = jax.vjp(f, x, w)
            return out, pull(dy)
        return jax.jit(run)

    ours = lambda a, b: gmm(a, b, gs, backend=backend, tiling=tiling)  # noqa: E731
    rag = lambda a, b: jax.lax.ragged_dot(a, b, gs)  # noqa: E731
    dense = lambda a, b: a @ b  # noqa: E731
    row = {"m": m, "k": k, "n": n, "groups": g, "routing": routing,
           "max_group": int(gs.max()), "empty_groups": int((gs == 0).sum()), "tiling": tiling}
    f_ours = jax.jit(ours)
    row["ours_fwd_ms"] = median_ms(lambda: f_ours(x, w), iters)
    fb_ours = fwd_bwd(ours)
    row["ours_fwdbwd_ms"] = median_ms(lambda: fb_ours(x, w, dy), iters)
    if tiling is None:
        f_dense = jax.jit(dense)
        row["dense_fwd_ms"] = median_ms(lambda: f_dense(x, w_dense), iters)
        fb_dense = fwd_bwd(dense)
        row["dense_fwdbwd_ms"] = median_ms(lambda: fb_dense(x, w_dense, dy), iters)
    if ragged and tiling is None:
        f_rag = jax.jit(rag)
        row["ragged_fwd_ms"] = median_ms(lambda: f_rag(x, w), max(2, iters // 8))
        a, b = np.asarray(f_ours(x, w), np.float32), np.asarray(f_rag(x, w), np.float32)
        row["ours_vs_ragged_max_rel_err"] = float(np.abs(a - b).max() / np.abs(b).max())
        if routing == "balanced":
            fb_rag = fwd_bwd(rag)
            row["ragged_fwdbwd_ms"] = median_ms(lambda: fb_rag(x, w, dy), 2)
    for key in [kk for kk in row if kk.endswith("_ms")]:
        mult = 3 if "fwdbwd" in key else 1
        row[key.replace("_ms", "_tflops")] = mult * flop / (row[key] * 1e-3) / 1e12
    print(json.dumps(row), flush=True)
    return row


def parse_tiling(text: str) -> Tiling:
    """'16-64-128-4-4' or with the row walk last, '16-64-128-4-4-groups' (the decode group walk)."""
    parts = text.split("-")
    walk = parts.pop() if parts[-1] in ("tiles", "groups") else "tiles"
    return Tiling(*(int(v) for v in parts))._replace(walk=walk)


def bench_chained(m, k, n, g, routing, chain, iters, backend, tilings, glu=False):
    """Decode-sized calls (`--chain`): `chain` dependent forward calls inside one jit (each call's output is the
    next call's input, so k == n), timed per call without host dispatch; ours for each tiling (None = the
    default) and `ragged_dot`. GB/s = expert weight bytes per call / time (decode reads every touched expert).
    `glu`: the fused up-projection `gmm_glu` (gate and up weights, SiTU) instead of `gmm`; the peer is `ragged_dot`
    twice + SiTU."""
    if k != n:
        raise ValueError(f"--chain needs k == n (the output feeds the next call), got {m}x{k}x{n}x{g}")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    # a tuple of [g, k, n] weights (gate and up for glu): slicing one stacked array inside the jit copied it per call
    w = tuple(jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(1 + glu))
    gs = jnp.asarray(group_sizes_for(m, g, routing))
    weight_bytes = int((gs > 0).sum()) * k * n * 2 * (1 + glu)

    def chained(call):
        return jax.jit(lambda x, w: jax.lax.fori_loop(0, chain, lambda i, h: call(h, w).astype(h.dtype), x))

    def ours(t):
        if glu:
            return lambda a, b: gmm_glu(a, b[0], b[1], gs, beta1=_BETAS[0], beta2=_BETAS[1], backend=backend,
                                        tiling=t)
        return lambda a, b: gmm(a, b[0], gs, backend=backend, tiling=t)

    def ragged(a, b):
        if glu:
            gate, up = (jax.lax.ragged_dot(a, b[i], gs, preferred_element_type=jnp.float32) for i in (0, 1))
            return glu_f32(gate, up, "situ", *_BETAS)
        return jax.lax.ragged_dot(a, b[0], gs)

    impls = {f"ours_{'default' if t is None else '-'.join(map(str, t))}": ours(t) for t in tilings}
    impls["ragged_dot"] = ragged
    row = {"m": m, "k": k, "n": n, "groups": g, "routing": routing, "chain": chain, "weight_MB": weight_bytes / 1e6,
           "call": "gmm_glu" if glu else "gmm"}
    for label, call in impls.items():
        try:
            f = chained(call)
            ms = median_ms(lambda: f(x, w), iters) / chain
            row[f"{label}_us"] = round(ms * 1e3, 2)
            row[f"{label}_GBps"] = round(weight_bytes / (ms * 1e-3) / 1e9, 1)
        except Exception as e:  # one tiling failing (e.g. shared memory) must not lose the others
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(row), flush=True)
    return row


def table(rows) -> str:
    head = ("| rows m | k | n | groups | routing | ours fwd TFLOP/s | ragged_dot fwd | dense fwd | ours/ragged | "
            "ours/dense | ours fwd+bwd TFLOP/s | ragged fwd+bwd | dense fwd+bwd | ours/dense (fwd+bwd) |")
    lines = [head, "|" + "---|" * 5 + "---:|" * 9]
    fmt = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        rag, den = r.get("ragged_fwd_tflops"), r.get("dense_fwd_tflops")
        ratio_rag = f"{r['ours_fwd_tflops'] / rag:.1f}×" if rag else "—"
        ratio_den = f"{100 * r['ours_fwd_tflops'] / den:.0f}%" if den else "—"
        den_fb = r.get("dense_fwdbwd_tflops")
        ratio_fb = f"{100 * r['ours_fwdbwd_tflops'] / den_fb:.0f}%" if den_fb else "—"
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {r['routing']} | "
                     f"{fmt(r['ours_fwd_tflops'])} | {fmt(rag)} | {fmt(den)} | {ratio_rag} | {ratio_den} | "
                     f"{fmt(r['ours_fwdbwd_tflops'])} | {fmt(r.get('ragged_fwdbwd_tflops'))} | {fmt(den_fb)} | "
                     f"{ratio_fb} |")
    return "\n".join(lines)


# ---- --glu: fused up-projection -----------------------------------------------------------------------------------

_BETAS = (4.0, 25.0)


def _glu_reference_f64(x, wg, wu, gs, dy, b1, b2):
    """Float64 loop of SiTU(x wg, x wu) and its three gradients (closed-form derivatives)."""
    x, wg, wu, dy = (np.asarray(a, np.float64) for a in (x, wg, wu, dy))
    out, dx, dwg, dwu = np.zeros((x.shape[0], wg.shape[2])), np.zeros_like(x), np.zeros_like(wg), np.zeros_like(wu)
    s = 0
    for i, c in enumerate(gs):
        r = slice(s, s + c)
        g, u = x[r] @ wg[i], x[r] @ wu[i]
        sig, tg, tu = 1.0 / (1.0 + np.exp(-g)), np.tanh(g / b1), np.tanh(u / b2)
        a, b = b1 * tg * sig, b2 * tu
        d_gate = dy[r] * b * ((1.0 - tg ** 2) * sig + b1 * tg * sig * (1.0 - sig))
        d_up = dy[r] * a * (1.0 - tu ** 2)
        out[r], dx[r] = a * b, d_gate @ wg[i].T + d_up @ wu[i].T
        dwg[i], dwu[i] = x[r].T @ d_gate, x[r].T @ d_up
        s += c
    return out, dx, dwg, dwu


def check_glu(backend: str) -> bool:
    rng = np.random.default_rng(2)
    m, k, n, g = 1000, 320, 384, 8
    gs = np.array([130, 0, 257, 3, 0, 311, 64, 100], np.int32)  # empty groups and a 135-row tail
    ok = True
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        wg, wu = (jnp.asarray(3.0 * rng.standard_normal((g, k, n)) / np.sqrt(k), dtype) for _ in range(2))
        dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
        with jax.default_matmul_precision("float32"):
            out, pull = jax.vjp(lambda a, b, c: gmm_glu(a, b, c, jnp.asarray(gs), beta1=_BETAS[0], beta2=_BETAS[1],
                                                        backend=backend), x, wg, wu)
            got = (out, *pull(dy))
        ref = _glu_reference_f64(*(a.astype(jnp.float32) for a in (x, wg, wu)), gs, dy.astype(jnp.float32),
                                 *_BETAS)
        for label, a, want in zip(("out", "d_lhs", "d_w_gate", "d_w_up"), got, ref):
            a = np.asarray(a.astype(jnp.float32), np.float64)
            err = float(np.max(np.abs(a - want)) / (np.max(np.abs(want)) + 1e-30))
            good = err < tol and bool(np.isfinite(a).all())
            ok &= good
            print(json.dumps({"check": f"glu-{backend}", "dtype": jnp.dtype(dtype).name, "value": label,
                              "max_rel_err": err, "ok": bool(good)}), flush=True)
    return ok


def bench_glu(m, k, n, g, routing, iters, ragged, backend, tiling=None):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    wg, wu = ((jax.random.normal(kk, (g, k, n), jnp.float32) * (2.0 / k ** 0.5)).astype(jnp.bfloat16)
              for kk in keys[1:3])
    dy = jax.random.normal(keys[3], (m, n), jnp.bfloat16)
    gs = jnp.asarray(group_sizes_for(m, g, routing))

    def situ(gate, up):
        return glu_f32(gate.astype(jnp.float32), up.astype(jnp.float32), "situ", *_BETAS).astype(jnp.bfloat16)

    fused = lambda a, b, c: gmm_glu(a, b, c, gs, beta1=_BETAS[0], beta2=_BETAS[1], backend=backend,  # noqa: E731
                                    tiling=tiling)
    ours2 = lambda a, b, c: situ(gmm(a, b, gs, backend=backend), gmm(a, c, gs, backend=backend))  # noqa: E731
    rag2 = lambda a, b, c: situ(jax.lax.ragged_dot(a, b, gs), jax.lax.ragged_dot(a, c, gs))  # noqa: E731

    def fwd_bwd(f):
        def run(a, b, c, d):
            out, pull = jax.vjp(f, a, b, c)
            return out, pull(d)
        return jax.jit(run)

    row = {"mode": "glu", "m": m, "k": k, "n": n, "groups": g, "routing": routing, "max_group": int(gs.max()),
           "empty_groups": int((gs == 0).sum()), "tiling": tiling}
    impls = [("fused", fused, iters)]
    if tiling is None:
        impls += [("unfused_gmm", ours2, iters)] + ([("unfused_ragged", rag2, 2)] if ragged else [])
    outs = {}
    for name, f, n_iter in impls:
        jf = jax.jit(f)
        row[f"{name}_fwd_ms"] = median_ms(lambda: jf(x, wg, wu), n_iter)
        outs[name] = np.asarray(jf(x, wg, wu), np.float32)
        if name != "unfused_ragged" or routing == "balanced":
            fb = fwd_bwd(f)
            row[f"{name}_fwdbwd_ms"] = median_ms(lambda: fb(x, wg, wu, dy), n_iter)
    for name in outs:
        if name != "fused":
            row[f"fused_vs_{name}_max_rel_err"] = float(np.abs(outs["fused"] - outs[name]).max()
                                                        / np.abs(outs[name]).max())
    flop = 4.0 * m * k * n
    for key in [kk for kk in row if kk.endswith("_ms")]:
        row[key.replace("_ms", "_tflops")] = (3 if "fwdbwd" in key else 1) * flop / (row[key] * 1e-3) / 1e12
    print(json.dumps(row), flush=True)
    return row


def table_glu(rows) -> str:
    lines = ["| rows m | k | n (each) | groups | routing | fused fwd ms | gmm×2 fwd ms | ragged×2 fwd ms | fused fwd "
             "TFLOP/s | fused fwd+bwd ms | gmm×2 fwd+bwd ms | ragged×2 fwd+bwd ms | fused fwd+bwd TFLOP/s |",
             "|" + "---|" * 5 + "---:|" * 8]
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {r['routing']} | "
                     + " | ".join(fmt(r.get(c)) for c in (
                         "fused_fwd_ms", "unfused_gmm_fwd_ms", "unfused_ragged_fwd_ms", "fused_fwd_tflops",
                         "fused_fwdbwd_ms", "unfused_gmm_fwdbwd_ms", "unfused_ragged_fwdbwd_ms",
                         "fused_fwdbwd_tflops")) + " |")
    return "\n".join(lines)


# ---- --mxfp4: inference with packed expert weights ----------------------------------------------------------------

def _random_mxfp4(key, g, n, k, scale_lo=118, scale_hi=124):
    k1, k2 = jax.random.split(key)
    packed = jax.random.randint(k1, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(k2, (g, n, k // 32), scale_lo, scale_hi + 1, jnp.int32).astype(jnp.uint8)
    return packed, scales


def check_mxfp4(backend: str) -> bool:
    m, k, n, g = 1000, 384, 320, 8
    gs = np.array([130, 0, 257, 3, 0, 311, 64, 100], np.int32)
    packed, scales = (np.asarray(a) for a in _random_mxfp4(jax.random.key(3), g, n, k, 110, 135))  # 2^-17..2^8
    ok = True
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(np.random.default_rng(4).standard_normal((m, k)), dtype)
        with jax.default_matmul_precision("float32"):
            got = np.asarray(gmm_mxfp4(x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(gs),
                                       preferred_element_type=jnp.float32, backend=backend), np.float64)
        xf, want, s = np.asarray(x.astype(jnp.float32), np.float64), np.zeros((m, n)), 0
        for i, c in enumerate(gs):
            want[s:s + c] = xf[s:s + c] @ lut.decode(packed[i], scales[i]).astype(np.float64).T
            s += c
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        good = err < 1e-5 and bool(np.isfinite(got).all()) and not got[s:].any()
        ok &= good
        print(json.dumps({"check": f"mxfp4-{backend}", "dtype": jnp.dtype(dtype).name, "max_rel_err": err,
                          "ok": bool(good)}), flush=True)
    return ok


def bench_mxfp4(m, k, n, g, routing, iters, ragged, backend, tiling=None):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    packed, scales = _random_mxfp4(kw, g, n, k)
    w_gkn = jax.block_until_ready(jnp.swapaxes(mxfp4_jnp.dequantize(packed, scales, jnp.bfloat16), 1, 2))
    gs = jnp.asarray(group_sizes_for(m, g, routing))
    used = int((gs > 0).sum())  # experts whose weights are read
    impls = {
        "mxfp4": (jax.jit(lambda a, p, s: gmm_mxfp4(a, p, s, gs, backend=backend, tiling=tiling)),
                  (x, packed, scales), iters),
        "bf16_gmm": (jax.jit(lambda a, w: gmm(a, w, gs, backend=backend)), (x, w_gkn), iters),
    }
    if tiling is None:
        impls["dequant_gmm"] = (jax.jit(lambda a, p, s: gmm(a, jnp.swapaxes(mxfp4_jnp.dequantize(p, s, a.dtype), 1, 2),
                                                            gs, backend=backend)), (x, packed, scales), iters)
    if ragged and tiling is None:
        impls["dequant_ragged"] = (jax.jit(lambda a, p, s: gmm_mxfp4_reference_xla(a, p, s, gs)),
                                   (x, packed, scales), max(2, iters // 8))
    row = {"mode": "mxfp4", "m": m, "k": k, "n": n, "groups": g, "routing": routing, "experts_used": used,
           "tiling": tiling}
    outs = {}
    for name, (f, args, n_iter) in impls.items():
        row[f"{name}_ms"] = median_ms(lambda: f(*args), n_iter)
        outs[name] = np.asarray(f(*args), np.float32)
    for name in outs:
        if name != "mxfp4":
            row[f"mxfp4_vs_{name}_max_rel_err"] = float(np.abs(outs["mxfp4"] - outs[name]).max()
                                                        / np.abs(outs[name]).max())
    flop = 2.0 * m * k * n
    weight_bytes = {"mxfp4": used * n * k * (0.5 + 1 / 32), "bf16_gmm": used * n * k * 2.0}
    for name in impls:
        row[f"{name}_tflops"] = flop / (row[f"{name}_ms"] * 1e-3) / 1e12
        if name in weight_bytes:
            row[f"{name}_weight_GBps"] = weight_bytes[name] / (row[f"{name}_ms"] * 1e-3) / 1e9
    print(json.dumps(row), flush=True)
    return row


def table_mxfp4(rows) -> str:
    lines = ["| rows m | k | n | groups | routing | mxfp4 ms | bf16 gmm ms | dequant+gmm ms | dequant+ragged_dot ms | "
             "mxfp4 TFLOP/s | mxfp4 weight GB/s | bf16 weight GB/s | bf16/mxfp4 time |",
             "|" + "---|" * 5 + "---:|" * 8]
    fmt = lambda v: "—" if v is None else f"{v:.3g}"  # noqa: E731
    for r in rows:
        ratio = r["bf16_gmm_ms"] / r["mxfp4_ms"]
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {r['routing']} | "
                     + " | ".join(fmt(r.get(c)) for c in (
                         "mxfp4_ms", "bf16_gmm_ms", "dequant_gmm_ms", "dequant_ragged_ms", "mxfp4_tflops",
                         "mxfp4_weight_GBps", "bf16_gmm_weight_GBps")) + f" | {ratio:.2f}× |")
    return "\n".join(lines)


_SWEEP = {
    "gmm": (Tiling(128, 64, 128, 4, 4), Tiling(128, 64, 256, 8, 4), Tiling(128, 128, 256, 8, 2),
            Tiling(256, 64, 128, 8, 3), Tiling(64, 64, 256, 4, 4)),
    "glu": (Tiling(128, 64, 128, 8, 3), Tiling(128, 64, 128, 4, 4), Tiling(64, 64, 256, 8, 3),
            Tiling(128, 32, 256, 8, 3)),
    "mxfp4": (Tiling(16, 128, 128, 4, 3), Tiling(64, 128, 128, 4, 3), Tiling(64, 128, 128, 8, 3),
              Tiling(128, 64, 128, 8, 3), Tiling(64, 256, 64, 4, 3)),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="rows x k x n x groups, comma-separated (defaults per mode)")
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ragged_max_rows", type=int, default=32768, help="skip ragged_dot above this many rows (OOM)")
    p.add_argument("--backend", default=None)
    p.add_argument("--check", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time a few tilings of ours on the first shape")
    p.add_argument("--tilings", default=None,
                   help="with --sweep: tilings tm-tk-tn-warps-stages, comma-separated (default: a fixed set)")
    p.add_argument("--chain", type=int, default=0,
                   help="decode-sized shapes (k == n): time this many dependent calls in one jit per measurement, "
                        "ours for the default and each --tilings entry, vs ragged_dot")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--glu", action="store_true", help="fused up-projection gmm_glu vs unfused")
    mode.add_argument("--mxfp4", action="store_true", help="gmm_mxfp4 vs bf16 gmm and dequantize-then-matmul")
    args = p.parse_args()
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}), flush=True)
    backend = args.backend
    name = "glu" if args.glu else "mxfp4" if args.mxfp4 else "gmm"
    checker, bench, tabulate = {"gmm": (check, bench_shape, table), "glu": (check_glu, bench_glu, table_glu),
                                "mxfp4": (check_mxfp4, bench_mxfp4, table_mxfp4)}[name]
    default_shapes = {
        "gmm": "32768x3584x6144x56,32768x3072x3584x56,8192x3584x6144x112,65536x3584x6144x64",
        "glu": "32768x3584x3072x56,8192x3584x3072x112",
        "mxfp4": "256x3584x3072x112,4096x3584x3072x112,4096x3072x3584x112,32768x3584x3072x56",
    }[name]
    if args.check and not checker(backend or "gpu"):
        raise SystemExit(f"{name} check FAILED")
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default_shapes).split(",")]
    if args.chain:
        tilings = [None] + ([parse_tiling(t) for t in args.tilings.split(",")] if args.tilings else [])
        for m, k, n, g in shapes:
            for routing in args.routing.split(","):
                bench_chained(m, k, n, g, routing, args.chain, args.iters, backend, tilings, glu=args.glu)
        return
    for m, k, n, g in shapes:
        for routing in args.routing.split(","):
            try:
                rows.append(bench(m, k, n, g, routing, args.iters, m <= args.ragged_max_rows, backend))
            except Exception as e:  # keep the other shapes' figures (e.g. one OOM)
                print(json.dumps({"mode": name, "m": m, "k": k, "n": n, "groups": g, "routing": routing,
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    if args.sweep:  # a few tilings of our kernel on the first shape (JSON lines only)
        m, k, n, g = shapes[0]
        tilings = _SWEEP[name] if not args.tilings else [parse_tiling(t) for t in args.tilings.split(",")]
        for t in tilings:
            try:
                bench(m, k, n, g, "balanced", max(5, args.iters // 2), False, backend, tiling=t)
            except Exception as e:
                print(json.dumps({"tiling": t, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    print(tabulate(rows))


if __name__ == "__main__":
    main()
