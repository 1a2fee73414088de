"""Training checkpoints: an Orbax `CheckpointManager` (async, atomic, keeps the last N) in `<workdir>/checkpoints`.

Each step directory holds three items:
- `state`: model parameters, MTP layer, router biases and routing statistics, optimizer state (one pytree; arrays
  restored straight into the shardings of the running job's state, so a resume re-shards for any mesh);
- `data`: the Grain iterator's state (`global_batch.checkpoint_save_args`: one JSON file per data-parallel shard for
  the trainer's `GlobalBatchIterator`, so 1- and N-process runs restore each other's; Grain's one file per process
  for a plain iterator), so a resumed run sees exactly the batches it would have seen;
- `meta`: step, config and the options that must match to resume (JSON), and the state's fingerprint.

Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint as the latest one. Orbax/tensorstore keep no checksums (a flipped byte in a state file restores
silently as a wrong value), so `save` records a fingerprint of every state array in the metadata and `restore`
recomputes it on the restored arrays: a checkpoint whose bytes changed on disk raises `CheckpointCorruptError`, and
the trainer falls back to the newest older checkpoint that verifies (`readable_steps`, `set_aside`).

The fingerprint (`fingerprint`) is two 32-bit sums per array of every element's bits mixed with its position,
computed on the devices under `jit` where the arrays live (each device reads its shard once; the sums are
all-reduced), so no array is copied to the host for it. Its cost is one read of the state in device memory per save
and per restore: at K3 scale (f32 masters plus optimizer state, some 12 TB over a pod) a few tens of milliseconds
per chip at HBM bandwidth, and one compile of the fingerprint program per run. A single changed bit changes a sum
with certainty; other damage goes unnoticed with probability about 2^-64. The data iterator's state (small JSON
per process) is not fingerprinted: a garbled file fails to parse on restore, which also makes the trainer fall back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from k3jax.config import ModelConfig, RuntimeConfig
from k3jax.data import global_batch
from k3jax.training.optimizer import lr_schedule

log = logging.getLogger(__name__)


FINGERPRINT = "mix32x2-v1"  # the algorithm of `fingerprint`, recorded with the sums
SET_ASIDE_SUFFIX = ".corrupt"  # a skipped step directory `<step>` is renamed `<step>.corrupt` (Orbax ignores it)


class CheckpointMismatchError(ValueError):
    """The workdir's checkpoint was written for a different config or training setup."""


class CheckpointCorruptError(ValueError):
    """A checkpoint that cannot be read, or whose restored state does not match the fingerprint saved with it."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, *, max_to_keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=("state", "data", "meta"))


def save(manager: ocp.CheckpointManager, step: int, state: nnx.State, data_iterator, meta: dict) -> bool:
    """Starts saving (asynchronously; the state's fingerprint is computed first, into the metadata); returns
    whether a save was started."""
    tree = state.to_pure_dict()
    meta = {**meta, "fingerprint": {"algorithm": FINGERPRINT, "state": fingerprint(tree)}}
    return manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree),
        data=global_batch.checkpoint_save_args(data_iterator),
        meta=ocp.args.JsonSave(meta)))


def step_path(manager: ocp.CheckpointManager, step: int) -> str:
    return os.path.join(str(manager.directory), str(step))


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    """Step `step`'s metadata; raises CheckpointCorruptError naming the file when it is missing or not a JSON
    object."""
    path = os.path.join(step_path(manager, step), "meta", "metadata")
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - Orbax raises several types for an unreadable item; all mean the same
        raise CheckpointCorruptError(f"{path}: unreadable checkpoint metadata ({_brief(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{path}: checkpoint metadata is not a JSON object")
    return meta


def readable_steps(manager: ocp.CheckpointManager, log_fn: Callable[[str], None]) -> list[tuple[int, dict]]:
    """(step, metadata) of every step whose metadata reads, newest first; each unreadable one is logged (which and
    why) and left out."""
    out = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            out.append((step, read_meta(manager, step)))
        except CheckpointCorruptError as e:
            log_fn(f"skipping checkpoint step {step}: {e}")
    return out


def restore(manager: ocp.CheckpointManager, step: int, state: nnx.State, data_iterator,
            saved_fingerprint: dict | None = None) -> nnx.State:
    """Restores step `step`: returns arrays shaped and sharded like `state` (which it does not modify) and
    sets `data_iterator` (a fresh iterator built with the same arguments; None: the data state is not read) to the
    saved position, in place.
    Raises CheckpointCorruptError when the step cannot be read or its arrays do not match `saved_fingerprint`
    (the metadata's `fingerprint`; None: older checkpoints without one are restored unverified)."""
    path = step_path(manager, step)
    target = jax.tree.map(_abstract, state.to_pure_dict())
    try:
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
            items["data"] = global_batch.checkpoint_restore_args(data_iterator)
        out = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001 - tensorstore, Orbax and Grain raise many types for damaged files
        raise CheckpointCorruptError(f"{path}: cannot be restored ({_brief(e)})") from None
    if saved_fingerprint is not None:
        verify(out["state"], saved_fingerprint, path)
    restored = jax.tree.map(lambda x: x, state)  # a copy of the structure to fill
    nnx.replace_by_pure_dict(restored, out["state"])
    return restored


def verify(tree, saved: dict, path: str) -> None:
    """Raises CheckpointCorruptError naming the arrays of `tree` whose fingerprint differs from `saved`."""
    if saved.get("algorithm") != FINGERPRINT:
        raise CheckpointCorruptError(f"{path}: unknown fingerprint algorithm {saved.get('algorithm')!r}")
    now, want = fingerprint(tree), saved.get("state", {})
    bad = sorted(k for k in set(now) | set(want) if now.get(k) != want.get(k))
    if bad:
        raise CheckpointCorruptError(f"{path}: {len(bad)} state array(s) differ from the fingerprint saved with "
                                     f"them (damaged on disk?): {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")


def set_aside(manager: ocp.CheckpointManager, steps: list[int], log_fn: Callable[[str], None]) -> None:
    """Renames step directories that failed to verify to `<step>.corrupt` (kept for inspection; Orbax no longer
    lists them, so the resumed run can write those steps again) and reloads the manager's step list."""
    if jax.process_index() == 0:
        for step in steps:
            src = step_path(manager, step)
            dst = src + SET_ASIDE_SUFFIX
            if os.path.exists(dst):
                dst = f"{dst}-{os.getpid()}"
            os.rename(src, dst)
            log_fn(f"moved the unverified checkpoint {src} aside to {dst} (delete it when no longer needed)")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("k3jax_checkpoint_set_aside")
    manager.reload()


def fingerprint(tree) -> dict[str, str]:
    """{array path: 16 hex digits}: two 32-bit sums over every element of each array (see the module docstring)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = _fingerprint_jit(tuple(x for _, x in leaves))
    return {jax.tree_util.keystr(p): "%08x%08x" % tuple(int(v) for v in np.asarray(_local(s)))
            for (p, _), s in zip(leaves, sums)}


@jax.jit
def _fingerprint_jit(arrays):
    return tuple(_fingerprint_leaf(x) for x in arrays)


def _fingerprint_leaf(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    w = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8-byte items: a trailing axis of 2 words
    pos = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):  # the row-major position of every word, without reshaping a sharded array
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= w.shape[axis]
    return jnp.stack([jnp.sum(_mix(w ^ (pos * jnp.uint32(0x9E3779B1)), 0x85EBCA6B, 0xC2B2AE35), dtype=jnp.uint32),
                      jnp.sum(_mix(w + pos * jnp.uint32(0x7FEB352D) + jnp.uint32(0x68E31DA4), 0x846CA68B,
                                   0x27D4EB2F), dtype=jnp.uint32)])


def _mix(v, a: int, b: int):
    """A bijection of uint32 (multiply by odd constants, xor-shift): one changed input bit changes the output."""
    v = v * jnp.uint32(a)
    v = v ^ (v >> 15)
    v = v * jnp.uint32(b)
    return v ^ (v >> 13)


def _local(x):
    """A replicated result's value on this process (multi-process results are not fully addressable)."""
    return x.addressable_data(0) if hasattr(x, "addressable_data") else x


def _brief(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


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


def check_data_parallel(saved: dict, dp: int, path: str, mesh_shape: dict) -> None:
    """The data iterator state is one Grain state per data-parallel shard: a resume needs the same shard count."""
    if saved.get("data_parallel_size") != dp:
        raise CheckpointMismatchError(
            f"cannot resume from {path}: its data iterator was saved for data-parallel size "
            f"{saved.get('data_parallel_size', 'unknown (an older per-process checkpoint)')}, this run's mesh "
            f"{mesh_shape} has {dp} (data x expert); resume with a mesh of the same data x expert size (any "
            f"number of processes), or use a fresh --workdir")


def check_resume(saved: dict, cfg: ModelConfig, resume_keys: dict[str, Any], dp: int, mesh_shape: dict, path: str,
                 own_data: bool) -> None:
    """`check_meta`, and with the trainer's own data (one saved iterator state per data-parallel shard) the same
    data-parallel size."""
    check_meta(saved, cfg, resume_keys, path)
    if own_data:
        check_data_parallel(saved, dp, path, mesh_shape)


def schedule_change(saved: dict, opts, step: int) -> str | None:
    """What a resume from `step` changes in the learning-rate schedule when --steps or --learning_rate differ from
    the checkpoint's (the cosine is recomputed, so the rate jumps); None when nothing changed. `opts`: the run's
    `TrainOptions` (steps, learning_rate, warmup_fraction, schedule())."""
    before = saved.get("schedule", {})
    now = {"steps": opts.steps, "learning_rate": opts.learning_rate}
    changed = [f"--{k} {before[k]} -> {v}" for k, v in now.items() if k in before and before[k] != v]
    if not changed:
        return None
    old = lr_schedule(before.get("learning_rate", opts.learning_rate), before.get("steps", opts.steps),
                      warmup_fraction=opts.warmup_fraction)
    return (f"{', '.join(changed)}: the learning-rate schedule is recomputed; step {step + 1} runs at lr "
            f"{float(opts.schedule()(step)):.2e} (the checkpoint's schedule: {float(old(step)):.2e})")


def none_verify(workdir: str) -> str:
    return (f"no checkpoint in {checkpoint_dir(workdir)} reads and verifies (each is listed above); "
            f"use --noresume to start over in it, or a fresh --workdir")


def restore_newest_verified(manager, candidates: list[tuple[int, dict]], modules, data, workdir: str,
                            log_fn: Callable[[str], None], *, check: Callable[[dict, str], None],
                            read_only: bool = False) -> int:
    """Restores the newest of `candidates` ((step, metadata), newest first; the first already checked by the
    caller, the others with `check(metadata, path)`) whose state reads and matches its saved fingerprint into
    `modules`; each one skipped is logged with the reason and, once a step verifies, moved aside (so the resumed run
    can save those steps again) unless `read_only` (an export: the workdir is left as it is). Returns the restored
    step; raises CheckpointCorruptError when none verifies."""
    skipped = []
    for k, (step, saved) in enumerate(candidates):
        path = step_path(manager, step)
        if k:
            check(saved, path)
        try:
            state = restore(manager, step, nnx.state(modules), data, saved.get("fingerprint"))
        except CheckpointCorruptError as e:
            log_fn(f"skipping checkpoint step {step}: {e}")
            skipped.append(step)
            continue
        nnx.update(modules, state)
        unreadable = [s for s in manager.all_steps() if s > step and s not in skipped]
        if (skipped or unreadable) and not read_only:
            set_aside(manager, sorted(skipped + unreadable), log_fn)
        verb = "restored" if read_only else "resumed"
        log_fn(f"{verb} from {path} (step {step})" + ("" if "fingerprint" in saved else
                                                     "; an older checkpoint without a fingerprint: not verified"))
        return step
    raise CheckpointCorruptError(none_verify(workdir))
