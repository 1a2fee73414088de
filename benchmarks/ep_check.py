"""Expert parallelism on real devices: the routed-experts layer of `sharding/expert_parallel.py` against the
single-device all-experts layer (`k3jax.layers.moe.experts_dense`), outputs and gradients.

    python -m benchmarks.ep_check --config=k3_gpu --tokens=8192 --mesh=1,2,1,1            # two GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.ep_check --config=tiny --tokens=64 --mesh=1,2,1,1             # the CPU smoke run

Dropless mode exchanges rows with the native `jax.lax.ragged_all_to_all` on GPU and TPU ('auto'; CPU has no such op
and runs the emulated exchange, which the unit tests already cover), capacity mode with a plain all-to-all. Each
routing is checked in both modes, in float32 (tight) and the config's compute dtype:

- random: every token's k distinct experts drawn uniformly, except one expert that receives no row;
- one_rank: every row to experts on expert rank 0 (the receive buffer's worst case).

Prints one JSON line per case (max error of the output and of each gradient, relative to the reference's largest
magnitude; the rank-load statistics) and a last summary line; exits 1 when any case is outside its tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import configs
from k3jax.layers.moe import experts_dense
from sharding import expert_parallel as ep
from sharding.mesh import make_mesh, parse_mesh
from sharding.shard import mesh_context

# Relative tolerances (error / largest reference magnitude): f32 sums in another order; bf16 rounds each operand.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def routing(kind: str, n: int, num_experts: int, k: int, ranks: int, seed: int = 0) -> np.ndarray:
    """int32 [n, k] distinct experts per token for routing `kind` (module docstring)."""
    r = np.random.RandomState(seed)
    if kind == "random":
        idle = num_experts - 1  # receives nothing
        return np.stack([r.permutation(idle)[:k] for _ in range(n)]).astype(np.int32)
    if kind == "one_rank":
        per_rank = num_experts // ranks
        if per_rank < k:
            raise ValueError(f"one_rank routing needs k={k} experts on one rank, which holds {per_rank}")
        return np.stack([r.permutation(per_rank)[:k] for _ in range(n)]).astype(np.int32)
    raise ValueError(f"unknown routing {kind!r}")


def check_case(cfg, mesh, kind: str, mode: str, dtype: str, tokens: int, seed: int = 0) -> dict:
    """Max relative errors of the EP layer's output and gradients against `experts_dense` for one case."""
    e, k = cfg.num_experts, cfg.num_experts_per_token
    lat, m = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    rows = mesh.shape["data"] * mesh.shape["expert"]
    b = rows
    t = tokens // b
    r = np.random.RandomState(seed + 1)
    dt = jnp.dtype(dtype)
    z = jnp.asarray(r.randn(b, t, lat), dt)
    weights = jnp.asarray(r.rand(b, t, k) + 0.1, jnp.float32)
    experts = jnp.asarray(routing(kind, b * t, e, k, mesh.shape["expert"], seed).reshape(b, t, k))
    w1 = jnp.asarray(r.randn(e, lat, m) / math.sqrt(lat), dt)
    w3 = jnp.asarray(r.randn(e, lat, m) / math.sqrt(lat), dt)
    w2 = jnp.asarray(r.randn(e, m, lat) / math.sqrt(m), dt)
    cot = jnp.asarray(r.randn(b, t, lat), jnp.float32)
    cfg = cfg.with_overrides([f"dtype={dtype}"])
    factor = float(mesh.shape["expert"]) if mode == "capacity" else None  # large enough to drop nothing

    def ep_loss(z, weights, w1, w3, w2):
        u, stats = ep.routed_experts(z, weights, experts, w1, w3, w2, cfg, mode=mode, capacity_factor=factor,
                                     mesh=mesh)
        return jnp.sum(u.astype(jnp.float32) * cot), (u, stats)

    def dense_loss(z, weights, w1, w3, w2):
        u = experts_dense(z.reshape(b * t, lat), weights.reshape(b * t, k), experts.reshape(b * t, k), w1, w3, w2,
                          cfg)
        return jnp.sum(u.reshape(b, t, lat).astype(jnp.float32) * cot), u.reshape(b, t, lat)

    args = (z, weights, w1, w3, w2)
    with mesh_context(mesh):
        grads, (u, stats) = jax.jit(jax.grad(ep_loss, argnums=tuple(range(5)), has_aux=True))(*args)
    one = jax.devices()[0]
    ref_grads, ref_u = jax.jit(jax.grad(dense_loss, argnums=tuple(range(5)), has_aux=True))(
        *jax.device_put(args, one))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    errors = {"output": rel(u, ref_u)}
    errors.update({f"grad_{name}": rel(g, rg) for name, g, rg in zip(("z", "weights", "w1", "w3", "w2"), grads,
                                                                     ref_grads)})
    stats = np.asarray(stats)
    loads = np.bincount(np.asarray(experts).reshape(-1) // (e // mesh.shape["expert"]),
                        minlength=mesh.shape["expert"])
    stats_ok = bool(np.allclose(stats, [loads.max(), loads.mean(), 0.0, b * t * k]))
    ok = stats_ok and max(errors.values()) <= TOLERANCE[dtype]
    return {"routing": kind, "mode": mode, "dtype": dtype, "tokens": b * t, "errors": errors,
            "tolerance": TOLERANCE[dtype], "rank_rows": stats[:2].tolist(), "dropped": float(stats[2]),
            "stats_match_numpy": stats_ok, "ok": ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="k3_gpu")
    p.add_argument("--mesh", default="1,2,1,1", help="data,expert,context,model over the first devices")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--modes", default="dropless,capacity")
    p.add_argument("--routings", default="random,one_rank")
    args = p.parse_args(argv)
    cfg = configs.get_config(args.config)
    sizes = parse_mesh(args.mesh)
    n = math.prod(sizes.values())
    if n > jax.device_count():
        raise SystemExit(f"--mesh={args.mesh} needs {n} devices; {jax.device_count()} present")
    if sizes["expert"] < 2:
        raise SystemExit(f"--mesh={args.mesh} has no expert parallelism (expert size {sizes['expert']})")
    mesh = make_mesh(**sizes, devices=jax.devices()[:n])
    native = jax.devices()[0].platform != "cpu"
    print(f"ep_check: {cfg.name} (E={cfg.num_experts}, k={cfg.num_experts_per_token}) on {n} "
          f"{jax.devices()[0].device_kind} devices, mesh {sizes}; dropless exchange: "
          f"{'native ragged_all_to_all' if native else 'emulated (CPU)'}", flush=True)
    results = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for kind in args.routings.split(","):
                res = check_case(cfg, mesh, kind, mode, dtype, args.tokens)
                results.append(res)
                print(json.dumps(res), flush=True)
    failed = [f"{r['routing']}/{r['mode']}/{r['dtype']}" for r in results if not r["ok"]]
    print(json.dumps({"cases": len(results), "failed": failed, "native_exchange": native}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
