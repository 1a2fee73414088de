"""Decode-sized kernels one at a time, each side by side with the XLA ops it replaces (same process, same inputs).

    python benchmarks/decode_kernels_bench.py                     # k3_gpu shapes, B = 64 rows, on a GPU
    python benchmarks/decode_kernels_bench.py --rows=64,16 --mix_variants=1-4,1-1,2-2 --route_warps=1,2,4,8

Ops (`--ops`):
- ``attn_res``: one AttnRes read + its RMSNorm: `pallas_kernels.attn_res.mix_norm` (variants block_rows-warps) vs
  the XLA composite `k3jax.layers.attn_res._composite`, for 1, 4 and all bank rows filled;
- ``route``: the routing plan: `pallas_kernels.moe.route_plan` (variants: warps) vs `jax.lax.top_k` +
  `k3jax.layers.moe.plan_from_experts` (argsort, inverse permutation, bincount).
Each timing is ``--chain`` dependent calls inside one jit (a `fori_loop` feeding each output into the next input,
so the calls cannot overlap and host dispatch is paid once), median of ``--iters``, divided by ``--chain``: the
per-call cost inside a decode step. Every kernel row also reports its max error against the XLA result.
A smoke run on CPU (``--backend=interpret``) checks the script, not the timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from timing import median_ms  # noqa: E402


def _emit(out: list, row: dict) -> None:
    """Keeps a measurement and prints it at once (a run cut short by a time limit still reports what it measured)."""
    out.append(row)
    print(json.dumps(row), flush=True)


def _chain(call, chain):
    """jit of `chain` dependent applications of `call(x) -> x` (same shape and dtype)."""
    return jax.jit(lambda x: jax.lax.fori_loop(0, chain, lambda i, h: call(h), x))


def bench_attn_res(rows, d, bank_rows, dtype, variants, backend, chain, iters):
    from k3jax.layers import attn_res
    from pallas_kernels.attn_res import mix_norm

    rng = np.random.default_rng(0)
    live = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    bank = jnp.asarray(rng.standard_normal((bank_rows, rows, d)), dtype)
    key_gain, query, out_gain = (jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32) for _ in range(3))
    out = []
    for filled in sorted({1, min(4, bank_rows), bank_rows}):
        def xla(x, filled=filled):
            return attn_res._composite(x, bank, key_gain, query, out_gain, filled, 1e-6, 1e-5)

        def kernel(x, filled=filled, r=None, w=4):
            return mix_norm(x, bank, filled, key_gain, query, out_gain, eps=1e-6, out_eps=1e-5, backend=backend,
                            block_rows=r, warps=w)

        want = np.asarray(jax.jit(xla)(live), np.float64)
        xla_us = median_ms(lambda f=_chain(lambda h: xla(h).astype(dtype), chain): f(live), iters) / chain * 1e3
        _emit(out, {"op": "attn_res", "rows": rows, "num_filled": filled, "impl": "xla", "us": xla_us})
        for text in variants:
            r, w = (int(v) for v in text.split("-"))
            if rows % r:
                continue
            row = {"op": "attn_res", "rows": rows, "num_filled": filled, "impl": f"mix_norm {r}-{w}"}
            try:
                got = np.asarray(jax.jit(lambda x: kernel(x, r=r, w=w))(live), np.float64)
                row["err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                f = _chain(lambda h: kernel(h, r=r, w=w).astype(dtype), chain)
                row["us"] = median_ms(lambda: f(live), iters) / chain * 1e3
                row["vs_xla"] = xla_us / row["us"]
            except Exception as e:  # noqa: BLE001 -- a variant that does not compile must not stop the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            _emit(out, row)
    return out


def bench_route(rows, experts, k, warps_list, backend, chain, iters):
    from k3jax.layers import moe
    from pallas_kernels.moe import route_plan

    rng = np.random.default_rng(1)
    scores = jnp.asarray(jax.nn.sigmoid(rng.standard_normal((rows, experts))), jnp.float32)

    def xla(s):
        _, idx = jax.lax.top_k(s, k)
        return moe.plan_from_experts(idx.astype(jnp.int32), experts)

    def feed(s, plan):  # a dependence on every output of the plan that XLA cannot fold away (none is negative)
        never = functools.reduce(jnp.logical_or, [f.reshape(-1)[0] < 0 for f in plan])
        return s + never.astype(s.dtype)

    want = jax.jit(xla)(scores)
    xla_us = median_ms(lambda f=_chain(lambda s: feed(s, xla(s)), chain): f(scores), iters) / chain * 1e3
    out = []
    _emit(out, {"op": "route", "rows": rows, "experts": experts, "k": k, "impl": "xla top_k + plan", "us": xla_us})
    for w in warps_list:
        row = {"op": "route", "rows": rows, "experts": experts, "k": k, "impl": f"route_plan warps {w}"}
        try:
            got = jax.jit(lambda s: route_plan(s, k, backend=backend, warps=w))(scores)
            row["mismatches"] = int(sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(got, want)))
            f = _chain(lambda s: feed(s, route_plan(s, k, backend=backend, warps=w)), chain)
            row["us"] = median_ms(lambda: f(scores), iters) / chain * 1e3
            row["vs_xla"] = xla_us / row["us"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _emit(out, row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--rows", default="64", help="decode batch sizes (tokens per step), comma-separated")
    ap.add_argument("--ops", default="attn_res,route")
    ap.add_argument("--mix_variants", default="1-4,1-2,1-1,2-4,4-4", help="mix_norm block_rows-warps")
    ap.add_argument("--route_warps", default="1,2,4,8")
    ap.add_argument("--chain", type=int, default=50)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="gpu", choices=("gpu", "interpret"))
    args = ap.parse_args(argv)
    import configs

    cfg = configs.get_config(args.config)
    bank_rows = cfg.num_attn_res_snapshots
    print(f"devices: {jax.devices()}  config {args.config}: D={cfg.hidden_size}, bank rows <= {bank_rows}, "
          f"E={cfg.num_experts}, k={cfg.num_experts_per_token}", flush=True)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        if "attn_res" in args.ops:
            rows_out += bench_attn_res(rows, cfg.hidden_size, bank_rows, cfg.jnp_dtype, args.mix_variants.split(","),
                                       args.backend, args.chain, args.iters)
        if "route" in args.ops:
            rows_out += bench_route(rows, cfg.num_experts, cfg.num_experts_per_token,
                                    [int(w) for w in args.route_warps.split(",")], args.backend, args.chain,
                                    args.iters)
    print("\n| op | rows | case | impl | µs per call | XLA / impl | check |")
    print("|---|---:|---|---|---:|---:|---|")
    for r in rows_out:
        case = f"{r['num_filled']} filled" if r["op"] == "attn_res" else f"E={r['experts']} k={r['k']}"
        check = (f"err {r['err']:.1e}" if "err" in r else f"{r['mismatches']} mismatches" if "mismatches" in r
                 else r.get("error", "(peer)"))
        us = f"{r['us']:.2f}" if "us" in r else "-"
        ratio = f"{r['vs_xla']:.2f}" if "vs_xla" in r else "-"
        print(f"| {r['op']} | {r['rows']} | {case} | {r['impl']} | {us} | {ratio} | {check} |")


if __name__ == "__main__":
    main()
