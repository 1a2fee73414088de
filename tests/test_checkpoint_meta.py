"""Resuming checks the checkpoint's config: architecture fields and the runtime knobs that shape the saved state
must match; kernel and other runtime knobs may change between runs (logged), in the nested metadata written now
and in the flat metadata of older checkpoints."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import configs
from k3jax.config import RuntimeConfig
from k3jax.training.checkpointing import CheckpointMismatchError, check_meta


def _meta(cfg, flat=False):
    saved = dataclasses.asdict(cfg)  # what the trainer writes
    if flat:
        saved = {k: v for k, v in saved.items() if k != "runtime"} | saved["runtime"]
    return {"config": saved, "options": {"seq_len": 32}}


@pytest.mark.parametrize("flat", [False, True])
def test_a_changed_kernel_knob_still_resumes(flat, caplog):
    cfg = configs.get_config("tiny", ["record_routing_stats=true"])
    meta = _meta(cfg, flat)
    check_meta(meta, cfg, {"seq_len": 32}, "ckpt")
    changed = cfg.replace(kda_impl="recurrent", mla_decode_impl="xla", remat=False, dtype="bfloat16",
                          moe_expert_parallel="capacity:1.5", decode_loop_unroll=4)
    with caplog.at_level(logging.INFO, logger="k3jax.training.checkpointing"):
        check_meta(meta, changed, {"seq_len": 32}, "ckpt")
    assert "config.runtime.kda_impl: checkpoint 'auto', now 'recurrent'" in caplog.text


@pytest.mark.parametrize("flat", [False, True])
def test_architecture_or_state_shaping_changes_block_resume(flat):
    cfg = configs.get_config("tiny", ["record_routing_stats=true"])
    meta = _meta(cfg, flat)
    assert set(RuntimeConfig.state_fields()) == {"param_dtype", "scan_layers", "expert_weights",
                                                 "record_routing_stats", "routing_histogram_bins",
                                                 "vision_trainable"}
    changed = cfg.replace(hidden_size=96, scan_layers=False, routing_histogram_bins=64, kda_impl="recurrent")
    with pytest.raises(CheckpointMismatchError) as err:
        check_meta(meta, changed, {"seq_len": 16}, "ckpt")
    text = str(err.value)
    for want in ("config.hidden_size: checkpoint 64, now 96", "config.runtime.scan_layers: checkpoint True",
                 "config.runtime.routing_histogram_bins: checkpoint 256, now 64", "seq_len: checkpoint 32"):
        assert want in text
    assert "kda_impl" not in text
