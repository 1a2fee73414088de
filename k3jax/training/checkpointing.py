"""Training checkpoints: an Orbax `CheckpointManager` (async, atomic, keeps the last N) in `<workdir>/checkpoints`.

Each step directory holds three items:
- `state`: model parameters, MTP layer, router biases and routing statistics, optimizer state (one pytree; arrays
  restored straight into the shardings of the running job's state, so a resume re-shards for any mesh);
- `data`: the Grain iterator's state (`global_batch.checkpoint_save_args`: one JSON file per data-parallel shard for
  the trainer's `GlobalBatchIterator`, so 1- and N-process runs restore each other's; Grain's one file per process
  for a plain iterator), so a resumed run sees exactly the batches it would have seen;
- `meta`: step, config and the options that must match to resume (JSON).

Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.config import ModelConfig, RuntimeConfig
from k3jax.data import global_batch

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The workdir's checkpoint was written for a different config or training setup."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, *, max_to_keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=("state", "data", "meta"))


def save(manager: ocp.CheckpointManager, step: int, state: nnx.State, data_iterator, meta: dict) -> bool:
    """Starts saving (asynchronously); returns whether a save was started."""
    return manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state.to_pure_dict()),
        data=global_batch.checkpoint_save_args(data_iterator),
        meta=ocp.args.JsonSave(meta)))


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore(manager: ocp.CheckpointManager, step: int, state: nnx.State, data_iterator) -> nnx.State:
    """Restores step `step`: returns arrays shaped and sharded like `state` (which it does not modify) and
    sets `data_iterator` (a fresh iterator built with the same arguments) to the saved position, in place."""
    target = jax.tree.map(_abstract, state.to_pure_dict())
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=global_batch.checkpoint_restore_args(data_iterator)))
    restored = jax.tree.map(lambda x: x, state)  # a copy of the structure to fill
    nnx.replace_by_pure_dict(restored, out["state"])
    return restored


def check_meta(meta: dict, cfg: ModelConfig, expected: dict[str, Any], path: str) -> None:
    """Raises CheckpointMismatchError listing every architecture field, state-shaping runtime knob
    (`RuntimeConfig.state_fields`) or option that differs from the checkpoint's. Other runtime knobs (kernel
    choices, compute dtype, remat, ...) may change between runs of one checkpoint; their changes are logged."""
    diffs, changed = [], []
    saved_cfg = meta.get("config", {})
    saved_runtime = saved_cfg.get("runtime", saved_cfg)  # older metadata holds the knobs at top level
    now = [(f"config.{f.name}", saved_cfg, f.name, getattr(cfg, f.name), True)
           for f in dataclasses.fields(cfg) if f.name != "runtime"]
    state = set(RuntimeConfig.state_fields())
    now += [(f"config.runtime.{f.name}", saved_runtime, f.name, getattr(cfg.runtime, f.name), f.name in state)
            for f in dataclasses.fields(cfg.runtime)]
    for label, saved, name, value, must_match in now:
        if name in saved and _norm(saved[name]) != _norm(value):
            (diffs if must_match else changed).append(f"{label}: checkpoint {saved[name]!r}, now {value!r}")
    for key, value in expected.items():
        if key in meta.get("options", {}) and _norm(meta["options"][key]) != _norm(value):
            diffs.append(f"{key}: checkpoint {meta['options'][key]!r}, now {value!r}")
    if diffs:
        raise CheckpointMismatchError(
            f"cannot resume from {path}: it was written with a different setup:\n  " + "\n  ".join(diffs)
            + "\nuse a fresh --workdir, or --noresume to start over in this one (old checkpoints are then replaced "
              "as new ones are written)")
    if changed:
        log.info("resuming %s with changed runtime knobs:\n  %s", path, "\n  ".join(changed))


def _abstract(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _norm(v):
    return json.loads(json.dumps(v))  # tuples -> lists, as the JSON metadata holds them
