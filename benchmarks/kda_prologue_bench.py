"""KDA training prologue (short conv → SiLU → per-head L2 norm) on one GPU: the Pallas kernels
(`pallas_kernels.kda.conv_prologue`) vs the XLA path the layer used before, forward and forward+backward.

    python -m benchmarks.kda_prologue_bench [--shapes=4x4096x1536,1x131072x1536] [--head_dim=128] [--iters=20]
                                            [--tilings=16-4,32-4,32-4:16-4]

Shapes are B×T×P (P = heads · head_dim; `k3_gpu`: 1536). bf16 activations, f32 kernel, packed documents (a
boundary every 1,000 tokens). First checks the kernel against the XLA path on the GPU (values and both gradients,
bf16 tolerance; exits non-zero on a mismatch), then times both with the median of `--iters` calls. The memory floor
column is the bytes a fused pass must move (forward: read x, write out; backward: read x and the output gradient,
write dx) at the H200's measured practical HBM bandwidth (4.3 TB/s, RESULTS.md 2026-12-02). One JSON line per
measurement, then a Markdown table.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import median_ms
from k3jax.ops.conv import conv_prologue

flags.DEFINE_string("shapes", "4x4096x1536,1x131072x1536", "B×T×P, comma-separated")
flags.DEFINE_integer("head_dim", 128, "columns per head (the norm's width)")
flags.DEFINE_integer("iters", 20, "timed calls per measurement")
flags.DEFINE_string("tilings", "32-4:16-4", "kernel block_t-warps choices, comma-separated; F-W:B-W gives the "
                    "backward its own")
flags.DEFINE_integer("width", 4, "conv taps W")

_HBM_BYTES_PER_S = 4.3e12


def _inputs(b, t, p, w):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, p)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((w, p)) * 0.5, jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, t, p)), jnp.bfloat16)
    seg = jnp.asarray(np.broadcast_to(np.arange(t) // 1000, (b, t)).astype(np.int32))
    return x, kernel, dout, seg


def _tiling(spec):
    """``"F-W"`` (both directions) or ``"F-W:B-W"`` (forward, backward) → (block_t, warps, bwd_block_t, bwd_warps)."""
    fwd, _, bwd = spec.partition(":")
    return tuple(int(v) for v in fwd.split("-")) + tuple(int(v) for v in (bwd or fwd).split("-"))


def _fns(backend, head_dim, tiling, seg):
    bt, warps, bwd_bt, bwd_warps = tiling

    def fwd(x, k):
        return conv_prologue(x, k, seg, head_dim=head_dim, normalize=True, backend=backend, block_t=bt,
                             warps=warps, bwd_block_t=bwd_bt, bwd_warps=bwd_warps)

    def fwd_bwd(x, k, dout):
        out, vjp = jax.vjp(fwd, x, k)
        return out, *vjp(dout)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _check(b, t, p, opts):
    x, kernel, dout, seg = _inputs(b, t, p, opts["width"])
    got = _fns("gpu", opts["head_dim"], opts["tilings"][0][1], seg)[1](x, kernel, dout)
    ref = _fns(None, opts["head_dim"], opts["tilings"][0][1], seg)[1](x, kernel, dout)
    ok = True
    for name, a, r in zip(("out", "dx", "dkernel"), got, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        err = float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-30))
        bound = 2e-2
        print(json.dumps({"check": name, "shape": f"{b}x{t}x{p}", "max_rel_err": err, "ok": err < bound}),
              flush=True)
        ok &= err < bound
    return ok


def main(argv):
    del argv
    opts = {"head_dim": flags.FLAGS.head_dim, "width": flags.FLAGS.width,
            "tilings": [(s, _tiling(s)) for s in flags.FLAGS.tilings.split(",")]}
    shapes = [tuple(int(v) for v in s.split("x")) for s in flags.FLAGS.shapes.split(",")]
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    if not _check(*shapes[0], opts):
        print("kda_prologue_bench: the kernel does not match the XLA path; not timing it", file=sys.stderr)
        sys.exit(1)
    rows = []
    for b, t, p in shapes:
        x, kernel, dout, seg = _inputs(b, t, p, opts["width"])
        elem = b * t * p * 2  # bf16 bytes of one [B, T, P] array
        floors = {"fwd": 2 * elem / _HBM_BYTES_PER_S * 1e3, "fwd+bwd": 5 * elem / _HBM_BYTES_PER_S * 1e3}
        variants = [("xla", None, (32, 4, 32, 4))] + [(f"pallas {s}", "gpu", tl) for s, tl in opts["tilings"]]
        for name, backend, tiling in variants:
            fwd, fwd_bwd = _fns(backend, opts["head_dim"], tiling, seg)
            for mode, fn in (("fwd", lambda: fwd(x, kernel)), ("fwd+bwd", lambda: fwd_bwd(x, kernel, dout))):
                ms = median_ms(fn, flags.FLAGS.iters)
                row = {"shape": f"{b}x{t}x{p}", "impl": name, "mode": mode, "ms": round(ms, 4),
                       "floor_ms": round(floors[mode], 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| shape | impl | mode | ms | memory floor ms | vs xla |\n|---|---|---|---:|---:|---:|")
    base = {(r["shape"], r["mode"]): r["ms"] for r in rows if r["impl"] == "xla"}
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{base[(r['shape'], r['mode'])] / r['ms']:.2f}× |")


if __name__ == "__main__":
    app.run(main)
