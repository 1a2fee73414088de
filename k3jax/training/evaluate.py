"""Held-out evaluation for `train.py --eval_every=N --eval_batches=M`: the LM loss of the model being trained on
held-out batches, forward only (one jitted program per sequence length, no gradients, the state left untouched).

Data: `--eval_data=DIR` (a prepared directory, `python -m k3jax.data.prepare`, e.g. a validation set), or else the
held-out split of the training data (`pipeline.SPLITS`: every 100th document in prepare order), which the training
stream then leaves out. Each evaluation reads the first M batches of it in order (unshuffled: the same batches
every time, so evaluations compare across steps; a split holding fewer tokens repeats from its start), each of
the training micro-batch's rows (batch_size / grad_accum, so the forward fits where the step does) at the current
context stage's seq_len, split over the data-parallel shards like training batches.

The loss is the next-token cross-entropy (`model.token_losses`, as the training loss) summed over the unmasked
positions of all M batches, divided by their number: a token-weighted mean. The MTP layer is not evaluated.

Quantization-aware training: with `expert_qat` or `expert_act_qat` on, every batch goes through two forwards of
the same state: `eval_loss`, the unquantized model (the f32 masters in the compute dtype, both knobs off), and
`eval_loss_quantized`, the run's fake quantization on (its training forward). With `expert_qat=mxfp4` alone the
quantized forward is what `--to_hf --experts mxfp4` of the checkpoint computes when served
(`tests/test_expert_qat.py`); `expert_act_qat=mxfp8` also rounds the experts' inputs, which serving does not.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config import ModelConfig
from k3jax.data import pipeline
from k3jax.data.global_batch import batch_axes, make_global_dataset
from k3jax.model import K3Model
from sharding.shard import TracedUnderMesh, batch_spec, plan_shardings

EVAL_KEYS = ("input_ids", "targets", "segment_ids", "loss_mask")


class EvalDataError(ValueError):
    """The eval data cannot serve this run (not a prepared directory's format, a larger vocabulary, too few
    documents for the data-parallel shards)."""


def quantizes(cfg: ModelConfig) -> bool:
    """Whether `cfg` trains with expert fake quantization (then the eval reports both losses)."""
    return cfg.runtime.expert_qat != "none" or cfg.runtime.expert_act_qat != "none"


def unquantized(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the QAT knobs off (not state fields: the same parameters run either way)."""
    return cfg.replace(expert_qat="none", expert_act_qat="none")


def make_eval_step(model: K3Model, mesh: Mesh) -> Callable[[K3Model, dict], dict]:
    """`step(model, batch) -> {"lm": masked loss sum, ["lm_quantized": ...,] "tokens": mask sum}` (f32 scalars,
    replicated), jitted with `model`'s state in its training shardings and the batch over the data-parallel axes;
    traced under `mesh` (the MoE takes its expert-parallel path when 'expert' > 1). With QAT on, "lm" is the
    unquantized model's sum and "lm_quantized" the run's fake-quantized one."""
    graphdef, state = nnx.split(model)
    variants = {"lm": graphdef}
    if quantizes(model.cfg):
        plain_cfg = unquantized(model.cfg)
        variants = {"lm": nnx.graphdef(nnx.eval_shape(lambda: K3Model(plain_cfg, rngs=nnx.Rngs(0)))),
                    "lm_quantized": graphdef}
    shardings = plan_shardings(state, mesh, log_fallbacks=False).shardings

    def pure(state, batch):
        mask_bt = batch["loss_mask"].astype(jnp.float32)
        out = {"tokens": mask_bt.sum()}
        for name, gd in variants.items():
            m = nnx.merge(gd, state)  # a copy: what the forward records (routing statistics) is dropped
            losses_bt = m.token_losses(m.hidden_states(batch["input_ids"], batch["segment_ids"]), batch["targets"])
            out[name] = (losses_bt * mask_bt).sum()
        return out

    jitted = TracedUnderMesh(jax.jit(pure, in_shardings=(shardings, NamedSharding(mesh, batch_spec(2))),
                                     out_shardings=NamedSharding(mesh, PartitionSpec())), mesh)

    def step(model: K3Model, batch: dict) -> dict:
        return jitted(nnx.state(model), {k: batch[k] for k in EVAL_KEYS})

    step.jitted = jitted
    return step


def mean_losses(sums: list[dict]) -> dict[str, float]:
    """Per-batch sums (`make_eval_step`'s outputs) -> the metrics: token-weighted mean losses (summed in float64)
    and the token count."""
    sums = jax.device_get(sums)
    tokens = sum(float(s["tokens"]) for s in sums)
    out = {"eval_loss": sum(float(s["lm"]) for s in sums) / max(tokens, 1.0)}
    if "lm_quantized" in sums[0]:
        out["eval_loss_quantized"] = sum(float(s["lm_quantized"]) for s in sums) / max(tokens, 1.0)
    out["eval_tokens"] = tokens
    return out


@dataclasses.dataclass
class Evaluator:
    """The eval pass of a training run: `due(step, final)` says when, `run(model, seq_len)` gives the metrics
    (`eval_loss`, with QAT `eval_loss_quantized`, `eval_tokens`, `eval_s`). Built before the model, so bad eval
    data stops a job at start-up (`check`)."""

    cfg: ModelConfig
    mesh: Mesh
    data_dir: str
    split: str  # pipeline.SPLITS: "heldout" of the training data, or "all" of --eval_data
    rows: int  # per batch (the training micro-batch)
    batches: int
    every: int
    _step: Callable | None = dataclasses.field(default=None, init=False, repr=False)  # built at the first run

    def check(self) -> str:
        """Validates the eval data (format, vocabulary, enough documents for every data-parallel shard); returns a
        line describing it."""
        try:
            meta = pipeline.read_metadata(self.data_dir)
        except ValueError as e:
            raise EvalDataError(f"eval data: {e}") from None
        if int(meta["vocab_size"]) > self.cfg.vocab_size:
            raise EvalDataError(f"eval data in {self.data_dir} was tokenized with vocab_size={meta['vocab_size']}, "
                             f"larger than config {self.cfg.name!r}'s vocab_size={self.cfg.vocab_size}")
        docs = pipeline.split_size(int(meta["num_documents"]), self.split)
        shards = math.prod(self.mesh.shape[a] for a in batch_axes())
        held_out = f"held-out split (every {pipeline.HELD_OUT_EVERY}th document)"
        if docs < shards:
            what = f"its {held_out} has" if self.split == "heldout" else "it has"
            raise EvalDataError(f"cannot evaluate on {self.data_dir}: {what} {docs} documents, fewer than the "
                             f"{shards} data-parallel shards that each read their own; pass --eval_data with a "
                             f"prepared directory of more documents")
        source = f"{held_out}, not trained on" if self.split == "heldout" else "all documents"
        return (f"eval: every {self.every} steps, {self.batches} batches of {self.rows} rows from {self.data_dir}, "
                f"{source}: {docs} documents" + (", unquantized and quantized" if quantizes(self.cfg) else ""))

    def due(self, step: int, final: bool) -> bool:
        return step % self.every == 0 or final

    def run(self, model: K3Model, seq_len: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self._step is None:
            self._step = make_eval_step(model, self.mesh)
        data = make_global_dataset(self.data_dir, self.mesh, batch_size=self.rows, seq_len=seq_len, shuffle=False,
                                   num_epochs=None, vocab_size=self.cfg.vocab_size, split=self.split)
        try:
            sums = [self._step(model, next(data)) for _ in range(self.batches)]
        finally:
            data.close()
        return {**mean_losses(sums), "eval_s": time.perf_counter() - t0}


def format_eval(m: dict) -> str:
    """The progress line's eval part ('' when the step has no eval)."""
    if "eval_loss" not in m:
        return ""
    quantized = f" quantized {m['eval_loss_quantized']:.4f}" if "eval_loss_quantized" in m else ""
    return f"eval {m['eval_loss']:.4f}{quantized} ({m['eval_s']:.1f}s)"
