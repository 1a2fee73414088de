"""Training checkpoints are verified on restore: a fingerprint of the state saved in the metadata catches flipped
bytes on disk, unreadable metadata names its file, and the trainer falls back to the newest step that verifies
(saying which it skipped and why); metrics.jsonl keeps one row per step across a resume."""

from __future__ import annotations

import glob
import json
import os

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.training import checkpointing
from k3jax.training.metrics import MetricsLog
from k3jax.training.trainer import TrainOptions, train


class _Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) / 7.0)
        self.b = nnx.Param(jnp.linspace(-1, 1, 96).astype(jnp.bfloat16))
        self.n = nnx.BatchStat(jnp.arange(5, dtype=jnp.int32))


def _data():
    return iter(grain.MapDataset.range(100).to_iter_dataset())


def _saved(tmp_path):
    """A manager with steps 1 and 2 of a small state (step 2: w + 1) and the data iterator at 3 and 5 items."""
    manager = checkpointing.make_manager(str(tmp_path), async_save=False)
    model = _Tiny()
    data = _data()
    for step, skip in ((1, 3), (2, 2)):
        for _ in range(skip):
            next(data)
        checkpointing.save(manager, step, nnx.state(model), data, {"step": step})
        model.w.value = model.w.value + 1
    manager.wait_until_finished()
    return manager


def _flip_bytes(step_dir: str) -> str:
    """Inverts a few bytes in the middle of the largest state data file; returns the file."""
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
             if os.path.isfile(f)]
    path = max(files, key=os.path.getsize)
    raw = bytearray(open(path, "rb").read())
    for pos in range(len(raw) // 3, 2 * len(raw) // 3, max(1, len(raw) // 20)):
        raw[pos] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)
    return path


def test_fingerprint_changes_with_any_one_bit_and_position():
    x = jnp.arange(1000, dtype=jnp.float32)
    base = checkpointing.fingerprint({"x": x})["['x']"]
    for i, bit in ((0, 0), (500, 31), (999, 7)):
        bits = np.asarray(x).view(np.uint32).copy()
        bits[i] ^= np.uint32(1 << bit)
        assert checkpointing.fingerprint({"x": jnp.asarray(bits.view(np.float32))})["['x']"] != base
    swapped = x.at[0].set(x[1]).at[1].set(x[0])  # same values, other places
    assert checkpointing.fingerprint({"x": swapped})["['x']"] != base
    assert checkpointing.fingerprint({"x": x + 0})["['x']"] == base


def test_flipped_bytes_in_a_saved_state_fail_verification_and_the_older_step_restores(tmp_path):
    manager = _saved(tmp_path)
    _flip_bytes(checkpointing.step_path(manager, 2))
    steps = checkpointing.readable_steps(manager, log_fn=print)
    assert [s for s, _ in steps] == [2, 1]
    template = nnx.state(_Tiny())
    with pytest.raises(checkpointing.CheckpointCorruptError, match=r"/2: .*(differ from the fingerprint|cannot be "
                                                                   r"restored)"):
        checkpointing.restore(manager, 2, template, _data(), steps[0][1]["fingerprint"])
    data = _data()
    state = checkpointing.restore(manager, 1, template, data, steps[1][1]["fingerprint"])
    np.testing.assert_array_equal(np.asarray(state["w"].value), np.asarray(_Tiny().w.value))
    assert next(data) == 3  # the iterator is where step 1 left it
    manager.close()


def test_garbage_metadata_names_its_file_and_the_step_is_skipped(tmp_path):
    manager = _saved(tmp_path)
    meta_file = os.path.join(checkpointing.step_path(manager, 2), "meta", "metadata")
    with open(meta_file, "w") as f:
        f.write("{not json")
    with pytest.raises(checkpointing.CheckpointCorruptError, match=f"{meta_file}: unreadable checkpoint metadata"):
        checkpointing.read_meta(manager, 2)
    logs = []
    steps = checkpointing.readable_steps(manager, logs.append)
    assert [s for s, _ in steps] == [1]
    assert len(logs) == 1 and "skipping checkpoint step 2" in logs[0] and meta_file in logs[0]
    # moved aside, the step is no longer listed and can be written again
    checkpointing.set_aside(manager, [2], logs.append)
    assert manager.all_steps() == [1]
    assert os.path.isdir(checkpointing.step_path(manager, 2) + ".corrupt")
    checkpointing.save(manager, 2, nnx.state(_Tiny()), _data(), {"step": 2})
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
    manager.close()


def test_metrics_rows_past_the_resumed_step_are_dropped(tmp_path):
    log = MetricsLog(str(tmp_path))
    for step in (1, 2, 3, 4):
        log.write(step, {"loss": float(step)})
    MetricsLog(str(tmp_path), resumed_step=2).write(3, {"loss": 30.0})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left


@pytest.mark.slow  # two short training runs: ~90 s on 2 CPU cores
def test_resume_skips_a_damaged_newest_checkpoint_and_redoes_its_steps(tmp_path, compile_cache):
    """A run halted after step 4 with checkpoints at 2 and 4. Garbage metadata at step 4: the resume check falls
    back to step 2 (nothing to do for --steps 2). Flipped state bytes at step 4: resume restores step 2 (the skipped
    step named, moved aside), steps 3-4 give the same losses as before, and metrics.jsonl holds steps 1-4 once."""
    cfg = configs.get_config("tiny", ["num_hidden_layers=2", "full_attn_layers=(2,)"])
    opts = dict(workdir=str(tmp_path), steps=6, halt_at_step=4, batch_size=2, seq_len=16, log_every=1,
                checkpoint_every=2, mesh="1,1,1,1", mtp=False)
    first = train(cfg, TrainOptions(**opts), log_fn=lambda m: None)
    step4 = os.path.join(tmp_path, "checkpoints", "4")
    meta_file = os.path.join(step4, "meta", "metadata")
    good_meta = open(meta_file).read()
    with open(meta_file, "w") as f:
        f.write("\x00garbage")
    logs = []
    assert train(cfg, TrainOptions(**{**opts, "steps": 2, "halt_at_step": None}), log_fn=logs.append) == []
    assert any("skipping checkpoint step 4" in m and meta_file in m for m in logs), logs
    assert any("nothing to do: checkpoint step 2" in m for m in logs), logs
    with open(meta_file, "w") as f:
        f.write(good_meta)

    _flip_bytes(step4)
    logs = []
    again = train(cfg, TrainOptions(**opts), log_fn=logs.append)
    assert any("skipping checkpoint step 4" in m and step4 in m for m in logs), logs
    assert any("resumed from" in m and "(step 2)" in m for m in logs), logs
    assert len(first) == 4 and len(again) == 2
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first[2:]))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4", "4.corrupt"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
