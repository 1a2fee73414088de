"""MLA absorbed decode attention over a paged latent cache: the Pallas kernel (pallas_kernels/mla) vs the XLA path
of `MLA.forward_cached` (gather every sequence's pages into [B, P * page_size, C], then the absorbed einsums), side
by side in one process.

    python -m benchmarks.mla_decode_bench [--batches=1,16,64] [--tokens=512,4096] [--heads=12] [--page_size=64]
                                          [--variants=auto,16-32-1-4-2] [--reps=50] [--iters=5]
    python -m benchmarks.mla_decode_bench --interpret       # CPU smoke test at tiny shapes (kernel interpreted)

Per (batch B, cached tokens S): one query token per sequence, H heads of width C = 512 + 64 (k3_gpu: H = 12),
bf16 cache and queries, f32 outputs [B, H, 512]; every sequence holds S tokens (its current one included) in a
page table of ceil(S / page_size) + 2 slots (room to grow, -1 past the length, as in serving) over a pool of
shuffled pages. Timing: `--reps` calls chained inside one jitted `fori_loop` (each call's query and table depend
on the previous output, so nothing is hoisted and Python dispatch is amortised), median over `--iters` runs, reported
per call. GB/s = the cache bytes a perfect kernel reads (B * S * C * 2) / time, for both paths (the XLA path
also reads the table's empty slots and writes and re-reads the gathered copy). `max_err` = max |kernel - XLA|.
Variants: `auto` (DecodeConfig defaults) or `block_h-block_s-num_splits-num_warps-num_stages` (0 = auto).
Prints one JSON line per measurement (flushed) and a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from k3jax.layers.mla import _masked_softmax, gather_latent_rows  # noqa: E402
from pallas_kernels.mla import DecodeConfig, paged_latent_attention  # noqa: E402


def parse_variant(text: str) -> DecodeConfig:
    if text == "auto":
        return DecodeConfig()
    parts = [int(p) for p in text.split("-")]
    if len(parts) != 5:
        raise ValueError(f"variant must be 'auto' or block_h-block_s-num_splits-num_warps-num_stages, got {text!r}")
    return DecodeConfig(*parts)


def xla_attention(q_bhc, pages_npc, table_bp, length_b, *, scale, latent_dim):
    """`MLA._attend_absorbed` on `gather_latent_rows` (the model's XLA decode path, T = 1), f32 [B, H, latent]."""
    cache_bsc = gather_latent_rows(pages_npc, table_bp)
    mask_b1s = jnp.arange(cache_bsc.shape[1], dtype=jnp.int32)[None, None, :] < length_b[:, None, None]
    logits = jnp.einsum("bhc,bsc->bhs", q_bhc, cache_bsc, preferred_element_type=jnp.float32)[:, :, None]
    probs = _masked_softmax(logits * scale, mask_b1s)[:, :, 0]  # [B, H, S]
    return jnp.einsum("bhs,bsr->bhr", probs, cache_bsc[..., :latent_dim].astype(probs.dtype))


def make_case(b, tokens, heads, width, page_size, dtype, seed=0):
    """(q [B, H, C], pool [B * P, page_size, C], shuffled table [B, P] with -1 past each length, lengths [B])."""
    rng = np.random.default_rng(seed)
    used = -(-tokens // page_size)
    slots = used + 2
    pool_pages = b * used
    ids = rng.permutation(pool_pages).astype(np.int32).reshape(b, used)
    table = np.full((b, slots), -1, np.int32)
    table[:, :used] = ids
    q = jnp.asarray(rng.standard_normal((b, heads, width), np.float32), dtype)
    pool = jnp.asarray(rng.standard_normal((pool_pages, page_size, width), np.float32), dtype)
    return q, pool, jnp.asarray(table), jnp.full((b,), tokens, jnp.int32)


def chained(attend, reps):
    """`reps` calls in one jitted loop; call i's query and page table depend on call i-1's output (a true
    dependency: XLA cannot hoist the gather or the kernel out of the loop)."""
    def run(q, pool, table, lengths):
        def body(_, acc):
            o = attend(q + (acc * 1e-30).astype(q.dtype), pool, table + (acc * 0).astype(table.dtype), lengths)
            return acc + o[0, 0, 0]
        return lax.fori_loop(0, reps, body, jnp.zeros((), jnp.float32))
    return jax.jit(run)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--tokens", default="512,4096")
    p.add_argument("--heads", type=int, default=12, help="query heads (k3_gpu: 12)")
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--page_size", type=int, default=64)
    p.add_argument("--variants", default="auto")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke test: the kernel through the Pallas interpreter at tiny shapes")
    args = p.parse_args(argv)
    if args.interpret:  # tiny shapes unless given explicitly
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        tiny = dict(batches="1,2", tokens="16,40", heads=3, latent=32, rope=16, page_size=8, reps=2, iters=1)
        for k, v in tiny.items():
            if f"--{k}" not in given:
                setattr(args, k, v)
    backend = "interpret" if args.interpret else "gpu"
    width, dtype = args.latent + args.rope, jnp.bfloat16
    scale = (128 + args.rope) ** -0.5
    variants = args.variants.split(",")
    print(json.dumps({"device": str(jax.devices()[0]), "backend": backend, "heads": args.heads, "C": width,
                      "page_size": args.page_size, "reps": args.reps, "iters": args.iters}), flush=True)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            case = make_case(b, tokens, args.heads, width, args.page_size, dtype)
            gb = b * tokens * width * jnp.dtype(dtype).itemsize / 1e9

            def xla(*a):
                return xla_attention(*a, scale=scale, latent_dim=args.latent)

            ref = jax.jit(xla)(*case)
            xla_chain = chained(xla, args.reps)
            xla_ms = median_ms(lambda: xla_chain(*case), args.iters) / args.reps
            for variant in variants:
                config = parse_variant(variant)

                def kernel(*a, config=config):
                    return paged_latent_attention(*a, scale=scale, latent_dim=args.latent, backend=backend,
                                                  config=config)

                err = float(jnp.max(jnp.abs(jax.jit(kernel)(*case) - ref)))
                kernel_chain = chained(kernel, args.reps)
                k_ms = median_ms(lambda: kernel_chain(*case), args.iters) / args.reps
                row = {"B": b, "tokens": tokens, "variant": variant, "xla_ms": round(xla_ms, 4),
                       "kernel_ms": round(k_ms, 4), "xla_GBps": float(f"{gb / xla_ms * 1e3:.4g}"),
                       "kernel_GBps": float(f"{gb / k_ms * 1e3:.4g}"), "speedup": round(xla_ms / k_ms, 2),
                       "max_err": err}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| B | tokens | variant | XLA ms | kernel ms | XLA GB/s | kernel GB/s | XLA/kernel | max err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['tokens']} | {r['variant']} | {r['xla_ms']:.4f} | {r['kernel_ms']:.4f} | "
              f"{r['xla_GBps']} | {r['kernel_GBps']} | {r['speedup']} | {r['max_err']:.2e} |")


if __name__ == "__main__":
    main()
