"""What quantization-aware training of the routed experts costs: QAT off, the XLA fake quantizer, the one-pass kernel.

    python -m benchmarks.qat_overhead [--train_step] [--smoke]

Times, in one process, one MoE layer's routed-expert block as the layer runs it in training
(`k3jax.layers.moe.LatentMoE._routed_experts` on one device): the f32 master stacks w1, w3 [E, L, M] and w2 [E, M, L]
cast to bf16 (QAT off) or MXFP4-fake-quantized along their reduction axis (`k3jax.ops.mx_quant.expert_weight_qat`
with impl "xla": the XLA quantizer then the cast; "kernel": `pallas_kernels.gmm.qat`, quantization fused into the
cast), optionally the MXFP8 activations (`expert_act_qat=mxfp8`, XLA), then the grouped GLU and down matmuls on
expert-sorted rows, forward + backward to the masters and the input rows, under `jax.checkpoint` (the step's remat:
the forward, quantization included, runs twice). Also the weight preparation alone (three stacks) and, on a GPU,
that the kernel's copy equals the XLA one bit for bit. Prints ms and each row's ratio to QAT off.

--train_step: also the `k3_gpu` train step (`benchmarks.train_throughput.run`, one device, bf16 Newton-Schulz) with
QAT off, weights by XLA, weights by the kernel, and weights by the kernel plus MXFP8 activations
(`mx_quant.weight_qat_impl`). --smoke: tiny shapes on CPU (the kernel interpreted), seconds.
"""

from __future__ import annotations

import argparse
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import configs
from benchmarks import train_throughput
from benchmarks.timing import median_ms
from k3jax.ops import mx_quant
from k3jax.ops.moe import experts_dropless
from k3jax.training.trainer import training_config
from pallas_kernels.gmm import qat as qat_kernels

# (row name, expert_qat, expert_act_qat, weight impl)
ROWS = (("off", "none", "none", "xla"), ("weights xla", "mxfp4", "none", "xla"),
        ("weights kernel", "mxfp4", "none", "kernel"), ("weights+act xla", "mxfp4", "mxfp8", "xla"),
        ("weights+act kernel", "mxfp4", "mxfp8", "kernel"))
STEP_ROWS = tuple(r for r in ROWS if r[0] != "weights+act xla")


def expert_block(masters, z_nl, weights_nk, experts_nk, cot_nl, cfg, impl: str):
    """The layer's routed experts from f32 masters (QAT as `cfg` and `impl` say), reduced against a cotangent."""
    w1, w3, w2 = (mx_quant.expert_weight_qat(w, cfg, impl=impl).astype(cfg.runtime.jnp_dtype) for w in masters)
    z_nl = mx_quant.expert_activation_qat(z_nl, cfg)
    out = experts_dropless(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg)
    return jnp.sum(out.astype(jnp.float32) * cot_nl)


def inputs(e: int, lat: int, m: int, tokens: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    masters = tuple(jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[1]))
                    for s in ((e, lat, m), (e, lat, m), (e, m, lat)))
    z = jnp.asarray(rng.standard_normal((tokens, lat), np.float32), jnp.bfloat16)
    experts = jnp.asarray(np.argsort(rng.random((tokens, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k), np.float32) / k)
    cot = jnp.asarray(rng.standard_normal((tokens, lat), np.float32))
    return masters, z, weights, experts, cot


def check_kernel_matches_xla(masters, dtype) -> bool:
    """The kernel's quantized copy equals the XLA quantizer's, bit for bit (NaN and Inf groups included)."""
    w = masters[0].at[0, 3, 5].set(jnp.nan).at[1, 40, 7].set(jnp.inf).at[2, :32, :].set(0.0)
    xla = jax.jit(lambda w: mx_quant.fake_quant_mxfp4_cast(w, dtype, impl="xla"))(w)
    ker = jax.jit(lambda w: mx_quant.fake_quant_mxfp4_cast(w, dtype, impl="kernel"))(w)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
    return bool(jnp.array_equal(bits(xla), bits(ker)))


def time_block(args, cfg) -> None:
    masters, z, weights, experts, cot = inputs(args.experts, args.latent, args.inter, args.tokens, args.topk)
    dt = cfg.runtime.jnp_dtype
    print(f"experts {args.experts} x [{args.latent}, {args.inter}], {args.tokens} tokens top-{args.topk} "
          f"({args.tokens * args.topk} rows), device {jax.devices()[0].device_kind}", flush=True)
    print(f"kernel copy == XLA copy bit for bit: {check_kernel_matches_xla(masters, dt)}", flush=True)

    def prep(impl, qat):
        c = cfg.replace(expert_qat=qat)
        return jax.jit(lambda ws: [mx_quant.expert_weight_qat(w, c, impl=impl).astype(dt) for w in ws])

    nbytes = sum(w.size for w in masters) * 6  # read f32, write bf16
    base = None
    for name, impl, qat in (("cast", "xla", "none"), ("xla quantize + cast", "xla", "mxfp4"),
                            ("kernel quantize + cast", "kernel", "mxfp4")):
        f = prep(impl, qat)
        ms = median_ms(lambda: f(masters), args.iters)
        base = base or ms
        print(f"weights only  {name:24s} {ms:8.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s (6 B/weight)  "
              f"x{ms / base:.2f}", flush=True)
    interpret = jax.devices()[0].platform == "cpu"
    for block in args.sweep:
        b = tuple(int(v) for v in block.split(","))
        f = jax.jit(lambda ws, b=b: [qat_kernels.mxfp4_fake_quant(w, out_dtype=dt, block=b, interpret=interpret)
                                     for w in ws])
        ms = median_ms(lambda: f(masters), args.iters)
        print(f"weights only  kernel block {block:13s} {ms:8.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)

    out = {}
    for name, qat, act, impl in ROWS:
        c = cfg.replace(expert_qat=qat, expert_act_qat=act)
        loss = functools.partial(expert_block, cfg=c, impl=impl)
        if not args.no_remat:
            loss = jax.checkpoint(loss)
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        ms = median_ms(lambda: f(masters, z, weights, experts, cot), args.iters)
        out[name] = (ms, f(masters, z, weights, experts, cot), f(masters, z, weights, experts, cot))
        print(f"expert block fwd+bwd  {name:20s} {ms:8.3f} ms  x{ms / out['off'][0]:.3f} of QAT off", flush=True)
    for a, b in (("weights xla", "weights kernel"), ("weights+act xla", "weights+act kernel")):
        (loss_a, (dw_a, dz_a)), (loss_b, (dw_b, dz_b)) = out[a][1], out[b][1]
        same = [bool(jnp.array_equal(x, y)) for x, y in ((loss_a, loss_b), *zip(dw_a, dw_b), (dz_a, dz_b))]
        rerun = [bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(out[a][1]), jax.tree.leaves(out[a][2]))]
        print(f"{b} == {a} bit for bit: loss {same[0]}, dw1 dw3 dw2 {same[1:4]}, dz {same[4]} "
              f"({a} against its own rerun: {rerun}; dz sums rows by a GPU scatter-add)", flush=True)


def time_train_step(args) -> None:
    step_args = types.SimpleNamespace(batch_per_device=args.batch_per_device, grad_accum=args.grad_accum,
                                      seq_len=args.seq_len, optimizer="muon", no_mtp=False, no_qb=False,
                                      muon_ns_dtype="bfloat16", compile_only=False, warmup=1,
                                      iters=args.step_iters, profile=False)
    base = None
    for name, qat, act, impl in STEP_ROWS:
        if args.step_rows and name not in args.step_rows:
            continue
        cfg = training_config(args.config, [f"expert_qat={qat}", f"expert_act_qat={act}", *args.set])
        with mx_quant.weight_qat_impl(impl):
            r = train_throughput.run(cfg, "1,1,1,1", step_args)
        base = base or r["step_ms"]
        print(f"{cfg.name} train step, QAT {name:18s}: {r['step_ms']:9.1f} ms  x{r['step_ms'] / base:.3f} of the "
              f"first row  (loss {r['loss']:.4f}, peak {r['peak_gib']:.1f} GiB)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3_gpu", help="whose expert shapes and activation (and train step)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (batch x sequence)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no_remat", action="store_true", help="no jax.checkpoint around the block (forward once)")
    p.add_argument("--train_step", action="store_true", help="also time the config's train step three ways")
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_per_device", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--step_iters", type=int, default=3)
    p.add_argument("--step_rows", nargs="*", default=[], help="only these train-step rows (names as printed)")
    p.add_argument("--set", action="append", default=[], help="extra key=value for the train step's config")
    p.add_argument("--sweep", nargs="*", default=[], help="kernel blocks 'groups,columns,warps' to time")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 iteration (CPU check of the script)")
    args = p.parse_args()
    cfg = configs.get_config(args.config).replace(dtype="bfloat16")
    args.experts, args.latent, args.inter = cfg.num_experts, cfg.expert_input_size, cfg.moe_intermediate_size
    args.topk = cfg.num_experts_per_token
    if args.smoke:
        args.experts, args.latent, args.inter, args.tokens, args.topk, args.iters = 4, 64, 32, 16, 2, 1
        cfg = cfg.replace(num_experts=4, num_experts_per_token=2, moe_intermediate_size=32)
    time_block(args, cfg)
    if args.train_step:
        time_train_step(args)


if __name__ == "__main__":
    main()
