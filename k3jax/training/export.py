"""A training checkpoint's model as a k3jax checkpoint: `python train.py --workdir=RUN --export_to=OUT`.

The newest step of `<workdir>/checkpoints` whose state reads and matches its fingerprint (or `step`) is restored
like a resume (the same --config / --set; optimizer, MTP and balancing as the checkpoint recorded them) and its
model, MTP layer and router biases are written with `k3jax.save_checkpoint`: what `serve.py --checkpoint`,
`--init_from` and `python -m k3jax.convert --to_hf` read. Parameters keep the training dtype (f32 masters).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.params import RouterBias
from k3jax.loading import save_checkpoint
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer
from k3jax.training import checkpointing
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option, run_config

STRUCTURE_KEYS = ("optimizer", "mtp", "quantile_balancing")  # options that shape the saved state


def export_checkpoint(cfg: ModelConfig, opts: TrainOptions, out: str, *, step: int | None = None,
                      overwrite: bool = False, log_fn: Callable[[str], None] = print) -> str:
    """Writes the model of `opts.workdir`'s newest verified checkpoint (or of `step`) to `out`; returns `out`.
    Raises CheckpointCorruptError / CheckpointMismatchError (config differences listed) before anything is
    written, FileExistsError for an existing `out` without `overwrite`."""
    if not os.path.isdir(checkpointing.checkpoint_dir(opts.workdir)):
        raise checkpointing.CheckpointCorruptError(f"{opts.workdir} holds no training checkpoints (no "
                                                   f"{checkpointing.checkpoint_dir(opts.workdir)})")
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"output {os.path.abspath(out)} already exists (pass --overwrite to replace it)")
    manager = checkpointing.make_manager(opts.workdir)
    try:
        candidates = [(s, m) for s, m in checkpointing.readable_steps(manager, log_fn) if step in (None, s)]
        if not candidates:
            raise checkpointing.CheckpointCorruptError(
                f"no checkpoint step {step} in {checkpointing.checkpoint_dir(opts.workdir)} (steps: "
                f"{sorted(manager.all_steps())})" if step is not None else checkpointing.none_verify(opts.workdir))
        saved_opts = candidates[0][1].get("options", {})
        opts = dataclasses.replace(opts, **{k: saved_opts[k] for k in STRUCTURE_KEYS if k in saved_opts})
        mesh = make_mesh_from_option(opts.mesh, cfg)
        cfg = run_config(cfg)
        check = lambda saved, path: checkpointing.check_meta(saved, cfg, {}, path)  # noqa: E731
        check(candidates[0][1], checkpointing.step_path(manager, candidates[0][0]))
        trainable, optimizer, _, _ = build(cfg, opts, mesh)
        checkpointing.restore_newest_verified(manager, candidates, (trainable, optimizer), None, opts.workdir,
                                              log_fn, check=check, read_only=True)
    finally:
        manager.close()
    weights = nnx.Any(nnx.Param, RouterBias)  # not the routing statistics the training forward records
    plain = cfg.replace(record_routing_stats=False)
    model = nnx.eval_shape(lambda: K3Model(plain, rngs=nnx.Rngs(0)))
    nnx.update(model, nnx.state(trainable.model, weights))
    mtp = None
    if trainable.mtp is not None:
        mtp = nnx.eval_shape(lambda: MTPLayer(plain, rngs=nnx.Rngs(0)))
        nnx.update(mtp, nnx.state(trainable.mtp, weights))
    return save_checkpoint(model, out, overwrite=overwrite, mtp=mtp)
