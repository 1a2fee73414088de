"""Sharded serving: greedy decoding with `Engine` on a device mesh beside the same engine on one device, in one
process: decode tokens/s per batch and whether the tokens are identical.

    python -m benchmarks.sharded_decode --config=k3_gpu --meshes 1,2,1,1 2,1,1,1 --batches 16,64      # two GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.sharded_decode --config=tiny --meshes 1,2,1,1 --batches 2 --prompt_len=16 \\
        --new_tokens=8 --iters=1                                                               # the CPU smoke run

Random weights (initialised on the host CPU, as `decode_bench`), random prompts of `--prompt_len` tokens, EOS off.
Per engine and batch: one warm-up `generate` (compiles), then `--iters` timed runs of `--new_tokens` and of 1 new
token; decode tokens/s = batch x (new_tokens - 1) / (median time of the long run - median time of the 1-token run),
so prefill is left out. Meshes are `data,expert,context,model` (context 1, as serving requires) over the first
devices. Prints one JSON line per (mesh, batch) with the ratio to one device and the tokens compared (sequences
identical, first differing position); exits 1 when a mesh's greedy tokens differ from one device's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import jax
import numpy as np

import configs
from benchmarks.models import random_model
from k3jax.inference.engine import Engine
from sharding.mesh import make_mesh, parse_mesh


def timed(engine: Engine, prompts, new_tokens: int, iters: int) -> tuple[float, list[list[int]]]:
    """(median seconds of `iters` greedy generations, the tokens of the last)."""
    times, out = [], None
    for _ in range(iters):
        t = time.perf_counter()
        out = engine.generate(prompts, new_tokens, eos_id=-1)
        times.append(time.perf_counter() - t)
    return statistics.median(times), [r.tokens for r in out]


def measure(engine: Engine, prompts, new_tokens: int, iters: int) -> dict:
    engine.generate(prompts, new_tokens, eos_id=-1)  # compiles every program the timed runs use
    engine.generate(prompts, 1, eos_id=-1)
    full_s, tokens = timed(engine, prompts, new_tokens, iters)
    prefill_s, _ = timed(engine, prompts, 1, iters)
    decode_s = full_s - prefill_s  # not positive when the timing noise exceeds the decode time (tiny smoke runs)
    return {"tokens_per_s": len(prompts) * (new_tokens - 1) / decode_s if decode_s > 0 else None, "generate_s": full_s,
            "prefill_s": prefill_s, "tokens": tokens}


def compare(tokens, ref) -> dict:
    same = [a == b for a, b in zip(tokens, ref)]
    first = min((next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(tokens, ref) if a != b),
                default=None)
    return {"identical_sequences": int(sum(same)), "sequences": len(ref), "first_difference_at": first}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="k3_gpu")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--meshes", nargs="+", default=["1,2,1,1"])
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    cfg = configs.get_config(args.config, args.set)
    meshes = []
    for text in args.meshes:
        sizes = parse_mesh(text)
        n = math.prod(sizes.values())
        if n > jax.device_count() or sizes["context"] != 1:
            raise SystemExit(f"--meshes {text}: needs context 1 and at most {jax.device_count()} devices")
        meshes.append((text, make_mesh(**sizes, devices=jax.devices()[:n])))
    print(f"sharded_decode: {cfg.name} on {jax.device_count()} {jax.devices()[0].device_kind} devices; prompts "
          f"{args.prompt_len} tokens, {args.new_tokens} new, greedy", flush=True)
    model = random_model(cfg)
    rng = np.random.default_rng(0)
    max_len = args.prompt_len + args.new_tokens
    failed = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).tolist()
        base = measure(Engine(model, max_len=max_len), prompts, args.new_tokens, args.iters)
        print(json.dumps({"mesh": "one device", "batch": batch,
                          **{k: v for k, v in base.items() if k != "tokens"}}), flush=True)
        for text, mesh in meshes:
            got = measure(Engine(model, max_len=max_len, mesh=mesh), prompts, args.new_tokens, args.iters)
            same = compare(got["tokens"], base["tokens"])
            if same["identical_sequences"] != batch:
                failed.append(f"{text}@{batch}")
            print(json.dumps({"mesh": text, "batch": batch, **{k: v for k, v in got.items() if k != "tokens"},
                              "vs_one_device": (got["tokens_per_s"] / base["tokens_per_s"]
                                                if got["tokens_per_s"] and base["tokens_per_s"] else None),
                              **same}), flush=True)
    print(json.dumps({"tokens_differ": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
