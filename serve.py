"""Serve a k3jax model. Batch mode (this issue's first step):

    python serve.py --config=tiny --prompts_file=prompts.txt --max_new_tokens=64 --out=out.jsonl

`--prompts_file`: `.jsonl` (objects with "prompt" text or "prompt_ids", optional "id") or plain text, one prompt per
line. Without `--checkpoint` the model is randomly initialised (a warning says so). Output: one JSON object per
prompt, in input order: index, [id], [prompt], completion, completion_ids, finish_reason, token counts.
"""

import sys

from absl import app, flags

import configs
from k3jax.config import ConfigError

_CONFIG = flags.DEFINE_string("config", "tiny", f"Named config: {', '.join(configs.names())}.")
_SET = flags.DEFINE_multi_string("set", [], "Config override key=value (repeatable).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "k3jax Orbax checkpoint directory (default: random init).")
_PROMPTS = flags.DEFINE_string("prompts_file", None, "Prompts: .jsonl or .txt (one prompt per line).")
_OUT = flags.DEFINE_string("out", None, "Output JSONL path.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt (at most).")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k filter; 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) filter; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for the random init and sampling.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Prompts per generation batch.")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "Max tokens per sequence (prompt + generated); "
                                "default: the config's max_position_embeddings.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from k3jax.inference.batch import BatchOptions, run_batch

    opts = BatchOptions(config=_CONFIG.value, overrides=tuple(_SET.value), checkpoint=_CHECKPOINT.value,
                        prompts_file=_PROMPTS.value or "", out=_OUT.value or "", max_new_tokens=_MAX_NEW.value,
                        temperature=_TEMP.value, top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value,
                        batch_size=_BATCH.value, max_len=_MAX_LEN.value)
    try:
        if not opts.checkpoint:
            configs.get_config(opts.config, list(opts.overrides))  # fail fast on a bad config name / override
        run_batch(opts)
    except (ValueError, ConfigError, NotImplementedError) as e:
        print(f"serve.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
