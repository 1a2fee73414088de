"""Global batches on a mesh (one process, 8 CPU devices): the data-parallel shard of every device matches the batch
sharding, shard j's rows are Grain shard j of dp, dp = 1 gives exactly `make_dataset`'s batches, the iterator state
round-trips, and a batch the data-parallel size does not divide fails clearly. (Several processes:
tests/test_multiprocess.py.)"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from k3jax.data import pipeline, prepare
from k3jax.data.global_batch import (
    assemble_global_batch,
    data_parallel_layout,
    device_shards,
    make_global_dataset,
)
from sharding.mesh import make_mesh
from sharding.shard import batch_spec

SEQ_LEN = 16


def write_corpus(root, num_docs: int = 120) -> str:
    """A prepared byte-token directory of `num_docs` short distinct documents (2 ArrayRecord shards)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i}: " + "xyz"[i % 3] * (i % 23)}) + "\n"
                                             for i in range(num_docs)))
    prepare.prepare(str(root / "docs.jsonl"), str(root / "out"), "byte", num_shards=2)
    return str(root / "out")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("global_batch"))


def _numpy(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize("sizes", [(8, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 1, 8), (2, 4, 1, 1)])
def test_device_shard_index_matches_the_batch_sharding(sizes):
    mesh = make_mesh(*sizes)
    rows = 3
    dp = sizes[0] * sizes[1]
    shape = (dp * rows, SEQ_LEN)
    index_map = jax.sharding.NamedSharding(mesh, batch_spec(2)).devices_indices_map(shape)
    got = device_shards(mesh)
    assert {d: (index_map[d][0].start or 0) // rows for d in index_map} == got
    layout = data_parallel_layout(mesh, dp * rows)
    assert layout.local_shards == tuple(range(dp)) and layout.rows_per_shard == rows


def test_batch_not_divisible_by_data_parallel_size_is_a_clear_error():
    with pytest.raises(ValueError, match=r"batch size 6 must be a positive multiple of the data-parallel size "
                                         r"data=2 x expert=2 = 4"):
        data_parallel_layout(make_mesh(2, 2, 1, 2), 6)


def test_data_parallel_size_one_gives_make_datasets_batches(data_dir):
    mesh = make_mesh(1, 1, 1, 8)
    it = make_global_dataset(data_dir, mesh, batch_size=4, seq_len=SEQ_LEN, seed=3)
    ref = pipeline.make_dataset(data_dir, batch_size=4, seq_len=SEQ_LEN, seed=3)
    for _ in range(3):
        got, want = next(it), next(ref)
        assert got["input_ids"].sharding.spec == batch_spec(2)
        for k in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    it.close()
    ref.close()


def test_shard_j_holds_grain_shard_j_of_the_data_parallel_size(data_dir):
    mesh = make_mesh(2, 2, 1, 2)
    it = make_global_dataset(data_dir, mesh, batch_size=8, seq_len=SEQ_LEN, seed=1)
    refs = [pipeline.make_dataset(data_dir, batch_size=2, seq_len=SEQ_LEN, seed=1, shard_index=j, shard_count=4)
            for j in range(4)]
    for _ in range(2):
        got = _numpy(next(it))
        wants = [next(r) for r in refs]
        for k in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(got[k], np.concatenate([w[k] for w in wants]))
    it.close()


def test_state_round_trip_continues_with_the_same_global_batches(data_dir):
    mesh = make_mesh(4, 1, 1, 2)
    it = make_global_dataset(data_dir, mesh, batch_size=8, seq_len=SEQ_LEN)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [_numpy(next(it)) for _ in range(2)]
    fresh = make_global_dataset(data_dir, mesh, batch_size=8, seq_len=SEQ_LEN)
    fresh.set_state(state)
    for w in want:
        got = _numpy(next(fresh))
        for k in pipeline.BATCH_KEYS:
            np.testing.assert_array_equal(got[k], w[k])
    other = make_global_dataset(data_dir, make_mesh(8, 1, 1, 1), batch_size=8, seq_len=SEQ_LEN)
    with pytest.raises(ValueError, match="restore on the mesh the checkpoint was saved with"):
        other.set_state(state)
    for x in (it, fresh, other):
        x.close()


def test_assemble_names_missing_shards():
    mesh = make_mesh(2, 1, 1, 4)
    layout = data_parallel_layout(mesh, 4)
    with pytest.raises(ValueError, match=r"shards \[1\] are missing"):
        assemble_global_batch({0: {"x": np.zeros((2, 3))}}, mesh, layout)


def test_remote_data_dirs_read_metadata_through_epath(data_dir, monkeypatch):
    """A gs:// directory's metadata is read with etils.epath (here mapped onto the local prepared directory)."""
    seen = []

    def fake_path(text):
        seen.append(text)
        return pathlib.Path(str(text).replace("gs://bucket/prepared", data_dir))

    monkeypatch.setattr(pipeline.epath, "Path", fake_path)
    assert pipeline.read_metadata("gs://bucket/prepared") == prepare.read_metadata(data_dir)
    assert seen == ["gs://bucket/prepared"]
    with pytest.raises(FileNotFoundError, match="gs://bucket/missing is not a prepared data directory"):
        pipeline.read_metadata("gs://bucket/missing")
