"""Decode-sized dense matmuls on one GPU: how fast the weights stream from HBM.

    python benchmarks/dense_decode_bench.py [--m=64] [--shapes=1536x4608,1536x1536,...] [--iters=20]
                                            [--tilings=16-64-128-4-4,...] [--no_cublas_run] [--check]

Why: the `k3_gpu` decode profile at batch 64 (RESULTS.md, 2026-11-30 session 5) spends ~790 us per step in ~140
dense matmuls whose weights stream at ~1.3-1.9 TB/s (e.g. the merged KDA q/k/v projection, 14 MB, 10.4 us), while
the grouped-matmul kernel streams the experts at ~3.2 TB/s. This measures, per decode shape (M rows x K x N, bf16
in and out, f32 accumulation), µs per call and weight bytes per second of:

- ``xla``: ``x @ w`` as the model writes it (XLA picks a Triton gemm fusion or cuBLAS);
- ``xla_cublas``: the same in a child process with ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS only), unless
  ``--no_cublas_run``;
- ``xla_triton_<bm-bn-bk-split-stages-warps>``: the same in a child process per ``--triton_configs`` entry, with
  XLA's Triton gemm config forced (``--xla_gpu_override_gemm_autotuner``): what each config does with the weights
  cold (XLA's autotuner times its candidates on L2-resident weights, i.e. not as a decode step sees them);
- ``split_<tn-tk-splits-warps-stages>``: our split-K decode kernel (`pallas_kernels.dense.decode_matmul`; splits 0:
  its default for the shape; the partial products summed by XLA inside the timed call);
- ``gmm_<tiling>``: our grouped-matmul kernel (`pallas_kernels.gmm.gmm`) with one group holding all M rows, per
  tiling ``tm-tk-tn-warps-stages``.

Each timed call multiplies ``copies`` distinct x (one each: a shared x would let XLA merge the matmuls into one over
concatenated weights) by ``copies`` distinct weight matrices (together >= 256 MB, so the weights
come from HBM, not the 50 MB L2, as in a decode step where every layer has its own weights), all inside one jit;
the figure is the GPU's busy time per matmul from a profiler trace of ``--iters`` calls (all kernels of the call,
e.g. a split-K reduction, included; the wall clock of such a call is mostly host dispatch), or with ``--wall_clock``
the median call time / copies. Default shapes are `k3_gpu`'s decode matmuls: merged KDA q/k/v
(1536x4608), KDA o_proj and output gate (1536x1536), shared-expert gate+up (1536x3072), latent MoE down/up
(1536x768, 768x1536), MLA q_a (1536x768) and the LM head (1536x163840). ``--check`` compares every
implementation's output with a float64 NumPy product first.
Prints one JSON line per measurement and a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.dense import SplitTiling, decode_matmul  # noqa: E402
from pallas_kernels.gmm import Tiling, gmm  # noqa: E402
from timing import median_ms  # noqa: E402

DEFAULT_SHAPES = "1536x4608,1536x1536,1536x3072,1536x768,768x1536,1536x163840"


def _parse_ints(text: str, cls, fields: str):
    parts = [int(x) for x in text.split("-")]
    if len(parts) != len(fields.split("-")):
        raise ValueError(f"tiling {text!r}: expected {fields}")
    return cls(*parts)


def parse_tiling(text: str) -> Tiling:
    """``tm-tk-tn-warps-stages`` of the grouped-matmul kernel."""
    return _parse_ints(text, Tiling, "tm-tk-tn-warps-stages")


def parse_split_tiling(text: str) -> SplitTiling:
    """``tn-tk-splits-warps-stages`` (splits 0: the kernel's default choice for the shape)."""
    return _parse_ints(text, SplitTiling, "tn-tk-splits-warps-stages")


def triton_gemm_key(text: str) -> str:
    """``bm-bn-bk-split-stages-warps`` -> an AutotuneResult.TritonGemmKey textproto without spaces (XLA_FLAGS splits
    on whitespace; the text format takes ',' between fields)."""
    names = ("block_m", "block_n", "block_k", "split_k", "num_stages", "num_warps")
    parts = text.split("-")
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--triton_configs: expected bm-bn-bk-split-stages-warps (positive ints), got {text!r}")
    return ",".join(f"{n}:{v}" for n, v in zip(names, parts)) + ",num_ctas:1"


def implementations(m: int, tilings: list[str], split_tilings: list[str]) -> dict:
    group_sizes = jnp.asarray([m], jnp.int32)

    def xla(x, w):
        return x @ w

    impls = {"xla": xla}
    backend = "gpu" if jax.default_backend() == "gpu" else "interpret"  # interpret: CPU smoke runs only
    for text in split_tilings:
        impls[f"split_{text}"] = (lambda t: lambda x, w: decode_matmul(x, w, tiling=t, backend=backend))(
            parse_split_tiling(text))
    for text in tilings:
        tiling = parse_tiling(text)
        impls[f"gmm_{text}"] = (lambda t: lambda x, w: gmm(x, w[None], group_sizes, tiling=t))(tiling)
    return impls


def device_us_per_call(call, iters: int, per_call: int) -> dict:
    """GPU busy time (union of kernel intervals, from a jax.profiler trace) per matmul: `iters` calls of `call`, each
    doing `per_call` matmuls."""
    from trace_summary import traced_summary

    jax.block_until_ready(call())
    summary = traced_summary(lambda: jax.block_until_ready(call()), iters, iters * per_call)
    if summary.get("backend") != "gpu":
        raise SystemExit("--device_time needs a GPU trace")
    return {"busy_us": summary["busy_per_step_ms"] * 1e3, "kernels_per_matmul": summary["kernels_per_step"]}


def bench_shape(m: int, k: int, n: int, impls: dict, iters: int, check: bool, stream_bytes: int,
                label_prefix: str = "", device_time: bool = False) -> list[dict]:
    weight_bytes = k * n * 2
    copies = max(1, -(-stream_bytes // weight_bytes))
    rng = np.random.default_rng(0)
    # one x per weight: with a shared x XLA's dot merger would concatenate all the weights into one matmul
    xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(copies)]
    x = xs[0]
    key = jax.random.key(1)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * (k ** -0.5) for i in range(copies)]
    rows = []
    for name, fn in impls.items():
        try:
            if check:
                got = np.asarray(jax.jit(fn)(x, ws[0]), np.float64)
                want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64)
                err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                if err > 2e-2:
                    raise RuntimeError(f"check failed: max relative error {err:.3g} > 2e-2")
            many = jax.jit(lambda xs, ws, fn=fn: tuple(fn(xi, wi) for xi, wi in zip(xs, ws)))
            ms = median_ms(lambda: many(xs, ws), iters) / copies
            row = {"impl": label_prefix + name, "m": m, "k": k, "n": n, "copies": copies, "wall_us": ms * 1e3}
            if device_time:  # a few-hundred-µs call is mostly host dispatch: use the GPU's own time
                trace = device_us_per_call(lambda: many(xs, ws), iters, copies)
                ms = trace["busy_us"] / 1e3
                row.update(kernels_per_matmul=trace["kernels_per_matmul"])
            row.update(us=ms * 1e3, weight_TB_per_s=weight_bytes / (ms * 1e-3) / 1e12)
            print(json.dumps(row), flush=True)
            rows.append(row)
        except (ValueError, RuntimeError) as e:  # a tiling that does not fit this shape: report, go on
            print(f"{label_prefix}{name} {k}x{n}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=64, help="rows (decode batch)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of KxN")
    p.add_argument("--tilings", default="16-64-128-4-4,64-64-64-4-4,64-128-32-4-4,16-128-64-4-4",
                   help="gmm tilings tm-tk-tn-warps-stages ('' for none)")
    p.add_argument("--split_tilings", default="64-64-0-4-4,128-64-0-4-4",
                   help="split-K tilings tn-tk-splits-warps-stages (splits 0: the default for the shape; '' for none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true")
    p.add_argument("--stream_mb", type=int, default=256, help="weight bytes per timed call (> L2: from HBM)")
    p.add_argument("--no_cublas_run", action="store_true", help="skip the cuBLAS-only child process")
    p.add_argument("--wall_clock", action="store_true",
                   help="report wall-clock time per call (host dispatch included) instead of GPU busy time")
    p.add_argument("--triton_configs", default="",
                   help="comma list of bm-bn-bk-split-stages-warps: one child process each with that Triton gemm "
                        "config forced for every XLA matmul")
    p.add_argument("--xla_only", default="", help=argparse.SUPPRESS)  # the child process: its row label
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    tilings = [t for t in args.tilings.split(",") if t] if not args.xla_only else []
    split_tilings = [t for t in args.split_tilings.split(",") if t] if not args.xla_only else []
    impls = implementations(args.m, tilings, split_tilings)
    prefix = args.xla_only
    if args.xla_only:
        impls = {"": impls["xla"]}
    else:
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for k, n in shapes:
        try:
            rows += bench_shape(args.m, k, n, impls, args.iters, args.check, args.stream_mb * 2 ** 20, prefix,
                                device_time=not args.wall_clock and jax.default_backend() == "gpu")
        except Exception as e:  # noqa: BLE001 -- report and go on with the other shapes
            print(f"{k}x{n}: failed: {type(e).__name__}: {e}", flush=True)
    if args.xla_only:
        return
    children = [] if args.no_cublas_run else [("xla_cublas", "--xla_gpu_enable_triton_gemm=false")]
    children += [(f"xla_triton_{c}", "--xla_gpu_override_gemm_autotuner=" + triton_gemm_key(c))
                 for c in args.triton_configs.split(",") if c]
    for label, flag in children:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
        cmd = [sys.executable, __file__, f"--xla_only={label}", f"--m={args.m}", f"--shapes={args.shapes}",
               f"--iters={args.iters}", f"--stream_mb={args.stream_mb}"] + (["--check"] if args.check else []) + (
                   ["--wall_clock"] if args.wall_clock else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
                rows.append(json.loads(line))
            elif "failed" in line:
                print(line, flush=True)
        if out.returncode:
            print(f"{label} run failed (rc {out.returncode}): {out.stderr[-1500:]}", flush=True)
    names = list(dict.fromkeys(r["impl"] for r in rows))
    clock = "wall clock" if args.wall_clock or jax.default_backend() != "gpu" else "GPU busy time"
    print(f"\nM = {args.m}, bf16; µs per matmul ({clock}; weight TB/s)\n")
    print("| K x N | weight MB | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for k, n in shapes:
        cells = []
        for name in names:
            r = next((r for r in rows if r["impl"] == name and (r["k"], r["n"]) == (k, n)), None)
            cells.append(f"{r['us']:.1f} ({r['weight_TB_per_s']:.2f})" if r else "—")
        print(f"| {k}x{n} | {k * n * 2 / 1e6:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
