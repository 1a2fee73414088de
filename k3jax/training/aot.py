"""Compile-only proof of the training step for TPU slices or NVIDIA GPUs on a machine without them (needs `libtpu`
or jax's CUDA plugin; not default dependencies; the devices come from `sharding.aot.aot_topology`).

`python -m k3jax.training.aot --config=tiny --topology=v5p:2x2x1 --mesh=2,1,1,2` (or `python train.py --compile_only
--topology=...`; `--topology=h200` for one H200) lowers one sharded training step (train.py's own step: Muon,
Quantile Balancing, MTP) for the topology's devices via
`jax.experimental.topologies.get_topology_desc`, compiles it with the real TPU or GPU compiler, and prints one JSON
line with the mesh and the per-chip `memory_analysis()` figures. Nothing is allocated: model and optimizer are
abstract (`nnx.eval_shape`). A GPU compile without a GPU leaves cuDNN's workspaces at 0 bytes (cuDNN sizes them
on the device); the packed attention backward's, the one that matters (72 GiB at one 131,072-token row with 64
document slots), is added from its formula (`cudnn_workspace_bytes`).

With the compiled step's cost analysis it also prints a roofline estimate of the step time per chip
(`roofline`): a model from the compiler's FLOP and HBM byte counts, the collective bytes in the HLO and the chip's
published peaks, not a measurement.

Install libtpu matching jax (`pip install "jax[tpu]==<jax version>"` pins it) only where this is wanted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

import configs
from k3jax.ops.attention import cudnn_packed_bwd_workspace_bytes
from k3jax.param_count import count_params
from k3jax.training.memory import compiled_memory, device_memory_bytes
from k3jax.training.metrics import model_flops_per_token
from k3jax.training.trainer import TrainOptions, build
from sharding.aot import aot_topology, missing_compiler, quiet_compile_only_process
from sharding.mesh import describe, make_mesh, parse_mesh

# Published per-chip peaks: dense bf16 FLOP/s, HBM bytes/s, ICI bytes/s (all links, one direction).
CHIP_PEAKS = {
    "v5p": {"flops": 459e12, "hbm": 2.765e12, "ici": 600e9},
    "v5e": {"flops": 197e12, "hbm": 819e9, "ici": 200e9},
    "v6e": {"flops": 918e12, "hbm": 1.64e12, "ici": 448e9},
    "v4": {"flops": 275e12, "hbm": 1.2e12, "ici": 300e9},
}
_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"(bf16|f32|f16|s32|u32|s8|u8|pred|f64|s64)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo_text: str) -> int:
    """Bytes produced by the collectives of a compiled HLO module, each counted once (a loop body's once too)."""
    total = 0
    for out_shape, _ in _COLLECTIVE.findall(hlo_text):
        for dtype, dims in _SHAPE.findall(out_shape):
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


_CUDNN_BWD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmaxBackward", operand_layout_constraints=\{'
                        r'\w+\[([0-9,]+)\].*?f32\[(\d+),(\d+),(\d+)\]')


def cudnn_workspace_bytes(hlo_text: str) -> int:
    """The largest workspace the compiled program's cuDNN packed attention backward calls will ask for on the
    device, for a program compiled without one (their workspace operands are u8[0] there): one call runs at a
    time, so the largest is what the device program adds. 0 for a program compiled on the device."""
    best = 0
    for line in hlo_text.splitlines():
        if "u8[0]" not in line.split("custom-call(")[0]:
            continue
        m = _CUDNN_BWD.search(line)
        if m:
            head_dim = int(m.group(1).split(",")[-1])
            rows, heads, seq_len = (int(m.group(i)) for i in (2, 3, 4))
            best = max(best, cudnn_packed_bwd_workspace_bytes(rows, 1, heads, seq_len, head_dim))
    return best


def roofline(cost: dict, model_flops_per_chip: float, generation: str) -> dict | None:
    """Step-time model per chip: max(compute, HBM) + collectives, where compute uses the larger of the compiler's
    FLOPs and the model's training FLOPs x 4/3 (remat recomputes the forward; the compiler counts a scanned
    layer's body once), HBM the compiler's bytes accessed, collectives their bytes over the chip's ICI bandwidth
    (no overlap assumed). Returns seconds and the predicted MFU, or None for an unknown chip or a compile without
    counts (XLA gives none for a GPU compiled without one)."""
    peaks = CHIP_PEAKS.get(generation)
    if peaks is None or not cost.get("bytes_accessed"):  # an unknown chip, or no counts (a GPU compile without one)
        return None
    compute_s = max(cost.get("flops", 0.0), model_flops_per_chip * 4 / 3) / peaks["flops"]
    hbm_s = cost.get("bytes_accessed", 0.0) / peaks["hbm"]
    ici_s = cost.get("collective_bytes", 0) / peaks["ici"]
    step_s = max(compute_s, hbm_s) + ici_s
    return {"compute_s": round(compute_s, 4), "hbm_s": round(hbm_s, 4), "collectives_s": round(ici_s, 4),
            "step_s": round(step_s, 4), "predicted_mfu": round(model_flops_per_chip / (step_s * peaks["flops"]), 4),
            "note": "a roofline model from compiler counts and published peaks, not a measurement"}


def compile_train_step(cfg, topology: str, mesh_sizes: dict[str, int], *, batch_size: int, seq_len: int,
                       options=None) -> dict:
    """Lowers and compiles one step of train.py's training (per-head Muon, Quantile Balancing, MTP, packed
    batches; `options`: a `k3jax.training.trainer.TrainOptions`) for `topology`; returns mesh and memory figures."""
    topo = aot_topology(topology)
    mesh = make_mesh(**mesh_sizes, devices=topo.devices)
    opts = dataclasses.replace(options or TrainOptions(), batch_size=batch_size, seq_len=seq_len)
    trainable, optimizer, step, _ = build(cfg, opts, mesh, abstract=True)
    state = nnx.state((trainable, optimizer))
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"input_ids": tokens, "targets": tokens, "segment_ids": tokens,
             "loss_mask": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
    lowered = step.jitted.lower(state, batch)
    kernels = sorted(set(re.findall(r"(kda_[a-z_]+|k3_t?gmm[a-z_0-9]*)", lowered.as_text())))
    compiled = lowered.compile()
    raw_cost = compiled.cost_analysis()
    raw_cost = (raw_cost[0] if isinstance(raw_cost, (list, tuple)) else raw_cost) or {}
    hlo_text = compiled.as_text()
    cost = {"flops": float(raw_cost.get("flops", 0.0)), "bytes_accessed": float(raw_cost.get("bytes accessed", 0.0)),
            "collective_bytes": collective_bytes(hlo_text)}
    active = count_params(cfg)["active_params"]
    chips = len(topo.devices)
    model_flops = model_flops_per_token(cfg, seq_len, active_params=active, mtp=opts.mtp) * batch_size * seq_len
    per_chip, total = compiled_memory(compiled)
    workspace = cudnn_workspace_bytes(hlo_text) if topo.devices[0].platform == "gpu" else 0
    total += workspace
    chip_bytes, chip_source = device_memory_bytes(topo.devices[0])
    n_params = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(trainable, nnx.Param)))
    return {
        "config": cfg.name,
        "topology": topology,
        "device_kind": topo.devices[0].device_kind,
        "num_chips": len(topo.devices),
        "mesh": describe(mesh),
        "params": n_params,
        "optimizer": opts.optimizer,
        "mtp": opts.mtp,
        "remat": cfg.runtime.remat,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "pallas_kernels": kernels,  # the Pallas (Mosaic) kernels in the compiled step, by name
        "per_chip_bytes": per_chip,
        "per_chip_total_gib": round(total / 2**30, 2),  # the compiler's figure + cuDNN's workspace (GPU)
        "cudnn_workspace_gib": round(workspace / 2**30, 2),
        "chip_gib": round(chip_bytes / 2**30, 2),
        "chip_gib_source": chip_source,
        "fits": total <= chip_bytes,
        "fallbacks": len(step.plan.fallbacks),
        "tokens_per_chip": batch_size * seq_len // chips,
        "cost_per_chip": cost,
        "model_flops_per_chip": model_flops / chips,
        "roofline": roofline(cost, model_flops / chips, topology.partition(":")[0]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--topology", default="v5p:2x2x1", help="TPU slice (v5p:2x2x1) or GPUs of one host (h200, h100:8)")
    p.add_argument("--mesh", default="2,1,1,2", help="data,expert,context,model (product = number of chips)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    args = p.parse_args(argv)
    quiet_compile_only_process(args.topology)
    need = missing_compiler(args.topology)
    if need:
        raise SystemExit(f"compiling for {args.topology} needs {need}")
    cfg = configs.get_config(args.config, args.set)
    print(json.dumps(compile_train_step(cfg, args.topology, parse_mesh(args.mesh), batch_size=args.batch_size,
                                        seq_len=args.seq_len)))


if __name__ == "__main__":
    main()
