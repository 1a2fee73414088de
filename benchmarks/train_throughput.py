"""Training throughput of the real train step (per-head Muon, Quantile Balancing, MTP, packed batches) on GPUs.

    python -m benchmarks.train_throughput --config=k3_gpu --batch_per_device=1 --seq_len=4096 \
        --meshes=1,1,1,1 2,1,1,1 1,2,1,1 [--set key=value ...] [--no_mtp] [--optimizer=adamw]

For each mesh (data,expert,context,model) it builds the model on that many devices (the first N), runs
`--warmup` steps, then times `--iters` steps (median) on synthetic packed batches (random tokens, 4 documents per
row) with `global batch = batch_per_device × devices` (weak scaling). Prints tokens/s, MFU (training FLOPs per token
from `k3jax.training.metrics.model_flops_per_token`: 6·active params + MLA and KDA sequence terms, over the device's
dense bf16 peak) and the scaling efficiency against the first mesh: tokens/s(N) / (N/N₀ · tokens/s(N₀)).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import numpy as np

import configs
from k3jax.param_count import count_params
from k3jax.training.metrics import model_flops_per_token, peak_flops_per_device
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option


def synthetic_batch(rng, batch: int, seq_len: int, vocab: int, docs_per_row: int = 4) -> dict:
    ids = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    bounds = np.sort(rng.choice(np.arange(1, seq_len), docs_per_row - 1, replace=False))
    segment = (1 + np.searchsorted(bounds, np.arange(seq_len), side="right")).astype(np.int32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.tile(segment, (batch, 1)),
            "loss_mask": np.ones((batch, seq_len), np.float32)}


def run(cfg, mesh_text: str, args) -> dict:
    devices = math.prod(int(x) for x in mesh_text.split(","))
    opts = TrainOptions(steps=1000, batch_size=args.batch_per_device * devices, seq_len=args.seq_len,
                        optimizer=args.optimizer, mtp=not args.no_mtp, quantile_balancing=not args.no_qb,
                        mesh=mesh_text)
    mesh = make_mesh_from_option(mesh_text)
    t0 = time.perf_counter()
    trainable, optimizer, step, _ = build(cfg, opts, mesh)
    rng = np.random.default_rng(0)
    batch = synthetic_batch(rng, opts.batch_size, args.seq_len, cfg.vocab_size)
    for _ in range(args.warmup):
        loss, _ = step(trainable, optimizer, batch)
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        loss, metrics = step(trainable, optimizer, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = opts.batch_size * args.seq_len
    active = count_params(trainable.model.cfg)["active_params"]
    fpt = model_flops_per_token(trainable.model.cfg, args.seq_len, active_params=active, mtp=opts.mtp)
    peak = peak_flops_per_device(jax.devices()[0])
    tps = tokens / sec
    out = {"mesh": mesh_text, "devices": devices, "batch": opts.batch_size, "step_ms": sec * 1e3,
           "tokens_per_s": tps, "tflops_per_device": tps * fpt / devices / 1e12, "loss": float(loss),
           "compile_s": compile_s, "mfu": (tps * fpt / (devices * peak)) if peak else None}
    del trainable, optimizer, step
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="k3_gpu")
    p.add_argument("--batch_per_device", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--meshes", nargs="+", default=["1,1,1,1"])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    p.add_argument("--no_mtp", action="store_true")
    p.add_argument("--no_qb", action="store_true")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    cfg = configs.get_config(args.config, args.set)
    counts = count_params(cfg)
    print(f"{cfg.name}: total {counts['total_params'] / 1e9:.2f}B active {counts['active_params'] / 1e9:.2f}B; "
          f"device {jax.devices()[0].device_kind} x{jax.device_count()}; T={args.seq_len} "
          f"B/device={args.batch_per_device} optimizer={args.optimizer} mtp={not args.no_mtp} "
          f"qb={not args.no_qb} overrides={args.set}", flush=True)
    base = None
    for mesh_text in args.meshes:
        r = run(cfg, mesh_text, args)
        if base is None:
            base = r
        eff = r["tokens_per_s"] / (r["devices"] / base["devices"] * base["tokens_per_s"])
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"mesh {r['mesh']:>9} devices {r['devices']} batch {r['batch']:>3}: step {r['step_ms']:8.1f} ms  "
              f"{r['tokens_per_s']:10,.0f} tokens/s  {r['tflops_per_device']:6.1f} TFLOP/s/device  MFU {mfu}  "
              f"scaling eff {100 * eff:.0f}%  (compile {r['compile_s']:.0f}s, loss {r['loss']:.3f})", flush=True)


if __name__ == "__main__":
    main()
