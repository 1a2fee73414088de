"""train.py's loop: exact resume from Orbax checkpoints, Quantile Balancing lowering the expert-load imbalance,
clear errors (NaN loss, mismatched resume), metrics in the workdir."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import configs
from k3jax.training import checkpointing
from k3jax.training.trainer import NonFiniteLossError, TrainOptions, train


@pytest.fixture
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache: the runs of one test compile the same step program once."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for n, v in old.items():
        jax.config.update(n, v)


def _short_tiny():
    """`tiny` cut to 5 layers (KDA x3 + MLA, then a trailing MLA; the first layer's FFN dense, the others MoE):
    every layer kind and the whole training pipeline at ~2/5 of the 13-layer step's compile time (the resume test
    trains three times)."""
    return configs.get_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])


def _opts(workdir, **kw):
    base = dict(workdir=str(workdir), steps=4, batch_size=2, seq_len=32, log_every=1, checkpoint_every=2,
                mesh="1,1,1,1")
    base.update(kw)
    return TrainOptions(**base)


def test_resume_continues_bit_exactly(tmp_path, compile_cache, monkeypatch):
    """Muon + MTP + Quantile Balancing + packed data: 4 steps straight == 2 steps, stop, resume, 2 more steps."""
    cfg = _short_tiny()
    straight = train(cfg, _opts(tmp_path / "a"), log_fn=lambda m: None)
    first = train(cfg, _opts(tmp_path / "b", halt_at_step=2), log_fn=lambda m: None)
    logs = []
    second = train(cfg, _opts(tmp_path / "b"), log_fn=logs.append)
    assert len(straight) == 4 and len(first) == 2 and len(second) == 2
    assert any("resumed from" in line and "step 2" in line for line in logs)
    np.testing.assert_array_equal(np.asarray(first + second), np.asarray(straight))
    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "learning_rate", "tokens_per_s",
                "expert_load_max_over_mean"):
        assert all(np.isfinite(r[key]) for r in rows), key
    # checkpoints are complete step directories; nothing half-written is left behind
    ckpts = sorted(os.listdir(tmp_path / "b" / "checkpoints"))
    assert ckpts == ["2", "4"], ckpts

    # resuming with a different setup names what differs instead of loading silently, and a finished run says
    # so; both before any model is built (no init of a large model to learn that)
    from k3jax.training import trainer

    def no_build(*a, **kw):
        raise AssertionError("the model was built")

    monkeypatch.setattr(trainer, "build", no_build)
    with pytest.raises(checkpointing.CheckpointMismatchError, match="seq_len"):
        train(cfg, _opts(tmp_path / "b", steps=6, seq_len=16), log_fn=lambda m: None)
    logs = []
    assert train(cfg, _opts(tmp_path / "b"), log_fn=logs.append) == []
    assert any("nothing to do" in line for line in logs)


def test_non_finite_update_stops_before_saving(tmp_path):
    """An infinite learning rate makes step 1's update NaN (its loss is still finite): the run stops at step 1 with
    a clear error and no checkpoint holding the NaN parameters is written."""
    cfg = _short_tiny()
    with pytest.raises(NonFiniteLossError, match="parameters became nan .* at step 1"):
        train(cfg, _opts(tmp_path, learning_rate=float("inf"), optimizer="adamw", mtp=False, steps=3,
                         checkpoint_every=1, quantile_balancing=False), log_fn=lambda m: None)
    assert not os.listdir(tmp_path / "checkpoints")


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="optimizer"):
        TrainOptions(optimizer="sgd")
    with pytest.raises(ValueError, match="batch_size"):
        TrainOptions(batch_size=0)


@pytest.mark.slow
def test_quantile_balancing_lowers_expert_load_imbalance(tmp_path):
    """A `tiny` run with Quantile Balancing has a lower max/mean expert load than the same run without it (same
    init, same batches). The learning rate is ~0 so the router barely moves and the comparison isolates the bias:
    step 1 routes with a zero bias in both runs; from step 2 on QB's bias (set from the previous batch) applies."""
    cfg = configs.get_config("tiny")
    ratios = {}
    for qb in (True, False):
        opts = _opts(tmp_path / str(qb), steps=10, batch_size=8, seq_len=64, optimizer="adamw", mtp=False,
                     quantile_balancing=qb, learning_rate=1e-9, checkpoint_every=0)
        train(cfg, opts, log_fn=lambda m: None)
        rows = [json.loads(line) for line in open(tmp_path / str(qb) / "metrics.jsonl")]
        ratios[qb] = np.array([r["expert_load_max_over_mean_avg"] for r in rows])
    on, off = ratios[True], ratios[False]
    assert on[0] == pytest.approx(off[0])  # same model, same first batch, zero bias in both
    assert on[1:].mean() < off[1:].mean() - 0.1, (on, off)
    assert on[1:].mean() < on[0] - 0.1, on
