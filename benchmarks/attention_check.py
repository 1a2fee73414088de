"""MLA training attention: cuDNN flash attention (`mla_attention_impl=cudnn`, GPU) and the blockwise JAX core
(`mla_attention_impl=flash`) against the XLA core, all through `k3jax.ops.attention.causal_attention`: forward and
input gradients (bf16 operands, compared with a float32 XLA run, packed documents and unpacked rows), then
forward+backward time of each on packed rows at long T beside this process's dense bf16 matmul throughput.

    python -m benchmarks.attention_check [--heads 12] [--seq 4096 32768] [--batch 1] [--impls cudnn flash xla]
        [--block 512] [--check_seq 1024] [--matmul_n 8192]

Exit status 1 when a checked path disagrees with the f32 reference by more than bf16 rounding allows. On a CPU,
e.g. `--impls flash xla --seq 256 --check_seq 128 --heads 2 --matmul_n 512`.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.train_throughput import dense_matmul_tflops
from k3jax.ops.attention import causal_attention, segment_attention

QK, V = 192, 128  # K3's MLA head dims (nope 128 + rope 64; value 128)


def _inputs(rng, b, t, h, docs, dtype):
    q, k = (jnp.asarray(rng.normal(size=(b, t, h, QK)), dtype) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, t, h, V)), dtype)
    bounds = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
    seg = np.tile(1 + np.searchsorted(bounds, np.arange(t), side="right"), (b, 1)).astype(np.int32)
    return q, k, v, jnp.asarray(seg)


def _loss_and_grads(impl, q, k, v, seg, w, block=512):
    def loss(q, k, v):
        out = causal_attention(q, k, v, scale=QK ** -0.5, impl=impl, segment_ids_bt=seg, block_q=block,
                               block_k=block)
        return jnp.sum(out * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def check(rng, impls, t, block) -> bool:
    b, h = 2, 4
    q, k, v, packed = _inputs(rng, b, t, h, docs=5, dtype=jnp.bfloat16)
    many = _inputs(rng, b, t, h, docs=min(t - 1, 80), dtype=jnp.bfloat16)[3]  # > 64 documents: cuDNN falls back
    w = jnp.asarray(rng.normal(size=(b, t, h, V)), jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ok = True
    for impl, seg, rows in [(i, s, r) for i in impls if i != "xla"
                            for s, r in ((packed, "packed"), (many, "80 documents"), (None, "unpacked"))]:
        _, want = _loss_and_grads("xla", *f32, seg, w, block)(*f32)
        out_ref = causal_attention(*f32, scale=QK ** -0.5, impl="xla", segment_ids_bt=seg)
        out = jax.jit(lambda q, k, v: causal_attention(q, k, v, scale=QK ** -0.5, impl=impl, segment_ids_bt=seg,
                                                       block_q=block, block_k=block))(q, k, v)
        _, got = _loss_and_grads(impl, q, k, v, seg, w, block)(q, k, v)
        for name, a, r in [("output", out, out_ref)] + [(f"d{n}", g, x) for n, g, x in zip("qkv", got, want)]:
            err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
            ok &= err < 2e-2
            print(f"{impl} vs f32 xla ({rows} rows, T={t}), {name}: max |error| / max |reference| = {err:.2e}",
                  flush=True)
    if "cudnn" in impls:  # the vision tower's bidirectional packed images (`segment_attention`)
        ok &= check_bidirectional(rng, t)
    return ok


def check_bidirectional(rng, t) -> bool:
    h, d = 4, 128
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, h, d)), jnp.bfloat16) for _ in range(3))
    seg = jnp.asarray(np.repeat([0, 1, 2, 3], [t // 2, t // 4, t // 8, t - t // 2 - t // 4 - t // 8])[None], jnp.int32)

    def masked(q, k, v):  # f32 reference: block-diagonal mask, no causality
        logits = jnp.einsum("bqhk,bshk->bhqs", q, k) * d ** -0.5
        logits = jnp.where((seg[:, None, :, None] == seg[:, None, None, :]), logits, -jnp.inf)
        return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(logits, axis=-1), v)

    want = masked(*(x.astype(jnp.float32) for x in (q, k, v)))
    got = jax.jit(lambda q, k, v: segment_attention(q, k, v, seg, scale=d ** -0.5, xla_core=masked))(q, k, v)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    print(f"cudnn bidirectional segments vs f32 masked core (4 images, T={t}): max |error| / max |reference| = "
          f"{err:.2e}", flush=True)
    return err < 2e-2


def timed(fn, *args, iters=5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--impls", nargs="+", choices=("cudnn", "flash", "xla"), default=["cudnn", "flash", "xla"])
    p.add_argument("--block", type=int, default=512, help="query and key block of impl=flash")
    p.add_argument("--check_seq", type=int, default=1024, help="T of the exactness check")
    p.add_argument("--matmul_n", type=int, default=8192, help="n of the n^3 dense matmul throughput reference")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    ok = check(rng, args.impls, args.check_seq, args.block)
    ceiling = dense_matmul_tflops(args.matmul_n)
    print(f"dense bf16 matmul {args.matmul_n}^3: {ceiling:.1f} TFLOP/s", flush=True)
    for t in args.seq:
        q, k, v, seg = _inputs(rng, args.batch, t, args.heads, 4, jnp.bfloat16)  # packed rows, as training
        w = jnp.ones((args.batch, t, args.heads, V), jnp.float32)
        for rows, s in (("unpacked", None), ("4 documents", seg)):
            # causal forward = half of 2·B·H·T²·(QK + V) over the whole row (packed rows: the same nominal count,
            # though a kernel that skips other documents' blocks does less); backward 2.5x the forward
            flops = 3.5 * args.batch * args.heads * t * t * (QK + V)
            line = f"T={t} B={args.batch} H={args.heads} {rows}:"
            for impl in args.impls:
                try:
                    sec = timed(_loss_and_grads(impl, q, k, v, s, w, args.block), q, k, v)
                    line += f"  {impl} fwd+bwd {sec * 1e3:8.2f} ms ({flops / sec / 1e12:6.1f} TFLOP/s causal)"
                except Exception as e:  # noqa: BLE001 -- XLA's T x T scores may not fit at long T: say so, go on
                    line += f"  {impl}: {type(e).__name__} {str(e).splitlines()[0][:120]}"
            print(line, flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
