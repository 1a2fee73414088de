"""train.py --export_to (k3jax/training/export.py): a training run's checkpoint becomes a k3jax checkpoint that
serve.py --checkpoint and python -m k3jax.convert --to_hf read, holding exactly the trained weights (model, MTP
layer, router biases; not the optimizer or routing statistics); bad input is refused before anything is written;
--init_from of such a checkpoint also starts the MTP layer from its weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.layers.params import RouterBias
from k3jax.loading import load_checkpoint, save_checkpoint
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer
from k3jax.training import checkpointing
from k3jax.training.export import export_checkpoint
from k3jax.training.init_from import init_mtp
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option, run_config, train


def _opts(workdir, **kw):
    return TrainOptions(**{**dict(workdir=str(workdir), steps=2, batch_size=2, seq_len=32, log_every=1,
                                  checkpoint_every=1, mesh="1,1,1,1"), **kw})


def test_export_refuses_a_workdir_without_checkpoints_and_an_existing_output(tmp_path):
    cfg = configs.get_config("tiny")
    with pytest.raises(checkpointing.CheckpointCorruptError, match="holds no training checkpoints"):
        export_checkpoint(cfg, _opts(tmp_path / "run"), str(tmp_path / "out"), log_fn=lambda m: None)
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        export_checkpoint(cfg, _opts(tmp_path / "run"), str(tmp_path / "out"), log_fn=lambda m: None)


@pytest.mark.slow
def test_export_writes_the_trained_weights_of_the_chosen_step(tmp_path):
    cfg = configs.get_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])
    opts = _opts(tmp_path / "run")
    train(cfg, opts, log_fn=lambda m: None)
    logs = []
    out = export_checkpoint(cfg, opts, str(tmp_path / "out"), step=1, log_fn=logs.append)
    assert any("step 1" in line for line in logs), logs
    manifest = json.load(open(tmp_path / "out" / "manifest.json"))
    assert manifest["hf"].get("mtp"), "the MTP layer is exported"

    # the step-1 training state, restored the way a resume does
    run_cfg = run_config(cfg)
    trainable, optimizer, _, _ = build(run_cfg, opts, make_mesh_from_option(opts.mesh, run_cfg))
    manager = checkpointing.make_manager(opts.workdir)
    state = checkpointing.restore(manager, 1, nnx.state((trainable, optimizer)), None)
    manager.close()
    nnx.update((trainable, optimizer), state)
    _, exported = load_checkpoint(out, dtype="float32")
    weights = nnx.Any(nnx.Param, RouterBias)
    want = dict(nnx.to_flat_state(nnx.state(trainable.model, weights)))
    got = dict(nnx.to_flat_state(nnx.state(exported, weights)))
    assert set(got) == set(want)
    for key, var in want.items():
        np.testing.assert_array_equal(np.asarray(got[key].get_value()), np.asarray(var.get_value()), err_msg=str(key))


def test_init_from_copies_the_checkpoints_mtp_layer_in_its_sharding(tmp_path):
    cfg = configs.get_config("tiny")
    model, saved = K3Model(cfg, rngs=nnx.Rngs(0)), MTPLayer(cfg, rngs=nnx.Rngs(1))
    save_checkpoint(model, str(tmp_path / "with"), mtp=saved)
    save_checkpoint(model, str(tmp_path / "without"))
    fresh = MTPLayer(run_config(cfg), rngs=nnx.Rngs(2))  # as the trainer builds it: with routing statistics
    flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))  # noqa: E731
    before = {k: v.get_value().sharding for k, v in flat(fresh).items()}
    assert not init_mtp(fresh, str(tmp_path / "without"))
    assert init_mtp(fresh, str(tmp_path / "with"))
    want, got = flat(saved), flat(fresh)
    assert set(got) == set(want)
    for key, var in want.items():
        np.testing.assert_array_equal(np.asarray(got[key].get_value()), np.asarray(var.get_value()), err_msg=str(key))
        assert got[key].get_value().sharding == before[key], key
