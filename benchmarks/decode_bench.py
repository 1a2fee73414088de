"""Prefill and decode throughput of the serving path on one GPU, with the decode step's memory-bandwidth floor.

    python benchmarks/decode_bench.py --config=k3_gpu --batches=1,16,64,256 --context=512 [--decode_steps=16]
        [--iters=5] [--prefill_iters=3] [--prefill_max_batch=64] [--budget_s=240] [--out_dir=$OUT]

Decode: the continuous-batching scheduler's own jitted decode (`k3jax.inference.scheduler._decode`: recurrent KDA
step, absorbed MLA over the latent cache, greedy sampling, `--decode_steps` steps per device call) for B slots whose
caches hold `--context` tokens (cache capacity context + room for the timed steps). Decode time does not depend on
the cached values (KDA states are fixed-size; MLA attends over the whole buffer under a mask), so the caches are
not prefilled. Prefill: `hidden_states_cached` on a fresh cache + last-token logits, min(B, --prefill_max_batch)
prompts of `--context` tokens per call (larger B = several such calls at the same rate).
Random bf16 weights (the config's own init), so routing is spread over the experts as at init.

Bandwidth floor of one decode step = bytes that must move / 4.8 TB/s (H200 HBM3e):
  weights: every non-expert parameter once (attention, dense/shared MLPs, router, norms, lm_head), B embedding rows,
           and the routed experts touched — per MoE layer E·(1-(1-k/E)^B) of E experts (uniform-routing expectation);
  caches:  KDA recurrent states (f32) and conv histories read + written, MLA latent rows read for the `context`
           valid positions + one row written per sequence and layer.
Reported: median step time, tokens/s, floor, and floor / step (the fraction of the bandwidth roofline reached).
The implementation reads the MLA buffer to its capacity (context + room), slightly more than the floor counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import configs  # noqa: E402
from k3jax.inference import scheduler as sched_lib  # noqa: E402
from k3jax.model import K3Model, init_cache  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
ROUTED_NAMES = ("w1", "w2", "w3")


def build_params(cfg):
    """(spec, flat params) of a randomly initialised model, initialised on device in one jitted call."""
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(0))))()
    leaves, treedef = jax.tree.flatten(state)
    return sched_lib._intern((graphdef, treedef)), tuple(leaves), abstract


def weight_bytes(abstract, cfg) -> dict:
    """Parameter bytes by how a decode step touches them."""
    out = {"dense": 0, "routed": 0, "embed": 0}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        names = [str(p) for p in path]
        nbytes = int(np.prod(var.shape)) * jnp.dtype(var.dtype).itemsize
        if names[0] == "embed_tokens":
            out["embed"] += nbytes
        elif "mlp" in names and names[-1] in ROUTED_NAMES:
            out["routed"] += nbytes
        else:
            out["dense"] += nbytes  # includes lm_head
    return out


def floor_bytes(cfg, wb: dict, batch: int, context: int) -> dict:
    e, k = cfg.num_experts, cfg.num_experts_per_token
    touched = 1.0 - (1.0 - k / e) ** batch
    row_bytes = wb["embed"] / cfg.vocab_size
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 1))
    kda, mla = 0, 0
    for group, gcfg in zip(cache.layers, cfg.layer_groups()):
        for st in group:
            if isinstance(st, tuple):  # KDAState: read + write every leaf
                kda += 2 * sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in st) * batch
            else:  # [.., 1, 1, C]: C elements per row and layer (times repeats)
                per_row = int(np.prod(st.shape)) * jnp.dtype(st.dtype).itemsize
                mla += per_row * (context + 1) * batch
    weights = wb["dense"] + wb["routed"] * touched + row_bytes * batch
    return {"weights": weights, "kda_state": kda, "mla_latent": mla, "total": weights + kda + mla,
            "experts_touched_frac": touched}


def slot_state(batch: int, max_new: int):
    return sched_lib.SlotState(
        last_s=jnp.arange(batch, dtype=jnp.int32) % 1000, done_s=jnp.zeros((batch,), bool),
        count_s=jnp.ones((batch,), jnp.int32), max_new_s=jnp.full((batch,), max_new, jnp.int32),
        temperature_s=jnp.zeros((batch,), jnp.float32), top_k_s=jnp.zeros((batch,), jnp.int32),
        top_p_s=jnp.ones((batch,), jnp.float32), keys_s=jax.random.split(jax.random.key(0), batch),
        eos_se=jnp.full((batch, sched_lib.MAX_EOS_IDS), -1, jnp.int32))


def bench_decode(cfg, spec, params, batch, context, steps, iters):
    max_len = context + steps * (iters + 2)
    cache = init_cache(cfg, batch, max_len)
    cache = jax.tree.map(lambda x: jnp.array(x, copy=True), cache)._replace(
        lengths=jnp.full((batch,), context, jnp.int32))
    state = slot_state(batch, 1 << 30)
    t0 = time.perf_counter()
    cache, state, tok, _, _ = sched_lib._decode(params, cache, state, spec=spec, greedy_only=True, steps=steps)
    tok.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        cache, state, tok, _, _ = sched_lib._decode(params, cache, state, spec=spec, greedy_only=True, steps=steps)
        tok.block_until_ready()
        times.append(time.perf_counter() - t0)
    call_s = statistics.median(times)
    return {"step_ms": call_s / steps * 1e3, "tokens_per_s": batch * steps / call_s, "compile_s": compile_s,
            "max_len": max_len}


def bench_prefill(cfg, spec, params, n, context, iters):
    def prefill(params, ids):
        model = sched_lib._merge(spec, params)
        fresh = init_cache(model.cfg, ids.shape[0], ids.shape[1])
        h, fresh = model.hidden_states_cached(ids, fresh)
        return model.logits(h[:, -1:]), fresh

    fn = jax.jit(prefill)
    ids = jax.random.randint(jax.random.key(1), (n, context), 0, cfg.vocab_size, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, ids))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, ids))
        times.append(time.perf_counter() - t0)
    call_s = statistics.median(times)
    return {"prefill_ms": call_s * 1e3, "tokens_per_s": n * context / call_s, "compile_s": compile_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode_steps", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prefill_iters", type=int, default=3)
    ap.add_argument("--prefill_max_batch", type=int, default=64)
    ap.add_argument("--budget_s", type=float, default=1e9, help="skip what would start after this many seconds")
    ap.add_argument("--out_dir", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    cfg = configs.get_config(args.config, args.set)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, config {cfg.name} ({cfg.dtype})",
          flush=True)
    spec, params, abstract = build_params(cfg)
    jax.block_until_ready(params)
    wb = weight_bytes(abstract, cfg)
    print(f"init {time.perf_counter() - start:.1f}s; weight bytes: {json.dumps(wb)}", flush=True)
    records = []
    out = open(os.path.join(args.out_dir, "decode_bench.jsonl"), "a") if args.out_dir else None

    def record(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    order = sorted(batches, key=lambda b: (b != 64, b))  # the target batch first
    jobs = [("decode", b) for b in order] + [("prefill", n) for n in sorted(
        {min(b, args.prefill_max_batch) for b in batches}, key=lambda n: (n != 16, n))]
    for kind, b in jobs:
        if time.perf_counter() - start > args.budget_s:
            record({"kind": kind, "batch": b, "skipped": "budget"})
            continue
        try:
            if kind == "decode":
                r = bench_decode(cfg, spec, params, b, args.context, args.decode_steps, args.iters)
                fb = floor_bytes(cfg, wb, b, args.context)
                floor_ms = fb["total"] / HBM_BYTES_PER_S * 1e3
                record({"kind": kind, "batch": b, "context": args.context, **r, "floor_ms": floor_ms,
                        "floor_frac": floor_ms / r["step_ms"], "floor_bytes": fb})
            else:
                record({"kind": kind, "batch": b, "context": args.context,
                        **bench_prefill(cfg, spec, params, b, args.context, args.prefill_iters)})
        except Exception as e:  # keep going: one OOM must not lose the other rows
            record({"kind": kind, "batch": b, "error": repr(e)[:500]})
            traceback.print_exc()
    print("\n| kind | batch | step / call ms | tokens/s | floor ms | floor/step | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        if "error" in r or "skipped" in r:
            print(f"| {r['kind']} | {r['batch']} | {r.get('error') or r.get('skipped')} | | | | |")
        elif r["kind"] == "decode":
            print(f"| decode | {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['floor_ms']:.3f} | "
                  f"{100 * r['floor_frac']:.0f}% | {r['compile_s']:.0f} |")
        else:
            print(f"| prefill | {r['batch']}x{r['context']} | {r['prefill_ms']:.1f} | {r['tokens_per_s']:,.0f} | | | "
                  f"{r['compile_s']:.0f} |")
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
