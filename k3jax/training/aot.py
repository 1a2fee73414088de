"""Compile-only proof of the training step for TPU topologies on a machine without TPUs (needs `libtpu`; not a
default dependency; the devices come from `sharding.aot.tpu_topology`).

`python -m k3jax.training.aot --config=tiny --topology=v5p:2x2x1 --mesh=2,1,1,2` (or `python train.py --compile_only
--topology=...`) lowers one sharded training step (train.py's own step: Muon, Quantile Balancing, MTP) for the
topology's devices via
`jax.experimental.topologies.get_topology_desc`, compiles it with the real TPU compiler, and prints one JSON line
with the mesh and the per-chip `memory_analysis()` figures. Nothing is allocated: model and optimizer are abstract
(`nnx.eval_shape`).

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
from k3jax.training.trainer import TrainOptions, build
from sharding.aot import libtpu_available, tpu_topology
from sharding.mesh import describe, make_mesh, parse_mesh


def compile_train_step(cfg, topology: str, mesh_sizes: dict[str, int], *, batch_size: int, seq_len: int,
                       options=None) -> dict:
    """Lowers and compiles one step of train.py's training (per-head Muon, Quantile Balancing, MTP, packed
    batches; `options`: a `k3jax.training.trainer.TrainOptions`) for `topology`; returns mesh and memory figures."""
    topo = tpu_topology(topology)
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
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    per_chip = {f: int(getattr(mem, f)) for f in fields if mem is not None and hasattr(mem, f)}
    n_params = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(trainable, nnx.Param)))
    total = per_chip.get("argument_size_in_bytes", 0) + per_chip.get("output_size_in_bytes", 0) \
        - per_chip.get("alias_size_in_bytes", 0) + per_chip.get("temp_size_in_bytes", 0)
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
        "per_chip_total_gib": round(total / 2**30, 2),
        "fallbacks": len(step.plan.fallbacks),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--mesh", default="2,1,1,2", help="data,expert,context,model (product = number of chips)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    args = p.parse_args(argv)
    if not libtpu_available():
        raise SystemExit("libtpu is not installed (pip install 'jax[tpu]==<jax version>'); nothing to compile with")
    cfg = configs.get_config(args.config, args.set)
    print(json.dumps(compile_train_step(cfg, args.topology, parse_mesh(args.mesh), batch_size=args.batch_size,
                                        seq_len=args.seq_len)))


if __name__ == "__main__":
    main()
