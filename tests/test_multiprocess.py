"""Two local JAX processes x 4 CPU devices (as two hosts of a pod): the global batch each mesh gets, built by the
processes from their own data-parallel shards, equals the one-process 8-device build; processes sharing a shard
hold identical rows; a missing process ends with a clear error instead of a hang."""

from __future__ import annotations

import numpy as np
import pytest

from k3jax.data import pipeline
from k3jax.data.global_batch import make_global_dataset
from sharding.mesh import make_mesh
from tests import multiprocess_worker as mp
from tests.test_global_batch import write_corpus


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("multiprocess"))


def _reference(data_dir) -> dict[str, np.ndarray]:
    """The one-process build of every DATA_MESHES batch (same mesh shapes over this process's 8 devices)."""
    out = {}
    for name, sizes, order in mp.DATA_MESHES:
        mesh = make_mesh(*sizes, devices=make_mesh(data=8).devices.flat[:len(order)])
        it = make_global_dataset(data_dir, mesh, batch_size=mp.DATA_BATCH, seq_len=mp.DATA_SEQ, seed=5)
        for step in range(mp.DATA_STEPS):
            for key, arr in next(it).items():
                out[f"{name}|{step}|{key}"] = np.asarray(arr)
        it.close()
    return out


def test_two_processes_build_the_one_process_global_batch(data_dir, tmp_path):
    results = mp.launch("data", ["--out", str(tmp_path), "--data_dir", data_dir])
    assert [r.error for r in results] == [None, None], mp.describe(results)
    ref = _reference(data_dir)
    assert len(ref) == len(mp.DATA_MESHES) * mp.DATA_STEPS * len(pipeline.BATCH_KEYS)
    got = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2)]
    for prefix, want in ref.items():
        for proc in got:
            np.testing.assert_array_equal(proc[f"{prefix}|gathered"], want, err_msg=prefix)
            local = [(k, v) for k, v in proc.items() if k.startswith(f"{prefix}|local|")]
            assert local, f"{prefix}: a process holds no shard"
            for key, rows in local:  # every device's rows, also where two processes hold the same shard
                start = int(key.rsplit("|", 1)[1])
                np.testing.assert_array_equal(rows, want[start:start + len(rows)], err_msg=key)
    assert (ref["1,1,1,8 shared|0|loss_mask"] > 0).any()


def test_a_missing_process_ends_with_a_clear_error(tmp_path):
    results = mp.launch("data", ["--out", str(tmp_path)], process_ids=[0], init_timeout=5, timeout=90)
    (only,) = results
    assert only.returncode is not None and only.returncode != 0, mp.describe(results)  # ended, not killed
    assert only.error == (f"process 0 did not join: not all 2 processes joined the coordinator within 5 s "
                          f"(exit {only.returncode})")
