"""Compile-only check of the Mosaic TPU chunkwise KDA kernels for a TPU topology on a machine without TPUs (needs
libtpu); nothing runs:

    python -m benchmarks.kda_tpu_aot [--topology=v5p:2x2x1] [--t=1000 --h=2 --d=128] [--vmem]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from k3jax.ops.kda import chunk_kda
from pallas_kernels.kda.tpu import chunk_kda_bwd_tpu, chunk_kda_fwd_tpu
from sharding.aot import tpu_topology

F32 = jnp.float32


def compile_for_topology(topology: str = "v5p:2x2x1", t: int = 1000, h: int = 2, d: int = 128,
                         vmem: bool = False) -> dict:
    """Compile-only check (no TPU needed, libtpu needed): lowers forward + gradients of
    ``chunk_kda(backend="tpu")`` (the TPU backward kernels) for one chip of ``topology`` and compiles them with the
    real XLA/Mosaic TPU compiler: bf16 K = V = d, f32 with traced segment ids, bf16 with cu_seqlens, and f32 at
    K = V = 64 (the transposed layout). Returns the device kind and per case the Mosaic call count and XLA temp
    bytes; ``vmem`` also bisects the smallest scoped-VMEM limit under which the bf16 forward kernel, and the
    backward (forward saving states + reverse kernel), compile: their VMEM footprints."""
    device = tpu_topology(topology).devices[0]
    single = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=single)

    def inputs(dtype, width, n_states=1, segmented=False):
        args = (sds((1, t, h, width), dtype), sds((1, t, h, width), dtype), sds((1, t, h, width), dtype),
                sds((1, t, h, width), F32), sds((1, t, h), F32), sds((n_states, h, width, width), F32))
        return args + ((sds((1, t), jnp.int32),) if segmented else ())

    def fwd_bwd(cu_seqlens=None):
        def run(*a):
            seg = a[6] if len(a) > 6 else None

            def core(*x):
                o, s = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu_seqlens,
                                 segment_ids=seg, backend="tpu")
                return jnp.sum(o.astype(F32)) + jnp.sum(s)

            return jax.value_and_grad(core, argnums=tuple(range(6)))(*a[:6])
        return run

    cu = (0, t // 3, t // 3, t)
    cases = {
        "bf16_fwd_bwd": (fwd_bwd(), inputs(jnp.bfloat16, d)),
        "f32_segment_ids_fwd_bwd": (fwd_bwd(), inputs(F32, d, segmented=True)),
        "bf16_cu_seqlens_fwd_bwd": (fwd_bwd(cu), inputs(jnp.bfloat16, d, n_states=len(cu) - 1)),
        "f32_k64_fwd_bwd": (fwd_bwd(), inputs(F32, 64)),
    }
    result = {"topology": topology, "device_kind": device.device_kind, "shape": [1, t, h, d]}
    for name, (fn, args) in cases.items():
        lowered = jax.jit(fn).lower(*args)
        mem = lowered.compile().memory_analysis()
        result[name] = {"mosaic_calls": lowered.as_text().count("tpu_custom_call"),
                        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1}
    if vmem:
        args = inputs(jnp.bfloat16, d)
        cotangents = (sds((1, t, h, d), jnp.bfloat16), sds((1, h, d, d), F32))
        kernels = {"fwd": (lambda limit: lambda *a: chunk_kda_fwd_tpu(*a, scale=d ** -0.5, vmem_limit_bytes=limit),
                           args),
                   "bwd": (lambda limit: lambda *a: chunk_kda_bwd_tpu(*a, scale=d ** -0.5, vmem_limit_bytes=limit),
                           args + cotangents)}
        for name, (make, kernel_args) in kernels.items():
            def compiles(limit, make=make, kernel_args=kernel_args):
                try:
                    jax.jit(make(limit)).lower(*kernel_args).compile()
                    return True
                except Exception:  # noqa: BLE001 - the compiler's scoped-VMEM OOM is the signal
                    return False

            low, high = 16 * 1024, 64 * 2**20
            if compiles(high):
                while high - low > 16 * 1024:
                    mid = (low + high) // 2 // 1024 * 1024
                    low, high = (low, mid) if compiles(mid) else (mid, high)
                result[f"bf16_{name}_min_scoped_vmem_kib"] = high // 1024
    return result


def main(argv=None) -> None:
    """Prints ``compile_for_topology``'s JSON line."""
    p = argparse.ArgumentParser(description=compile_for_topology.__doc__.split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--t", type=int, default=1000)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--vmem", action="store_true", help="also bisect the kernel's scoped-VMEM footprint")
    args = p.parse_args(argv)
    print(json.dumps(compile_for_topology(args.topology, args.t, args.h, args.d, args.vmem)), flush=True)


if __name__ == "__main__":
    main()
