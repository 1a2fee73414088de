"""train.py's eval pass (`--eval_every`, `--eval_batches`, `--eval_data`; k3jax/training/evaluate.py): the held-out
split is disjoint from what training reads; the eval runs at every N-th and the last step and equals a
hand-computed token-weighted mean loss over the same batches, unquantized and (with expert QAT) quantized, in the
progress line and metrics.jsonl; bad flags and unusable eval data are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import configs
from k3jax.data import pipeline, prepare
from k3jax.model import K3Model
from k3jax.training import checkpointing, trainer
from k3jax.training.evaluate import EvalDataError, Evaluator
from k3jax.training.trainer import TrainOptions, run_config, train
from sharding.mesh import make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny cut to two layers (KDA + MoE FFN, then MLA); the experts' widths (32) are one MX group: QAT runs on it
QAT_TINY = ["num_hidden_layers=2", "full_attn_layers=(2,)", "expert_qat=mxfp4"]


@pytest.fixture(scope="module")
def numbered_docs(tmp_path_factory):
    """A prepared directory of 250 byte-token documents 'doc 000 ...' .. 'doc 249 ...' (2 shards)."""
    out = str(tmp_path_factory.mktemp("eval_data") / "docs")
    docs = [(f"d{i}", f"doc {i:03d} " + "x" * (i % 7)) for i in range(250)]
    prepare.write_documents(docs, out, prepare.byte_tokenizer(), num_shards=2, num_threads=1)
    return out


def _documents(data_dir: str, split: str) -> list[str]:
    """The texts of every document of `split`, read once through the pipeline (unshuffled, one row at a time)."""
    it = pipeline.make_dataset(data_dir, batch_size=1, seq_len=64, shuffle=False, num_epochs=1, shard_index=0,
                               shard_count=1, split=split)
    texts = []
    for batch in it:
        ids, seg, pos = batch["input_ids"][0], batch["segment_ids"][0], batch["positions"][0]
        for s in np.unique(seg[seg > 0]):
            piece = bytes(int(t) for t in ids[seg == s] if t < 256).decode()
            if pos[seg == s][0] > 0:  # the rest of a document cut at the previous row's end
                texts[-1] += piece
            else:
                texts.append(piece)
    it.close()
    return texts


def test_held_out_split_is_every_100th_document_and_training_reads_the_others(numbered_docs):
    held = _documents(numbered_docs, "heldout")
    train_docs = _documents(numbered_docs, "train")
    assert [t[:7] for t in held] == ["doc 099", "doc 199"]
    assert sorted(t[:7] for t in train_docs) == [f"doc {i:03d}" for i in range(250) if i % 100 != 99]
    assert (pipeline.split_size(250, "heldout"), pipeline.split_size(250, "train")) == (2, 248)
    with pytest.raises(ValueError, match="split must be one of"):
        pipeline.make_dataset(numbered_docs, batch_size=1, seq_len=8, split="valid")


def _hand_mean(cfg, state, data_dir, split, rows, seq_len, batches) -> float:
    """Token-weighted mean next-token cross-entropy of `cfg`'s model holding `state` over the first `batches`
    unshuffled batches of `split`: logits through the model's call, softmax cross-entropy by optax, in float64."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    fwd = jax.jit(lambda st, ids, seg: nnx.merge(graphdef, st)(ids, seg))
    it = pipeline.make_dataset(data_dir, batch_size=rows, seq_len=seq_len, shuffle=False, shard_index=0,
                               shard_count=1, split=split)
    total = count = 0.0
    for _ in range(batches):
        b = next(it)
        logits = fwd(state, jnp.asarray(b["input_ids"]), jnp.asarray(b["segment_ids"]))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.asarray(b["targets"]))
        total += float(np.sum(np.asarray(ce, np.float64) * b["loss_mask"]))
        count += float(b["loss_mask"].sum())
    it.close()
    return total / count


def test_eval_runs_every_n_steps_and_last_and_equals_the_hand_computed_mean_with_and_without_qat(
        tmp_path, monkeypatch):
    """A 5-step QAT run with --eval_every=2 (its optimizer step stubbed out, so the model stays at its init and the
    expected losses can be computed by hand): eval rows at steps 2, 4 and 5 only, each with the unquantized and the
    quantized loss of the held-out batches (different), both in the progress line."""
    states = []

    def frozen_step(trainable, optimizer, mesh, loss_fn, **kw):
        def step(t, o, batch):
            states.append(nnx.state(t.model))
            return jnp.float32(1.0), {"grad_norm": jnp.float32(0.0), "param_norm": jnp.float32(1.0)}
        return step

    monkeypatch.setattr(trainer, "make_sharded_train_step", frozen_step)
    cfg = configs.get_config("tiny", QAT_TINY)
    opts = TrainOptions(workdir=str(tmp_path), steps=5, batch_size=4, grad_accum=2, seq_len=32, log_every=10,
                        checkpoint_every=0, mesh="1,1,1,1", mtp=False, eval_every=2, eval_batches=3)
    logs = []
    train(cfg, opts, log_fn=logs.append)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = {r["step"]: r for r in rows if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 5]
    assert all("eval_loss" not in r for r in rows if r["step"] not in evals)
    assert any(line.startswith("eval: every 2 steps, 3 batches of 2 rows") for line in logs), logs
    eval_lines = [line for line in logs if " eval " in line]
    assert len(eval_lines) == 3 and all(" quantized " in line for line in eval_lines), eval_lines

    state = states[-1]  # the frozen run's model
    data_dir = trainer.data_dir_for(cfg, opts)
    cfg = run_config(cfg)  # as the trainer builds the model (routing statistics recorded)
    plain = _hand_mean(cfg.replace(expert_qat="none"), state, data_dir, "heldout", 2, 32, 3)
    quantized = _hand_mean(cfg, state, data_dir, "heldout", 2, 32, 3)
    for r in evals.values():
        assert r["eval_tokens"] == 3 * 2 * 32  # the held-out documents fill every row
        np.testing.assert_allclose(r["eval_loss"], plain, rtol=2e-6)
        np.testing.assert_allclose(r["eval_loss_quantized"], quantized, rtol=2e-6)
    assert abs(plain - quantized) > 1e-4


@pytest.mark.slow  # ~20 s; the QAT eval test above also checks the unquantized loss against the hand mean
def test_eval_without_qat_reports_one_loss_over_eval_data(numbered_docs):
    """--eval_data: all of its documents (the hand-computed mean over them); no quantized loss without QAT."""
    cfg = run_config(configs.get_config("tiny", QAT_TINY[:2]))
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(3))))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(3))))())
    evaluator = Evaluator(cfg, mesh, numbered_docs, "all", rows=2, batches=2, every=1)
    assert "250 documents" in evaluator.check()
    got = evaluator.run(model, seq_len=16)
    assert "eval_loss_quantized" not in got and got["eval_tokens"] == 2 * 2 * 16
    np.testing.assert_allclose(got["eval_loss"], _hand_mean(cfg, nnx.state(model), numbered_docs, "all", 2, 16, 2),
                               rtol=2e-6)


def test_unusable_eval_data_is_refused_at_start_up(numbered_docs, tmp_path):
    cfg = configs.get_config("tiny")
    two = make_mesh(data=2, devices=jax.devices()[:2])
    three = make_mesh(data=3, devices=jax.devices()[:3])
    Evaluator(cfg, two, numbered_docs, "heldout", rows=2, batches=1, every=1).check()
    with pytest.raises(EvalDataError, match=r"held-out split \(every 100th document\) has 2 documents, fewer than "
                                            r"the 3 data-parallel shards"):
        Evaluator(cfg, three, numbered_docs, "heldout", rows=3, batches=1, every=1).check()
    small = cfg.replace(vocab_size=258, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with pytest.raises(EvalDataError, match="vocab_size=259, larger than config 'tiny'"):
        Evaluator(small, two, numbered_docs, "all", rows=2, batches=1, every=1).check()
    with pytest.raises(FileNotFoundError, match="is not a prepared data directory"):
        Evaluator(cfg, two, str(tmp_path), "all", rows=2, batches=1, every=1).check()


def test_bad_eval_options_are_rejected_and_held_out_training_cannot_resume_a_full_data_checkpoint():
    with pytest.raises(ValueError, match="eval_every must be >= 0 and eval_batches >= 1"):
        TrainOptions(eval_every=5, eval_batches=0)
    with pytest.raises(ValueError, match="eval_every must be >= 0"):
        TrainOptions(eval_every=-1)
    with pytest.raises(ValueError, match="eval_data is read only with eval_every > 0"):
        TrainOptions(eval_data="/data/valid")
    assert TrainOptions().train_split == "all" and TrainOptions(eval_every=5, eval_data="/v").train_split == "all"
    assert TrainOptions(eval_every=5).train_split == "train"
    cfg = configs.get_config("tiny")
    saved = {"config": {}, "options": TrainOptions().resume_keys()}
    with pytest.raises(checkpointing.CheckpointMismatchError, match="train_split: checkpoint 'all', now 'train'"):
        checkpointing.check_meta(saved, cfg, TrainOptions(eval_every=5).resume_keys(), "ckpt")
    checkpointing.check_meta(saved, cfg, TrainOptions(eval_every=5, eval_data="/v").resume_keys(), "ckpt")


@pytest.mark.parametrize("flags_, message", [
    (["--eval_every=5", "--eval_batches=0"], "error: eval_every must be >= 0 and eval_batches >= 1"),
    (["--eval_data=/nonexistent/valid"], "error: eval_data is read only with eval_every > 0"),
    (["--eval_every=5", "--eval_data=/nonexistent/valid"], "error: /nonexistent/valid is not a prepared data"),
])
def test_train_py_exits_2_on_bad_eval_flags(flags_, message):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "train.py", "--config=tiny", "--mesh=1,1,1,1", "--steps=1", *flags_],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_qat_run_reports_quantized_and_unquantized_eval_losses(tmp_path):
    """A real 4-step QAT run (Muon, MTP, Quantile Balancing) with --eval_every=2: finite, falling eval losses of
    both models at steps 2 and 4."""
    cfg = configs.get_config("tiny", QAT_TINY)
    opts = TrainOptions(workdir=str(tmp_path), steps=4, batch_size=2, seq_len=32, log_every=10, checkpoint_every=0,
                        mesh="1,1,1,1", eval_every=2, eval_batches=2)
    train(cfg, opts, log_fn=lambda m: None)
    rows = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "eval_loss" in r}
    assert sorted(rows) == [2, 4]
    for key in ("eval_loss", "eval_loss_quantized"):
        assert np.isfinite(rows[2][key]) and rows[4][key] < rows[2][key], (key, rows)
