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
from k3jax.inference.batch_chat import batch_vision, generate_chat, load_images, parse_chat_record, placeholder_id
from k3jax.inference.chat import load_chat_template
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
    vision: bool = True  # chat records may carry images when the weights have a vision tower
    image_placeholder_id: int = -1  # -1: `image_slots.default_placeholder_id`


def read_prompts(path: str) -> list[dict]:
    """Prompts from `.jsonl` (one object per line: "prompt" text, "prompt_ids" list of ints or "messages", a chat
    conversation whose image parts name local files (`batch_chat`); optional "id") or any other extension as plain
    text (one prompt per non-empty line). Raises ValueError naming the line (and the image file)."""
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
            if not isinstance(obj, dict) or sum(k in obj for k in ("prompt", "prompt_ids", "messages")) != 1:
                raise ValueError(f"{path}:{n}: expected an object with exactly one of 'prompt', 'prompt_ids' or "
                                 "'messages'")
            unknown = set(obj) - {"prompt", "prompt_ids", "messages", "id"}
            if unknown:
                raise ValueError(f"{path}:{n}: unknown field(s) {sorted(unknown)}")
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise ValueError(f"{path}:{n}: 'prompt' must be a string")
            if "prompt_ids" in obj and not (isinstance(obj["prompt_ids"], list) and obj["prompt_ids"]
                                            and all(isinstance(i, int) for i in obj["prompt_ids"])):
                raise ValueError(f"{path}:{n}: 'prompt_ids' must be a non-empty list of ints")
            if "messages" in obj:
                obj["messages"] = parse_chat_record(obj["messages"], f"{path}:{n}", os.path.dirname(path))
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
    parent = os.path.dirname(os.path.abspath(opts.out))
    if os.path.isdir(opts.out) or not os.path.isdir(parent):  # found before generating, not after
        raise ValueError(f"--out={opts.out} is a directory" if os.path.isdir(opts.out) else
                         f"--out={opts.out}: {parent} is not an existing directory")
    return SamplingParams(opts.temperature, opts.top_k, opts.top_p).validate()


def run_batch(opts: BatchOptions, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
              model=None, engine: Engine | None = None, vision=None) -> list[dict]:
    """Generates a completion for every prompt of `opts.prompts_file`, writes `opts.out` (JSONL, input order) and
    returns the records. `model` / `engine`: an already-built model or engine to use instead of loading one;
    `vision`: the vision tower for chat records with images (default: the one in --checkpoint / --hf_dir)."""
    sp = validate(opts)
    items = read_prompts(opts.prompts_file)
    if engine is None:
        if model is None:
            cfg, model = load_model(opts, log)
        engine = Engine(model)
    cfg = engine.cfg
    source = opts.hf_dir or opts.checkpoint
    tok = make_tokenizer(cfg, source)
    max_len = opts.max_len or cfg.max_position_embeddings
    chat_items = [i for i, item in enumerate(items) if "messages" in item]
    with_images = [i for i in chat_items if items[i]["messages"].images]
    where = {i: f"{opts.prompts_file}:{item['line']}" for i, item in enumerate(items)}
    vision = batch_vision(opts, bool(with_images), vision, where[with_images[0]] if with_images else "",
                          engine.mesh)
    chat = load_chat_template(tok, source) if chat_items else None
    encoded, images = {}, {}
    for i, item in enumerate(items):
        if "messages" in item:
            images[i] = load_images(item["messages"], vision.cfg, where[i]) if item["messages"].images else ()
            try:
                ids = chat.encode(item["messages"].messages,
                                  [[placeholder_id(opts, cfg)] * im.num_tokens for im in images[i]])
            except ValueError as e:
                raise ValueError(f"{where[i]}: chat template: {e}") from None
        else:
            ids = list(item["prompt_ids"]) if "prompt_ids" in item else tok.encode(item["prompt"], add_bos=True)
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"{where[i]}: token ids must be in [0, {cfg.vocab_size})")
        if len(ids) + opts.max_new_tokens - 1 > max_len:
            raise ValueError(f"{where[i]}: prompt of {len(ids)} tokens + max_new_tokens "
                             f"{opts.max_new_tokens} exceeds the maximum length {max_len}")
        encoded[i] = ids

    key = jax.random.key(opts.seed)
    results: dict[int, tuple[list[int], str]] = {}
    if chat_items:  # through the scheduler, as the server runs chat requests (images, turn-end ids)
        eos = ([] if cfg.eos_token_id is None else [int(cfg.eos_token_id)]) + list(chat.stop_ids)
        model = nnx.merge(engine.graphdef, engine.params)
        results.update(generate_chat(model, [(i, encoded[i], images[i]) for i in chat_items], opts=opts,
                                     sampling=sp, eos_ids=eos, vision=vision, mesh=engine.mesh, key=key, log=log))
    # Batches of similar length (sorted) keep padding and the number of prefill buckets small.
    order = sorted((i for i in encoded if i not in images), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), opts.batch_size):
        idx = order[start:start + opts.batch_size]
        out = engine.generate([encoded[i] for i in idx], opts.max_new_tokens, sp, cfg.eos_token_id,
                              jax.random.fold_in(key, start))
        results.update((i, (r.tokens, r.finish_reason)) for i, r in zip(idx, out))
        log(f"generated {min(start + opts.batch_size, len(order))}/{len(order)}")
    records = []
    for i, item in enumerate(items):
        tokens, finish = results[i]
        rec = {"index": i}
        if "id" in item:
            rec["id"] = item["id"]
        if "prompt" in item:
            rec["prompt"] = item["prompt"]
        rec.update(completion=tok.decode(tokens), completion_ids=tokens, finish_reason=finish,
                   prompt_tokens=len(encoded[i]), completion_tokens=len(tokens))
        records.append(rec)
    tmp = f"{opts.out}.tmp-{os.getpid()}"  # renamed when complete: a killed run leaves no partial --out
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, opts.out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    log(f"wrote {len(records)} completions to {opts.out}")
    return records
