"""The pretraining loop behind `train.py`: per-head Muon + AdamW, Quantile Balancing, MTP, packed Grain data, an
explicit mesh, Orbax checkpoints with exact resume, metrics (loss, grad norm, lr, tokens/s, MFU, expert load).

One jitted step (`k3jax.training.step.make_sharded_train_step`) does: forward (main model + MTP layer) with document
packing (segment ids), loss = LM loss + mtp_weight · MTP loss, gradients, optimizer update, then Quantile Balancing
sets every MoE layer's router bias from the margin histogram the forward recorded (used from the next step).

Start-up, in this order, so that a job that cannot run stops within seconds: the mesh (`--mesh` absent or 'auto':
the config's parallelism plan over `jax.device_count()`, `sharding.plan`), the data's metadata, the resume check,
the per-device memory estimate (`memory.check_fit`: parameters, gradients, optimizer state, one micro-batch's
activations; a `DoesNotFitError` names the smallest TPU slice that fits), the step compiled on abstract state for
every context stage with the compiler's per-device memory checked against the device (`compile_ahead`), then the
model.
Precision: parameters are stored in `cfg.runtime.param_dtype` (`train.py`: float32 masters, every matmul in
`cfg.runtime.dtype`) and the optimizer state in `opts.state_dtype` (float32 by default). Input:
`global_batch.make_global_dataset` (each process reads the rows of its data-parallel shards). Only process 0 logs
and writes metrics; every process takes part in checkpoint saves (Orbax). With `eval_every`, a held-out LM loss
(`k3jax.training.evaluate`; with expert QAT also the quantized model's) every N steps, in the progress line and the
metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import configs
from k3jax.config import ModelConfig
from k3jax.convert.checkpoint import read_manifest
from k3jax.convert.hf_config import check_config
from k3jax.data import multimodal_pipeline as mm_pipeline
from k3jax.data import pipeline, prepare
from k3jax.data.global_batch import make_global_dataset
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer
from k3jax.param_count import count_params
from k3jax.training import checkpointing
from k3jax.training import multimodal as mm
from k3jax.training.balancing import apply_quantile_balancing, routing_load_metrics
from k3jax.training.evaluate import Evaluator, format_eval
from k3jax.training.init_from import init_mtp, init_weights
from k3jax.training.loss import masked_mean, mtp_loss, token_counts
from k3jax.training.memory import GIB, check_compiled_fit, check_fit, format_compiled
from k3jax.training.metrics import MetricsLog, format_duration, model_flops_per_token, peak_flops_per_device
from k3jax.training.optimizer import make_optimizer
from k3jax.training.options import TrainOptions, stage_at
from k3jax.training.step import make_sharded_train_step
from sharding.expert_parallel import expert_parallel_metrics
from sharding.mesh import describe, make_mesh
from sharding.plan import mesh_sizes_for, plan_for, plan_text
from sharding.rules import LOGICAL_AXIS_RULES
from sharding.shard import plan_shardings

log = logging.getLogger(__name__)


# Training keeps f32 master parameters (matmuls still run in cfg.runtime.dtype, bf16); `--set param_dtype=` overrides.
TRAIN_PARAM_DTYPE = "float32"


def training_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """The named config as training runs it: parameters in TRAIN_PARAM_DTYPE unless `overrides` (`--set`) name
    param_dtype; the compute dtype stays the config's."""
    return configs.get_config(name, [f"param_dtype={TRAIN_PARAM_DTYPE}", *overrides])


class SetupError(ValueError):
    """A mesh, batch or data option that does not fit the devices or the data (train.py: one `error:` line)."""


class StoppedBySignal(Exception):
    """SIGTERM / SIGINT stopped training before its last step, after saving a checkpoint when there is a workdir:
    the run is not finished (train.py exits non-zero so a scheduler restarts it). `losses`: the steps that ran;
    `last_saved`: the newest checkpointed step."""

    def __init__(self, message: str, losses: list[float], last_saved: int):
        super().__init__(message)
        self.losses, self.last_saved = losses, last_saved


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite (nothing is saved from that step on)."""


class Trainable(nnx.Module):
    """What the optimizer trains: the model, (optionally) its MTP layer and (multimodal) the vision tower, whose
    tokens replace the `placeholder_id` embeddings (k3jax/training/multimodal.py)."""

    def __init__(self, cfg: ModelConfig, *, mtp: bool, rngs: nnx.Rngs, vision=None, placeholder_id: int = -1):
        self.model = K3Model(cfg, rngs=rngs)
        self.mtp = MTPLayer(cfg, rngs=rngs) if mtp else None
        self.vision = mm.make_vision_model(cfg, vision, rngs) if vision is not None else None
        self.placeholder_id = placeholder_id


def loss_fn(trainable: Trainable, batch: dict, mtp_weight: float):
    """LM loss (+ mtp_weight · MTP loss) over the unmasked positions of a packed batch. A micro-batch of gradient
    accumulation carries its whole batch's `token_counts` ("lm_tokens", "mtp_tokens") as the denominators."""
    model = trainable.model
    segment_ids = batch.get("segment_ids")
    if trainable.vision is not None:
        h = mm.hidden_states(trainable, batch)
    else:
        h = model.hidden_states(batch["input_ids"], segment_ids)
    lm = masked_mean(model.token_losses(h, batch["targets"]), batch["loss_mask"], denominator=batch.get("lm_tokens"))
    metrics = {"lm_loss": lm}
    loss = lm
    if trainable.mtp is not None:
        extra = mtp_loss(model, trainable.mtp, h, batch["targets"], batch["loss_mask"], segment_ids,
                         denominator=batch.get("mtp_tokens"))
        metrics["mtp_loss"] = extra
        loss = lm + mtp_weight * extra
    return loss, metrics


def after_update(trainable: Trainable, grads, *, balance: bool) -> dict:
    metrics = {"grad_norm": optax.global_norm(grads),
               "param_norm": optax.global_norm(nnx.state(trainable, nnx.Param)),  # finite => safe to save
               **routing_load_metrics(trainable), **expert_parallel_metrics(trainable)}
    if balance:
        apply_quantile_balancing(trainable)
    return metrics


def make_trainable(cfg: ModelConfig, opts: TrainOptions) -> tuple[Trainable, nnx.Optimizer]:
    """A freshly initialised model (+ MTP layer) and its optimizer (unplaced)."""
    vision, placeholder = mm.vision_setup(cfg, opts.vision_config, opts.data)
    trainable = Trainable(cfg, mtp=opts.mtp, rngs=nnx.Rngs(opts.seed), vision=vision,
                          placeholder_id=-1 if placeholder is None else placeholder)
    schedule = opts.schedule()
    state_dtype = jnp.dtype(opts.state_dtype)
    if opts.optimizer == "muon":
        tx = make_optimizer(trainable, learning_rate=schedule, weight_decay=opts.weight_decay,
                            max_grad_norm=opts.max_grad_norm, mu_dtype=state_dtype, ns_dtype=opts.muon_ns_dtype)
    else:
        tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=opts.weight_decay, mu_dtype=state_dtype)
        if opts.max_grad_norm is not None:
            tx = optax.chain(optax.clip_by_global_norm(opts.max_grad_norm), tx)
    return trainable, nnx.Optimizer(trainable, _state_in(tx, state_dtype), wrt=mm.trainable_params(cfg))


def _state_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` whose floating-point state is stored in `dtype` (every moment, also AdamW's second one, which optax
    keeps in the parameters' dtype); the update itself computes in the promoted (f32) type."""
    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(tx.init(params))

    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return updates, cast(state)

    return optax.GradientTransformation(init, update)


def run_config(cfg: ModelConfig) -> ModelConfig:
    """The config a training run uses: `cfg` with routing statistics recorded (the expert-load metrics always;
    Quantile Balancing when `opts.quantile_balancing`)."""
    return cfg if cfg.runtime.record_routing_stats else cfg.replace(record_routing_stats=True)


def build(cfg: ModelConfig, opts: TrainOptions, mesh, *, abstract: bool = False):
    """(trainable, optimizer, step function, lr schedule) on `mesh`.

    Initialisation runs as one jitted function whose outputs are already in their shardings (no process ever
    holds the whole model). With `abstract`, nothing is allocated: model and optimizer are shape-only
    (`nnx.eval_shape`), for compile-only runs.
    """
    cfg = run_config(cfg)
    abstract_pair = nnx.eval_shape(lambda: make_trainable(cfg, opts))
    if abstract:
        trainable, optimizer = abstract_pair
    else:
        graphdef, abstract_state = nnx.split(abstract_pair)
        shardings = plan_shardings(abstract_state, mesh).shardings
        state = jax.jit(lambda: nnx.state(make_trainable(cfg, opts)), out_shardings=shardings)()
        trainable, optimizer = nnx.merge(graphdef, state)
    step = make_sharded_train_step(
        trainable, optimizer, mesh, lambda t, b: loss_fn(t, b, opts.mtp_weight), has_aux=True,
        after_update=lambda t, g: after_update(t, g, balance=opts.quantile_balancing), grad_accum=opts.grad_accum,
        accumulate_context=lambda b: token_counts(b["targets"], b["loss_mask"]), wrt=mm.trainable_params(cfg))
    return trainable, optimizer, step, opts.schedule()


def make_mesh_from_option(text: str | None, cfg: ModelConfig | None = None):
    """The training mesh: `text` None or 'auto' -> the config's plan over `jax.device_count()`
    (`sharding.plan.mesh_sizes_for`), else 'data,expert,context,model'. A mesh of n < all devices takes n / P
    devices of each of the P processes (the first ones of each), so every process holds part of it."""
    try:
        sizes = mesh_sizes_for(text, cfg if cfg is not None else {}, jax.device_count())
        n = math.prod(sizes.values())
        if n >= jax.device_count():
            return make_mesh(**sizes)
    except ValueError as e:
        raise SetupError(f"--mesh={text or 'auto'}: {e}") from None
    procs = jax.process_count()
    log.warning("mesh %s uses %d of %d devices", text, n, jax.device_count())
    if procs == 1:
        return make_mesh(**sizes, devices=jax.devices()[:n])
    if n % procs:
        raise SetupError(f"mesh {text} has {n} devices, not a multiple of the {procs} processes: every process "
                         f"must hold the same number of the mesh's devices")
    per = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = [d for p in range(procs) for d in [x for x in per if x.process_index == p][:n // procs]]
    return make_mesh(**sizes, devices=devices)


def data_parallel_size(mesh) -> int:
    """Rows of a batch are split over the 'batch' rule's mesh axes (data x expert)."""
    axes = LOGICAL_AXIS_RULES["batch"]
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    return math.prod(mesh.shape[a] for a in axes)


def check_batch(opts: TrainOptions, mesh) -> None:
    """batch_size / grad_accum rows per micro-batch, split evenly over the data-parallel shards."""
    dp = data_parallel_size(mesh)
    micro = opts.batch_size // opts.grad_accum
    if micro % dp:
        raise SetupError(f"--batch_size={opts.batch_size} / --grad_accum={opts.grad_accum} = {micro} rows per "
                         f"micro-batch must be a multiple of the data-parallel size {dp} (data x expert of mesh "
                         f"{dict(mesh.shape)}): every data-parallel shard holds the same number of rows; use "
                         f"--batch_size a multiple of {dp * opts.grad_accum}")


def check_memory(cfg: ModelConfig, opts: TrainOptions, mesh, log_fn: Callable[[str], None]) -> dict:
    """`memory.check_fit` for what training holds (parameters in cfg.runtime.param_dtype, no separate master, optimizer
    state in opts.state_dtype, one micro-batch at the longest context stage); logs the per-device figures. The step is
    then compiled before anything is allocated (`compile_ahead`), so the estimate refuses only when parameters,
    gradients and optimizer state alone exceed the device."""
    seq_len = max([opts.seq_len] + [length for _, length in opts.context_stages])
    est = check_fit(cfg, mesh, batch_size=opts.batch_size // opts.grad_accum, seq_len=seq_len,
                    optimizer=opts.optimizer, mtp=opts.mtp, master_dtype=None, state_dtype=opts.state_dtype,
                    plan=plan_for(cfg), compiled_check_follows=True)
    run = cfg.runtime
    log_fn(f"memory per device (estimate): params {est['params'] / GIB:.2f} GiB ({run.param_dtype}, compute "
           f"{run.dtype}), gradients {est['gradients'] / GIB:.2f} GiB, optimizer state {est['optimizer'] / GIB:.2f} "
           f"GiB ({opts.state_dtype}), activations {est['activations'] / GIB:.2f} GiB ({est['rows_per_device']} x "
           f"{seq_len} tokens per micro-batch), other {(est['other_state'] + est['batch']) / GIB:.2f} GiB; total "
           f"{est['total'] / GIB:.2f} of {est['usable_bytes'] / GIB:.2f} GiB usable ({est['device_bytes_source']})"
           + ("; over by the estimate, the compiled step decides" if est["over"] else ""))
    return est


def compile_ahead(cfg: ModelConfig, opts: TrainOptions, mesh, est: dict, log_fn: Callable[[str], None]):
    """Compiles the step for every context stage's batch shape (`pipeline.batch_shapes`, or the multimodal
    pipeline's) on abstract state (nothing allocated) and checks the compiler's per-device memory against the device
    (`memory.check_compiled_fit`): a step that cannot fit raises `DoesNotFitError` here, before the model is built.
    Returns the abstract step's jitted function holding the executables (the real step adopts them, so nothing
    compiles twice); None for a step that is not `make_sharded_train_step`'s."""
    trainable, optimizer, step, _ = build(cfg, opts, mesh, abstract=True)
    if not hasattr(getattr(step, "jitted", None), "compile_ahead"):
        return None
    state = nnx.state((trainable, optimizer))
    vcfg = mm.vision_setup(cfg, opts.vision_config, opts.data)[0]
    for seq_len in sorted({opts.seq_len, *(length for _, length in opts.context_stages)}):
        shapes = (pipeline.batch_shapes(opts.batch_size, seq_len) if vcfg is None else
                  mm_pipeline.batch_shapes(vcfg, batch_size=opts.batch_size, seq_len=seq_len,
                                           max_patches=opts.max_patches))
        batch = {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}
        log_fn(f"compiling the training step for {opts.batch_size} x {seq_len} tokens before allocating "
               f"(minutes for a large model)")
        t0 = time.perf_counter()
        compiled = step.jitted.compile_ahead(state, batch)
        fit = check_compiled_fit(compiled, cfg, est, batch_size=opts.batch_size, seq_len=seq_len)
        if fit["total"]:
            log_fn(f"memory per device (compiled, {opts.batch_size} x {seq_len}): {fit['total'] / GIB:.2f} GiB "
                   f"({format_compiled(fit['per_device'])}) of {fit['usable_bytes'] / GIB:.2f} GiB usable; "
                   f"compiled in {time.perf_counter() - t0:.0f} s")
        elif est["over"]:  # no compiler figure to overrule the estimate
            check_fit(cfg, mesh, batch_size=opts.batch_size // opts.grad_accum, seq_len=seq_len,
                      optimizer=opts.optimizer, mtp=opts.mtp, master_dtype=None, state_dtype=opts.state_dtype,
                      plan=plan_for(cfg))
    return step.jitted


def data_dir_for(cfg: ModelConfig, opts: TrainOptions) -> str:
    """`opts.data`, or the embedded corpus prepared on the fly (byte tokens) when no data is given."""
    if opts.data is not None:
        return opts.data
    if cfg.vocab_size < 259:
        raise SetupError(f"config {cfg.name!r} has vocab_size={cfg.vocab_size}; the embedded byte-level corpus "
                         f"needs >= 259 (256 bytes + BOS/EOS/PAD); pass --data with a matching tokenizer")
    return pipeline.default_data_dir(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id)


def make_evaluator(cfg: ModelConfig, opts: TrainOptions, mesh, log_fn: Callable[[str], None]) -> Evaluator | None:
    """The run's eval pass (None without `eval_every`), its data checked: `--eval_data`, or the held-out split of
    the training data."""
    if not opts.eval_every:
        return None
    held_out = opts.eval_data is None
    evaluator = Evaluator(cfg, mesh, data_dir_for(cfg, opts) if held_out else opts.eval_data,
                          "heldout" if held_out else "all", opts.batch_size // opts.grad_accum, opts.eval_batches,
                          opts.eval_every)
    log_fn(evaluator.check())
    return evaluator


def data_metadata(cfg: ModelConfig, opts: TrainOptions) -> tuple[str, dict]:
    """(`data_dir_for`, its prepared metadata); SetupError (or FileNotFoundError) for data the config cannot read."""
    data_dir = data_dir_for(cfg, opts)
    try:
        meta = prepare.read_metadata(data_dir)
    except ValueError as e:  # another format, or unparsable JSON
        raise SetupError(str(e)) from None
    if int(meta["vocab_size"]) > cfg.vocab_size:
        raise SetupError(f"data in {data_dir} was tokenized with vocab_size={meta['vocab_size']}, larger than "
                         f"config {cfg.name!r}'s vocab_size={cfg.vocab_size}")
    return data_dir, meta


def open_data(cfg: ModelConfig, opts: TrainOptions, log_fn: Callable[[str], None], mesh, *, seq_len: int,
              stage: int = 0):
    """Global batches on `mesh` (`global_batch.make_global_dataset`: each process reads its data-parallel shards)
    from `data_dir_for` (prepared with `python -m k3jax.data.prepare`), its `opts.train_split` documents. Context
    stage s reads with seed + s. Multimodal (`opts.vision_config`): `multimodal.open_data`."""
    if opts.vision_config is not None:
        vcfg = mm.vision_setup(cfg, opts.vision_config, opts.data)[0]
        return mm.open_data(cfg, vcfg, opts.data, mesh, batch_size=opts.batch_size, seq_len=seq_len,
                            max_patches=opts.max_patches, seed=opts.seed + stage, log_fn=log_fn)
    data_dir, meta = data_metadata(cfg, opts)
    log_fn(f"data: {data_dir} ({meta.get('num_documents', '?')} documents, {meta.get('num_tokens', '?')} tokens), "
           f"seq_len {seq_len}")
    return make_global_dataset(data_dir, mesh, batch_size=opts.batch_size, seq_len=seq_len, seed=opts.seed + stage,
                               split=opts.train_split)


def train(cfg: ModelConfig, opts: TrainOptions, *, data=None, log_fn: Callable[[str], None] = print) -> list[float]:
    """Trains for `opts.steps` steps (resuming from `opts.workdir` when it has a checkpoint); returns this run's
    per-step losses. `data`: a Grain iterator of packed batches (default: `open_data`, one per context stage).
    Raises `memory.DoesNotFitError` before anything is allocated when the step cannot fit the devices."""
    if data is not None and opts.context_stages:
        raise ValueError("context stages need the trainer to open each stage's data itself (pass data=None)")
    if data is not None and opts.train_split != "all":
        raise ValueError("an eval on the held-out split needs the trainer's own data, which leaves it out (pass "
                         "data=None, or eval_data)")
    if jax.process_index() != 0:  # one log and one metrics file per run
        log_fn = _quiet
    mesh = make_mesh_from_option(opts.mesh, cfg)
    cfg = run_config(cfg)
    log_fn(f"mesh: {describe(mesh)} from {opts.mesh or 'auto'} (plan {plan_text(plan_for(cfg))}); "
           f"{jax.process_count()} process(es), {jax.local_device_count()} local devices each")
    check_batch(opts, mesh)
    if data is None and opts.vision_config is None:
        data_metadata(cfg, opts)  # a missing or unreadable --data stops here, before the compile
    log_fn(f"tokens per step: {opts.batch_size} x {opts.seq_len} = {opts.batch_size * opts.seq_len:,}"
           + (f" ({opts.grad_accum} micro-batches of {opts.batch_size // opts.grad_accum} rows)"
              if opts.grad_accum > 1 else ""))
    est = check_memory(cfg, opts, mesh, log_fn)
    evaluator = make_evaluator(cfg, opts, mesh, log_fn)
    # the checkpoint's setup is checked before the model is built: a mismatch or a finished run costs no init
    manager = checkpointing.make_manager(opts.workdir, max_to_keep=opts.keep_checkpoints) if opts.workdir else None
    dp = data_parallel_size(mesh)
    meta = {"config": dataclasses.asdict(cfg), "options": opts.resume_keys(), "data_parallel_size": dp,
            "schedule": {"steps": opts.steps, "learning_rate": opts.learning_rate}}
    start = 0
    candidates: list[tuple[int, dict]] = []  # (step, metadata) newest first, of the steps whose metadata reads
    try:
        if manager is not None and opts.resume and manager.all_steps():
            candidates = checkpointing.readable_steps(manager, log_fn)
            if not candidates:
                raise checkpointing.CheckpointCorruptError(checkpointing.none_verify(opts.workdir))
            start, saved = candidates[0]
            checkpointing.check_resume(saved, cfg, opts.resume_keys(), dp, dict(mesh.shape),
                                       checkpointing.step_path(manager, start), data is None)
        if opts.init_from and not start:  # a missing or malformed checkpoint is reported before the build
            check_config(read_manifest(opts.init_from)[1], cfg)
        if start < opts.steps:
            ahead = compile_ahead(cfg, opts, mesh, est, log_fn)
            trainable, optimizer, step_fn, schedule = build(cfg, opts, mesh)
            if ahead is not None:
                step_fn.jitted.adopt(ahead)
    except BaseException:
        if manager is not None:
            manager.close()
        raise
    if start >= opts.steps:
        log_fn(f"nothing to do: checkpoint step {start} >= --steps {opts.steps}")
        if manager is not None:
            manager.close()
        return []
    counts = _param_counts(trainable)
    log_fn(f"model: config={cfg.name} params={counts['total']:,} (mtp {counts['mtp']:,}) "
           f"mesh={dict(mesh.shape)} optimizer={opts.optimizer} quantile_balancing={opts.quantile_balancing}")
    stage, seq_len = stage_at(opts, max(start, 1))
    own_data = data is None
    if data is None:
        data = open_data(cfg, opts, log_fn, mesh, seq_len=seq_len, stage=stage)
    if start:
        start = checkpointing.restore_newest_verified(
            manager, candidates, (trainable, optimizer), data, opts.workdir, log_fn,
            check=lambda saved, path: checkpointing.check_resume(saved, cfg, opts.resume_keys(), dp,
                                                                 dict(mesh.shape), path, own_data))
        note = checkpointing.schedule_change(dict(candidates)[start], opts, start)
        if note:
            log_fn(note)
    elif opts.init_from:
        init_weights(trainable.model, opts.init_from, mesh)
        if trainable.vision is not None and mm.init_vision(trainable.vision, opts.init_from):
            log_fn(f"initialised the vision tower from {opts.init_from}")
        log_fn(f"initialised the model from {opts.init_from}")
        if trainable.mtp is not None:
            log_fn(f"initialised the MTP layer from {opts.init_from}" if init_mtp(trainable.mtp, opts.init_from)
                   else f"the MTP layer starts from random weights ({opts.init_from} holds none)")

    active = count_params(cfg)["active_params"]
    peak = peak_flops_per_device()
    metrics_log = MetricsLog(opts.workdir if jax.process_index() == 0 else None, resumed_step=start)
    stop = _SignalFlag()
    losses: list[float] = []
    pending: list[tuple[int, jax.Array, dict]] = []
    t_window = time.perf_counter()
    steps_in_window = 0
    last_saved = start
    finished = False
    last_step = max(start + 1, min(opts.steps, opts.halt_at_step or opts.steps))
    t_first = time.perf_counter()  # reset when the first step is done: the ETA is the mean step time since then
    try:
        for i in range(start + 1, opts.steps + 1):
            new_stage, new_len = stage_at(opts, i)
            if new_stage != stage:
                _close(data)
                stage, seq_len = new_stage, new_len
                log_fn(f"step {i}: context stage {stage}: seq_len {seq_len}")
                data = open_data(cfg, opts, log_fn, mesh, seq_len=seq_len, stage=stage)
            batch = next(data)
            loss, metrics = step_fn(trainable, optimizer, batch)
            pending.append((i, loss, metrics))
            steps_in_window += 1
            is_last = i == opts.steps or (opts.halt_at_step is not None and i >= opts.halt_at_step)
            stage_ends = stage_at(opts, i + 1)[0] != stage
            save_now = manager is not None and (is_last or stop.raised
                                                or (opts.checkpoint_every and i % opts.checkpoint_every == 0))
            evaluate = evaluator is not None and evaluator.due(i, final=i == opts.steps)
            if i == start + 1 or i % opts.log_every == 0 or save_now or is_last or stage_ends or evaluate:
                elapsed = time.perf_counter() - t_window
                done = _drain(pending, losses)  # raises NonFiniteLossError before anything is saved
                if i == start + 1:
                    t_first = time.perf_counter()
                eta_s = (last_step - i) * (time.perf_counter() - t_first) / max(i - start - 1, 1)
                m = {k: float(v) for k, v in done[-1][2].items()}
                if evaluate:  # after the window's timing: its time is not counted in tokens/s
                    m.update(evaluator.run(trainable.model, seq_len))
                tps = opts.batch_size * seq_len * steps_in_window / max(elapsed, 1e-9)
                m.update(loss=losses[-1], learning_rate=float(schedule(i - 1)), tokens_per_s=tps, seq_len=seq_len)
                if peak:
                    flops_per_token = model_flops_per_token(cfg, seq_len, active_params=active, mtp=opts.mtp)
                    m["mfu"] = tps * flops_per_token / (peak * jax.device_count())
                metrics_log.write(i, m)
                log_fn(_format(i, m, first=(i == start + 1), elapsed=elapsed, eta_s=eta_s))
                t_window, steps_in_window = time.perf_counter(), 0
            if save_now or (manager is not None and stop.raised):  # a signal during this step's logging too
                checkpointing.save(manager, i, nnx.state((trainable, optimizer)), data, {**meta, "step": i})
                last_saved = i
            if stop.raised or is_last:
                finished = is_last
                break
    finally:
        if manager is not None:
            manager.wait_until_finished()
            manager.close()
        stop.restore()
        _close(data)
    if stop.raised and not finished:
        where = (f"checkpoint of step {last_saved} saved in {opts.workdir}; run the same command to resume"
                 if manager is not None else "nothing saved (no --workdir)")
        raise StoppedBySignal(f"stopped by a signal after step {start + len(losses)} of {opts.steps}: {where}",
                              losses, last_saved)
    return losses


def _close(data) -> None:
    close = getattr(data, "close", None)
    if close is not None:
        close()


def _quiet(msg: str) -> None:
    del msg


def _drain(pending, losses):
    """Fetches the pending steps' losses; raises NonFiniteLossError at the first step whose loss or updated
    parameters are not finite (before anything from that step is saved)."""
    done = list(pending)
    pending.clear()
    fetched = jax.device_get([(l, m["param_norm"]) for _, l, m in done])
    for (i, _, _), (loss, pnorm) in zip(done, fetched):
        loss, pnorm = float(loss), float(pnorm)
        if not (math.isfinite(loss) and math.isfinite(pnorm)):
            what = f"loss became {loss}" if not math.isfinite(loss) else f"parameters became {pnorm} (norm)"
            raise NonFiniteLossError(f"{what} at step {i}; nothing was saved from this step on. Lower "
                                     f"--learning_rate, check the data, or resume from the last checkpoint")
        losses.append(loss)
    return done


def _format(step: int, m: dict, *, first: bool, elapsed: float, eta_s: float | None = None) -> str:
    parts = [f"step {step}: loss {m['loss']:.4f}"]
    if "mtp_loss" in m:
        parts.append(f"lm {m['lm_loss']:.4f} mtp {m['mtp_loss']:.4f}")
    parts.append(f"grad_norm {m['grad_norm']:.3f} lr {m['learning_rate']:.2e}")
    if first:
        parts.append(f"(first step {elapsed:.1f}s)")
    else:
        parts.append(f"{m['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in m:
            parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "expert_load_max_over_mean" in m:
        parts.append(f"load max/mean {m['expert_load_max_over_mean']:.2f}")
    if "eval_loss" in m:
        parts.append(format_eval(m))
    if not first and eta_s:
        parts.append(f"ETA {format_duration(eta_s)}")
    return "  ".join(parts)


def _param_counts(trainable: Trainable) -> dict[str, int]:
    def count(module):
        return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))

    return {"total": count(trainable.model), "mtp": count(trainable.mtp) if trainable.mtp is not None else 0}


class _SignalFlag:
    """SIGTERM / SIGINT set a flag: the loop saves a checkpoint after the current step and exits cleanly."""

    def __init__(self):
        self.raised = False
        self._old = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: no handlers
            self._old = {}

    def _handle(self, signum, frame):
        if self.raised:  # a second signal: give up immediately
            raise KeyboardInterrupt
        self.raised = True
        log.warning("signal %s: saving a checkpoint after this step, then exiting", signum)

    def restore(self):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
