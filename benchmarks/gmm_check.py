"""Checks of the grouped matmul kernels outside the unit tests.

    python -m benchmarks.gmm_check          # any host: lower every GPU kernel for CUDA (no GPU needed)

``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas -> Triton lowering of: `gmm`
forward + both gradients, `gmm_glu` forward + its recomputing backward (situ and silu), and `gmm_mxfp4` (bf16 and
f32 lhs, bf16 and f32 out), each at the default tilings (K3-like shapes) and at one small tiling, and prints one
JSON line per case with the Triton kernels found in the lowered program; exits 1 if a case fails to lower or
lacks one of its kernels. It does not run the Triton compiler (registers, shared memory), which only happens on a GPU;
`benchmarks/gmm_bench.py --check` runs the kernels there against float64 references.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.gmm import gmm, gmm_glu, gmm_mxfp4


def _cases(m, k, n, g, tiling):
    sd = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    sizes = sd((g,), jnp.int32)

    def gmm_fwd_bwd(x, w, gs, dy):
        out, pull = jax.vjp(lambda a, b: gmm(a, b, gs, backend="gpu", tiling=tiling), x, w)
        return (out, *pull(dy))

    def glu_fwd_bwd(activation):
        def run(x, wg, wu, gs, dy):
            out, pull = jax.vjp(lambda a, b, c: gmm_glu(a, b, c, gs, activation=activation, beta1=4.0, beta2=25.0,
                                                        backend="gpu", tiling=tiling), x, wg, wu)
            return (out, *pull(dy))
        return run

    def mxfp4(out_dtype):
        def run(x, p, s, gs):
            return gmm_mxfp4(x, p, s, gs, preferred_element_type=out_dtype, backend="gpu",
                             tiling=None if tiling is None else tiling[:1] + (max(tiling[1], 32),) + tiling[2:])
        return run

    x, w, dy = sd((m, k), bf16), sd((g, k, n), bf16), sd((m, n), bf16)
    yield "gmm_fwd_bwd", gmm_fwd_bwd, (x, w, sizes, dy), {"k3_gmm", "k3_tgmm"}
    for act in ("situ", "silu"):  # forward: the fused kernel; backward: recompute + d_lhs (gmm) + tgmm
        yield f"glu_{act}_fwd_bwd", glu_fwd_bwd(act), (x, w, w, sizes, dy), {"k3_gmm", "k3_gmm_glu", "k3_tgmm"}
    for lhs_dtype, out_dtype in ((bf16, bf16), (bf16, jnp.float32), (jnp.float32, jnp.float32)):
        name = f"mxfp4_{jnp.dtype(lhs_dtype).name}_to_{jnp.dtype(out_dtype).name}"
        yield name, mxfp4(out_dtype), (sd((m, k), lhs_dtype), sd((g, n, k // 2), jnp.uint8),
                                       sd((g, n, k // 32), jnp.uint8), sizes), {"k3_gmm_mxfp4"}


def lower_for_cuda(shapes=((1000, 3584, 3072, 8, None), (100, 96, 48, 4, (16, 32, 16)))):
    """Lowers every case for CUDA; returns (rows, ok)."""
    rows, ok = [], True
    for m, k, n, g, tiling in shapes:
        for name, fn, args, want_kernels in _cases(m, k, n, g, tiling):
            row = {"case": name, "shape": [m, k, n, g], "tiling": tiling}
            try:
                row["triton_calls"], row["kernels"] = triton_kernels(fn, *args, name_pattern=r"k3_[a-z0-9_]+")
                row["ok"] = set(row["kernels"]) == want_kernels
            except Exception as e:  # report every case, then fail
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
            ok &= row["ok"]
            rows.append(row)
    return rows, ok


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows, ok = lower_for_cuda()
    for row in rows:
        print(json.dumps(row), flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
