"""train.py's loop: exact resume from Orbax checkpoints, Quantile Balancing lowering the expert-load imbalance,
clear errors (NaN loss, mismatched resume, batch vs data-parallel size), metrics in the workdir; the precision
policy (f32 masters, optimizer state dtype) and bf16 HF export from f32 training parameters."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import configs
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.loading import save_checkpoint
from k3jax.model import K3Model
from k3jax.training import checkpointing
from k3jax.training.memory import estimate_memory
from k3jax.training.trainer import (
    NonFiniteLossError,
    TrainOptions,
    check_batch,
    make_trainable,
    run_config,
    train,
    training_config,
)
from sharding.mesh import make_mesh


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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_training_holds_f32_masters_and_the_chosen_optimizer_state_dtype():
    """train.py's config: f32 parameters, bf16 compute (unless --set param_dtype); the optimizer state in
    --state_dtype (AdamW's second moment too), as the memory estimate counts it."""
    cfg = training_config("k3_gpu")
    assert (cfg.runtime.param_dtype, cfg.runtime.dtype) == ("float32", "bfloat16")
    assert training_config("k3_gpu", ["param_dtype=bfloat16"]).runtime.param_dtype == "bfloat16"
    tiny = training_config("tiny", ["dtype=bfloat16"])
    for optimizer in ("muon", "adamw"):
        for state_dtype in ("float32", "bfloat16"):
            opts = TrainOptions(optimizer=optimizer, state_dtype=state_dtype, mtp=False)
            trainable, opt = nnx.eval_shape(lambda opts=opts: make_trainable(run_config(tiny), opts))
            params = jax.tree.leaves(nnx.state(trainable, nnx.Param))
            assert {x.dtype for x in params} == {jnp.dtype("float32")}
            state = [x for x in jax.tree.leaves(nnx.state(opt, nnx.optimizer.OptState))
                     if x.ndim > 0 and jnp.issubdtype(x.dtype, jnp.floating)]
            assert {x.dtype for x in state} == {jnp.dtype(state_dtype)}, (optimizer, state_dtype)
            est = estimate_memory(tiny, (1, 1, 1, 1), batch_size=1, seq_len=8, optimizer=optimizer, mtp=False,
                                  master_dtype=None, state_dtype=state_dtype)
            assert est["optimizer"] == sum(x.size * x.dtype.itemsize for x in state)
    with pytest.raises(ValueError, match="state_dtype"):
        TrainOptions(state_dtype="float16")


def test_micro_batch_not_divisible_by_the_data_parallel_size_is_a_clear_error():
    mesh = make_mesh(2, 2, 1, 2)
    check_batch(TrainOptions(batch_size=16, grad_accum=4), mesh)
    with pytest.raises(ValueError, match=r"--batch_size=16 / --grad_accum=8 = 2 rows per micro-batch must be a "
                                         r"multiple of the data-parallel size 4 .* --batch_size a multiple of 32"):
        check_batch(TrainOptions(batch_size=16, grad_accum=8), mesh)
    with pytest.raises(ValueError, match="grad_accum must be >= 1 and divide batch_size=16"):
        TrainOptions(batch_size=16, grad_accum=3)


def test_to_hf_writes_the_releases_bf16_from_f32_training_parameters(tmp_path):
    """A model holding f32 masters (what training holds) saved as a k3jax checkpoint keeps f32; `--to_hf` writes
    the release's dtypes (bf16, the values the f32 ones rounded; f32 where a bf16 model keeps f32), `--dtype f32`
    keeps f32."""
    cfg = training_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    save_checkpoint(model, str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert {dt for item in manifest["items"].values() for dt, _ in item.values()} == {"float32"}
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf32"), dtype="f32")
    for name, dtype in (("hf", "bfloat16"), ("hf32", "float32")):
        tensors = {}
        for file in sorted(os.listdir(tmp_path / name)):
            if file.endswith(".safetensors"):
                with safe_open(str(tmp_path / name / file), "numpy") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})
        narrow = sorted(k for k, v in tensors.items() if v.dtype != np.dtype("float32"))
        if dtype == "float32":
            assert tensors and not narrow, name
        else:  # bf16 but for the few tensors a bf16 model keeps in f32 (as the release stores them)
            assert len(narrow) > 0.8 * len(tensors), name
            assert all(str(tensors[k].dtype) == "bfloat16" for k in tensors if "embed_tokens" in k or "experts" in k)
        assert json.loads((tmp_path / name / "config.json").read_text())["torch_dtype"] == dtype
        if name == "hf":
            bf16 = tensors
    f32 = tensors
    for k, v in f32.items():
        np.testing.assert_array_equal(bf16[k], v.astype(bf16[k].dtype), err_msg=k)


@pytest.mark.slow
def test_a_step_the_compiler_cannot_fit_is_refused_before_the_model_is_built_and_a_fitting_one_compiles_once(
        tmp_path, compile_cache, monkeypatch):
    """The estimate passes (parameters, gradients and optimizer state fit), the compiled step does not: refused
    naming the compiler's figure, with only the abstract build done. With the device's real memory the run trains on
    the executable compiled ahead: the real step's jit never traces (nothing compiles twice)."""
    from k3jax.training import memory, trainer

    cfg = configs.get_config("tiny", ["num_hidden_layers=2", "full_attn_layers=(2,)", "attn_res_block_size=2"])
    opts = _opts(tmp_path / "w", steps=1, checkpoint_every=0)
    est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=2, seq_len=32, master_dtype=None)
    state_bytes = sum(est[c] for c in memory.STATE_COMPONENTS)
    assert est["activations"] > state_bytes  # the estimate alone would refuse
    builds = []
    real_build = trainer.build

    def recording_build(cfg, opts, mesh, *, abstract=False):
        out = real_build(cfg, opts, mesh, abstract=abstract)
        builds.append((abstract, out[2]))
        return out

    monkeypatch.setattr(trainer, "build", recording_build)
    small = int(state_bytes / 0.9) + 1
    with monkeypatch.context() as m:
        m.setattr(memory, "device_memory_bytes", lambda device=None: (small, "a test's device"))
        logs = []
        with pytest.raises(memory.DoesNotFitError, match="the compiled training step needs .* nothing was allocated"):
            train(cfg, opts, log_fn=logs.append)
    assert [a for a, _ in builds] == [True]
    assert any("over by the estimate, the compiled step decides" in line for line in logs)

    logs = []
    assert len(train(cfg, opts, log_fn=logs.append)) == 1
    assert [a for a, _ in builds] == [True, True, False]
    assert any(line.startswith("memory per device (compiled, 2 x 32): ") for line in logs)
    assert builds[-1][1].jitted._cache_size() == 0
