"""Grouped matmul on one GPU: our Pallas kernel vs `jax.lax.ragged_dot` vs one dense XLA matmul of the same FLOPs.

    python benchmarks/gmm_bench.py [--shapes=32768x3584x6144x56,...] [--routing=balanced,skewed] [--iters=20]
                                   [--check] [--ragged_max_rows=32768] [--sweep]

Shapes are rows×k×n×groups (K3 latent experts: up k=3584 n=2·3072, down k=3072 n=3584; rows per rank 8k–64k,
groups = 896 / expert-parallel degree). bf16 inputs, f32 accumulation, bf16 outputs for all three. Forward and
forward+backward (both gradients, through `jax.vjp`), median of `--iters` calls after warm-up; TFLOP/s counts
2·m·k·n per matmul (forward 1, backward 2). Routing: 'balanced' (equal groups) or 'skewed' (Zipf-like sizes with
~1/8 of the groups empty). `--check` first compares the GPU kernels with a float64 NumPy per-group loop (forward,
d_lhs, d_rhs; f32 and bf16; empty groups, one group holding all rows, rows past sum(group_sizes)) and exits
non-zero on a mismatch. `--sweep` times a few tilings of the forward and backward kernels on the first shape.
Prints one JSON line per measurement (flushed; filter with `grep --line-buffered` so a timeout keeps them) and a
Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gmm import Tiling, gmm  # noqa: E402


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


def _median_ms(fn, iters):
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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
    row["ours_fwd_ms"] = _median_ms(lambda: f_ours(x, w), iters)
    fb_ours = fwd_bwd(ours)
    row["ours_fwdbwd_ms"] = _median_ms(lambda: fb_ours(x, w, dy), iters)
    if tiling is None:
        f_dense = jax.jit(dense)
        row["dense_fwd_ms"] = _median_ms(lambda: f_dense(x, w_dense), iters)
        fb_dense = fwd_bwd(dense)
        row["dense_fwdbwd_ms"] = _median_ms(lambda: fb_dense(x, w_dense, dy), iters)
    if ragged and tiling is None:
        f_rag = jax.jit(rag)
        row["ragged_fwd_ms"] = _median_ms(lambda: f_rag(x, w), max(2, iters // 8))
        a, b = np.asarray(f_ours(x, w), np.float32), np.asarray(f_rag(x, w), np.float32)
        row["ours_vs_ragged_max_rel_err"] = float(np.abs(a - b).max() / np.abs(b).max())
        if routing == "balanced":
            fb_rag = fwd_bwd(rag)
            row["ragged_fwdbwd_ms"] = _median_ms(lambda: fb_rag(x, w, dy), 2)
    for key in [kk for kk in row if kk.endswith("_ms")]:
        mult = 3 if "fwdbwd" in key else 1
        row[key.replace("_ms", "_tflops")] = mult * flop / (row[key] * 1e-3) / 1e12
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="32768x3584x6144x56,32768x3072x3584x56,8192x3584x6144x112,"
                                       "65536x3584x6144x64")
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ragged_max_rows", type=int, default=32768, help="skip ragged_dot above this many rows (OOM)")
    p.add_argument("--backend", default=None)
    p.add_argument("--check", action="store_true")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}), flush=True)
    backend = args.backend
    if args.check and not check(backend or "gpu"):
        raise SystemExit("gmm check FAILED")
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for m, k, n, g in shapes:
        for routing in args.routing.split(","):
            try:
                rows.append(bench_shape(m, k, n, g, routing, args.iters, m <= args.ragged_max_rows, backend))
            except Exception as e:  # keep the other shapes' figures (e.g. one OOM)
                print(json.dumps({"m": m, "k": k, "n": n, "groups": g, "routing": routing,
                                  "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    if args.sweep:
        m, k, n, g = shapes[0]
        for t in (Tiling(128, 64, 128, 4, 4), Tiling(128, 64, 256, 8, 4), Tiling(128, 128, 256, 8, 2),
                  Tiling(256, 64, 128, 8, 3), Tiling(64, 64, 256, 4, 4)):
            try:
                bench_shape(m, k, n, g, "balanced", max(5, args.iters // 2), False, backend, tiling=t)
            except Exception as e:
                print(json.dumps({"tiling": t, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
