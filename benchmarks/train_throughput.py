"""Training throughput of the real train step (per-head Muon, Quantile Balancing, MTP, packed batches) on GPUs.

    python -m benchmarks.train_throughput --config=k3_gpu --batch_per_device=1 --seq_len=4096 \
        --meshes=1,1,1,1 2,1,1,1 1,2,1,1 [--set key=value ...] [--no_mtp] [--optimizer=adamw]
        [--losses=20 --global_batch=8]

For each mesh (data,expert,context,model) it builds the model on that many devices (the first N), runs
`--warmup` steps, then times `--iters` steps (median) on synthetic packed batches (random tokens, 4 documents per
row) with `global batch = batch_per_device × devices × grad_accum` (weak scaling; `--grad_accum` micro-batches
of `batch_per_device` rows per device run inside one optimizer step). Prints tokens/s, MFU (training FLOPs per token
from `k3jax.training.metrics.model_flops_per_token`: 6·active params + MLA and KDA sequence terms, over the device's
dense bf16 peak) and the scaling efficiency against the first mesh: tokens/s(N) / (N/N₀ · tokens/s(N₀)).
`--losses=N` first trains N steps from the initial state on N fresh batches, the same for every mesh, and compares
the losses of meshes with the same global batch (`--global_batch` fixes it for all meshes): a parallel form that is
wrong (e.g. the expert-parallel exchange) shows as a loss difference beyond bf16 rounding.
The same process's dense bf16 matmul throughput (an 8192³ matmul) is printed beside it as the practical ceiling.

--profile: traces `--profile_steps` steps of the first mesh with `jax.profiler` and prints where a step's kernel
time goes by part of the step (forward, backward, Muon Newton–Schulz, other optimizer work, Quantile Balancing,
MTP, collectives), by model source line and by kernel; kernels map to source lines through the optimised HLO (a
second compile, served by the persistent compilation cache in `--cache_dir`). With `--out_dir` the summary is
also written as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.trace_summary import hlo_sources, kernel_group, load_profile, trace_xplane
from k3jax.param_count import count_params
from k3jax.training.memory import compiled_memory, device_memory_bytes
from k3jax.training.metrics import model_flops_per_token, peak_flops_per_device
from k3jax.training.trainer import TrainOptions, build, make_mesh_from_option, training_config


def synthetic_batch(rng, batch: int, seq_len: int, vocab: int, docs_per_row: int = 4) -> dict:
    ids = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    bounds = np.sort(rng.choice(np.arange(1, seq_len), docs_per_row - 1, replace=False))
    segment = (1 + np.searchsorted(bounds, np.arange(seq_len), side="right")).astype(np.int32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.tile(segment, (batch, 1)),
            "loss_mask": np.ones((batch, seq_len), np.float32)}


def run(cfg, mesh_text: str, args) -> dict:
    devices = math.prod(int(x) for x in mesh_text.split(","))
    opts = TrainOptions(steps=1000, batch_size=args.global_batch or args.batch_per_device * devices * args.grad_accum,
                        seq_len=args.seq_len, optimizer=args.optimizer, mtp=not args.no_mtp,
                        quantile_balancing=not args.no_qb, mesh=mesh_text, grad_accum=args.grad_accum,
                        muon_ns_dtype=args.muon_ns_dtype)
    mesh = make_mesh_from_option(mesh_text)
    t0 = time.perf_counter()
    trainable, optimizer, step, _ = build(cfg, opts, mesh)
    rng = np.random.default_rng(0)
    batch = synthetic_batch(rng, opts.batch_size, args.seq_len, cfg.vocab_size)
    # compiled ahead (the timed calls reuse it through the persistent cache) so that a step whose temporaries
    # cannot fit is reported before it allocates them
    compiled = step.jitted.lower(nnx.state((trainable, optimizer)), batch).compile()
    per_device, total = compiled_memory(compiled)
    limit, source = device_memory_bytes()
    mem = {"arguments_gib": per_device.get("argument_size_in_bytes", 0) / 2**30,
           "temporaries_gib": per_device.get("temp_size_in_bytes", 0) / 2**30, "total_gib": total / 2**30,
           "device_gib": limit / 2**30}
    print(f"mesh {mesh_text}: compiled in {time.perf_counter() - t0:.0f}s; per device {mem['total_gib']:.2f} GiB "
          f"(arguments {mem['arguments_gib']:.2f}, temporaries {mem['temporaries_gib']:.2f}) of "
          f"{mem['device_gib']:.2f} GiB ({source})", flush=True)
    del compiled
    if args.compile_only:  # fills the persistent compilation cache for a later timed run
        return None
    if total > limit:
        print(f"mesh {mesh_text}: does not fit: the compiled step needs {mem['total_gib']:.2f} GiB per device, "
              f"the device holds {mem['device_gib']:.2f} GiB; not run", flush=True)
        return {"mesh": mesh_text, "devices": devices, "batch": opts.batch_size, "fits": False, "memory": mem}
    losses = []
    for i in range(args.losses):  # from the initial state, one fresh batch per step (the same for every mesh)
        loss, _ = step(trainable, optimizer,
                       synthetic_batch(np.random.default_rng(1000 + i), opts.batch_size, args.seq_len, cfg.vocab_size))
        losses.append(float(loss))
    if losses:
        print(f"mesh {mesh_text}: losses of the first {len(losses)} steps: "
              + " ".join(f"{x:.4f}" for x in losses), flush=True)
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
           "compile_s": compile_s, "mfu": (tps * fpt / (devices * peak)) if peak else None,
           "peak_gib": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30,
           "fits": True, "memory": mem, "losses": losses}
    if args.profile:
        out["profile"] = profile_steps(step, trainable, optimizer, batch, args.profile_steps, args.out_dir)
    del trainable, optimizer, step
    return out


# ---------------------------------------------------------------------- --profile

# (part of the step, test on "op name stack @ source (function)" of a kernel's HLO instruction), first match wins.
_PARTS = (
    ("collectives", lambda k, s: re.search(r"nccl|all-reduce|all_reduce|all-gather|all_gather|reduce-scatter|"
                                          r"reduce_scatter|all-to-all|all_to_all|collective", k + s) is not None),
    ("optimizer: Muon Newton-Schulz", lambda k, s: "newton_schulz" in s or "orthogonalize_blocks" in s),
    ("optimizer: other (momentum, AdamW, decay, norms)", lambda k, s: "optimizer.py" in s or "optax/" in s),
    ("Quantile Balancing", lambda k, s: "balancing.py" in s),
    ("MTP", lambda k, s: "mtp.py" in s),
    ("backward", lambda k, s: "transpose(" in s),
    ("forward", lambda k, s: bool(s)),
    ("unattributed kernels", lambda k, s: True),
)


def step_part(kernel: str, where: str) -> str:
    return next(name for name, test in _PARTS if test(kernel, where))


def profile_steps(step, trainable, optimizer, batch, steps: int, out_dir: str | None = None) -> dict:
    """Kernel time per step by part, source line and kernel, from a `jax.profiler` trace of `steps` steps. With
    `out_dir`, the optimised HLO (gzip) is written there and the result keeps the 300 costliest HLO instructions with
    their op names, so fusions can be read back offline."""

    def one_step():
        loss, _ = step(trainable, optimizer, batch)
        jax.block_until_ready(loss)

    with tempfile.TemporaryDirectory() as tmp:
        trace = load_profile(trace_xplane(one_step, steps, tmp))
    sources = {}
    try:  # kernel names -> HLO instructions -> source lines (a recompile; the persistent cache serves it)
        hlo = step.jitted.lower(nnx.state((trainable, optimizer)), batch).compile().as_text()
        sources = hlo_sources(hlo)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with gzip.open(os.path.join(out_dir, "train_step.hlo.txt.gz"), "wt") as f:
                f.write(hlo)
    except Exception as e:  # noqa: BLE001 -- the profile stands without sources (kernel names only)
        print(f"(no HLO sources: {type(e).__name__}: {str(e)[:200]})", flush=True)
    group_of = kernel_group(sources)
    parts, lines, kernels, instrs = {}, {}, {}, {}
    span = [None, None]
    plane = next((p for p in trace.planes if p.name.startswith("/device:")), None)
    plane_lines = list(plane.lines) if plane is not None else []
    # Library kernels (cuBLAS gemms, copies) carry no HLO name: the "XLA Ops" line's op running at the same time
    # names the HLO instruction they belong to.
    op_events = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name)
                       for line in plane_lines if "Ops" in line.name for e in line.events)
    op_starts = [o[0] for o in op_events]
    for line in plane_lines:
        if not line.name.startswith("Stream"):
            continue
        for e in line.events:
            name = e.name
            src = sources.get(name) or sources.get(re.sub(r"__\d+$", "", name))
            if not src and op_events:
                i = bisect.bisect_right(op_starts, e.start_ns) - 1
                if i >= 0 and op_events[i][1] >= e.start_ns + e.duration_ns:
                    op = op_events[i][2]
                    src = sources.get(op.replace(".", "_")) or sources.get(op)
                    name = op.replace(".", "_") if src else name
            for agg, key in ((parts, step_part(e.name, src or "")), (lines, group_of(name)),
                             (kernels, re.sub(r"(_\d+)+$", "", e.name))):
                agg[key] = agg.get(key, 0) + e.duration_ns
            instrs[f"{name} | {src or ''}"] = instrs.get(f"{name} | {src or ''}", 0) + e.duration_ns
            span[0] = e.start_ns if span[0] is None else min(span[0], e.start_ns)
            span[1] = e.start_ns + e.duration_ns if span[1] is None else max(span[1], e.start_ns + e.duration_ns)

    def top(agg, n):
        return [(k[:150], v / 1e6 / steps) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:n]]

    return {"steps": steps, "kernel_ms_per_step": sum(parts.values()) / 1e6 / steps,
            "span_ms_per_step": ((span[1] - span[0]) / 1e6 / steps) if span[0] is not None else None,
            "parts_ms": top(parts, 20), "top_sources_ms": top(lines, 30), "top_kernels_ms": top(kernels, 20),
            **({"instructions_ms": [(k[:400], v / 1e6 / steps) for k, v in
                                    sorted(instrs.items(), key=lambda kv: -kv[1])[:300]]} if out_dir else {})}


def print_profile(p: dict) -> None:
    print(f"\nstep breakdown ({p['steps']} traced steps): kernel time {p['kernel_ms_per_step']:.1f} ms/step, "
          f"device span {p['span_ms_per_step'] or 0:.1f} ms/step", flush=True)
    total = p["kernel_ms_per_step"] or 1.0
    for title, key in (("by part", "parts_ms"), ("by source line", "top_sources_ms"), ("by kernel", "top_kernels_ms")):
        print(f"  {title}:")
        for name, ms in p[key]:
            print(f"    {ms:9.2f} ms  {100 * ms / total:5.1f}%  {name}")


def dense_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """This process's dense bf16 matmul throughput (n×n @ n×n), the practical MFU ceiling."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    t = time.perf_counter()
    for _ in range(iters):
        out = f(a)
    jax.block_until_ready(out)
    return 2 * n ** 3 * iters / (time.perf_counter() - t) / 1e12


def compare_losses(results: list[dict]) -> list[tuple[str, str, float]]:
    """(mesh, first mesh with the same global batch, max relative loss difference) for every later mesh that
    recorded `--losses`; printed. The runs start from the same initial state and see the same batches, so the losses
    differ only by summation order (bf16 tolerance) unless the parallel form is wrong."""
    out = []
    with_losses = [r for r in results if r.get("losses")]
    for i, r in enumerate(with_losses):
        ref = next((q for q in with_losses[:i] if q["batch"] == r["batch"]), None)
        if ref is None:
            continue
        n = min(len(r["losses"]), len(ref["losses"]))
        a, b = np.asarray(r["losses"][:n]), np.asarray(ref["losses"][:n])
        worst = float(np.max(np.abs(a - b) / np.abs(b)))
        out.append((r["mesh"], ref["mesh"], worst))
        print(f"losses: mesh {r['mesh']} vs {ref['mesh']} (batch {r['batch']}, {n} steps): max relative "
              f"difference {worst:.2e}", flush=True)
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
    p.add_argument("--compile_only", action="store_true",
                   help="build and compile each mesh's step into --cache_dir, time nothing (parallel warm-up)")
    p.add_argument("--muon_ns_dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grad_accum", type=int, default=1,
                   help="micro-batches per optimizer step (each batch_per_device rows per device)")
    p.add_argument("--global_batch", type=int, default=0,
                   help="rows per optimizer step for every mesh (default: batch_per_device x devices x grad_accum)")
    p.add_argument("--losses", type=int, default=0,
                   help="first train this many steps from the initial state on fresh batches (the same for every "
                        "mesh) and compare the losses of meshes with the same global batch")
    p.add_argument("--profile", action="store_true", help="trace the first mesh's steps and print the breakdown")
    p.add_argument("--profile_steps", type=int, default=2)
    p.add_argument("--out_dir", default=None, help="write results (and the profile) as JSON here")
    p.add_argument("--cache_dir", default=os.path.join(tempfile.gettempdir(), "k3jax_jit_cache"),
                   help="persistent compilation cache ('' = off)")
    args = p.parse_args()
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cfg = training_config(args.config, args.set)  # as train.py: f32 master parameters unless --set param_dtype=
    counts = count_params(cfg)
    print(f"{cfg.name}: total {counts['total_params'] / 1e9:.2f}B active {counts['active_params'] / 1e9:.2f}B; "
          f"device {jax.devices()[0].device_kind} x{jax.device_count()}; T={args.seq_len} "
          f"B/device={args.batch_per_device} grad_accum={args.grad_accum} optimizer={args.optimizer} "
          f"ns={args.muon_ns_dtype} "
          f"params={cfg.runtime.param_dtype} compute={cfg.runtime.dtype} "
          f"mtp={not args.no_mtp} qb={not args.no_qb} overrides={args.set}", flush=True)
    peak = peak_flops_per_device(jax.devices()[0])
    ceiling = dense_matmul_tflops() if jax.devices()[0].platform != "cpu" else None
    if ceiling:
        share = f" ({100e12 * ceiling / peak:.0f}% of the {peak / 1e12:.0f} TFLOP/s peak)" if peak else ""
        print(f"dense bf16 matmul 8192^3 in this process: {ceiling:.0f} TFLOP/s{share}", flush=True)
    base = None
    results = []
    for mesh_text in args.meshes:
        r = run(cfg, mesh_text, args)
        if r is None:
            continue
        results.append(r)
        if not r["fits"]:
            continue
        if base is None:
            base = r
        eff = r["tokens_per_s"] / (r["devices"] / base["devices"] * base["tokens_per_s"])
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"mesh {r['mesh']:>9} devices {r['devices']} batch {r['batch']:>3}: step {r['step_ms']:8.1f} ms  "
              f"{r['tokens_per_s']:10,.0f} tokens/s  {r['tflops_per_device']:6.1f} TFLOP/s/device  MFU {mfu}  "
              f"scaling eff {100 * eff:.0f}%  (compile {r['compile_s']:.0f}s, loss {r['loss']:.3f}, "
              f"peak memory {r['peak_gib']:.1f} GiB)", flush=True)
        if "profile" in r:
            print_profile(r["profile"])
        args.profile = False  # the first mesh only
    compare_losses(results)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"train_throughput_{cfg.name}.json"), "w") as f:
            json.dump({"args": vars(args), "dense_matmul_tflops": ceiling, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
