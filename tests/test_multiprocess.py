"""Two local JAX processes x 4 CPU devices (as two hosts of a pod): the global batch each mesh gets, built by the
processes from their own data-parallel shards, equals the one-process 8-device build; processes sharing a shard
hold identical rows; training through the trainer gives the one-process losses; a 2-process checkpoint resumes in
2 processes and in 1; a missing process or a mismatched resume ends with a clear error instead of a hang."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from k3jax.data import pipeline
from k3jax.data.global_batch import make_global_dataset
from k3jax.training.checkpointing import CheckpointMismatchError
from k3jax.training.trainer import train
from sharding.mesh import make_mesh
from tests import multiprocess_worker as mp
from tests.test_global_batch import write_corpus

# The losses of 2 processes (gloo all-reduces) against 1 process (in-process all-reduces): the same program on the
# same mesh shape; only the summation order of cross-device reductions may differ.
LOSS_RTOL = 1e-5


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


# ------------------------------------------------------------------------------------------------ training


def _train_in_process(data_dir, **kw) -> list[float]:
    """The one-process run (this process's 8 devices; a smaller mesh takes the first ones)."""
    return train(mp.train_config(), mp.train_options(data=data_dir, **kw), log_fn=lambda m: None)


def _train_in_processes(data_dir, tmp_path, name, **kw) -> tuple[list[list[float]], list[str]]:
    """`mp.train_task` in 2 processes x 4 devices: (every process's losses, process 0's log). Runs of one test share
    a compilation cache (the resume compiles nothing new)."""
    args = ["--out", str(tmp_path / name), "--data_dir", data_dir, "--compile_cache", str(tmp_path / "xla_cache")]
    for key, value in kw.items():
        args += [f"--{key}", str(value)]
    results = mp.launch("train", args, timeout=1200)
    assert [r.error for r in results] == [None, None], mp.describe(results)
    out = [json.loads((tmp_path / name / f"process_{i}.json").read_text()) for i in range(2)]
    assert out[0]["log"] and not out[1]["log"]  # only process 0 logs
    return [o["losses"] for o in out], out[0]["log"]


@pytest.mark.slow
def test_two_processes_train_like_one_process_on_a_2_2_1_1_mesh(data_dir, tmp_path):
    """2 processes x 4 CPU devices (the mesh takes 2 devices of each: data = one per process) train the 5-layer
    `tiny` (Muon, MTP, Quantile Balancing) with the losses of one process holding the same mesh."""
    (loss0, loss1), log = _train_in_processes(data_dir, tmp_path, "mp", mesh="2,2,1,1", steps=3)
    want = _train_in_process(data_dir, mesh="2,2,1,1", steps=3)
    print("2 processes:", loss0, "\n1 process:  ", want)
    assert loss0 == loss1 and len(loss0) == 3
    np.testing.assert_allclose(loss0, want, rtol=LOSS_RTOL)
    assert any(line.startswith("mesh: data=2 expert=2 context=1 model=1 (4 cpu devices)") and "2 process(es)" in line
               for line in log), log


@pytest.mark.slow
def test_two_processes_train_like_one_process_on_a_1_2_1_2_mesh(data_dir, tmp_path):
    (loss0, loss1), _ = _train_in_processes(data_dir, tmp_path, "mp", mesh="1,2,1,2", steps=3)
    want = _train_in_process(data_dir, mesh="1,2,1,2", steps=3)
    print("2 processes:", loss0, "\n1 process:  ", want)
    assert loss0 == loss1
    np.testing.assert_allclose(loss0, want, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_in_two_processes_and_in_one(data_dir, tmp_path, compile_cache):
    """Steps 1-2 in 2 processes (checkpoint at 2: parameters, optimizer, one Grain state per data-parallel shard),
    then steps 3-4 resumed in 2 processes and, from a copy, in 1 process (Orbax restores into that process's
    sharding): both continue the losses of one straight 4-step run. A mesh with another data-parallel size is
    refused with a clear error before anything is built."""
    mesh = "2,2,1,1"
    want = _train_in_process(data_dir, mesh=mesh, steps=4)  # the straight run and the 1-process resume share the cache
    work = tmp_path / "work"
    (first, _), _ = _train_in_processes(data_dir, tmp_path, "first", mesh=mesh, steps=4, halt_at_step=2,
                                        workdir=work)
    data_files = sorted(f for f in os.listdir(work / "checkpoints" / "2" / "data") if f.endswith(".json"))
    assert data_files == [f"shard_{j}-of-4.json" for j in range(4)], data_files
    shutil.copytree(work, tmp_path / "copy")
    (second, other), log = _train_in_processes(data_dir, tmp_path, "second", mesh=mesh, steps=4, workdir=work)
    assert any("resumed from" in line and "(step 2)" in line for line in log), log
    one = _train_in_process(data_dir, mesh=mesh, steps=4, workdir=str(tmp_path / "copy"))
    print("straight:", want, "\n2+2 processes:", first + second, "\n2+1 processes:", first + one)
    assert second == other and len(first) == 2 and len(second) == len(one) == 2
    np.testing.assert_allclose(first + second, want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(first + one, want, rtol=LOSS_RTOL)
    with pytest.raises(CheckpointMismatchError, match="data-parallel size 4, this run's mesh .* has 2"):
        _train_in_process(data_dir, mesh="1,2,1,2", steps=6, workdir=str(work))


def test_train_py_without_all_processes_ends_with_a_clear_error(tmp_path):
    """`train.py` joins through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; with the second
    process missing it stops after --distributed_timeout seconds naming the problem instead of hanging."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_"))}
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{mp.free_port()}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "train.py", "--config=tiny", "--steps=1", "--distributed_timeout=5"],
                          cwd=mp.REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "not all 2 processes joined the coordinator" in proc.stderr, proc.stderr[-3000:]
