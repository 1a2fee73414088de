"""Checks of the Pallas KDA kernels outside the unit tests.

    python -m benchmarks.kda_check              # any host: lower forward + backward for CUDA (no GPU needed)
    python -m benchmarks.kda_check --run        # on a GPU: gradients of backend="gpu" vs the token recurrence

Lowering (default): ``jax.jit(value_and_grad(loss)).trace(...).lower(lowering_platforms=("cuda",))`` runs the
Pallas -> Triton lowering of every kernel of ``chunk_kda(backend="gpu")`` (forward and Pallas backward; bf16 and
f32; with and without cu_seqlens) on the host and prints the Triton kernels found in the lowered program. It does
not run the Triton compiler (register allocation, shared memory), which only happens on a GPU.

``--run`` compares o, the final state and the six gradients with ``jax.grad`` of ``kda_recurrent`` (f32 matmul
precision) on the GPU, prints one JSON line per dtype with max-error / max-|ref| per quantity, and exits 1 if any
exceeds the tolerance (f32 1e-4, bf16 3e-2).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda import chunk_kda, chunk_kda_gated, kda_recurrent, l2_normalize
from pallas_kernels.cuda_lowering import triton_kernels

_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def _loss(core, w_o, w_s):
    def loss(*args):
        o, s = core(*args)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)
    return loss


def lower_for_cuda(t=1000, h=2, d=128):
    """Lower value_and_grad of chunk_kda(backend='gpu') for CUDA; returns one dict per case (plain, cu_seqlens,
    traced segment ids)."""
    sd = jax.ShapeDtypeStruct
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for packing in (None, (0, 70, 70, t), "segment_ids"):
            cu_seqlens = packing if isinstance(packing, tuple) else None
            n_states = 1 if cu_seqlens is None else len(cu_seqlens) - 1
            args = (sd((1, t, h, d), dtype), sd((1, t, h, d), dtype), sd((1, t, h, d), dtype),
                    sd((1, t, h, d), jnp.float32), sd((1, t, h), jnp.float32), sd((n_states, h, d, d), jnp.float32),
                    sd((1, t), jnp.int32))

            def core(*a, cu_seqlens=cu_seqlens, segmented=packing == "segment_ids"):
                return chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu_seqlens,
                                 segment_ids=a[6] if segmented else None, backend="gpu")

            loss = _loss(core, jnp.ones((1, t, h, d), jnp.float32), jnp.ones((n_states, h, d, d), jnp.float32))
            calls, kernels = triton_kernels(jax.value_and_grad(loss, argnums=tuple(range(6))), *args,
                                            name_pattern=r"kda_[a-z_]+")
            rows.append({"dtype": jnp.dtype(dtype).name, "packing": packing, "triton_calls": calls,
                         "kernels": kernels})
    return rows


def run_on_gpu(b=2, t=1000, h=3, d=128, config=None, backend="gpu"):
    """Outputs, final state and gradients of the GPU kernels (`config`: a KernelConfig, default the defaults) vs
    the token recurrence; returns (rows, ok). `backend="interpret"` runs the same check on CPU (slow)."""
    rng = np.random.default_rng(1)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = (unit(rng.standard_normal((b, t, h, d))) for _ in range(2))
    v = rng.standard_normal((b, t, h, d))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((b, t, h, d))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    h0 = 0.1 * rng.standard_normal((b, h, d, d))
    w_o = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((b, h, d, d)), jnp.float32)

    seg = np.zeros((b, t), np.int32)
    for start in (5, 64, 70, 75, 400, 401):  # mid-chunk, on a chunk start, two in one sub-chunk, 1-token document
        seg[0, start:] += 1

    rows, ok = [], True
    for dtype, segmented in ((jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)):
        seg_ids = jnp.asarray(seg) if segmented else None

        def ours(*a, seg_ids=seg_ids):
            return chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, segment_ids=seg_ids,
                             backend=backend, config=config)

        def reference(*a, seg_ids=seg_ids):
            return kda_recurrent(*a[:5], scale=d ** -0.5, initial_state_bhkv=a[5], segment_ids_bt=seg_ids)

        args = tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + tuple(
            jnp.asarray(x, jnp.float32) for x in (g, beta, h0))
        grad = jax.value_and_grad(_loss(ours, w_o, w_s), argnums=tuple(range(6)))
        got_out = jax.jit(ours)(*args)
        got = jax.jit(grad)(*args)[1]
        with jax.default_matmul_precision("float32"):
            want_out = jax.jit(reference)(*args)
            want = jax.jit(jax.grad(_loss(reference, w_o, w_s), argnums=tuple(range(6))))(*args)
        row = {"check": "gpu_grads", "dtype": jnp.dtype(dtype).name, "segment_ids": segmented, "shape": [b, t, h, d]}
        for name, x, ref in zip(("o", "final_state") + _NAMES, tuple(got_out) + tuple(got),
                                tuple(want_out) + tuple(want)):
            x, ref = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, ref))
            row[name] = float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))
            ok = ok and row[name] < _TOLERANCE[row["dtype"]]
        rows.append(row)
    gated_rows, gated_ok = _gated_check(rng, b, 1024, h, d, config, backend)
    rows += gated_rows
    return rows, ok and gated_ok


def _gated_check(rng, b, t, h, d, config, backend):
    """``chunk_kda_gated`` on raw inputs (T a multiple of 64, so the intra kernel activates the gate in-kernel for
    the modes that can) vs the token recurrence on inputs prepared in XLA: outputs and the
    gradients of all seven inputs, in f32 (all checked) and bf16 (dA_log / ddt_bias, sums over every token with
    cancellation, are reported but not checked in bf16: the XLA-gate path's error there is as large)."""
    raw = [rng.standard_normal((b, t, h, d)) for _ in range(4)]
    blog = rng.standard_normal((b, t, h))
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
    dt_bias = jnp.asarray(0.1 * rng.standard_normal((h, d)), jnp.float32)
    w_o = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)

    def ours(q, k, v, graw, blog, a_log, dt_bias):
        o, _ = chunk_kda_gated(q, k, v, graw, blog, A_log=a_log, dt_bias=dt_bias, backend=backend, config=config)
        return o

    def reference(q, k, v, graw, blog, a_log, dt_bias):
        qn, kn = (l2_normalize(x).astype(x.dtype) for x in (q, k))
        g = -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (graw.astype(jnp.float32) + dt_bias))
        return kda_recurrent(qn, kn, v, g, jax.nn.sigmoid(blog.astype(jnp.float32)), scale=d ** -0.5)[0]

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w_o)

    rows, ok = [], True
    names = ("o", "dq", "dk", "dv", "dg_raw", "dbeta_logits", "dA_log", "ddt_bias")
    for dtype in (jnp.float32, jnp.bfloat16):
        args = (*(jnp.asarray(x, dtype) for x in (*raw, blog)), a_log, dt_bias)
        argnums = tuple(range(7))
        got = (jax.jit(ours)(*args), *jax.jit(jax.grad(loss(ours), argnums=argnums))(*args))
        with jax.default_matmul_precision("float32"):
            want = (jax.jit(reference)(*args), *jax.jit(jax.grad(loss(reference), argnums=argnums))(*args))
        row = {"check": "gpu_gated_raw_inputs", "dtype": jnp.dtype(dtype).name, "shape": [b, t, h, d]}
        for name, x, ref in zip(names, got, want):
            x, ref = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, ref))
            row[name] = float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))
            if dtype == jnp.float32 or name not in ("dA_log", "ddt_bias"):
                ok = ok and row[name] < _TOLERANCE[row["dtype"]]
        rows.append(row)
    return rows, ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run the gradient check on the GPU (else lower only)")
    args = p.parse_args(argv)
    if not args.run:
        for row in lower_for_cuda():
            print(json.dumps(row), flush=True)
        return
    rows, ok = run_on_gpu()
    for row in rows:
        print(json.dumps(row), flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
