"""Long-prompt prefill through the serving scheduler on one device: time to first token and device memory of a cold
prompt of --tokens tokens, then of a prompt sharing all but its last --tail tokens with it (a prefix-cache hit at the
last kept KDA checkpoint: with the defaults, 129024 of 131072 tokens).

    python -m benchmarks.long_prefill_bench --config=k3_gpu --tokens=131072 [--tail=64] [--block=512] [--out=F.json]

Random bf16 weights (`benchmarks.decode_bench.build_params`), one decode slot, the serving XLA flags, the prefix cache
as serve.py sets it up by default (--block-token chunks; checkpoints every --block tokens up to 16384, every 6144
past it). Time to first token is the wall time of `Scheduler.generate` for one request of max_tokens 1 (the prefill
chunks, the last-token logits and the sampled token back on the host), after one compile run of three blocks.
Peak memory is the device's peak_bytes_in_use (None where the device reports none).
"""

from __future__ import annotations

import argparse
import json
import time

from k3jax.inference.xla_flags import apply_serving_flags

apply_serving_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import configs  # noqa: E402
from benchmarks.decode_bench import build_params  # noqa: E402
from k3jax.inference.scheduler import Request, Scheduler  # noqa: E402


def _peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else round(stats["peak_bytes_in_use"] / 2**30, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--tail", type=int, default=64, help="tokens of the second prompt that differ from the first")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--page_size", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not 0 < args.tail < args.tokens:
        raise SystemExit(f"error: --tail must be in [1, --tokens), got {args.tail}")
    cfg = configs.get_config(args.config, args.set)
    spec, leaves, _ = build_params(cfg)
    graphdef, treedef = spec.value
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    sched = Scheduler(model, num_slots=1, max_len=args.tokens + args.block, prefix_block=args.block,
                      page_size=args.page_size)
    pc = sched.prefix_cache
    rng = np.random.default_rng(0)
    low = min(1000, cfg.vocab_size // 4)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(low, cfg.vocab_size - low, n)]

    def ttft(name: str, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        sched.generate([Request(name, prompt, 1, eos_ids=[])])
        return time.perf_counter() - t0

    warm = ids(3 * args.block)
    compile_s = ttft("compile", warm) + ttft("compile-hit", warm)
    pc.clear()
    pc.reset_stats()
    prompt = ids(args.tokens)
    cold_s = ttft("cold", prompt)
    snapshots, snapshot_bytes = len(pc), pc.bytes_used
    hit_s = ttft("hit", prompt[:-args.tail] + ids(args.tail))
    rec = {"config": args.config, "device": jax.devices()[0].device_kind, "tokens": args.tokens, "block": args.block,
           "compile_s": round(compile_s, 1), "cold_ttft_s": round(cold_s, 3), "cold_tokens_per_s": round(
               args.tokens / cold_s), "hit_ttft_s": round(hit_s, 3), "speedup": round(cold_s / hit_s, 1),
           "hit_resumed_at": pc.tokens_saved, "snapshots": snapshots, "snapshot_mib": round(snapshot_bytes / 2**20, 1),
           "snapshot_limit_gib": round(pc.max_bytes / 2**30, 2), "peak_gib": _peak_gib()}
    print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
