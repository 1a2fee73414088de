"""KDA forward / forward+backward on one GPU: our Pallas kernel, our pure-XLA chunked path and fla `chunk_kda`.

    python -m benchmarks.kda_bench --shapes=1x8192x96,1x8192x64 --fla_shapes=1x8192x96 [--iters=20] [--check]
        [--impls=pallas,xla] [--variants=64-4-4,32-4-4,64-4-4-doubling] [--breakdown]

Inputs are K3's: raw gate input + A_log + dt_bias with the lower-bounded gate (−5), L2 norm and β sigmoid done
inside the timed function for every implementation (fla and our `chunk_kda_gated` activate the gate in-kernel).
bf16 q/k/v, K = V = 128. Two timings per implementation: latency (median of `--iters` calls, each synced) and
pipelined device time (`--iters` calls back to back, one sync: what triton.testing.do_bench measures); nominal
TFLOP/s (183 kFLOP per token per head, docs/kernels.md#kda-chunk) and the fraction of the ≈0.21 ms forward roofline at
1×8192×96 (scaled by tokens·heads for other shapes) from the pipelined time; ratios to fla for both timings.
fla autotunes for minutes per new shape: `--fla_shapes` limits it to the listed shapes (default: all).
Pallas variants are `block_v-warps(parallel)-warps(sequential)[-solve[-stages[-block_k[-intra]]]]`
(KernelConfig.parse); `--breakdown` also times the intra-chunk kernel alone for each variant; `--profile` traces
three forward and three forward+backward calls of each implementation at the first shape (jax.profiler for ours,
torch.profiler for fla) and prints each GPU kernel's time per call, to compare stage by stage. `--check` first
runs `benchmarks.kda_check`'s GPU check (outputs, state, gradients vs the token recurrence) and stops if it fails.
The Pallas fwd+bwd column uses the Pallas forward and backward kernels (chunk_kda's default bwd="pallas").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

# JAX and torch share the GPU in this process: stop JAX from preallocating 75% of it (fla OOMs at T=32768 otherwise).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda_check import run_on_gpu
from benchmarks.trace_summary import summarize_xplane, trace_xplane
from k3jax.ops.kda import KernelConfig, chunk_kda_gated, kda_chunked, l2_normalize
from pallas_kernels.kda.chunk_fwd import intra_chunk

FLOP_PER_TOKEN_HEAD = 183e3
ROOFLINE_MS_1x8192x96 = 0.21


def _median_ms(fn, iters):
    """Latency: median over `iters` calls of one call including its dispatch and a device sync."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _pipelined_ms(launch, sync, iters, reps=3):
    """Device time per call: `iters` calls launched back to back (no sync between them, so host dispatch overlaps
    the device work, as triton.testing.do_bench measures), then one sync; the median of `reps` such runs."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            launch()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def _k3_gate(graw, a_log, dt_bias):
    return -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (graw.astype(jnp.float32) + dt_bias))


def _xla_core(q, k, v, graw, blog, a_log, dt_bias, scale, chunk, variant):
    del variant
    o, _ = kda_chunked(l2_normalize(q), l2_normalize(k), v, _k3_gate(graw, a_log, dt_bias),
                       jax.nn.sigmoid(blog.astype(jnp.float32)), scale=scale, chunk_size=chunk)
    return o


def _pallas_core(q, k, v, graw, blog, a_log, dt_bias, scale, chunk, variant):
    """variant: a KernelConfig. K3's entry point (chunk_kda_gated: the gate is activated inside the intra kernel
    for the intra modes that can, like fla's use_gate_in_kernel)."""
    del chunk
    o, _ = chunk_kda_gated(q, k, v, graw, blog, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, scale=scale,
                           backend="gpu", config=variant)
    return o


CORES = {"xla": _xla_core, "pallas": _pallas_core}


def bench_intra(b, t, h, d, iters, variant):
    """The intra-chunk kernel alone (bf16 inputs, T a multiple of 64): its share of the Pallas forward."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)) * d ** -0.5, jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(-5.0 * rng.random((b, t, h, d)), jnp.float32)
    beta = jnp.asarray(rng.random((b, t, h)), jnp.float32)
    f = jax.jit(lambda *a: intra_chunk(*a, scale=d ** -0.5, config=variant))
    jax.block_until_ready(f(q, k, v, g, beta))
    return _median_ms(lambda: jax.block_until_ready(f(q, k, v, g, beta)), iters)


DEFAULT_VARIANT = KernelConfig()
PROFILE_CALLS = 3


def _print_kernels(label, kernels):
    """kernels: [(name, us per call, launches per call)], printed longest first."""
    total = sum(us for _, us, _ in kernels)
    print(f"profile {label}: {total / 1e3:.3f} ms of kernels per call", flush=True)
    for name, us, count in sorted(kernels, key=lambda r: -r[1])[:20]:
        print(f"  {us:9.1f} us  x{count:<5.3g} {name[:110]}", flush=True)


def profile_jax(label, fn, args):
    """Device time per GPU kernel of `fn(*args)` (already compiled), from a jax.profiler trace."""
    path = trace_xplane(lambda: jax.block_until_ready(fn(*args)), PROFILE_CALLS,
                        tempfile.mkdtemp(prefix="kda_profile_"))
    summary = summarize_xplane(path, PROFILE_CALLS, top=40)
    rows = summary.get("top_kernels") or summary.get("top_events", [])
    _print_kernels(label, [(r["name"], r["per_step_us"], r["count_per_step"]) for r in rows])


def profile_torch(label, fn):
    """Device time per CUDA kernel of `fn()` (already autotuned), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us:
            rows.append((ev.key, us / PROFILE_CALLS, ev.count / PROFILE_CALLS))
    _print_kernels(label, rows)


def bench_jax(core, b, t, h, d, iters, chunk, variant=DEFAULT_VARIANT, with_bwd=True, profile=None):
    rng = np.random.default_rng(0)
    q, k, v, graw = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(4))
    blog = jnp.asarray(rng.standard_normal((b, t, h)), jnp.bfloat16)
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((h, d)) * 0.1, jnp.float32)

    def fwd(q, k, v, graw, blog):
        return core(q, k, v, graw, blog, a_log, dt_bias, d ** -0.5, chunk, variant).astype(jnp.bfloat16)

    f = jax.jit(fwd)
    # value_and_grad: the loss value keeps the forward output live (with grad alone XLA drops a custom_vjp forward
    # whose output the backward does not need, and the timing would omit the forward kernel).
    fb = jax.jit(jax.value_and_grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4)))
    args = (q, k, v, graw, blog)
    last = {}

    def pipelined(fn):
        def launch():
            last["out"] = fn(*args)  # the previous call's outputs are freed as they are replaced

        return _pipelined_ms(launch, lambda: jax.block_until_ready(last.get("out")), iters)

    jax.block_until_ready(f(*args))
    ms_f = _median_ms(lambda: jax.block_until_ready(f(*args)), iters)
    gpu_f = pipelined(f)
    if profile:
        profile_jax(f"{profile} fwd", f, args)
    if not with_bwd:
        return ms_f, float("nan"), gpu_f, float("nan")
    jax.block_until_ready(fb(*args))
    ms_fb = _median_ms(lambda: jax.block_until_ready(fb(*args)), iters)
    gpu_fb = pipelined(fb)
    last.clear()
    if profile:
        profile_jax(f"{profile} fwd+bwd", fb, args)
    return ms_f, ms_fb, gpu_f, gpu_fb


def bench_fla(b, t, h, d, iters, profile=False):
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    torch.manual_seed(0)
    dev = "cuda"
    q, k, v, graw = (torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
    blog = torch.randn(b, t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    a_log = torch.log(torch.empty(h, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(h * d, device=dev) * 0.1

    def fwd():
        o, _ = fla_chunk_kda(q, k, v, graw, blog, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
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

    def fwd_nograd():
        with torch.no_grad():
            fwd()

    ms = (timed(fwd, False), timed(fwd_bwd, True), _pipelined_ms(fwd_nograd, torch.cuda.synchronize, iters),
          _pipelined_ms(fwd_bwd, torch.cuda.synchronize, iters))
    if profile:
        profile_torch("fla fwd", fwd_nograd)
        profile_torch("fla fwd+bwd", fwd_bwd)
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x8192x96,1x8192x64,1x32768x96")
    p.add_argument("--fla_shapes", default=None, help="shapes to run fla on (default: all of --shapes)")
    p.add_argument("--impls", default="pallas,xla")
    p.add_argument("--variants", default="64-4-4",
                   help="comma list of Pallas configs (KernelConfig.parse syntax), each timed fwd and fwd+bwd")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--chunk", type=int, default=64, help="chunk size of the XLA path (the kernel uses 64)")
    p.add_argument("--no_fla", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="also time the intra-chunk kernel alone")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time of each implementation, first shape")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.check:  # the kernels' own GPU check (outputs, final state and all gradients vs the token recurrence)
        for var in dict.fromkeys(args.variants.split(",")):
            try:
                rows, ok = run_on_gpu(config=KernelConfig.parse(var))
            except Exception:  # noqa: BLE001 -- the kernel does not build or run here: stop before spending time
                traceback.print_exc()
                sys.exit(1)
            for check_row in rows:
                print(json.dumps({"variant": var, **check_row}), flush=True)
            if not ok:
                sys.exit(1)
    fla_shapes = set((args.fla_shapes or args.shapes).split(","))
    rows = []
    for shape_index, shape in enumerate(args.shapes.split(",")):
        profile = args.profile and shape_index == 0
        b, t, h = (int(x) for x in shape.split("x"))
        nominal = b * t * h * FLOP_PER_TOKEN_HEAD
        roofline_ms = ROOFLINE_MS_1x8192x96 * (b * t * h) / (8192 * 96)
        row = {"shape": shape}
        for impl in args.impls.split(","):
            variants = args.variants.split(",") if impl == "pallas" else ["64-4-4"]
            for i, var in enumerate(variants):
                name = impl if i == 0 else f"{impl}_{var}"
                try:
                    ms_f, ms_fb, gpu_f, gpu_fb = bench_jax(CORES[impl], b, t, h, 128, args.iters, args.chunk,
                                                           KernelConfig.parse(var),
                                                           profile=f"{name} {shape}" if profile else None)
                    if impl == "pallas" and args.breakdown:
                        row[f"{name}_intra_ms"] = bench_intra(b, t, h, 128, args.iters, KernelConfig.parse(var))
                except Exception:  # noqa: BLE001 -- report and time the other implementations
                    traceback.print_exc()
                    continue
                row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = ms_f, ms_fb
                row[f"{name}_fwd_gpu_ms"], row[f"{name}_fwdbwd_gpu_ms"] = gpu_f, gpu_fb
                row[f"{name}_fwd_tflops"] = nominal / gpu_f / 1e9
                row[f"{name}_fwd_roofline_frac"] = roofline_ms / gpu_f
                print(f"{shape}: {name} ({var}) fwd {ms_f:.3f} ms, fwd+bwd {ms_fb:.3f} ms (latency); "
                      f"pipelined fwd {gpu_f:.3f} ms, fwd+bwd {gpu_fb:.3f} ms", flush=True)
        if not args.no_fla and shape in fla_shapes:
            try:
                (row["fla_fwd_ms"], row["fla_fwdbwd_ms"], row["fla_fwd_gpu_ms"],
                 row["fla_fwdbwd_gpu_ms"]) = bench_fla(b, t, h, 128, args.iters, profile=profile)
                print(f"{shape}: fla fwd {row['fla_fwd_ms']:.3f} ms, fwd+bwd {row['fla_fwdbwd_ms']:.3f} ms "
                      f"(latency); pipelined fwd {row['fla_fwd_gpu_ms']:.3f} ms, fwd+bwd "
                      f"{row['fla_fwdbwd_gpu_ms']:.3f} ms", flush=True)
                for key in [k for k in row if k.endswith("_fwd_ms") and not k.startswith("fla")]:
                    name = key[: -len("_fwd_ms")]
                    for kind in ("fwd", "fwdbwd", "fwd_gpu", "fwdbwd_gpu"):
                        row[f"{name}_over_fla_{kind}"] = row[f"{name}_{kind}_ms"] / row[f"fla_{kind}_ms"]
            except Exception:  # noqa: BLE001 -- fla failures must not lose the rows above
                traceback.print_exc()
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
