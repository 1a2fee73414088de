"""KDA forward / forward+backward on one GPU: our pure-XLA chunked path vs fla `chunk_kda`, side by side.

    python benchmarks/kda_bench.py --shapes=1x8192x96,1x8192x64,1x32768x96 [--iters=20] [--no_fla]

Inputs are K3's: raw gate input + A_log + dt_bias with the lower-bounded gate (−5), L2 norm and β sigmoid done
inside the timed function for both (fla fuses them in its kernel). bf16 q/k/v, K = V = 128. Reports the median
of `--iters` timed calls after warm-up, nominal TFLOP/s (183 kFLOP per token per head, KERNELS.md §2) and the
ratio to fla.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# JAX and torch share the GPU in this process: stop JAX from preallocating 75% of it (fla OOMs at T=32768 otherwise).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.layers.norms import l2_normalize  # noqa: E402
from k3jax.ops.kda import kda_chunked  # noqa: E402

FLOP_PER_TOKEN_HEAD = 183e3
ROOFLINE_MS_1x8192x96 = 0.21


def _median_ms(fn, iters):
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_ours(b, t, h, d, iters, chunk):
    rng = np.random.default_rng(0)
    q, k, v, graw = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(4))
    blog = jnp.asarray(rng.standard_normal((b, t, h)), jnp.bfloat16)
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((h, d)) * 0.1, jnp.float32)

    def fwd(q, k, v, graw, blog):
        g = -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (graw.astype(jnp.float32) + dt_bias))
        o, _ = kda_chunked(l2_normalize(q), l2_normalize(k), v, g, jax.nn.sigmoid(blog.astype(jnp.float32)),
                           scale=d ** -0.5, chunk_size=chunk)
        return o.astype(jnp.bfloat16)

    f = jax.jit(fwd)
    fb = jax.jit(jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4)))
    args = (q, k, v, graw, blog)
    jax.block_until_ready(f(*args)); jax.block_until_ready(fb(*args))
    ms_f = _median_ms(lambda: jax.block_until_ready(f(*args)), iters)
    ms_fb = _median_ms(lambda: jax.block_until_ready(fb(*args)), iters)
    return ms_f, ms_fb


def bench_fla(b, t, h, d, iters):
    import torch
    from fla.ops.kda import chunk_kda

    torch.manual_seed(0)
    dev = "cuda"
    q, k, v, graw = (torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
    blog = torch.randn(b, t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    a_log = torch.log(torch.empty(h, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(h * d, device=dev) * 0.1

    def fwd():
        o, _ = chunk_kda(q, k, v, graw, blog, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0)
        return o

    def fwd_bwd():
        o = fwd()
        o.float().sum().backward()

    for _ in range(3):  # autotune + warm-up
        with torch.no_grad():
            fwd()
        fwd_bwd()
    torch.cuda.synchronize()

    def timed(fn, grad):
        def run():
            if grad:
                fn()
            else:
                with torch.no_grad():
                    fn()
            torch.cuda.synchronize()
        return _median_ms(run, iters)

    return timed(fwd, False), timed(fwd_bwd, True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x8192x96,1x8192x64,1x32768x96")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--no_fla", action="store_true")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        b, t, h = (int(x) for x in shape.split("x"))
        nominal = b * t * h * FLOP_PER_TOKEN_HEAD
        row = {"shape": shape}
        row["xla_fwd_ms"], row["xla_fwdbwd_ms"] = bench_ours(b, t, h, 128, args.iters, args.chunk)
        print(f"{shape}: ours fwd {row['xla_fwd_ms']:.3f} ms, fwd+bwd {row['xla_fwdbwd_ms']:.3f} ms", flush=True)
        if not args.no_fla:
            row["fla_fwd_ms"], row["fla_fwdbwd_ms"] = bench_fla(b, t, h, 128, args.iters)
            row["xla_over_fla_fwd"] = row["xla_fwd_ms"] / row["fla_fwd_ms"]
            row["xla_over_fla_fwdbwd"] = row["xla_fwdbwd_ms"] / row["fla_fwdbwd_ms"]
        row["xla_fwd_tflops"] = nominal / row["xla_fwd_ms"] / 1e9
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
