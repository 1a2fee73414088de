"""Train an EAGLE-3 draft (`k3jax.eagle3.Eagle3Layer`) against a frozen target (docs/training.md#draft):

    python -m k3jax.training.draft --init_from=CKPT --out=DRAFT_DIR [--data=PREPARED] [--steps=2000]

The target (a converted k3jax checkpoint) runs forward only: its AttnRes block outputs feed the draft and its
next-token distributions are the teacher. The draft unrolls `--unroll_steps` (7) training-time-test steps
(`Eagle3Layer.unrolled`) and every (chain, step) within one document scores

    loss = −log Σ_v min(p_target(v), p_draft(v))          (temperature 1)

the negative log of the probability that speculative sampling accepts the drafted token there. Only the draft's
parameters get gradients (AdamW, f32 masters, warmup + cosine); the target's embedding and head are shared, not
trained. The draft is saved atomically with `save_eagle3` (Orbax weights + draft.json) at the end and every
`--save_every` steps; serve it with `Eagle3Draft(load_eagle3(DRAFT_DIR, cfg), k)` (docs/serving.md#drafts).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

from k3jax.atomic import AtomicDir
from k3jax.config import ConfigError, ModelConfig
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.data import pipeline
from k3jax.eagle3 import DEFAULT_UNROLL_STEPS, DraftCheckpointError, Eagle3Layer, block_features, save_eagle3
from k3jax.loading import load_checkpoint
from k3jax.model import K3Model

DRAFT_BATCH_KEYS = ("input_ids", "segment_ids")


def shift_left(x_bt: jax.Array, s: int, fill=0) -> jax.Array:
    """x[:, p + s] at p (fill past the row): the value s positions later, [B, T, ...]."""
    if s == 0:
        return x_bt
    pad = [(0, 0), (0, s)] + [(0, 0)] * (x_bt.ndim - 2)
    return jnp.pad(x_bt[:, s:], pad, constant_values=fill)


def acceptance_log_prob(logp_target_nv: jax.Array, logq_draft_nv: jax.Array) -> jax.Array:
    """log Σ_v min(p(v), q(v)) per row from log-probabilities [..., V] (a logsumexp of the elementwise minimum):
    the log-probability that speculative sampling accepts a token drawn from q where the target samples p."""
    return jax.nn.logsumexp(jnp.minimum(logp_target_nv, logq_draft_nv), axis=-1)


def unrolled_loss(target_logits_btv: jax.Array, draft_logits_sbtv: list[jax.Array], segment_ids_bt: jax.Array
                  ) -> tuple[jax.Array, dict]:
    """The EAGLE-3 loss over S unrolled steps: chain p's step s (draft_logits_sbtv[s-1][:, p]) predicts token
    p + s + 1, so it is compared with the target's distribution at position p + s. Counted where positions p and
    p + s exist and lie in one document (segment_ids equal, > 0). Returns (mean of −log Σ min(p, q) over the counted
    (chain, step) pairs, metrics: per-step expected acceptance `accept_s{s}` and top-1 agreement `top1_s{s}`)."""
    logp_btv = jax.nn.log_softmax(target_logits_btv.astype(jnp.float32), axis=-1)
    seg_bt = segment_ids_bt
    total, count, metrics = 0.0, 0.0, {}
    for s, logits_btv in enumerate(draft_logits_sbtv, start=1):
        logq_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
        logp_s = shift_left(logp_btv, s)
        valid_bt = ((shift_left(seg_bt, s) == seg_bt) & (seg_bt > 0)).astype(jnp.float32)
        log_acc_bt = acceptance_log_prob(logp_s, logq_btv)
        n = jnp.maximum(valid_bt.sum(), 1.0)
        total = total - jnp.sum(valid_bt * log_acc_bt)
        count = count + valid_bt.sum()
        metrics[f"accept_s{s}"] = jnp.sum(valid_bt * jnp.exp(log_acc_bt)) / n
        agree_bt = jnp.argmax(logq_btv, -1) == jnp.argmax(logp_s, -1)
        metrics[f"top1_s{s}"] = jnp.sum(valid_bt * agree_bt) / n
    loss = total / jnp.maximum(count, 1.0)
    return loss, {"loss": loss, **metrics}


class TargetPass(NamedTuple):
    """What the frozen target contributes to a draft step (computed outside the gradient)."""

    feats_btf: jax.Array  # the chosen AttnRes block outputs side by side
    logits_btv: jax.Array  # the teacher's next-token logits
    embeds_sbtd: list  # Emb(t_{p+s}) for s = 1..S (the shared embedding; zeros' row past the end)


def target_pass(target: K3Model, batch: dict, feature_blocks, unroll_steps: int) -> TargetPass:
    ids_bt, seg_bt = batch["input_ids"], batch["segment_ids"]
    h_btd, blocks = target.hidden_states_and_blocks(ids_bt, seg_bt)
    embeds = [target.embed(shift_left(ids_bt, s)) for s in range(1, unroll_steps + 1)]
    return jax.lax.stop_gradient(TargetPass(block_features(blocks, feature_blocks), target.logits(h_btd), embeds))


def draft_loss(layer: Eagle3Layer, target: K3Model, tp: TargetPass, segment_ids_bt: jax.Array
               ) -> tuple[jax.Array, dict]:
    """The draft's unrolled forward on the target's features and `unrolled_loss` (the head is the target's)."""
    outs = layer.unrolled(layer.fuse_features(tp.feats_btf), tp.embeds_sbtd, segment_ids_bt)
    return unrolled_loss(tp.logits_btv, [target.logits(o) for o in outs], segment_ids_bt)


@dataclasses.dataclass(frozen=True)
class DraftOptions:
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    unroll_steps: int = DEFAULT_UNROLL_STEPS
    feature_blocks: tuple[int, ...] | None = None  # None: blocks 1, 4 and the last
    seed: int = 0
    log_every: int = 20

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "unroll_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.unroll_steps >= self.seq_len:
            raise ValueError(f"unroll_steps ({self.unroll_steps}) must be below seq_len ({self.seq_len})")
        if not self.learning_rate > 0 or self.warmup_steps < 0:
            raise ValueError(f"learning_rate must be > 0 and warmup_steps >= 0, got {self.learning_rate}, "
                             f"{self.warmup_steps}")


def optimizer(opts: DraftOptions) -> optax.GradientTransformation:
    warmup = min(opts.warmup_steps, max(opts.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, opts.learning_rate, warmup, max(opts.steps, warmup + 1),
                                                  end_value=0.1 * opts.learning_rate)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=opts.weight_decay))


def new_draft(target_cfg: ModelConfig, opts: DraftOptions) -> Eagle3Layer:
    """A fresh draft for the target (f32 master weights whatever the target's parameter dtype)."""
    return Eagle3Layer(target_cfg.replace(param_dtype="float32"), feature_blocks=opts.feature_blocks,
                       rngs=nnx.Rngs(opts.seed))


class DraftTrainer:
    """The jitted step (draft parameters and optimizer state donated; the target's state an argument, never
    differentiated) and a forward-only evaluation of the same loss."""

    def __init__(self, target: K3Model, layer: Eagle3Layer, opts: DraftOptions):
        self.opts = opts
        self.target_graphdef, self.target_state = nnx.split(target)
        self.graphdef, self.params = nnx.split(layer)
        self.tx = optimizer(opts)
        self.opt_state = self.tx.init(self.params)
        self.step_count = 0

        blocks = layer.feature_blocks

        def loss_and_grad(params, target_state, batch, *, grad: bool):
            target = nnx.merge(self.target_graphdef, target_state)
            tp = target_pass(target, batch, blocks, opts.unroll_steps)

            def loss_fn(params):
                return draft_loss(nnx.merge(self.graphdef, params), target, tp, batch["segment_ids"])

            if not grad:
                return loss_fn(params)[1], None
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return metrics, grads

        def step(params, opt_state, target_state, batch):
            metrics, grads = loss_and_grad(params, target_state, batch, grad=True)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            metrics["grad_norm"] = optax.global_norm(grads)
            return optax.apply_updates(params, updates), opt_state, metrics

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._eval = jax.jit(lambda params, target_state, batch: loss_and_grad(params, target_state, batch,
                                                                               grad=False)[0])

    @property
    def layer(self) -> Eagle3Layer:
        return nnx.merge(self.graphdef, self.params)

    def step(self, batch: dict) -> dict:
        self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, self.target_state,
                                                          _device_batch(batch))
        self.step_count += 1
        return metrics

    def evaluate(self, batch: dict) -> dict[str, float]:
        return {k: float(v) for k, v in self._eval(self.params, self.target_state, _device_batch(batch)).items()}


def _device_batch(batch: dict) -> dict:
    return {k: jnp.asarray(batch[k], jnp.int32) for k in DRAFT_BATCH_KEYS}


def data_iterator(cfg: ModelConfig, data: str | None, opts: DraftOptions, *, split: str = "train") -> Iterator[dict]:
    """Packed batches of `data` (prepared with `python -m k3jax.data.prepare`) or, without it, of the embedded
    byte-level corpus (byte-vocabulary targets such as `tiny`)."""
    if data is None:
        if cfg.vocab_size < 259:
            raise ValueError(f"config {cfg.name!r} has vocab_size={cfg.vocab_size}; the embedded byte-level corpus "
                             f"needs >= 259; pass --data")
        data = pipeline.default_data_dir(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)
    return pipeline.make_dataset(data, batch_size=opts.batch_size, seq_len=opts.seq_len, seed=opts.seed,
                                 shard_index=0, shard_count=1, vocab_size=cfg.vocab_size, split=split)


def train_draft(target: K3Model, opts: DraftOptions, batches: Iterator[dict], *, layer: Eagle3Layer | None = None,
                save: Callable[[Eagle3Layer, int, dict], None] | None = None, save_every: int = 0,
                log_fn: Callable[[str], None] = print) -> tuple[Eagle3Layer, list[dict]]:
    """`opts.steps` steps on `batches`; returns the trained draft and every step's metrics (floats)."""
    trainer = DraftTrainer(target, layer if layer is not None else new_draft(target.cfg, opts), opts)
    history, start = [], time.time()
    for i in range(opts.steps):
        metrics = {k: float(v) for k, v in trainer.step(next(batches)).items()}
        history.append(metrics)
        step = i + 1
        if step == 1 or step % opts.log_every == 0 or step == opts.steps:
            log_fn(f"step {step}: loss {metrics['loss']:.4f}, accept@1 {metrics['accept_s1']:.3f}, accept@"
                   f"{opts.unroll_steps} {metrics[f'accept_s{opts.unroll_steps}']:.3f}, top1@1 "
                   f"{metrics['top1_s1']:.3f}, grad norm {metrics['grad_norm']:.3f} ({time.time() - start:.1f} s)")
        if save is not None and save_every and step % save_every == 0 and step < opts.steps:
            save(trainer.layer, step, metrics)
    layer = trainer.layer
    if save is not None:
        save(layer, opts.steps, history[-1] if history else {})
    return layer, history


# ------------------------------------------------------------------------------------------ entry point

_INIT = flags.DEFINE_string("init_from", None, "The target: a converted k3jax checkpoint (python -m k3jax.convert).")
_OUT = flags.DEFINE_string("out", None, "Directory the draft is written to (atomically; --overwrite replaces it).")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace an existing --out.")
_DATA = flags.DEFINE_string("data", None, "Prepared data dir (python -m k3jax.data.prepare); default: embedded corpus.")
_STEPS = flags.DEFINE_integer("steps", 2000, "Training steps.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per sequence (documents packed).")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Peak AdamW learning rate (warmup, then cosine to 10%).")
_WARMUP = flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.")
_WD = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
_UNROLL = flags.DEFINE_integer("unroll_steps", DEFAULT_UNROLL_STEPS, "Training-time-test steps unrolled (EAGLE-3).")
_BLOCKS = flags.DEFINE_string("feature_blocks", None, "Three AttnRes block numbers, e.g. 1,4,-1 (-1: the last); "
                              "default: 1, 4 and the last.")
_SET = flags.DEFINE_multi_string("set", [], "Runtime override of the target key=value (repeatable), e.g. "
                                 "--set kda_impl=chunked.")
_DTYPE = flags.DEFINE_string("dtype", None, "Target parameter and compute dtype (default: the checkpoint's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for the draft's init and the data order.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Log every N steps.")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 0, "Also save every N steps (0: only at the end).")


def _parse_blocks(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--feature_blocks={text!r} is not a comma-separated list of integers") from None


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        if not _INIT.value or not _OUT.value:
            raise ValueError("--init_from (the target checkpoint) and --out (the draft directory) are required")
        opts = DraftOptions(steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ.value,
                            learning_rate=_LR.value, warmup_steps=_WARMUP.value, weight_decay=_WD.value,
                            unroll_steps=_UNROLL.value, feature_blocks=_parse_blocks(_BLOCKS.value), seed=_SEED.value,
                            log_every=_LOG_EVERY.value)
        cfg, target = load_checkpoint(_INIT.value, dtype=_DTYPE.value, overrides=tuple(_SET.value))
        layer = new_draft(cfg, opts)  # bad feature blocks or a plain-residual target fail here, before the data
        batches = data_iterator(cfg, _DATA.value, opts)
        print(f"target {cfg.name} from {_INIT.value}; draft on blocks {list(layer.feature_blocks)}, "
              f"{opts.unroll_steps} unrolled steps, {opts.steps} steps of {opts.batch_size} x {opts.seq_len}",
              flush=True)

        AtomicDir(_OUT.value, _OVERWRITE.value).check()  # an existing --out fails now, not after training
        saved = []

        def save(layer, step, metrics):
            info = {"step": step, "metrics": metrics, "init_from": _INIT.value, "data": _DATA.value,
                    "options": dataclasses.asdict(opts)}
            path = save_eagle3(layer, _OUT.value, overwrite=_OVERWRITE.value or bool(saved), info=info)
            saved.append(step)
            print(f"saved the draft (step {step}) to {path}", flush=True)

        train_draft(target, opts, batches, layer=layer, save=save, save_every=_SAVE_EVERY.value,
                    log_fn=lambda m: print(m, flush=True))
    except (ValueError, ConfigError, CheckpointError, DraftCheckpointError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run()
