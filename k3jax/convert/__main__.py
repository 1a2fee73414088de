"""HF safetensors <-> k3jax Orbax checkpoints.

  python -m k3jax.convert --hf_dir DIR --out DIR [--config NAME] [--dtype bf16|f32] [--experts bf16|mxfp4]
      [--text_only]
  python -m k3jax.convert --to_hf --checkpoint DIR --out DIR [--shard_size_gb 4] [--dtype bf16|f32]
      [--experts bf16|mxfp4]

Every input check (config.json, every safetensors header, tensor names/shapes/dtypes) runs before anything is
written; the output appears atomically (written as OUT.tmp-<pid>-<hex>, renamed when complete; a killed
conversion's leftover is removed by the next one, with a message); an existing OUT is replaced only with
--overwrite. A tensor holding NaN/Inf stops the conversion (naming it) unless --allow_nonfinite. Bad input or an
unwritable output ends with one `error: ...` line and exit status 2. The vision tower and projector
(`vision_tower.*` / `mm_projector.*`, checked against config.json's vision_config) are converted too, in their
stored dtypes; --text_only drops them instead (saying so) and records a text-only config.json for --to_hf.
"""

from __future__ import annotations

import logging
import sys
import time

from absl import app, flags

from k3jax.atomic import os_error
from k3jax.config import ConfigError
from k3jax.convert.checkpoint import hf_to_orbax
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.convert.to_hf import orbax_to_hf

flags.DEFINE_string("hf_dir", None, "HF directory: config.json + *.safetensors (+ model.safetensors.index.json)")
flags.DEFINE_string("out", None, "output directory (must not exist unless --overwrite)")
flags.DEFINE_string("config", None, "registry config name to check config.json against (and to use)")
flags.DEFINE_enum("dtype", None, ["bf16", "f32"],
                  "parameter dtype (default: config.json torch_dtype, or --config's); with --to_hf the safetensors "
                  "dtype (default: the HF source's, else bf16: the release's, also for f32 training masters)")
flags.DEFINE_enum("experts", None, ["bf16", "mxfp4"],
                  "bf16 (default): decode MXFP4 experts to the parameter dtype; mxfp4: keep them packed (decoded on "
                  "load). With --to_hf (default: as the checkpoint holds them): bf16 writes dense experts; mxfp4 "
                  "writes packed ones, quantizing dense experts exactly as an expert_qat=mxfp4 forward does")
flags.DEFINE_bool("to_hf", False, "convert a k3jax checkpoint (--checkpoint) back to HF safetensors")
flags.DEFINE_string("checkpoint", None, "k3jax checkpoint directory (with --to_hf)")
flags.DEFINE_float("shard_size_gb", 4.0, "maximum safetensors shard size with --to_hf")
flags.DEFINE_bool("overwrite", False, "replace an existing --out")
flags.DEFINE_bool("allow_nonfinite", False, "convert tensors holding NaN/Inf (refused by default)")
flags.DEFINE_bool("text_only", False, "drop the vision tower and projector tensors (vision_tower.*, mm_projector.*) "
                  "and write a text-only config.json (default: convert them)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    for name in ("absl", "jax"):  # our own progress lines only: no Orbax INFO line per saved or loaded array
        logging.getLogger(name).setLevel(logging.WARNING)
    start = time.time()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        if FLAGS.to_hf:
            if not FLAGS.checkpoint:
                raise app.UsageError("--to_hf needs --checkpoint")
            out = orbax_to_hf(FLAGS.checkpoint, FLAGS.out, overwrite=FLAGS.overwrite,
                              max_shard_bytes=int(FLAGS.shard_size_gb * (1 << 30)), log=log,
                              dtype=FLAGS.dtype or "auto", experts=FLAGS.experts)
        else:
            if not FLAGS.hf_dir:
                raise app.UsageError("--hf_dir is required (or --to_hf --checkpoint)")
            out = hf_to_orbax(FLAGS.hf_dir, FLAGS.out, config=FLAGS.config, dtype=FLAGS.dtype,
                              experts=FLAGS.experts or "bf16", overwrite=FLAGS.overwrite, log=log,
                              allow_nonfinite=FLAGS.allow_nonfinite, text_only=FLAGS.text_only)
    except (CheckpointError, ConfigError, FileExistsError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # an unwritable output (read-only, full disk) or unreadable input
        print(f"error: {os_error(e)}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    app.run(main)
