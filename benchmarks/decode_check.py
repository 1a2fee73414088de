"""On-GPU check of the opt-in decode kernels against the same kernels through the Pallas interpreter.

    python -m pallas_kernels.decode_check            # on a GPU; k3_gpu decode shapes (B = 64 rows by default)

The unit tests run these kernels only through the interpreter (CPU CI); this runs each one compiled by Triton on
the GPU and through the interpreter (plain XLA ops, also on the GPU) on the same random inputs, at the `k3_gpu`
decode shapes, and prints one JSON line per case with the max error / max |reference|. It exits 1 when a case
exceeds its tolerance: a Triton lowering that differs from the interpreter's semantics is a bug in our kernel
(e.g. an out-of-bounds or overlapping access that the interpreter forgives).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

_TOL = 2e-2  # bf16 activations; the kernels are the same program on both sides


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check_mix_norm(rows: int, d: int, bank: int, dtype, backend: str = "gpu") -> list[dict]:
    from pallas_kernels.attn_res.mix_norm import mix_norm

    rng = np.random.default_rng(0)
    live = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    bank_nmd = jnp.asarray(rng.standard_normal((bank, rows, d)), dtype)
    gains = [jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32) for _ in range(3)]
    out = []
    for filled in sorted({0, 1, bank // 2, bank}):
        got, want = (mix_norm(live, bank_nmd, filled, *gains, eps=1e-6, out_eps=1e-5, backend=b)
                     for b in (backend, "interpret"))
        out.append({"kernel": "attn_res.mix_norm", "rows": rows, "d": d, "num_filled": filled,
                    "err": _err(got, want)})
    return out


def check_route_plan(n: int, e: int, k: int, backend: str = "gpu") -> list[dict]:
    from pallas_kernels.moe.route_plan import route_plan

    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
    got, want = (route_plan(scores, k, backend=b) for b in (backend, "interpret"))
    row = {"kernel": "moe.route_plan", "n": n, "e": e, "k": k}
    for name in got._fields:
        row[name + "_mismatches"] = int(np.sum(np.asarray(getattr(got, name)) != np.asarray(getattr(want, name))))
    top = np.argsort(-np.asarray(scores), axis=1, kind="stable")[:, :k]
    row["experts_vs_argsort_mismatches"] = int(np.sum(np.sort(top, 1) != np.sort(np.asarray(got.experts_nk), 1)))
    row["err"] = float(sum(v for key, v in row.items() if key.endswith("_mismatches")))
    return [row]


def check_kda_fused(b: int, h: int, kd: int, wm1: int, dtype, backend: str = "gpu") -> list[dict]:
    from pallas_kernels.kda.decode_fused import kda_decode_fused

    rng = np.random.default_rng(2)
    p = h * kd
    args = (tuple(jnp.asarray(rng.standard_normal((b, p)), dtype) for _ in "qkv"),
            jnp.asarray(rng.standard_normal((b, wm1, 3, p)), dtype),
            tuple(jnp.asarray(rng.standard_normal((wm1 + 1, p)) / 2, jnp.float32) for _ in "qkv"),
            jnp.asarray(rng.standard_normal((b, h, kd)), dtype),
            jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32),
            jnp.asarray(rng.standard_normal((h, kd)) * 0.5 - 3, jnp.float32),
            jnp.asarray(rng.standard_normal((b, h)), dtype),
            jnp.asarray([0] + [1] * (b - 1), jnp.int32))
    state = rng.standard_normal((b, h, kd, kd)).astype(np.float32)
    epilogue = dict(out_gate_bp=jnp.asarray(rng.standard_normal((b, p)), dtype),
                    out_norm_v=jnp.asarray(rng.uniform(0.5, 1.5, kd), jnp.float32), out_eps=1e-5)
    rows = []
    for form, extra in (("prologue", {}), ("prologue_output", epilogue)):  # kda_decode_fusion's two kernel forms
        res = {}
        for which in (backend, "interpret"):
            res[which] = kda_decode_fused(*args, jnp.asarray(state), scale=kd ** -0.5, lower_bound=-5.0,
                                          backend=which, **extra)
        (o, s), (o_ref, s_ref) = res[backend], res["interpret"]
        rows.append({"kernel": "kda.decode_fused", "form": form, "b": b, "h": h, "k": kd, "err_o": _err(o, o_ref),
                     "err_state": _err(s, s_ref), "err": max(_err(o, o_ref), _err(s, s_ref))})
    return rows


def check_split_k(m: int, k: int, n: int, dtype, backend: str = "gpu") -> list[dict]:
    from pallas_kernels.dense.decode_matmul import decode_matmul

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    got = decode_matmul(x, w, backend=backend)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    return [{"kernel": "dense.decode_matmul", "m": m, "k": k, "n": n, "err": _err(got, want)}]


def check_planned_experts(n: int, cfg_name: str, backend: str = "gpu") -> list[dict]:
    import configs
    from k3jax.layers import moe
    from pallas_kernels.gmm import DECODE_GROUP_WALK

    cfg = configs.get_config(cfg_name)
    e, lat, mi = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(4)
    dt = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((n, cfg.hidden_size)), dt)
    router = jnp.asarray(rng.standard_normal((cfg.hidden_size, e)) / 40, jnp.float32)
    bias = jnp.asarray(0.01 * rng.standard_normal(e), jnp.float32)
    z = jnp.asarray(rng.standard_normal((n, lat)), dt)
    w1, w3 = (jnp.asarray(rng.standard_normal((e, lat, mi)) / np.sqrt(lat), dt) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((e, mi, lat)) / np.sqrt(mi), dt)
    weights, experts, _ = moe.route(x, router, bias, cfg)
    want = moe.experts_dense(z, weights, experts, w1, w3, w2, cfg)  # every expert on every token: no gmm kernel
    p_weights, plan = moe.route_planned(x, router, bias, cfg, backend)
    rows = []
    for walk in (True, False):
        tiling = DECODE_GROUP_WALK if walk else None
        got = jax.jit(lambda z, pw, plan, *w: moe.experts_planned(z, pw, plan, *w, cfg, decode_tiling=tiling))(
            z, p_weights, plan, w1, w3, w2)  # weights as arguments: closed over, XLA would constant-fold them
        rows.append({"kernel": "moe.experts_planned", "n": n, "group_walk": walk,
                     "experts_mismatches": int(np.sum(np.asarray(plan.experts_nk) != np.asarray(experts))),
                     "err": _err(got, want)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--rows", default="64,16,1", help="decode batch sizes (tokens per step)")
    ap.add_argument("--backend", default="gpu", choices=("gpu", "interpret"))
    args = ap.parse_args(argv)
    import configs

    cfg = configs.get_config(args.config)
    print(f"devices: {jax.devices()}", flush=True)
    bank, bk = cfg.num_attn_res_snapshots, args.backend
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        cases += [lambda r=rows: check_mix_norm(r, cfg.hidden_size, bank, jnp.bfloat16, bk),
                  lambda r=rows: check_route_plan(r, cfg.num_experts, cfg.num_experts_per_token, bk),
                  lambda r=rows: check_kda_fused(r, cfg.kda_num_heads, cfg.kda_head_dim,
                                                 cfg.kda_short_conv_kernel_size - 1, jnp.bfloat16, bk),
                  lambda r=rows: check_split_k(r, cfg.hidden_size, 2 * cfg.hidden_size, jnp.bfloat16, bk),
                  lambda r=rows: check_planned_experts(r, args.config, bk)]
    failed = 0
    for case in cases:
        try:
            rows_out = case()
        except Exception as e:  # noqa: BLE001 -- report and go on to the next kernel
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:400]}"}), flush=True)
            failed += 1
            continue
        for row in rows_out:
            row["ok"] = bool(row["err"] <= _TOL)
            failed += not row["ok"]
            print(json.dumps(row), flush=True)
    print(f"{'FAILED' if failed else 'ok'}: {failed} case(s) over tolerance or erroring", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
