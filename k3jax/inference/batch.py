"""Batch-mode serving: read prompts from a file, generate, write JSONL (the logic behind `serve.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Callable

import jax
from flax import nnx

import configs
from k3jax.data.text import ByteTokenizer
from k3jax.inference.engine import Engine, SamplingParams
from k3jax.loading import load_checkpoint, load_hf, load_tokenizer
from k3jax.model import K3Model


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    config: str = "tiny"
    overrides: tuple[str, ...] = ()
    checkpoint: str | None = None
    hf_dir: str | None = None
    prompts_file: str = ""
    out: str = ""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    max_len: int | None = None  # cache capacity; None: the config's max_position_embeddings


def read_prompts(path: str) -> list[dict]:
    """Prompts from `.jsonl` (one object per line: "prompt" text or "prompt_ids" list of ints, optional "id") or
    any other extension as plain text (one prompt per non-empty line). Raises ValueError naming the line."""
    if not path:
        raise ValueError("--prompts_file is required")
    if not os.path.isfile(path):
        raise ValueError(f"prompts file not found: {path}")
    items = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if path.endswith(".jsonl"):
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
                raise ValueError(f"{path}:{n}: expected an object with exactly one of 'prompt' or 'prompt_ids'")
            unknown = set(obj) - {"prompt", "prompt_ids", "id"}
            if unknown:
                raise ValueError(f"{path}:{n}: unknown field(s) {sorted(unknown)}")
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise ValueError(f"{path}:{n}: 'prompt' must be a string")
            if "prompt_ids" in obj and not (isinstance(obj["prompt_ids"], list) and obj["prompt_ids"]
                                            and all(isinstance(i, int) for i in obj["prompt_ids"])):
                raise ValueError(f"{path}:{n}: 'prompt_ids' must be a non-empty list of ints")
            obj["line"] = n
            items.append(obj)
    else:
        items = [{"prompt": line, "line": n} for n, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise ValueError(f"prompts file {path} has no prompts")
    return items


def load_model(opts, log: Callable[[str], None]):
    """(config, model): from `--hf_dir` via `k3jax.load_hf`, from `--checkpoint` via `k3jax.load_checkpoint`, else
    randomly initialised (warned). `opts` needs config, overrides, checkpoint, hf_dir and seed."""
    if opts.checkpoint and opts.hf_dir:
        raise ValueError("give --checkpoint or --hf_dir, not both")
    if opts.hf_dir:
        return load_hf(opts.hf_dir, overrides=list(opts.overrides))
    if opts.checkpoint:
        return load_checkpoint(opts.checkpoint, overrides=list(opts.overrides))
    cfg = configs.get_config(opts.config, list(opts.overrides))
    log(f"WARNING: no --checkpoint or --hf_dir given: using RANDOMLY INITIALISED weights for config {cfg.name!r} "
        f"(seed {opts.seed}); the output is noise.")
    return cfg, K3Model(cfg, rngs=nnx.Rngs(opts.seed))


def make_tokenizer(cfg, checkpoint: str | None):
    """The tokenizer of `checkpoint` (an Orbax checkpoint or HF directory) when it has one
    (`k3jax.load_tokenizer`), else the byte tokenizer (tiny configs)."""
    if checkpoint:
        try:
            return load_tokenizer(checkpoint, cfg)
        except (FileNotFoundError, OSError, ValueError):
            pass
    if cfg.vocab_size > 4096:
        raise NotImplementedError(f"config {cfg.name!r} needs its tokenizer (a checkpoint with a tokenizer); the "
                                  "byte-level tokenizer only covers the tiny configs")
    return ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size)


def validate(opts: BatchOptions) -> SamplingParams:
    if opts.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {opts.max_new_tokens}")
    if opts.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {opts.batch_size}")
    if opts.max_len is not None and opts.max_len < 2:
        raise ValueError(f"--max_len must be >= 2, got {opts.max_len}")
    if not opts.out:
        raise ValueError("--out is required")
    return SamplingParams(opts.temperature, opts.top_k, opts.top_p).validate()


def run_batch(opts: BatchOptions, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
              model=None, engine: Engine | None = None) -> list[dict]:
    """Generates a completion for every prompt of `opts.prompts_file`, writes `opts.out` (JSONL, input order) and
    returns the records. `model` / `engine`: an already-built model or engine to use instead of loading one."""
    sp = validate(opts)
    items = read_prompts(opts.prompts_file)
    if engine is None:
        if model is None:
            cfg, model = load_model(opts, log)
        engine = Engine(model)
    cfg = engine.cfg
    tok = make_tokenizer(cfg, opts.hf_dir or opts.checkpoint)
    max_len = opts.max_len or cfg.max_position_embeddings
    encoded = []
    for item in items:
        ids = list(item["prompt_ids"]) if "prompt_ids" in item else tok.encode(item["prompt"], add_bos=True)
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"{opts.prompts_file}:{item['line']}: token ids must be in [0, {cfg.vocab_size})")
        if len(ids) + opts.max_new_tokens - 1 > max_len:
            raise ValueError(f"{opts.prompts_file}:{item['line']}: prompt of {len(ids)} tokens + max_new_tokens "
                             f"{opts.max_new_tokens} exceeds the maximum length {max_len}")
        encoded.append(ids)

    key = jax.random.key(opts.seed)
    # Batches of similar length (sorted) keep padding and the number of prefill buckets small.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    records: list[dict | None] = [None] * len(encoded)
    for start in range(0, len(order), opts.batch_size):
        idx = order[start:start + opts.batch_size]
        results = engine.generate([encoded[i] for i in idx], opts.max_new_tokens, sp, cfg.eos_token_id,
                                  jax.random.fold_in(key, start))
        for i, r in zip(idx, results):
            item = items[i]
            rec = {"index": i}
            if "id" in item:
                rec["id"] = item["id"]
            if "prompt" in item:
                rec["prompt"] = item["prompt"]
            rec.update(completion=tok.decode(r.tokens), completion_ids=r.tokens, finish_reason=r.finish_reason,
                       prompt_tokens=r.prompt_length, completion_tokens=len(r.tokens))
            records[i] = rec
        log(f"generated {min(start + opts.batch_size, len(order))}/{len(order)}")
    with open(opts.out, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    log(f"wrote {len(records)} completions to {opts.out}")
    return records
