"""EAGLE-3 draft: train it against a frozen target for a fixed budget, then decode greedily with and without it.

    python benchmarks/eagle3_bench.py --config=k3_gpu --train_steps=300 --batches=1,16,64 --out_dir=$OUT

The target is randomly initialised (initialised on the host CPU, as benchmarks/decode_bench.py does) unless
--init_from names a converted checkpoint. The draft trains on the embedded byte corpus (or --data) with
`k3jax.training.draft.DraftTrainer`; decoding uses the held-out split's documents as prompts (--prompt_len
tokens each) and times `Engine.generate` against `SpeculativeEngine(Eagle3Draft)` (same process, same weights,
greedy, no EOS), each after one untimed call that compiles it. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from k3jax.inference.eagle3_draft import Eagle3Draft  # noqa: E402
from k3jax.inference.engine import Engine  # noqa: E402
from k3jax.inference.speculative import SpeculativeEngine  # noqa: E402
from k3jax.loading import load_checkpoint  # noqa: E402
from k3jax.model import K3Model  # noqa: E402
from k3jax.training.draft import DraftOptions, DraftTrainer, data_iterator, new_draft  # noqa: E402


def random_target(cfg) -> K3Model:
    """A randomly initialised model, initialised in one jitted call on the host CPU, then copied to the device."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    with jax.default_device(jax.devices("cpu")[0]):
        state = jax.jit(lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(0))))()
    state = jax.device_put(jax.tree.map(np.asarray, state))
    return nnx.merge(graphdef, state)


def prompts_from(cfg, opts: DraftOptions, n: int, length: int) -> list[list[int]]:
    it = data_iterator(cfg, None, DraftOptions(batch_size=n, seq_len=length, seed=1), split="heldout")
    rows = next(it)["input_ids"]
    it.close()
    return [list(map(int, r)) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--init_from", default=None)
    ap.add_argument("--train_steps", type=int, default=300)
    ap.add_argument("--train_batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--unroll_steps", type=int, default=7)
    ap.add_argument("--learning_rate", type=float, default=1e-3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--init_prng", default="unsafe_rbg")
    ap.add_argument("--out_dir", default=None)
    args = ap.parse_args()
    out = open(os.path.join(args.out_dir, "eagle3_bench.jsonl"), "a") if args.out_dir else None

    def record(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    if args.init_prng:
        jax.config.update("jax_default_prng_impl", args.init_prng)
    t0 = time.perf_counter()
    if args.init_from:
        cfg, target = load_checkpoint(args.init_from, overrides=tuple(args.set))
    else:
        cfg = configs.get_config(args.config, args.set)
        target = random_target(cfg)
    record({"kind": "init", "config": cfg.name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "s": round(time.perf_counter() - t0, 1)})

    opts = DraftOptions(steps=args.train_steps, batch_size=args.train_batch, seq_len=args.seq_len,
                        unroll_steps=args.unroll_steps, learning_rate=args.learning_rate, warmup_steps=20)
    trainer = DraftTrainer(target, new_draft(cfg, opts), opts)
    held = data_iterator(cfg, None, opts, split="heldout")
    eval_batch = next(held)
    held.close()
    before = trainer.evaluate(eval_batch)
    batches = data_iterator(cfg, None, opts)
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.step(next(batches)))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1, opts.steps):
        m = trainer.step(next(batches))
        if i % 50 == 0:
            record({"kind": "train", "step": i + 1, **{k: round(float(v), 4) for k, v in m.items()}})
    jax.block_until_ready(trainer.params)
    step_ms = (time.perf_counter() - t0) / max(opts.steps - 1, 1) * 1e3
    batches.close()
    after = trainer.evaluate(eval_batch)
    record({"kind": "draft", "train_steps": opts.steps, "batch": opts.batch_size, "seq_len": opts.seq_len,
            "unroll": opts.unroll_steps, "first_step_s": round(compile_s, 1), "step_ms": round(step_ms, 1),
            "heldout_before": {k: round(v, 4) for k, v in before.items()},
            "heldout_after": {k: round(v, 4) for k, v in after.items()}})

    layer = trainer.layer
    max_len = args.prompt_len + args.new_tokens + args.k + 8
    plain = Engine(target, max_len=max_len)
    spec = SpeculativeEngine(target, Eagle3Draft(layer, args.k), max_len=max_len)
    for b in [int(x) for x in args.batches.split(",") if x.strip()]:
        prompts = prompts_from(cfg, opts, b, args.prompt_len)
        row = {"kind": "decode", "batch": b, "k": args.k, "new_tokens": args.new_tokens}
        for name, engine in (("plain", plain), ("eagle3", spec)):
            engine.generate(prompts, args.new_tokens, eos_id=-1)  # compile
            t0 = time.perf_counter()
            res = engine.generate(prompts, args.new_tokens, eos_id=-1)
            dt = time.perf_counter() - t0
            row[f"{name}_tokens_per_s"] = round(sum(len(r.tokens) for r in res) / dt, 1)
            row[f"{name}_tokens"] = [r.tokens for r in res]
        row["same_tokens"] = row.pop("plain_tokens") == row.pop("eagle3_tokens")
        row["speedup"] = round(row["eagle3_tokens_per_s"] / row["plain_tokens_per_s"], 3)
        row["mean_accepted_length"] = round(spec.last_stats["mean_accepted_length"], 3)
        row["acceptance_rate"] = round(spec.last_stats["acceptance_rate"], 3)
        record(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
