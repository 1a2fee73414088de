"""EAGLE-3 draft: train a target and a draft for a fixed budget, then decode greedily with and without speculation.

    python benchmarks/eagle3_bench.py --config=k3_gpu --set scan_layers=False --target_train_steps=300 \
        --train_steps=300 --batches=1,16,64 --out_dir=$OUT

The target is randomly initialised (on the host CPU, as benchmarks/decode_bench.py does) unless --init_from names a
k3jax checkpoint. A random target has nothing a draft can learn (2026-12-04: acceptance 0.0), so
--target_train_steps=N first trains it on the embedded byte corpus (or --data) for N steps through the repository's
training step (`k3jax.training.trainer.build`: --target_batch × --seq_len tokens per step, AdamW at
--target_lr, f32 master weights, no MTP), giving it a peaked, learnable distribution; the trained target is saved
as a k3jax checkpoint (in --save_target, default a temporary directory) and loaded back in the serving dtype, so a
later call can skip the training with `--init_from=DIR`. The draft then trains with the target frozen
(`k3jax.training.draft.DraftTrainer`). Decoding uses the held-out split's documents as prompts (--prompt_len tokens
each) and times, per batch b, the plain `Scheduler` against `SpeculativeScheduler(Eagle3Draft)` with its
switch-off rules (more than --max_spec_batch running slots; accepted tokens per verification below
--min_accepted, default the cost model's 0.4·k, judged after --spec_window speculative steps and re-probed every
--probe_every plain steps); both with b slots, same process, same weights, greedy, no EOS, each after untimed
calls that compile it (the speculative scheduler's plain step included). --engines also times `Engine` against
`SpeculativeEngine` (always speculating). One JSON line per measurement; a decode line has plain and speculative
tokens/s, their ratio, mean accepted length, acceptance rate, steps decoded plainly (by low acceptance and in all)
and whether the tokens equal.

Runtime on one H200 (estimate; k3_gpu's small train steps take ~0.1-0.5 s, the draft's 78 ms): target build +
compile ~60-120 s, 300 steps 30-150 s, saving and loading the ~8 GB f32 checkpoint ~30-60 s; draft compile + 300
steps ~60 s; decoding 3 batches × 2 schedulers, each compiled by two untimed calls, ~150-250 s: 6-10 minutes in
all, more than one 600 s call holds. So run it as two calls on the same (warm) machine, the first training and
saving the target (--target_only stops there; workdir/ is git-ignored, so it stays between calls), the second
loading it:

    python benchmarks/eagle3_bench.py --config=k3_gpu --set scan_layers=False --target_train_steps=300 \
        --save_target=workdir/eagle3_target --target_only --out_dir=$OUT
    python benchmarks/eagle3_bench.py --config=k3_gpu --set scan_layers=False --init_from=workdir/eagle3_target \
        --train_steps=300 --batches=1,16,64 --out_dir=$OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from benchmarks.models import random_model  # noqa: E402
from k3jax.inference.eagle3_draft import Eagle3Draft  # noqa: E402
from k3jax.inference.engine import Engine  # noqa: E402
from k3jax.inference.scheduler import Request, Scheduler  # noqa: E402
from k3jax.inference.spec_scheduler import DEFAULT_MAX_SPEC_BATCH, SpecCounters, SpeculativeScheduler  # noqa: E402
from k3jax.inference.speculative import SpeculativeEngine  # noqa: E402
from k3jax.layers.params import RoutingStats  # noqa: E402
from k3jax.loading import load_checkpoint, save_checkpoint  # noqa: E402
from k3jax.model import K3Model  # noqa: E402
from k3jax.training.draft import DraftOptions, DraftTrainer, data_iterator, new_draft  # noqa: E402
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option, training_config  # noqa: E402


def train_target(args, record) -> str:
    """Trains a fresh target for --target_train_steps steps (the trainer's step, one device); saves it as a k3jax
    checkpoint and returns its directory."""
    tcfg = training_config(args.config, args.set)
    opts = TrainOptions(steps=args.target_train_steps, batch_size=args.target_batch, seq_len=args.seq_len,
                        learning_rate=args.target_lr, optimizer="adamw", mtp=False, warmup_fraction=0.05,
                        data=args.data, mesh="1,1,1,1")
    t0 = time.perf_counter()
    trainable, optimizer, step, _ = build(tcfg, opts, make_mesh_from_option(opts.mesh, tcfg))
    batches = data_iterator(tcfg, args.data, DraftOptions(batch_size=opts.batch_size, seq_len=opts.seq_len))
    loss, _ = step(trainable, optimizer, next(batches))
    first = float(loss)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1, opts.steps):
        loss, _ = step(trainable, optimizer, next(batches))
        if (i + 1) % 50 == 0:
            record({"kind": "target_train", "step": i + 1, "loss": round(float(loss), 4)})
    last = float(loss)
    batches.close()
    step_ms = (time.perf_counter() - t0) / max(opts.steps - 1, 1) * 1e3
    out = args.save_target or os.path.join(tempfile.mkdtemp(prefix="eagle3_bench_"), "target")
    t0 = time.perf_counter()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: K3Model(tcfg, rngs=nnx.Rngs(0))))  # without routing statistics
    save_checkpoint(nnx.merge(graphdef, nnx.state(trainable.model, nnx.Not(RoutingStats))), out, overwrite=True)
    record({"kind": "target", "train_steps": opts.steps, "batch": opts.batch_size, "seq_len": opts.seq_len,
            "lr": opts.learning_rate, "first_loss": round(first, 4), "last_loss": round(last, 4),
            "first_step_s": round(compile_s, 1), "step_ms": round(step_ms, 1),
            "save_s": round(time.perf_counter() - t0, 1), "checkpoint": out})
    del trainable, optimizer, step
    return out


def prompts_from(cfg, data, n: int, length: int) -> list[list[int]]:
    it = data_iterator(cfg, data, DraftOptions(batch_size=n, seq_len=length, seed=1), split="heldout")
    rows = next(it)["input_ids"]
    it.close()
    return [list(map(int, r)) for r in rows]


def timed_generate(sched: Scheduler, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for `sched.generate` of `prompts` and the tokens (after untimed calls that compile it: two, since
    with a checkpoint-loaded target the second call compiles again, on its first call's output buffers)."""
    def requests():
        return [Request(i, p, new_tokens, eos_ids=[]) for i, p in enumerate(prompts)]

    for _ in range(2):
        sched.generate(requests())
    if isinstance(sched, SpeculativeScheduler):  # its plain step, for the steps the switch-off rules decode plainly
        sched.enabled = False
        sched.generate(requests()[:1])
        sched.enabled = True
        sched.counters = SpecCounters()
        sched.gate.reset()
        if sched.break_even_source != "given":
            sched.calibrate()  # the break-even from measured step times, as the server's warm-up sets it
    t0 = time.perf_counter()
    res = sched.generate(requests())
    dt = time.perf_counter() - t0
    return dt, [res[i][0] for i in range(len(prompts))]


def decode_schedulers(target, layer, cfg, args, b: int, record) -> None:
    prompts = prompts_from(cfg, args.data, b, args.prompt_len)
    shape = dict(num_slots=b, max_len=args.prompt_len + args.new_tokens + args.k + 8,
                 max_prefill_batch=min(1 << (b.bit_length() - 1), 16))
    plain_s, plain_toks = timed_generate(Scheduler(target, **shape), prompts, args.new_tokens)
    sched = SpeculativeScheduler(target, Eagle3Draft(layer, args.k), max_spec_batch=args.max_spec_batch,
                                 min_accepted_per_step=args.min_accepted, spec_window=args.spec_window,
                                 probe_every=args.probe_every, draft_name="eagle3", **shape)
    spec_s, spec_toks = timed_generate(sched, prompts, args.new_tokens)
    n = sum(len(t) for t in plain_toks)
    st = sched.speculative_stats()
    plain_tps, spec_tps = n / plain_s, sum(len(t) for t in spec_toks) / spec_s
    record({"kind": "decode", "decoder": "scheduler", "batch": b, "k": args.k, "new_tokens": args.new_tokens,
            "plain_tokens_per_s": round(plain_tps, 1), "spec_tokens_per_s": round(spec_tps, 1),
            "ratio": round(spec_tps / plain_tps, 3), "mean_accepted_length": round(st["mean_accepted_length"], 3),
            "acceptance_rate": round(st["acceptance_rate"], 3), "spec_steps": st["spec_steps"],
            "plain_steps": st["plain_steps"], "spec_off_low_acceptance": st["spec_off_low_acceptance"],
            "probes": st["probes"], "min_accepted_per_step": round(st["min_accepted_per_step"], 3),
            "break_even_source": st["break_even_source"], "step_ms": st["step_ms"],
            "same_tokens": plain_toks == spec_toks,
            "tokens_equal_fraction": round(float(np.mean([a == c for a, c in zip(plain_toks, spec_toks)])), 3)})


def decode_engines(target, layer, cfg, args, b: int, record) -> None:
    max_len = args.prompt_len + args.new_tokens + args.k + 8
    prompts = prompts_from(cfg, args.data, b, args.prompt_len)
    spec = SpeculativeEngine(target, Eagle3Draft(layer, args.k), max_len=max_len)
    row = {"kind": "decode", "decoder": "engine", "batch": b, "k": args.k, "new_tokens": args.new_tokens}
    for name, engine in (("plain", Engine(target, max_len=max_len)), ("spec", spec)):
        engine.generate(prompts, args.new_tokens, eos_id=-1)  # compile
        t0 = time.perf_counter()
        res = engine.generate(prompts, args.new_tokens, eos_id=-1)
        dt = time.perf_counter() - t0
        row[f"{name}_tokens_per_s"] = round(sum(len(r.tokens) for r in res) / dt, 1)
        row[f"{name}_tokens"] = [r.tokens for r in res]
    row["same_tokens"] = row.pop("plain_tokens") == row.pop("spec_tokens")
    row["ratio"] = round(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], 3)
    row["mean_accepted_length"] = round(spec.last_stats["mean_accepted_length"], 3)
    row["acceptance_rate"] = round(spec.last_stats["acceptance_rate"], 3)
    record(row)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--init_from", default=None, help="a k3jax checkpoint as the target (e.g. a --save_target)")
    ap.add_argument("--data", default=None, help="prepared data dir (default: the embedded byte corpus)")
    ap.add_argument("--target_train_steps", type=int, default=0, help="train the random target first (0: no)")
    ap.add_argument("--target_batch", type=int, default=8)
    ap.add_argument("--target_lr", type=float, default=1e-3)
    ap.add_argument("--save_target", default=None, help="where the trained target is saved (default: a temp dir)")
    ap.add_argument("--target_only", action="store_true", help="stop once the target is trained and saved")
    ap.add_argument("--train_steps", type=int, default=300)
    ap.add_argument("--train_batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--unroll_steps", type=int, default=7)
    ap.add_argument("--learning_rate", type=float, default=1e-3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--max_spec_batch", type=int, default=DEFAULT_MAX_SPEC_BATCH)
    ap.add_argument("--min_accepted", type=float, default=None, help="break-even (default 0.4·k; 0: never off)")
    ap.add_argument("--spec_window", type=int, default=16)
    ap.add_argument("--probe_every", type=int, default=256)
    ap.add_argument("--engines", action="store_true", help="also time Engine against SpeculativeEngine")
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
    init_from = args.init_from
    if init_from is None and args.target_train_steps > 0:
        init_from = train_target(args, record)
        if args.target_only:
            return 0
    if init_from:
        serving = configs.get_config(args.config, args.set).runtime.param_dtype
        cfg, target = load_checkpoint(init_from, dtype=serving,
                                      overrides=(*args.set, "record_routing_stats=False"))
    else:
        cfg = configs.get_config(args.config, args.set)
        target = random_model(cfg)
    record({"kind": "init", "config": cfg.name, "init_from": init_from, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "param_dtype": cfg.runtime.param_dtype, "s": round(time.perf_counter() - t0, 1)})

    opts = DraftOptions(steps=args.train_steps, batch_size=args.train_batch, seq_len=args.seq_len,
                        unroll_steps=args.unroll_steps, learning_rate=args.learning_rate, warmup_steps=20)
    trainer = DraftTrainer(target, new_draft(cfg, opts), opts)
    held = data_iterator(cfg, args.data, opts, split="heldout")
    eval_batch = next(held)
    held.close()
    before = trainer.evaluate(eval_batch)
    batches = data_iterator(cfg, args.data, opts)
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.step(next(batches)))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1, opts.steps):
        m = trainer.step(next(batches))
        if (i + 1) % 50 == 0:
            record({"kind": "train", "step": i + 1, **{k: round(float(v), 4) for k, v in m.items()}})
    jax.block_until_ready(trainer.params)
    step_ms = (time.perf_counter() - t0) / max(opts.steps - 1, 1) * 1e3
    batches.close()
    after = trainer.evaluate(eval_batch)
    record({"kind": "draft", "train_steps": opts.steps, "batch": opts.batch_size, "seq_len": opts.seq_len,
            "unroll": opts.unroll_steps, "first_step_s": round(compile_s, 1), "step_ms": round(step_ms, 1),
            "heldout_before": {k: round(v, 4) for k, v in before.items()},
            "heldout_after": {k: round(v, 4) for k, v in after.items()}})

    for b in [int(x) for x in args.batches.split(",") if x.strip()]:
        decode_schedulers(target, trainer.layer, cfg, args, b, record)
        if args.engines:
            decode_engines(target, trainer.layer, cfg, args, b, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
