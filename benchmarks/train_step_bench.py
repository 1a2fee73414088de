"""Training-step throughput of a named config on one device (pure-XLA paths, no Pallas kernels yet).

    python benchmarks/train_step_bench.py --config=k3_gpu --batch_size=1 --seq_len=4096 [--set key=value ...]

Times forward+backward+AdamW (median of --iters steps after warm-up) and prints tokens/s and the model's
nominal training FLOP rate (6 · active params · tokens; attention/KDA FLOPs excluded, so a lower bound).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import configs
from k3jax.model import K3Model
from k3jax.param_count import count_params
from k3jax.training.simple import make_train_step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="k3_gpu")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    cfg = configs.get_config(args.config, args.set)
    counts = count_params(cfg)
    t0 = time.perf_counter()
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    step = make_train_step()

    batch = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1)),
                        jnp.int32)
    loss = step(model, optimizer, batch)
    jax.block_until_ready(loss)
    print(f"{cfg.name}: init+compile+first step {time.perf_counter() - t0:.1f}s, loss {float(loss):.3f}", flush=True)
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        jax.block_until_ready(step(model, optimizer, batch))
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = args.batch_size * args.seq_len
    tflops = 6 * counts["active_params"] * tokens / sec / 1e12
    print(f"{cfg.name} {jax.devices()[0].device_kind} B={args.batch_size} T={args.seq_len} overrides={args.set}: "
          f"step {sec * 1e3:.1f} ms, {tokens / sec:,.0f} tokens/s, >= {tflops:.1f} TFLOP/s "
          f"(6·active={counts['active_params'] / 1e9:.2f}B)", flush=True)


if __name__ == "__main__":
    main()
