"""Train a k3jax model: `python train.py --config=tiny` (CPU, embedded corpus) or `--config=k3` on a pod."""

from absl import app, flags

import configs
from k3jax.training.simple import TrainOptions, train

_CONFIG = flags.DEFINE_string("config", "tiny", f"Named config: {', '.join(configs.names())}.")
_SET = flags.DEFINE_multi_string("set", [], "Config override key=value (repeatable), e.g. --set kda_impl=recurrent.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate (1% warmup, cosine decay).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for init and data order.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Log every N steps.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = configs.get_config(_CONFIG.value, _SET.value)
    opts = TrainOptions(steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ.value,
                        learning_rate=_LR.value, seed=_SEED.value, log_every=_LOG_EVERY.value)
    losses = train(cfg, opts, log=lambda msg: print(msg, flush=True))
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    app.run(main)
