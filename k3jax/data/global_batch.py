"""Multi-host input: every process builds exactly the rows of one global batch that its addressable devices hold.

The global batch [B, T] is sharded on B over the data-parallel mesh axes (the 'batch' rule of `sharding/rules.py`:
('data', 'expert')): dp = data·expert shards of B/dp rows, shard j being rows [j·B/dp, (j+1)·B/dp), with j the
data-major index of a device's (data, expert) coordinates (how `NamedSharding` splits a dimension over a tuple of
axes). Devices that differ only in 'context' / 'model' hold the same shard, on one host or on several.

The rows of shard j are the batches of Grain shard j of dp (`pipeline.build_dataset(shard_index=j, shard_count=dp,
batch_size=B/dp)`): a function of the mesh alone. So processes holding the same shard read identical rows (as JAX
requires), a process holding several shards reads each one, and the global batch is the same whatever the number
of processes: a 2-process run and a 1-process run on the same mesh shape see the same data
(`tests/test_multiprocess.py`). With dp = 1 the rows are exactly `pipeline.make_dataset`'s (shard 0 of 1).

`GlobalBatchIterator` is a `grain.DatasetIterator` (its state: one Grain state per local shard). Its Orbax item
(`checkpoint_save_args` / `checkpoint_restore_args`, `ShardStateHandler`) stores one JSON file per data-parallel
shard (`shard_<j>-of-<dp>.json`, written by the lowest process holding shard j), not one per process: a run on any
number of processes with the same data-parallel size restores it (each process reads the shards it holds), so a
checkpoint of 2 processes resumes in 1 and the other way round. Each yielded batch is a dict of global `jax.Array`s
(`jax.make_array_from_callback` with the batch sharding).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding

from k3jax.data import pipeline
from sharding.rules import LOGICAL_AXIS_RULES
from sharding.shard import batch_spec


def batch_axes() -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over (the 'batch' rule), major to minor."""
    axes = LOGICAL_AXIS_RULES["batch"]
    return () if axes is None else (axes if isinstance(axes, tuple) else (axes,))


@dataclasses.dataclass(frozen=True)
class DataParallelLayout:
    """How one process's devices cut the global batch: `dp_size` shards of `rows_per_shard` rows; this process's
    addressable devices hold shards `local_shards` (ascending)."""

    dp_size: int
    rows_per_shard: int
    local_shards: tuple[int, ...]
    writer_shards: tuple[int, ...] = ()  # the local shards this process is the lowest holder of (it saves them)


def device_shards(mesh: Mesh) -> dict[jax.Device, int]:
    """The data-parallel shard index of every device of `mesh` (the data-major index of its batch-axes coords)."""
    axes = batch_axes()
    dims = [mesh.axis_names.index(a) for a in axes]
    sizes = [mesh.shape[a] for a in axes]
    return {mesh.devices[c]: int(np.ravel_multi_index([c[d] for d in dims], sizes)) if axes else 0
            for c in np.ndindex(mesh.devices.shape)}


def data_parallel_layout(mesh: Mesh, batch_size: int, process_index: int | None = None) -> DataParallelLayout:
    """The layout of a [batch_size, ...] batch on `mesh` for process `process_index` (default this process)."""
    axes = batch_axes()
    dp = math.prod(mesh.shape[a] for a in axes)
    if batch_size < 1 or batch_size % dp:
        raise ValueError(f"batch size {batch_size} must be a positive multiple of the data-parallel size "
                         f"{' x '.join(f'{a}={mesh.shape[a]}' for a in axes)} = {dp} (mesh {dict(mesh.shape)}): "
                         f"every data-parallel shard holds the same number of rows")
    process_index = jax.process_index() if process_index is None else process_index
    by_device = device_shards(mesh)
    shards = {j for d, j in by_device.items() if d.process_index == process_index}
    if not shards:
        raise ValueError(f"process {process_index} holds no device of mesh {dict(mesh.shape)}; every process "
                         f"must own devices of the training mesh (a mesh over a device subset leaves some out)")
    lowest = {}
    for d, j in by_device.items():
        lowest[j] = min(lowest.get(j, d.process_index), d.process_index)
    writers = tuple(sorted(j for j in shards if lowest[j] == process_index))
    return DataParallelLayout(dp, batch_size // dp, tuple(sorted(shards)), writers)


def assemble_global_batch(parts: Mapping[int, Mapping[str, np.ndarray]], mesh: Mesh,
                          layout: DataParallelLayout) -> dict[str, jax.Array]:
    """{shard index: {key: [rows_per_shard, ...] numpy}} (this process's shards) -> {key: global jax.Array} of
    [dp_size·rows_per_shard, ...] rows, sharded over the batch axes."""
    missing = [j for j in layout.local_shards if j not in parts]
    if missing:
        raise ValueError(f"rows of data-parallel shards {missing} are missing (this process holds "
                         f"{list(layout.local_shards)})")
    keys = parts[layout.local_shards[0]].keys()
    out = {}
    for key in keys:
        first = np.asarray(parts[layout.local_shards[0]][key])
        if first.shape[0] != layout.rows_per_shard:
            raise ValueError(f"{key}: a shard has {first.shape[0]} rows, expected {layout.rows_per_shard}")
        shape = (layout.dp_size * layout.rows_per_shard,) + first.shape[1:]
        sharding = NamedSharding(mesh, batch_spec(first.ndim))

        def rows(index, key=key):
            start = index[0].start or 0
            return np.asarray(parts[start // layout.rows_per_shard][key])[(slice(None),) + tuple(index[1:])]

        out[key] = jax.make_array_from_callback(shape, sharding, rows)
    return out


class GlobalBatchIterator(grain.DatasetIterator):
    """Global batches on a mesh from one Grain iterator per local data-parallel shard (see the module docstring).

    `make_shard(shard_index, shard_count, rows)` returns the iterator of one shard's [rows, ...] numpy batches.
    State: {'dp_size': dp, 'shards': {str(j): state of shard j}} over this process's shards.
    """

    def __init__(self, mesh: Mesh, batch_size: int,
                 make_shard: Callable[[int, int, int], grain.DatasetIterator], *, process_index: int | None = None):
        self.mesh = mesh
        self.layout = data_parallel_layout(mesh, batch_size, process_index)
        lay = self.layout
        super().__init__([make_shard(j, lay.dp_size, lay.rows_per_shard) for j in lay.local_shards])

    def __next__(self) -> dict[str, jax.Array]:
        self._assert_not_closed()
        parts = {j: next(it) for j, it in zip(self.layout.local_shards, self._parents)}
        return assemble_global_batch(parts, self.mesh, self.layout)

    def get_state(self) -> dict[str, Any]:
        return {"dp_size": self.layout.dp_size,
                "shards": {str(j): it.get_state() for j, it in zip(self.layout.local_shards, self._parents)}}

    def set_state(self, state: dict[str, Any]) -> None:
        want = sorted(str(j) for j in self.layout.local_shards)
        if state.get("dp_size") != self.layout.dp_size or sorted(state.get("shards", {})) != want:
            raise ValueError(f"data iterator state is for dp_size={state.get('dp_size')} shards "
                             f"{sorted(state.get('shards', {}))}, this process reads dp_size={self.layout.dp_size} "
                             f"shards {want}: restore on the mesh the checkpoint was saved with")
        for j, it in zip(self.layout.local_shards, self._parents):
            it.set_state(state["shards"][str(j)])


def make_global_dataset(data_dir: str, mesh: Mesh, *, batch_size: int, seq_len: int, seed: int = 0,
                        shuffle: bool = True, num_epochs: int | None = None, worker_count: int = 0,
                        vocab_size: int | None = None, process_index: int | None = None,
                        split: str = "all") -> GlobalBatchIterator:
    """Global packed batches (`pipeline`'s batch dict, as jax.Arrays of `batch_size` rows sharded over the batch
    axes of `mesh`) from a prepared `data_dir`; each process reads only its data-parallel shards. Arguments as
    `pipeline.make_dataset` (`worker_count` applies per local shard). Call `.close()` when done."""
    def make_shard(index: int, count: int, rows: int) -> grain.DatasetIterator:
        return pipeline.make_dataset(data_dir, batch_size=rows, seq_len=seq_len, seed=seed, shuffle=shuffle,
                                     num_epochs=num_epochs, worker_count=worker_count, shard_index=index,
                                     shard_count=count, vocab_size=vocab_size, split=split)

    return GlobalBatchIterator(mesh, batch_size, make_shard, process_index=process_index)


def _shard_file(directory: epath.Path, shard: int, dp_size: int) -> epath.Path:
    return directory / f"shard_{shard}-of-{dp_size}.json"


class ShardStateHandler(ocp.CheckpointHandler):
    """Orbax handler of a `GlobalBatchIterator`'s state: one JSON file per data-parallel shard (module docstring).
    Saved by the lowest process holding each shard; restored by every process from the files of its shards."""

    def save(self, directory: epath.Path, args: ShardStateSave) -> None:
        it = args.item
        state = it.get_state()
        for j in it.layout.writer_shards:
            _shard_file(directory, j, it.layout.dp_size).write_text(json.dumps(state["shards"][str(j)]))

    def restore(self, directory: epath.Path, args: ShardStateRestore) -> GlobalBatchIterator:
        it = args.item
        lay = it.layout
        missing = [j for j in lay.local_shards if not _shard_file(directory, j, lay.dp_size).exists()]
        if missing:
            found = sorted(p.name for p in directory.iterdir())
            raise ValueError(f"{directory} holds no data iterator state for data-parallel shards {missing} of "
                             f"dp_size={lay.dp_size} (found {found[:8]}): restore on a mesh with the data-parallel "
                             f"size (data x expert) the checkpoint was saved with; states written per process "
                             f"(process_*.json) come from the per-process iterator and cannot be restored here")
        it.set_state({"dp_size": lay.dp_size, "shards": {
            str(j): json.loads(_shard_file(directory, j, lay.dp_size).read_text()) for j in lay.local_shards}})
        return it

    def structure(self, directory: epath.Path) -> None:
        return None

    def metadata(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(ShardStateHandler, for_save=True)
@dataclasses.dataclass
class ShardStateSave(ocp.args.CheckpointArgs):
    item: GlobalBatchIterator


@ocp.args.register_with_handler(ShardStateHandler, for_restore=True)
@dataclasses.dataclass
class ShardStateRestore(ocp.args.CheckpointArgs):
    item: GlobalBatchIterator


def checkpoint_save_args(iterator: grain.DatasetIterator) -> ocp.args.CheckpointArgs:
    """Orbax args saving `iterator`: per data-parallel shard for a `GlobalBatchIterator`, else Grain's per-process
    item (`pipeline.checkpoint_save_args`)."""
    if isinstance(iterator, GlobalBatchIterator):
        return ShardStateSave(iterator)
    return pipeline.checkpoint_save_args(iterator)


def checkpoint_restore_args(iterator: grain.DatasetIterator) -> ocp.args.CheckpointArgs:
    """Orbax args restoring into `iterator` (a fresh one from the same arguments), in place; see
    `checkpoint_save_args`."""
    if isinstance(iterator, GlobalBatchIterator):
        return ShardStateRestore(iterator)
    return pipeline.checkpoint_restore_args(iterator)
