"""What this GPU's HBM delivers to plain streaming kernels: the practical ceiling behind the decode floor's 4.8 TB/s.

    python -m benchmarks.hbm_ceiling [--gb=2] [--iters=20]

The decode benchmark's floor (`decode_bench.py`) divides a step's bytes by the H200's nominal 4.8 TB/s. This
times, on the same GPU and in one process, kernels that do nothing but move bytes, so the floor can be read
against what is reachable at all:
- ``xla_sum``: a jitted bf16 -> f32 reduction over ``--gb`` GB (read only);
- ``xla_scale``: ``x * c`` over ``--gb`` GB (one read + one write);
- ``torch_sum`` / ``torch_copy`` (if torch with CUDA is importable): ``x.sum()`` and ``y.copy_(x)``.
Each is timed as the median wall clock of ``--iters`` calls (one warm-up) over buffers much larger than the 50 MB L2,
and reported in TB/s of bytes moved (read + written). Prints one JSON line per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.timing import median_ms


def _torch_rows(n_elems: int, iters: int) -> list[dict]:
    try:
        import torch
    except ImportError:
        return [{"impl": "torch", "error": "torch not importable"}]
    if not torch.cuda.is_available():
        return [{"impl": "torch", "error": "torch has no CUDA device"}]
    x = torch.randn(n_elems, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    nbytes = x.numel() * x.element_size()
    rows = [{"impl": "torch_sum", "ms": timed(lambda: x.sum(dtype=torch.float32)), "bytes": nbytes},
            {"impl": "torch_copy", "ms": timed(lambda: y.copy_(x)), "bytes": 2 * nbytes}]
    x = y = None  # free the buffers before empty_cache (a `del` would hide them from the lambdas above)
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="buffer size in GB (bf16)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no_torch", action="store_true")
    args = ap.parse_args(argv)
    n = int(args.gb * 1e9) // 2
    print(f"devices: {jax.devices()}, buffer {n * 2 / 1e9:.2f} GB bf16", flush=True)
    rows = []
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
    nbytes = x.size * 2
    f_sum = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f_scale = jax.jit(lambda a: a * jnp.bfloat16(0.999))
    rows.append({"impl": "xla_sum", "ms": median_ms(lambda: f_sum(x), args.iters), "bytes": nbytes})
    rows.append({"impl": "xla_scale", "ms": median_ms(lambda: f_scale(x), args.iters), "bytes": 2 * nbytes})
    x = None  # free the buffer before empty_cache
    if not args.no_torch:
        rows += _torch_rows(n, args.iters)
    for r in rows:
        if "ms" in r:
            r["tbs"] = r["bytes"] / r["ms"] / 1e9
        print(json.dumps(r), flush=True)
    print("\n| impl | GB moved | ms | TB/s | of 4.8 TB/s |\n|---|---:|---:|---:|---:|")
    for r in rows:
        if "ms" in r:
            print(f"| {r['impl']} | {r['bytes'] / 1e9:.2f} | {r['ms']:.3f} | {r['tbs']:.2f} | {r['tbs'] / 4.8:.0%} |")
        else:
            print(f"| {r['impl']} | - | - | - | {r['error']} |")
    return rows


if __name__ == "__main__":
    main()
