"""Block Attention Residuals read + RMSNorm on one GPU: the fused Pallas kernels (`pallas_kernels.attn_res`) vs the
XLA path (`attn_res_mix` then `rms_norm`), forward and forward+backward.

    python -m benchmarks.attn_res_bench [--shapes=16384x1536x2,16384x1536x5] [--tilings=16-4,32-8] [--iters=20]

Shapes are tokens×D×filled bank rows (`k3_gpu`: D = 1,536, up to 5 rows; its training micro-batch 4 × 4,096 tokens).
bf16 activations and bank, f32 query and gain. First checks the kernels against the XLA path on the GPU (values and
the four gradients, bf16 tolerance; exits non-zero on a mismatch), then times both (median of `--iters` calls). The
memory floor is the bytes one fused pass must move (forward: read the N + 1 sources, write the output; backward:
read the sources and the output gradient, write their gradients) at the H200's practical 4.3 TB/s (RESULTS.md
2026-12-02). One JSON line per measurement, then a Markdown table.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import median_ms
from k3jax.layers.attn_res import attn_res_mix
from k3jax.layers.norms import rms_norm
from k3jax.ops.attn_res import read_norm

flags.DEFINE_string("shapes", "16384x1536x2,16384x1536x5", "tokens×D×filled rows, comma-separated")
flags.DEFINE_string("tilings", "16-4,32-8", "kernel block_t-warps choices, comma-separated")
flags.DEFINE_integer("iters", 20, "timed calls per measurement")

_HBM_BYTES_PER_S = 4.3e12
_EPS = 1e-6


def _inputs(m, d, n):
    rng = np.random.default_rng(0)
    live = jnp.asarray(rng.standard_normal((1, m, d)), jnp.bfloat16)
    bank = jnp.asarray(rng.standard_normal((n + 1, 1, m, d)), jnp.bfloat16)  # one unread row, as in the model
    query = jnp.asarray(rng.standard_normal(d) * 0.05, jnp.float32)
    gain = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((1, m, d)), jnp.bfloat16)
    return live, bank, query, gain, dout


def _fns(n, tiling):
    if tiling is None:
        def fwd(live, bank, query, gain):
            return rms_norm(attn_res_mix(live, bank, n, query, _EPS), gain, _EPS)
    else:
        def fwd(live, bank, query, gain):
            return read_norm(live, bank, n, query, gain, eps_read=_EPS, eps_norm=_EPS, backend="gpu",
                             block_t=tiling[0], warps=tiling[1])

    def fwd_bwd(live, bank, query, gain, dout):
        out, vjp = jax.vjp(fwd, live, bank, query, gain)
        return out, *vjp(dout)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def main(argv):
    del argv
    tilings = [tuple(int(v) for v in s.split("-")) for s in flags.FLAGS.tilings.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in flags.FLAGS.shapes.split(",")]
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    m, d, n = shapes[0]
    args = _inputs(m, d, n)
    got, ref = _fns(n, tilings[0])[1](*args), _fns(n, None)[1](*args)
    ok = True
    for name, a, r in zip(("out", "d_live", "d_bank", "d_query", "d_gain"), got, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        err = float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-30))
        print(json.dumps({"check": name, "shape": f"{m}x{d}x{n}", "max_rel_err": err, "ok": err < 3e-2}), flush=True)
        ok &= err < 3e-2
    if not ok:
        print("attn_res_bench: the kernels do not match the XLA path; not timing them", file=sys.stderr)
        sys.exit(1)
    rows = []
    for m, d, n in shapes:
        live, bank, query, gain, dout = _inputs(m, d, n)
        elem = m * d * 2
        floors = {"fwd": (n + 2) * elem / _HBM_BYTES_PER_S * 1e3,
                  "fwd+bwd": (3 * n + 5) * elem / _HBM_BYTES_PER_S * 1e3}
        for name, tiling in [("xla", None)] + [(f"pallas {t}-{w}", (t, w)) for t, w in tilings]:
            fwd, fwd_bwd = _fns(n, tiling)
            for mode, fn in (("fwd", lambda: fwd(live, bank, query, gain)),
                             ("fwd+bwd", lambda: fwd_bwd(live, bank, query, gain, dout))):
                row = {"shape": f"{m}x{d}x{n}", "impl": name, "mode": mode,
                       "ms": round(median_ms(fn, flags.FLAGS.iters), 4), "floor_ms": round(floors[mode], 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    base = {(r["shape"], r["mode"]): r["ms"] for r in rows if r["impl"] == "xla"}
    print("\n| tokens×D×rows | impl | mode | ms | memory floor ms | vs xla |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{base[(r['shape'], r['mode'])] / r['ms']:.2f}× |")


if __name__ == "__main__":
    app.run(main)
