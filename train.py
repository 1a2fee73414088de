"""Train a k3jax model: `python train.py --config=tiny` (CPU, embedded corpus) or `--config=k3` on a pod.

Per-head Muon + AdamW, Quantile Balancing of the router biases, one MTP layer, packed Grain data, a mesh from the
config's parallelism plan (or --mesh), Orbax checkpoints in --workdir (resumed automatically), metrics in
<workdir>/metrics.jsonl. The same command runs on one process or on every host of a pod slice: it joins
`jax.distributed` from TPU auto-detection or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
(docs/pod.md). Parameters are f32 masters (bf16 compute) unless --set param_dtype=...; optimizer state is
--state_dtype (f32). A step that cannot fit the devices stops before anything is allocated, naming the smallest
TPU v5p slice that fits.
"""

import glob
import json
import logging
import math
import os
import sys
import threading

import jax
from absl import app, flags

import configs
from k3jax.atomic import os_error
from k3jax.config import ConfigError
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.training.aot import compile_train_step
from k3jax.training.checkpointing import CheckpointCorruptError, CheckpointMismatchError
from k3jax.training.evaluate import EvalDataError
from k3jax.training.export import export_checkpoint
from k3jax.training.memory import DoesNotFitError, estimate_memory, format_breakdown, knob_hints
from k3jax.training.options import STATE_DTYPES, parse_context_stages
from k3jax.training.trainer import SetupError, StoppedBySignal, TrainOptions, train, training_config
from sharding.aot import missing_compiler, parse_gpu_target, quiet_compile_only_process
from sharding.mesh import initialize_distributed, is_multi_host_launch
from sharding.plan import mesh_sizes_for

_CONFIG = flags.DEFINE_string("config", "tiny", f"Named config: {', '.join(configs.names())}.")
_SET = flags.DEFINE_multi_string("set", [], "Config override key=value (repeatable), e.g. --set kda_impl=recurrent.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics.jsonl go here; without it nothing is saved.")
_STEPS = flags.DEFINE_integer("steps", 300, "Total training steps (the schedule's length).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step (global, over all processes).")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence (documents are packed into it).")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate (1% warmup, cosine decay).")
_WD = flags.DEFINE_float("weight_decay", 0.1, "Decoupled weight decay (Muon and AdamW).")
_OPT = flags.DEFINE_enum("optimizer", "muon", ["muon", "adamw"], "Per-head Muon + AdamW, or AdamW everywhere.")
_QB = flags.DEFINE_boolean("quantile_balancing", True, "Quantile Balancing of the MoE router biases.")
_MTP = flags.DEFINE_boolean("mtp", True, "Train one multi-token-prediction layer (predicts t+2).")
_MTP_WEIGHT = flags.DEFINE_float("mtp_weight", 0.3, "Weight of the MTP loss.")
_DATA = flags.DEFINE_string("data", None, "Prepared data dir (python -m k3jax.data.prepare); default: embedded corpus.")
_MESH = flags.DEFINE_string("mesh", None, "data,expert,context,model sizes (e.g. 2,1,1,1); absent or 'auto': the "
                            "config's parallelism plan over all devices (sharding/plan.py).")
_ACCUM = flags.DEFINE_integer("grad_accum", 1, "Micro-batches per optimizer step (must divide --batch_size).")
_STATE_DTYPE = flags.DEFINE_enum("state_dtype", "float32", list(STATE_DTYPES), "Optimizer state dtype.")
_INIT_TIMEOUT = flags.DEFINE_integer("distributed_timeout", 300, "Seconds to wait for every process to join.")
_RESUME = flags.DEFINE_boolean("resume", True, "Resume from the workdir's latest checkpoint when there is one.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for init and data order.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Log every N steps.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Save every N steps (also at the end and on SIGTERM).")
_STAGES = flags.DEFINE_string("context_stages", None,
                               "Context curriculum AFTER_STEP:SEQ_LEN,... e.g. 1000:65536,5000:262144.")
_INIT = flags.DEFINE_string("init_from", None, "Start from a converted k3jax checkpoint (python -m k3jax.convert).")
_COMPILE_ONLY = flags.DEFINE_boolean("compile_only", False,
                                     "Lower and compile one training step for --topology (a TPU pod slice via libtpu, "
                                     "or GPUs via jax's CUDA plugin, on this machine) and print per-chip memory; "
                                     "nothing runs.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "For --compile_only: a TPU slice (v5p:8x8x8) or GPUs of "
                                "one host (h200, h100, h200:8).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 0, "Held-out LM loss every N steps and after the last one (0: no "
                                   "eval); with expert QAT, of the quantized and the unquantized model.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 10, "Batches per eval (of batch_size / grad_accum rows each).")
_EVAL_DATA = flags.DEFINE_string("eval_data", None, "Prepared eval data dir; default: the held-out split of the "
                                 "training data (every 100th document, then left out of training).")
_VISION = flags.DEFINE_string("vision_config", None, "Multimodal: train a vision tower "
                              f"({', '.join(configs.vision_names())}) on --data from `python -m "
                              "k3jax.data.prepare_multimodal`; --set vision_trainable=false freezes it.")
_MAX_PATCHES = flags.DEFINE_integer("max_patches", 1024, "Multimodal: image patches per sequence (a multiple of the "
                                    "merge kernel; padded).")
_HALT = flags.DEFINE_integer("halt_at_step", None, "Stop (and save) after this step, as a preemption would.")
_EXPORT = flags.DEFINE_string("export_to", None, "Train nothing: write the model (with its MTP layer) of --workdir's "
                              "newest verified checkpoint (or --export_step) as a k3jax checkpoint here, for "
                              "serve.py --checkpoint and python -m k3jax.convert --to_hf (same --config / --set).")
_EXPORT_STEP = flags.DEFINE_integer("export_step", None, "With --export_to: the checkpoint step to export.")


def options_from_flags() -> TrainOptions:
    """The TrainOptions the flags give (ValueError naming a bad one)."""
    return TrainOptions(
        workdir=_WORKDIR.value, steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ.value,
        learning_rate=_LR.value, weight_decay=_WD.value, optimizer=_OPT.value, quantile_balancing=_QB.value,
        mtp=_MTP.value, mtp_weight=_MTP_WEIGHT.value, data=_DATA.value, mesh=_MESH.value, resume=_RESUME.value,
        seed=_SEED.value, log_every=_LOG_EVERY.value, checkpoint_every=_CKPT_EVERY.value,
        halt_at_step=_HALT.value, context_stages=parse_context_stages(_STAGES.value), init_from=_INIT.value,
        grad_accum=_ACCUM.value, state_dtype=_STATE_DTYPE.value, eval_every=_EVAL_EVERY.value,
        eval_batches=_EVAL_BATCHES.value, eval_data=_EVAL_DATA.value, vision_config=_VISION.value,
        max_patches=_MAX_PATCHES.value)


# Exit status of a run stopped by SIGTERM / SIGINT before its last step (after saving): 128 + SIGTERM, what a
# shell reports for a process the signal ended, so schedulers restart it rather than count it as done.
STOPPED_BY_SIGNAL = 143


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for name in ("absl", "jax"):  # our own lines only: no library INFO logs (e.g. "Unable to initialize backend")
        logging.getLogger(name).setLevel(logging.WARNING)
    if not _COMPILE_ONLY.value and not join_distributed(_INIT_TIMEOUT.value):  # compile-only: one process
        return 3
    try:
        cfg = training_config(_CONFIG.value, _SET.value)  # f32 master parameters unless --set param_dtype=...
        opts = options_from_flags()
    except ValueError as e:  # ConfigError included: an unknown --config or --set key, a malformed value
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if _COMPILE_ONLY.value:
        if opts.vision_config is not None:
            print("error: --compile_only compiles the text model only (no --vision_config)", file=sys.stderr)
            return 2
        return compile_only(cfg, opts, _TOPOLOGY.value)
    if _EXPORT.value is not None and (opts.workdir is None or opts.vision_config is not None):
        print("error: --export_to needs --workdir (a training run's directory) and exports text models only",
              file=sys.stderr, flush=True)
        return 2
    if opts.workdir is None:
        print("no --workdir: checkpoints and metrics are not saved", flush=True)
    try:
        if _EXPORT.value is not None:
            out = export_checkpoint(cfg, opts, _EXPORT.value, step=_EXPORT_STEP.value,
                                    log_fn=lambda msg: print(msg, flush=True))
            print(f"wrote {out}: serve it with `python serve.py --checkpoint={out}`, convert it with "
                  f"`python -m k3jax.convert --to_hf --checkpoint={out} --out=HF_DIR`", flush=True)
            return 0
        losses = train(cfg, opts, log_fn=lambda msg: print(msg, flush=True))
    except StoppedBySignal as e:  # preempted: not finished, so a scheduler must not count the job as done
        print(str(e), file=sys.stderr, flush=True)
        return STOPPED_BY_SIGNAL
    except DoesNotFitError as e:
        print(f"does not fit: {e}", file=sys.stderr, flush=True)
        return 2
    except (CheckpointError, ConfigError, CheckpointMismatchError, CheckpointCorruptError, EvalDataError,
            SetupError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # an unwritable --workdir (read-only, full disk) or an unreadable input
        print(f"error: {os_error(e)}", file=sys.stderr, flush=True)
        return 2
    if losses:
        print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}", flush=True)
    return 0


def on_tpu_vm() -> bool:
    """A Cloud TPU VM (its chips appear as /dev/accel* or /dev/vfio/N); compile-only hosts set TPU_SKIP_MDS_QUERY."""
    return not os.environ.get("TPU_SKIP_MDS_QUERY") and bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def join_distributed(timeout: int) -> bool:
    """`jax.distributed.initialize` when launched multi-process: on a TPU VM always (jax reads the slice's workers,
    coordinator and this host's id from the TPU metadata; one host is one process), elsewhere from
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or SLURM / Open MPI); a no-op for one process. A
    peer that does not join within `timeout` seconds makes jax's coordination client abort this process: a watchdog
    names the problem first (stderr)."""
    if not (is_multi_host_launch() or on_tpu_vm()):
        return True
    what = (f"{os.environ.get('JAX_NUM_PROCESSES', 'all')} processes at the coordinator "
            f"{os.environ.get('JAX_COORDINATOR_ADDRESS', '(auto-detected)')}")
    print(f"joining jax.distributed: waiting up to {timeout} s for {what}", flush=True)

    def complain():
        print(f"not all {what.replace(' at ', ' joined ')} within --distributed_timeout={timeout} s: start the "
              f"same command on every host (same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, a distinct "
              f"JAX_PROCESS_ID each); this process ends now", file=sys.stderr, flush=True)

    watchdog = threading.Timer(timeout, complain)
    watchdog.daemon = True
    watchdog.start()
    try:
        if not initialize_distributed(initialization_timeout=timeout):  # a TPU VM without the multi-host variables
            jax.distributed.initialize(initialization_timeout=timeout)
    except Exception as e:  # noqa: BLE001 - jax raises several types here; all mean the same to the user
        watchdog.cancel()
        complain()
        print(f"({type(e).__name__}: {str(e)[:400]})", file=sys.stderr, flush=True)
        return False
    watchdog.cancel()
    return True


def compile_only(cfg, opts: TrainOptions, topology: str) -> int:
    """Compiles one training step for `topology` (mesh from --mesh or the config's plan over its chips) and prints
    the compiler's per-chip memory next to the estimate."""
    try:
        gpu = parse_gpu_target(topology)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    need = missing_compiler(topology)
    if need:
        raise app.UsageError(f"--compile_only --topology={topology} needs {need}")
    quiet_compile_only_process(topology)
    try:
        chips = gpu[1] if gpu else math.prod(int(d) for d in topology.partition(":")[2].split("x"))
    except ValueError:
        raise app.UsageError(f"--topology={topology!r} is neither GEN:AxBxC (e.g. v5p:8x8x16) nor a GPU "
                             "(h200, h100:8)") from None
    sizes = mesh_sizes_for(opts.mesh, cfg, chips)
    print(f"compile only: {cfg.name} on {topology} ({chips} chips), mesh {sizes} from {opts.mesh or 'auto'}",
          flush=True)
    micro = opts.batch_size // opts.grad_accum
    est = estimate_memory(cfg, sizes, batch_size=micro, seq_len=opts.seq_len, optimizer=opts.optimizer,
                          mtp=opts.mtp, master_dtype=None, state_dtype=opts.state_dtype)
    print(f"estimate per chip: {est['total'] / 2**30:.2f} GiB ({format_breakdown(est)})", flush=True)
    try:
        out = compile_train_step(cfg, topology, sizes, batch_size=opts.batch_size, seq_len=opts.seq_len,
                                 options=opts)
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program far over the chip's memory
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        hints = knob_hints(cfg, est)
        print(f"does not fit on {topology}: {str(e).splitlines()[0]}" + (f"\ntry: {hints}" if hints else ""),
              file=sys.stderr, flush=True)
        return 2
    out.update(param_dtype=cfg.runtime.param_dtype, state_dtype=opts.state_dtype, grad_accum=opts.grad_accum,
               estimate_total_gib=round(est["total"] / 2**30, 2))
    print(json.dumps(out, indent=1))
    verdict = "fits" if out["fits"] else "does not fit"
    extra = (f", with {out['cudnn_workspace_gib']:.2f} GiB of cuDNN attention workspace added (a compile without a "
             f"GPU leaves it out)" if out.get("cudnn_workspace_gib") else "")
    print(f"compiled step: {out['per_chip_total_gib']:.2f} GiB per chip of {out['chip_gib']:.2f} GiB "
          f"({out['chip_gib_source']}{extra}): {verdict}", flush=True)
    return 0 if out["fits"] else 2


if __name__ == "__main__":
    app.run(main)
