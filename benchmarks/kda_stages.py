"""Per-kernel times of the Pallas KDA forward and backward on one GPU (where the time goes, for tuning).

    python -m benchmarks.kda_stages --shape=1x8192x96 --variants=64-4-4,32-4-4-doubling-1-32-split [--iters=10]
        [--check] [--stages=intra,recurrence]

Each stage (forward: intra, recurrence; backward: states, reverse, state_grads, intra_bwd, or with
``intra_bwd="tiled"`` its two kernels bwd_intra_a = solve gradients and bwd_intra_b = pair gradients, with
``intra_bwd="state_fused"`` bwd_state_solve and bwd_pair_fused in place of state_grads + both) is jitted alone
on the previous stage's outputs (bf16 q/k/v, K = V = 128, gate in [-5, 0]) and timed (median of `--iters` calls
after warm-up). Before timing, every stage of the first variant is compiled for f32 and bf16 at a small shape and any
compile error (e.g. Triton running out of shared memory) is printed per stage, so one run tells which kernel fails;
`--profile` prints the GPU kernels inside each stage of the first variant; `--check` first runs
`benchmarks.kda_check`'s check (outputs, state, gradients) with each variant.
Variant syntax: `block_v-warps(parallel)-warps(sequential)[-solve[-stages[-block_k[-intra[-intra_bwd]]]]]`, e.g.
`64-4-4-doubling-1-32-split-tiled` (`KernelConfig.parse`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda_check import run_on_gpu
from pallas_kernels.kda import KernelConfig, chunk_bwd, chunk_fwd, common, intra_bwd_fused, intra_bwd_tiled, intra_split


def _inputs(b, t, h, d, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = (jnp.asarray(unit(rng.standard_normal((b, t, h, d))), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    g = jnp.asarray(-5.0 * rng.random((b, t, h, d)), jnp.float32)
    beta = jnp.asarray(rng.random((b, t, h)), jnp.float32)
    s0 = jnp.zeros((b, h, d, d), jnp.float32)
    d_o = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    return q, k, v, g, beta, s0, d_o


def stage_fns(b, t, h, d, dtype, config, interpret=False):
    """Ordered (name, jitted fn, args builder) for each kernel; builders read earlier stages' outputs."""
    scale = d ** -0.5
    _, precision = common.matmul_policy(dtype)
    kw = dict(precision=precision, config=config, interpret=interpret)
    block_v = chunk_fwd.check_dims(d, d, config)
    n = t // chunk_fwd.CHUNK
    specs = chunk_fwd.SequentialSpecs(b=b, h=h, n=n, kd=d, vd=d, block_v=block_v, layout=None)
    q, k, v, g, beta, s0, d_o = _inputs(b, t, h, d, dtype)
    out = {}
    stages = [
        ("intra", lambda: jax.jit(lambda *a: chunk_fwd.intra_chunk(*a, scale=scale, config=config,
                                                                   interpret=interpret)),
         lambda: (q, k, v, g, beta), ("qg", "kg", "w", "u", "aqk", "decay")),
        ("recurrence", lambda: jax.jit(lambda *a: chunk_fwd.fused_recurrence(*a, specs, out_dtype=dtype, **kw)),
         lambda: (out["qg"], out["kg"], out["w"], out["u"], out["aqk"], out["decay"], s0), ("o", "final")),
        ("bwd_states", lambda: jax.jit(lambda *a: chunk_fwd.chunk_states(*a, specs, **kw)),
         lambda: (out["kg"], out["w"], out["u"], out["decay"], s0), ("states", "v_new", "final2")),
        ("bwd_reverse", lambda: jax.jit(lambda *a: chunk_bwd.reverse_states(*a, specs, **kw)),
         lambda: (out["qg"], out["kg"], out["w"], out["aqk"], out["decay"], d_o, s0), ("ds_end", "dv_new", "ds0")),
        ("bwd_state_grads", lambda: jax.jit(lambda *a: chunk_bwd.state_grads(*a, **kw)),
         lambda: (d_o, out["v_new"], out["dv_new"], out["states"], out["ds_end"]),
         ("dqg", "dkg", "dw", "daqk", "d_decay")),
        ("bwd_intra", lambda: jax.jit(lambda *a: chunk_bwd.intra_bwd(*a, scale=scale, **kw)),
         lambda: (q, k, v, g, beta, out["u"], out["w"], out["dqg"], out["dkg"], out["dw"], out["dv_new"],
                  out["daqk"], out["d_decay"]), ("dq", "dk", "dv", "dg", "dbeta")),
    ]
    split_intra = ("intra", lambda: jax.jit(lambda *a: intra_split.intra_chunk_split(
        *a, scale=scale, config=config, interpret=interpret, return_solve=True)),
        lambda: (q, k, v, g, beta), ("qg", "kg", "w", "u", "aqk", "decay", "solve_terms"))
    if config.intra_bwd == "tiled":  # split recompute, then the two tiled backward kernels as their own stages
        stages[0] = split_intra
        stages[-1:] = [
            ("bwd_intra_a", lambda: jax.jit(lambda *a: intra_bwd_tiled.solve_grads(*a, **kw)),
             lambda: (out["solve_terms"][1], out["solve_terms"][0], beta, out["dv_new"], out["u"], v, out["dw"],
                      out["w"], k, out["solve_terms"][2]), ("dv", "z", "dkk", "dbeta")),
            ("bwd_intra_b", lambda: jax.jit(lambda *a: intra_bwd_tiled.pair_grads(*a, scale=scale, **kw)),
             lambda: (q, k, out["solve_terms"][2], beta, out["z"], out["dqg"], out["dkg"], out["daqk"], out["dkk"],
                      out["d_decay"]), ("dq", "dk", "dg")),
        ]
    elif config.intra_bwd == "state_fused":  # split recompute; state-product gradients inside the two kernels
        stages[0] = split_intra
        stages[-2:] = [
            ("bwd_state_solve", lambda: jax.jit(lambda *a: intra_bwd_fused.state_solve_grads(*a, **kw)),
             lambda: (out["solve_terms"][1], out["solve_terms"][0], beta, out["dv_new"], out["u"], v, out["w"], k,
                      out["solve_terms"][2], d_o, out["v_new"], out["states"], out["ds_end"]),
             ("dv", "dkk", "dbeta", "daqk", "dqs", "dkgf", "bgz", "dgl")),
            ("bwd_pair_fused", lambda: jax.jit(lambda *a: intra_bwd_fused.pair_grads_fused(*a, scale=scale, **kw)),
             lambda: (q, k, out["solve_terms"][2], out["dqs"], out["dkgf"], out["bgz"], out["daqk"], out["dkk"],
                      out["dgl"]), ("dq", "dk", "dg")),
        ]
    elif config.intra == "split":  # the split intra stage and its own backward (which reads the solve terms)
        stages[0] = split_intra
        stages[-1] = ("bwd_intra", lambda: jax.jit(lambda *a: intra_split.intra_bwd_split(*a, scale=scale, **kw)),
                      lambda: (q, k, v, beta, out["u"], out["w"], out["solve_terms"], out["dqg"], out["dkg"],
                               out["dw"], out["dv_new"], out["daqk"], out["d_decay"]),
                      ("dq", "dk", "dv", "dg", "dbeta"))
    return stages, out


def run_stages(b, t, h, d, dtype, config, iters, timed=True, interpret=False, only=None, profile=False):
    stages, out = stage_fns(b, t, h, d, dtype, config, interpret)
    rows = {}
    needed = {"intra"} if only is None else set(only) | {"intra"}
    for name, make, args, names in stages:
        if only is not None and name not in needed and not _feeds(name, only):
            continue
        try:
            fn = make()
            a = args()
            res = jax.block_until_ready(fn(*a))
        except Exception as e:  # noqa: BLE001 -- report which kernel fails and go on with the others
            rows[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            for nm in names:
                out.setdefault(nm, None)
            continue
        res = res if isinstance(res, tuple) else (res,)
        out.update(zip(names, res))
        if timed:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                times.append((time.perf_counter() - t0) * 1e3)
            rows[name] = round(statistics.median(times), 3)
            if profile:
                from kda_bench import profile_jax

                profile_jax(f"stage {name}", fn, a)
        else:
            rows[name] = "ok"
    return rows


_ORDER = ["intra", "recurrence", "bwd_states", "bwd_reverse", "bwd_state_grads", "bwd_intra", "bwd_intra_a",
          "bwd_intra_b", "bwd_state_solve", "bwd_pair_fused"]


def _feeds(name, only):
    """Whether stage `name` must run because a later requested stage reads its outputs (they run in order)."""
    last = max(_ORDER.index(x) for x in only)
    return _ORDER.index(name) < last


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1x8192x96")
    p.add_argument("--variants", default="64-4-4")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no_compile_check", action="store_true")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script (Pallas interpreter)")
    p.add_argument("--stages", default=None, help="comma list of stage names to time (default: all)")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time inside each stage (first variant)")
    p.add_argument("--check", action="store_true",
                   help="first check each variant against the token recurrence (outputs, state, gradients)")
    args = p.parse_args()
    b, t, h = (int(x) for x in args.shape.split("x"))
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for index, text in enumerate(args.variants.split(",")):
        config = KernelConfig.parse(text)
        if args.check:
            rows, ok = run_on_gpu(b=1, t=200, h=2, config=config, backend="interpret" if args.interpret else "gpu")
            print(json.dumps({"variant": text, "check_ok": ok, "check": rows}), flush=True)
        if not args.no_compile_check and index == 0:
            for dtype in (jnp.float32, jnp.bfloat16):
                rows = run_stages(1, 256, 2, 128, dtype, config, 0, timed=False, interpret=args.interpret)
                print(json.dumps({"variant": text, "compile_check": jnp.dtype(dtype).name, **rows}), flush=True)
        only = None if args.stages is None else args.stages.split(",")
        rows = run_stages(b, t, h, 128, jnp.bfloat16, config, args.iters, interpret=args.interpret, only=only,
                          profile=args.profile and index == 0)
        fwd = {k: v for k, v in rows.items() if not str(v).startswith("error")}
        fwd_ms = sum(fwd.get(k, 0) for k in ("intra", "recurrence"))
        recompute = ("intra",) if config.residuals == "inputs" else ()  # "intra": the forward's results are kept
        bwd = sum(fwd.get(k, 0) for k in recompute + ("bwd_states", "bwd_reverse", "bwd_state_grads", "bwd_intra",
                                                      "bwd_intra_a", "bwd_intra_b", "bwd_state_solve",
                                                      "bwd_pair_fused"))
        print(json.dumps({"variant": text, "shape": args.shape, "ms": rows, "fwd_ms": round(fwd_ms, 3),
                          "bwd_ms": round(bwd, 3)}), flush=True)


if __name__ == "__main__":
    main()
