"""A minimal AdamW training loop for small configs (the README's first command). The pretraining issue replaces
its internals (Muon, Quantile Balancing, Grain, Orbax); the command line stays."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax
import numpy as np
import optax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.data.text import ByteTokenizer, random_windows, stdlib_corpus, token_stream
from k3jax.model import K3Model
from k3jax.training.loss import next_token_loss


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_fraction: float = 0.01
    weight_decay: float = 0.1
    seed: int = 0
    log_every: int = 20


class NonFiniteLossError(FloatingPointError):
    """Raised when the loss becomes NaN or infinite."""


def make_optimizer(opts: TrainOptions) -> optax.GradientTransformation:
    warmup = max(1, int(opts.warmup_fraction * opts.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, opts.learning_rate, warmup, max(opts.steps, warmup + 1))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=opts.weight_decay))


def make_train_step():
    """A jitted `step(model, optimizer, batch [B, T+1]) -> loss`: next-token loss, gradients, optimizer update."""

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            return next_token_loss(model(batch[:, :-1]), batch[:, 1:])

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return step


def train(cfg: ModelConfig, opts: TrainOptions, log=print) -> list[float]:
    """Trains on the embedded byte-level corpus; returns the per-step losses."""
    if cfg.vocab_size < 259:
        raise ValueError(f"config {cfg.name!r} has vocab_size={cfg.vocab_size}; byte-level data needs >= 259")
    tokenizer = ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size)
    tokens = token_stream(stdlib_corpus(), tokenizer)
    log(f"corpus: {len(tokens):,} byte tokens from the Python standard library")
    model = K3Model(cfg, rngs=nnx.Rngs(opts.seed))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log(f"model: config={cfg.name} params={n_params:,} layers={cfg.num_hidden_layers} "
        f"groups={[(g.start, len(g.pattern), g.num_repeats) for g in cfg.layer_groups()]}")
    optimizer = nnx.Optimizer(model, make_optimizer(opts), wrt=nnx.Param)

    step = make_train_step()
    batches = random_windows(tokens, opts.batch_size, opts.seq_len, opts.seed)
    losses: list[float] = []
    tokens_per_step = opts.batch_size * opts.seq_len
    t_start = t_window = time.perf_counter()
    for i in range(1, opts.steps + 1):
        loss = float(step(model, optimizer, next(batches)))
        if not np.isfinite(loss):
            raise NonFiniteLossError(f"loss became {loss} at step {i}; lower --learning_rate or check the data")
        losses.append(loss)
        if i == 1:
            log(f"step 1: loss {loss:.4f} (compile + first step {time.perf_counter() - t_start:.1f}s)")
            t_window = time.perf_counter()
        elif i % opts.log_every == 0 or i == opts.steps:
            elapsed = time.perf_counter() - t_window
            steps_in_window = opts.log_every if i % opts.log_every == 0 else i % opts.log_every
            log(f"step {i}: loss {loss:.4f}  {tokens_per_step * steps_in_window / max(elapsed, 1e-9):,.0f} tokens/s")
            t_window = time.perf_counter()
    logging.info("done")
    return losses
