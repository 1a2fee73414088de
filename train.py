"""Train a k3jax model: `python train.py --config=tiny` (CPU, embedded corpus) or `--config=k3` on a pod.

Per-head Muon + AdamW, Quantile Balancing of the router biases, one MTP layer, packed Grain data, an explicit
mesh, Orbax checkpoints in --workdir (resumed automatically), metrics in <workdir>/metrics.jsonl.
"""

import json
import logging

from absl import app, flags

import configs
from k3jax.training.aot import compile_train_step
from k3jax.training.trainer import TrainOptions, parse_context_stages, train
from sharding.aot import libtpu_available
from sharding.mesh import initialize_distributed, parse_mesh

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
_MESH = flags.DEFINE_string("mesh", None, "data,expert,context,model sizes (e.g. 2,1,1,1); default: all on data.")
_RESUME = flags.DEFINE_boolean("resume", True, "Resume from the workdir's latest checkpoint when there is one.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for init and data order.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Log every N steps.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Save every N steps (also at the end and on SIGTERM).")
_STAGES = flags.DEFINE_string("context_stages", None,
                               "Context curriculum AFTER_STEP:SEQ_LEN,... e.g. 1000:65536,5000:262144.")
_INIT = flags.DEFINE_string("init_from", None, "Start from a converted k3jax checkpoint (python -m k3jax.convert).")
_COMPILE_ONLY = flags.DEFINE_boolean("compile_only", False,
                                     "Lower and compile one training step for --topology (a TPU pod slice, via libtpu "
                                     "on this machine) and print per-chip memory; nothing runs.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "TPU topology for --compile_only, e.g. v5p:8x8x8.")
_HALT = flags.DEFINE_integer("halt_at_step", None, "Stop (and save) after this step, as a preemption would.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("absl").setLevel(logging.WARNING)
    initialize_distributed()  # no-op unless launched multi-host
    cfg = configs.get_config(_CONFIG.value, _SET.value)
    opts = TrainOptions(
        workdir=_WORKDIR.value, steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ.value,
        learning_rate=_LR.value, weight_decay=_WD.value, optimizer=_OPT.value, quantile_balancing=_QB.value,
        mtp=_MTP.value, mtp_weight=_MTP_WEIGHT.value, data=_DATA.value, mesh=_MESH.value, resume=_RESUME.value,
        seed=_SEED.value, log_every=_LOG_EVERY.value, checkpoint_every=_CKPT_EVERY.value,
        halt_at_step=_HALT.value, context_stages=parse_context_stages(_STAGES.value), init_from=_INIT.value)
    if _COMPILE_ONLY.value:
        if not libtpu_available():
            raise app.UsageError("--compile_only needs libtpu (pip install 'jax[tpu]==<jax version>')")
        if opts.mesh is None:
            raise app.UsageError("--compile_only needs --mesh=data,expert,context,model for the topology's chips")
        print(json.dumps(compile_train_step(cfg, _TOPOLOGY.value, parse_mesh(opts.mesh), batch_size=opts.batch_size,
                                            seq_len=opts.seq_len, options=opts), indent=1))
        return
    if opts.workdir is None:
        print("no --workdir: checkpoints and metrics are not saved", flush=True)
    losses = train(cfg, opts, log_fn=lambda msg: print(msg, flush=True))
    if losses:
        print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    app.run(main)
