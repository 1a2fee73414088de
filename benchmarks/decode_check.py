"""On-GPU check of the fused KDA decode kernel against the same kernels through the Pallas interpreter.

    python -m benchmarks.decode_check            # on a GPU; k3_gpu decode shapes (B = 64 rows by default)

The unit tests run this kernel only through the interpreter (CPU CI); this runs it compiled by Triton on
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

import configs
from pallas_kernels.kda.decode_fused import kda_decode_fused

_TOL = 2e-2  # bf16 activations; the kernels are the same program on both sides


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check_kda_fused(b: int, h: int, kd: int, wm1: int, dtype, backend: str = "gpu") -> list[dict]:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--rows", default="64,16,1", help="decode batch sizes (tokens per step)")
    ap.add_argument("--backend", default="gpu", choices=("gpu", "interpret"))
    args = ap.parse_args(argv)
    cfg = configs.get_config(args.config)
    print(f"devices: {jax.devices()}", flush=True)
    bk = args.backend
    cases = [lambda r=rows: check_kda_fused(r, cfg.kda_num_heads, cfg.kda_head_dim,
                                            cfg.kda_short_conv_kernel_size - 1, jnp.bfloat16, bk)
             for rows in (int(r) for r in args.rows.split(","))]
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
