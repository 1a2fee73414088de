"""Compile-only check of the TPU grouped matmul kernels for a TPU topology on a machine without TPUs (needs libtpu).

    python -m benchmarks.gmm_tpu_aot [--topology=v5p:2x2x1] [--m=2048 --k=1024 --n=1536 --groups=8]

Lowers forward + both gradients (`jax.vjp` of `gmm(backend='tpu')`), a standalone `tgmm`, `gmm_glu` forward + its
recomputing backward (SiTU) and `gmm_mxfp4` for one chip of the topology with bf16 inputs, compiles them with the
real Mosaic/XLA TPU compiler and prints one JSON line with the device kind and per-chip memory figures. Nothing
runs.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import gmm, gmm_glu, gmm_mxfp4, tgmm
from sharding.aot import tpu_topology


def compile_gmm(topology: str, m: int, k: int, n: int, groups: int) -> dict:
    device = tpu_topology(topology).devices[0]
    single = jax.sharding.SingleDeviceSharding(device)
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=single)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16, sharding=single)
    d_out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16, sharding=single)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=single)
    packed = jax.ShapeDtypeStruct((groups, n, k // 2), jnp.uint8, sharding=single)  # HF layout [g, n, k/2]
    scales = jax.ShapeDtypeStruct((groups, n, k // 32), jnp.uint8, sharding=single)

    def fwd_bwd(x, w, gs, dy):
        out, pull = jax.vjp(lambda a, b: gmm(a, b, gs, backend="tpu"), x, w)
        return (out, *pull(dy))

    def glu_fwd_bwd(x, wg, wu, gs, dy):
        out, pull = jax.vjp(lambda a, b, c: gmm_glu(a, b, c, gs, beta1=4.0, beta2=25.0, backend="tpu"), x, wg, wu)
        return (out, *pull(dy))

    result = {"topology": topology, "device_kind": device.device_kind, "shape": [m, k, n, groups]}
    for name, fn, args in (("gmm_fwd_bwd", fwd_bwd, (lhs, rhs, sizes, d_out)),
                           ("tgmm", lambda x, dy, gs: tgmm(x, dy, gs, backend="tpu"), (lhs, d_out, sizes)),
                           ("glu_fwd_bwd", glu_fwd_bwd, (lhs, rhs, rhs, sizes, d_out)),
                           ("mxfp4", lambda x, p, s, gs: gmm_mxfp4(x, p, s, gs, backend="tpu"),
                            (lhs, packed, scales, sizes))):
        lowered = jax.jit(fn).lower(*args)
        text = lowered.as_text()
        compiled = lowered.compile()
        mem = compiled.memory_analysis()
        result[name] = {"mosaic_calls": text.count("tpu_custom_call"),
                        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1}
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--groups", type=int, default=8)
    args = p.parse_args(argv)
    print(json.dumps(compile_gmm(args.topology, args.m, args.k, args.n, args.groups)))


if __name__ == "__main__":
    main()
