"""The fused one-token KDA decode kernel vs the XLA step, side by side in one process (one GPU).

    python -m benchmarks.kda_decode_bench [--shapes=64x12,1x96,256x12] [--block_v=16,32,64,128] [--warps=4]
        [--steps=16] [--iters=20] [--no_check]
    python -m benchmarks.kda_decode_bench --interpret        # CPU smoke run at tiny shapes (Pallas interpreter)

Per shape ``BxH`` (K = V = ``--dim``, default 128; bf16 q/k/v, f32 g / beta / state): the XLA step
(``k3jax.ops.kda.kda_step``) and the kernel (``pallas_kernels.kda.kda_decode_step``, one row per ``block_v``) are each
jitted as ``--steps`` consecutive decode steps with the state donated (updated in place) and an optimization barrier
between steps (so XLA cannot fuse across steps, as in a model where the whole network runs between them). Reported
per step: the median over ``--iters`` calls divided by ``--steps`` (``ms``), the effective bandwidth of the state
traffic (one f32 read + one write of ``[B, H, K, V]``, ``GB/s``), and ``xla_ms / ms``. ``--no_check`` skips the
check that each kernel variant's output and state equal the XLA step's at the benchmark shape.

``*_in_scan`` rows (``--layers`` L > 0): the same step inside a ``lax.scan`` over L stacked states ``[L, B, H, K, V]``
(scan input -> scan output, stack donated), per layer. This is how the model's scanned layer groups decode: the
scan slices each layer's state out and writes the new one back, which XLA can fuse into its own step's fusions
but not into a kernel call (expect extra copies around the kernel there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda import kda_step
from pallas_kernels.kda import kda_decode_step


def _inputs(b, h, d, seed=0):
    """bf16 unit q/k and v, f32 gate in [-5, 0], beta in (0, 1), a random f32 state."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True))

    q, k = (jnp.asarray(unit(rng.standard_normal((b, h, d))), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    g = jnp.asarray(-5.0 * rng.random((b, h, d)), jnp.float32)
    beta = jnp.asarray(rng.random((b, h)), jnp.float32)
    state = jnp.asarray(0.1 * rng.standard_normal((b, h, d, d)), jnp.float32)
    return q, k, v, g, beta, state


def _steps_fn(step, n_steps):
    """``n_steps`` decode steps in one jit, state donated, a barrier between steps; returns (last o, state)."""
    def run(q, k, v, g, beta, state):
        o = None
        for _ in range(n_steps):
            o, state = step(q, k, v, g, beta, state)
            o, state = jax.lax.optimization_barrier((o, state))
        return o, state

    return jax.jit(run, donate_argnums=5)


def _scan_fn(step, n_layers):
    """One decode step per layer over ``n_layers`` stacked states ``[L, B, H, K, V]`` as ``lax.scan`` input and
    output (how the model's scanned layer groups hold their KDA states), stack donated."""
    def run(q, k, v, g, beta, states_lbhkv):
        def body(acc, state):
            o, state = step(q, k, v, g, beta, state)
            return acc + o, state

        acc0 = jnp.zeros(v.shape, jnp.float32)
        return jax.lax.scan(body, acc0, states_lbhkv)

    return jax.jit(run, donate_argnums=5)


def _time_per_step_ms(fn, args, iters, n_steps):
    """Median wall time of one call (``n_steps`` steps) / n_steps, chaining the donated state."""
    *fixed, state = args
    _, state = jax.block_until_ready(fn(*fixed, state))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _, state = jax.block_until_ready(fn(*fixed, state))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / n_steps


def bench_shape(b, h, d, args, backend):
    scale = d ** -0.5
    state_gb = 2 * b * h * d * d * 4 / 1e9  # one f32 read + one write of the state per step
    inputs = _inputs(b, h, d)
    rows = []

    def record(name, ms, extra=None):
        row = {"shape": f"{b}x{h}", "K=V": d, "impl": name, "ms": round(ms, 4), "GB/s": round(state_gb / ms * 1e3, 1)}
        row.update(extra or {})
        rows.append(row)
        print(json.dumps(row), flush=True)

    def xla(*a):
        return kda_step(*a, scale=scale)

    stacked = inputs[:5] + (jnp.stack([inputs[5]] * args.layers),) if args.layers else None
    xla_ms = _time_per_step_ms(_steps_fn(xla, args.steps), _copy(inputs), args.iters, args.steps)
    record("xla_kda_step", xla_ms)
    if stacked:
        xla_scan_ms = _time_per_step_ms(_scan_fn(xla, args.layers), _copy(stacked), args.iters, args.layers)
        record("xla_kda_step_in_scan", xla_scan_ms)
    ref_o, ref_s = jax.jit(lambda *a: kda_step(*a, scale=scale))(*inputs)
    for block_v in (int(x) for x in args.block_v.split(",")):
        for warps in (int(x) for x in args.warps.split(",")):
            def kernel(*a, block_v=block_v, warps=warps):
                return kda_decode_step(*a, scale=scale, backend=backend, block_v=block_v, warps=warps)

            name = f"kernel_bv{block_v}_w{warps}"
            try:
                extra = {}
                if not args.no_check:
                    o, s = jax.jit(kernel)(*_copy(inputs))
                    extra = {"max_err_o": float(jnp.max(jnp.abs(o - ref_o))),
                             "max_err_state": float(jnp.max(jnp.abs(s - ref_s)))}
                ms = _time_per_step_ms(_steps_fn(kernel, args.steps), _copy(inputs), args.iters, args.steps)
                record(name, ms, {**extra, "xla_ms/ms": round(xla_ms / ms, 2)})
                if stacked:
                    scan_ms = _time_per_step_ms(_scan_fn(kernel, args.layers), _copy(stacked), args.iters,
                                                args.layers)
                    record(name + "_in_scan", scan_ms, {"xla_ms/ms": round(xla_scan_ms / scan_ms, 2)})
            except Exception as e:  # noqa: BLE001 -- report the failing variant and go on with the others
                print(json.dumps({"shape": f"{b}x{h}", "impl": name,
                                  "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}), flush=True)
    return rows


def _copy(inputs):
    """Fresh buffers (the timed functions donate the state)."""
    return tuple(jnp.array(x, copy=True) for x in inputs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=None, help="comma list of BxH (default 64x12,1x96,256x12; 2x2 with "
                   "--interpret)")
    p.add_argument("--dim", type=int, default=None, help="K = V (default 128; 32 with --interpret)")
    p.add_argument("--block_v", default="16,32,64,128", help="comma list of kernel value-block widths")
    p.add_argument("--warps", default="4", help="comma list of Triton warps per program")
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed call (default 16; 2 with "
                   "--interpret)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20; 2 with --interpret)")
    p.add_argument("--layers", type=int, default=3, help="also time each implementation inside a lax.scan over "
                   "this many stacked layer states, as the model's scanned groups decode (0: skip)")
    p.add_argument("--no_check", action="store_true")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (Pallas interpreter, tiny shapes)")
    args = p.parse_args()
    smoke = args.interpret
    args.shapes = args.shapes or ("2x2" if smoke else "64x12,1x96,256x12")
    args.dim = args.dim or (32 if smoke else 128)
    args.steps = args.steps or (2 if smoke else 16)
    args.iters = args.iters or (2 if smoke else 20)
    if smoke and args.block_v == p.get_default("block_v"):
        args.block_v = "16,32"
    backend = "interpret" if smoke else "gpu"
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, backend {backend}", flush=True)
    for shape in args.shapes.split(","):
        b, h = (int(x) for x in shape.split("x"))
        bench_shape(b, h, args.dim, args, backend)


if __name__ == "__main__":
    main()
