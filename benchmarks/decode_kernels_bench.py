"""Decode-sized kernels one at a time, each side by side with the XLA ops it replaces (same process, same inputs).

    python -m benchmarks.decode_kernels_bench                     # k3_gpu shapes, B = 64 rows, on a GPU
    python -m benchmarks.decode_kernels_bench --rows=64,16 --ops=kda --kda_variants=128-4o,32-4

Ops (`--ops`):
- ``kda``: the fused one-token KDA decode (`pallas_kernels.kda.decode_fused`; variants block_v-warps, suffix ``o``
  with the output epilogue, the model's default), chained through its f32 state, beside an XLA pass over the same
  state (``s * c + 1``: one f32 read + one write, the traffic's streaming ceiling); kernel rows report their
  state's and output's max difference from the first variant's;
- ``experts``: one decode MoE layer's routed experts on random routing: the planned path (plan + `gmm_glu` +
  `gmm`) vs the plan-free `pallas_kernels.moe.assigned` kernels per ``--experts_tilings`` (the three longest
  kernels' mean times in ``kernels``);
- ``glu_lhs``: the plan-free GLU kernel alone beside two diagnostic twins that read z's rows differently
  (contiguous rows: wrong by design; a one-hot row-pick matmul: exact), i.e. what its row gather costs;
- ``hbm``: how fast the routed experts' weights stream on this GPU: an XLA reduction over a bf16 weight stack, a
  read-only Pallas stream of it (`_stream_sum`, variants ``--stream_tilings``) and our grouped matmuls (`gmm_glu`,
  `gmm`) on ``rows`` x top-k balanced rows.
Each timing is ``--chain`` dependent calls inside one jit (a `fori_loop` feeding each output into the next input,
so the calls cannot overlap and host dispatch is paid once), median of ``--iters``, divided by ``--chain``: the
per-call cost inside a decode step. For ``kda``, ``experts``, ``glu_lhs`` and ``hbm`` on a GPU the figure is the
GPU's busy time per call from a profiler trace instead (``wall_us`` keeps the chain's wall clock, which also
counts the loop's per-iteration predicate copy to the host), and each chained call goes through ``--rotate``
distinct states / weight copies so that none is still in the L2 when it comes round again.
A smoke run on CPU (``--backend=interpret``) checks the script, not the timings. ``K3_BENCH_NO_TRACE=1`` skips the
profiler traces (wall clock only): under Nsight Compute (`benchmarks/ncu_decode_kernels.sh`), which owns CUPTI.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import configs
from benchmarks.timing import median_ms
from benchmarks.trace_summary import traced_summary
from k3jax.layers import moe
from k3jax.ops import backend as backend_lib
from pallas_kernels.gmm import Tiling, epilogue, gmm, gmm_glu
from pallas_kernels.kda.decode_fused import kda_decode_fused
from pallas_kernels.moe import assigned
from pallas_kernels.tiling import next_pow2, triton_params


def _emit(out: list, row: dict) -> None:
    """Keeps a measurement and prints it at once (a run cut short by a time limit still reports what it measured)."""
    out.append(row)
    print(json.dumps(row), flush=True)


def _chain(call, chain):
    """jit of `chain` dependent applications of `call(x) -> x` (same shape and dtype)."""
    return jax.jit(lambda x: jax.lax.fori_loop(0, chain, lambda i, h: call(h), x))


def _device_us(f, arg, iters: int, chain: int) -> dict:
    """From a profiler trace of `iters` calls of the chained `f(arg)` (GPU only): busy time per chained call (the
    loop's own small kernels included, its host round trips not) and the longest kernel's mean time; the wall clock
    of a `fori_loop` chain also counts the loop's per-iteration predicate copy back to the host (~10 µs on an H200)."""

    if jax.default_backend() != "gpu" or os.environ.get("K3_BENCH_NO_TRACE"):
        return {}
    jax.block_until_ready(f(arg))
    summary = traced_summary(lambda: jax.block_until_ready(f(arg)), iters, iters * chain)
    top = summary["top_kernels"]
    return {"busy_us": summary["busy_per_step_ms"] * 1e3, "kernel": top[0]["name"][:60], "kernel_us": top[0]["avg_us"],
            "kernels": {t["name"][:40]: round(t["avg_us"], 2) for t in top[:3]}}


def _timed_rotated(step, x, rotate: int, chain: int, iters: int) -> dict:
    """Times `step(x, i) -> x` (weight copy i) chained over the `rotate` copies, `chain` times: wall clock and (GPU)
    trace figures per call, and ``us``: the busy time per call where traced, else the wall clock."""
    def one(c):
        for i in range(rotate):
            c = step(c, i)
        return c

    f = _chain(one, chain)
    row = {"wall_us": median_ms(lambda: f(x), iters) / chain / rotate * 1e3}
    dev = _device_us(f, x, iters, chain)
    row.update(dev)
    row["us"] = dev["busy_us"] / rotate if dev else row["wall_us"]
    return row


def _rel_err(got, want) -> float:
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def bench_kda(rows, heads, kd, wm1, variants, backend, chain, iters, rotate):

    rng = np.random.default_rng(2)
    p = heads * kd
    proj = tuple(jnp.asarray(rng.standard_normal((rows, p)), jnp.bfloat16) for _ in range(3))
    hist = jnp.asarray(rng.standard_normal((rows, wm1, 3, p)), jnp.bfloat16)
    conv = tuple(jnp.asarray(rng.standard_normal((wm1 + 1, p)) / 2, jnp.float32) for _ in range(3))
    z = jnp.asarray(rng.standard_normal((rows, heads, kd)), jnp.bfloat16)
    a_log = jnp.asarray(rng.standard_normal(heads) / 4, jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((heads, kd)) / 4, jnp.float32)
    b_raw = jnp.asarray(rng.standard_normal((rows, heads)), jnp.bfloat16)
    valid = jnp.ones((rows,), jnp.int32)
    # `rotate` states, each updated once per chained call: a state is re-read only after (rotate - 1) others'
    # traffic went through the 50 MB L2 (as in a model, where every layer has its own state)
    states = tuple(jnp.asarray(rng.standard_normal((rows, heads, kd, kd)) / 8, jnp.float32) for _ in range(rotate))
    state_mb = 2 * states[0].size * 4 / 1e6  # one read + one write per call

    gate = jnp.asarray(rng.standard_normal((rows, p)), jnp.bfloat16)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(kd), jnp.float32)

    def kernel(s, bv=32, w=4, out=False):  # out: the output epilogue (the model's default: whole heads)
        extra = dict(out_gate_bp=gate, out_norm_v=norm) if out else {}
        return kda_decode_fused(proj, hist, conv, z, a_log, dt_bias, b_raw, valid, s, scale=kd ** -0.5,
                                lower_bound=-5.0, backend=backend, block_v=bv, warps=w, **extra)

    def timed(row, call):
        f = _chain(lambda ss: tuple(call(s) for s in ss), chain)
        row["wall_us"] = median_ms(lambda: f(states), iters) / chain / rotate * 1e3
        dev = _device_us(f, states, iters, chain)
        row.update(dev)
        row["us"] = dev["busy_us"] / rotate if dev else row["wall_us"]
        row["gbs"] = state_mb / row["us"] * 1e3
        return row

    out = []
    _emit(out, timed({"op": "kda", "rows": rows, "impl": f"xla s*c+1 (same f32 traffic, {rotate} states)"},
                     lambda s: s * 0.999 + 1e-3))
    copy_us = out[-1]["us"]
    want, want_epilogue = None, variants[0].endswith("o")
    for text in variants:
        out_epilogue = text.endswith("o")
        bv, w = (int(x) for x in text.rstrip("o").split("-"))
        row = {"op": "kda", "rows": rows, "impl": f"fused {text}"}
        try:
            got = [np.asarray(x, np.float64) for x in jax.jit(lambda s: kernel(s, bv, w, out_epilogue))(states[0])]
            want = got if want is None else want  # the first variant's (o, state)
            row["o_err"], row["err"] = (float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(got, want))
            if out_epilogue != want_epilogue:
                row.pop("o_err")  # a gated bf16 o against a raw f32 one: only the states compare
            timed(row, lambda s: kernel(s, bv, w, out_epilogue)[1])
            row["vs_xla"] = copy_us / row["us"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _emit(out, row)
    return out


def _stream_sum(w_ekn, tk: int, tn: int, warps: int, stages: int, interpret: bool):
    """[E, K, N] -> [E, N] f32 column sums: reads every weight once in (1, tk, tn) tiles, program (e, column tile)
    walking K in a pipelined loop, i.e. the grouped matmul's weight traffic without its matmul (a read ceiling)."""


    e, k, n = w_ekn.shape

    def kernel(w_ref, o_ref):
        ei, j = pl.program_id(0), pl.program_id(1)
        cols = pl.ds(pl.multiple_of(j * tn, tn), tn)

        def body(i, acc):
            rows = pl.ds(pl.multiple_of(i * tk, tk), tk)
            return acc + jnp.sum(w_ref[ei, rows, cols].astype(jnp.float32), axis=0)
        o_ref[ei, cols] = jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tn,), jnp.float32))

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((e, n), jnp.float32), grid=(e, n // tn),
                          interpret=interpret, compiler_params=triton_params(interpret, warps, stages),
                          name="k3_stream_sum")(w_ekn)


def bench_hbm(cfg, rows, chain, iters, backend, stream_tilings, rotate):
    """How fast weights stream on this GPU, on the routed experts' shapes: an XLA reduction, a Pallas read-only
    stream (`_stream_sum`, per tiling tk-tn-warps-stages) and our grouped matmuls on `rows` balanced tokens (top-k
    rows per token), each call depending on the last (no hoisting out of the chain)."""

    e, latent, inter = cfg.num_experts, cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size
    m = rows * cfg.num_experts_per_token
    rng = np.random.default_rng(3)
    sizes = jnp.asarray(np.full(e, m // e) + (np.arange(e) < m % e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, latent)), jnp.bfloat16)
    # `rotate` copies of each weight stack, all used once per chained call (each re-read only after the others
    # went through the 50 MB L2, as in a model where every layer has its own experts)
    w_ups = [jnp.asarray(rng.standard_normal((e, latent, 2 * inter)) / 32, jnp.bfloat16) for _ in range(rotate)]
    w_gates = [(w[..., :inter], w[..., inter:]) for w in w_ups]  # gate, up: separate arrays, as the model holds them
    w_downs = [jnp.asarray(rng.standard_normal((e, inter, latent)) / 32, jnp.bfloat16) for _ in range(rotate)]
    interpret = backend == "interpret"
    out = []

    def emit(name, mb, step, arg):  # step(carry, i) uses weight copy i; chained over every copy, `chain` times
        def one(c):
            for i in range(rotate):
                c = step(c, i)
            return c
        f = _chain(one, chain)
        row = {"op": "hbm", "rows": m, "impl": f"{name} ({mb:.0f} MB, {rotate} copies)",
               "wall_us": median_ms(lambda: f(arg), iters) / chain / rotate * 1e3}
        dev = _device_us(f, arg, iters, chain)
        row.update(dev)
        row["us"] = dev["busy_us"] / rotate if dev else row["wall_us"]
        row["gbs"] = mb / row["us"] * 1e3
        _emit(out, row)

    for name, ws in (("glu weights", w_ups), ("down weights", w_downs)):
        mb = ws[0].size * 2 / 1e6
        emit(f"xla reduce, {name} {list(ws[0].shape)}", mb,
             lambda c, i, ws=ws: jnp.sum(ws[i].astype(jnp.float32) * c, axis=(0, 1))[:1].sum() * 1e-9 + c,
             jnp.float32(1))
        for text in stream_tilings:
            tk, tn, wp, st = (int(v) for v in text.split("-"))
            try:
                emit(f"pallas stream {text}, {name}", mb, lambda c, i, ws=ws, t=(tk, tn, wp, st):
                     _stream_sum(ws[i], *t, interpret)[0, :1].sum() * 1e-9 + c, jnp.float32(1))
            except Exception as ex:  # noqa: BLE001
                _emit(out, {"op": "hbm", "rows": m, "impl": f"pallas stream {text}", "error": str(ex)[:200]})
    gmm_backend = "interpret" if interpret else None
    emit("gmm_glu (ours)", w_ups[0].size * 2 / 1e6, lambda h, i: gmm_glu(
        h, *w_gates[i], sizes, beta1=4.0, beta2=25.0, backend=gmm_backend)[:, :latent].astype(h.dtype), x)
    emit("gmm down (ours)", w_downs[0].size * 2 / 1e6,
         lambda h, i: gmm(h, w_downs[i], sizes, backend=gmm_backend).astype(h.dtype), x)
    return out


def _glu_lhs_variant(z_nl, experts_nk, w_gate, w_up, *, lhs: str, tiling, splits: int, interpret: bool):
    """Diagnostic twins of `assigned_glu` (same walk, weights and epilogue) that differ only in how a row tile of
    z is read: ``contiguous`` loads z's first tm rows instead of the gathered ones (wrong result; what the kernel
    would cost if its activation rows needed no gather), ``onehot`` loads the whole [N, tk] z slice (contiguous)
    and picks the tile's rows with a one-hot [tm, N] matmul (exact: one nonzero bf16 product per output)."""


    tiling = assigned.fit_tiling(tiling, *w_gate.shape[1:])
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    steps = z_nl.shape[1] // tk
    n = z_nl.shape[0]
    np_ = next_pow2(n, 16)
    z_pad = jnp.pad(z_nl, ((0, np_ - n), (0, 0)))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)

    def tile_body(e, rows, n0, z_ref, gate_ref, up_ref):
        if lhs == "onehot":
            pick = (rows[:, None] == jax.lax.broadcasted_iota(jnp.int32, (tm, np_), 1)).astype(z_nl.dtype)

        def body(kk, accs):
            k0 = pl.multiple_of(kk * tk, tk)
            if lhs == "contiguous":
                a = z_ref[pl.ds(0, tm), pl.ds(k0, tk)]
            else:
                a = dot(pick, z_ref[:, pl.ds(k0, tk)]).astype(z_nl.dtype)  # [tm, tk]: the tile's rows, exact
            return (accs[0] + dot(a, gate_ref[e, pl.ds(k0, tk), pl.ds(n0, tn)]),
                    accs[1] + dot(a, up_ref[e, pl.ds(k0, tk), pl.ds(n0, tn)]))

        zeros = jnp.zeros((tm, tn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
        return epilogue.glu_f32(gate, up, "situ", 4.0, 25.0)

    return assigned._assigned_call(tile_body, z_pad, (w_gate, w_up), experts_nk, lhs_by_token=True,
                                   n_out=w_gate.shape[2], out_dtype=z_nl.dtype, tiling=tiling, splits=splits,
                                   interpret=interpret, name=f"k3_glu_{lhs}")


def bench_glu_lhs(cfg, rows, chain, iters, backend, rotate):
    """The plan-free GLU kernel alone (its default tiling) beside its two diagnostic twins (`_glu_lhs_variant`):
    how much of its time the gathered activation rows cost."""

    e, lat, inter, k = (cfg.num_experts, cfg.routed_expert_hidden_size or cfg.hidden_size,
                        cfg.moe_intermediate_size, cfg.num_experts_per_token)
    rng = np.random.default_rng(4)
    experts = jnp.asarray(np.stack([rng.choice(e, size=k, replace=False) for _ in range(rows)]), jnp.int32)
    z = jnp.asarray(rng.standard_normal((rows, lat)), jnp.bfloat16)
    ws = [tuple(jnp.asarray(rng.standard_normal((e, lat, inter)) / np.sqrt(lat), jnp.bfloat16) for _ in range(2))
          for _ in range(rotate)]
    interpret = backend == "interpret"
    t = assigned.ASSIGNED_TILING
    calls = {"gather (the kernel)": lambda zz, w: assigned.assigned_glu(
                 zz, experts, *w, activation="situ", beta1=4.0, beta2=25.0, tiling=t,
                 backend="interpret" if interpret else "gpu"),
             "contiguous rows (diagnostic, wrong result)": lambda zz, w: _glu_lhs_variant(
                 zz, experts, *w, lhs="contiguous", tiling=t, splits=4, interpret=interpret),
             "one-hot row pick": lambda zz, w: _glu_lhs_variant(
                 zz, experts, *w, lhs="onehot", tiling=t, splits=4, interpret=interpret)}
    out, want = [], None
    for name, fn in calls.items():
        row = {"op": "glu_lhs", "rows": rows, "impl": name}
        try:
            row.update(_timed_rotated(lambda c, i, fn=fn: (fn(c, ws[i])[:rows, :lat] * 4.0).astype(c.dtype), z,
                                      rotate, chain, iters))
            got = np.asarray(jax.jit(lambda zz: fn(zz, ws[0]))(z)[:rows * k], np.float32)
            if want is None:
                want = got
            else:
                row["err"] = _rel_err(got, want)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        _emit(out, row)
    return out


def bench_experts(cfg, rows, chain, iters, backend, tilings, rotate):
    """The routed experts of one decode MoE layer on `rows` tokens with a random top-k routing: the planned path
    (`moe.experts_dropless`: argsort plan, row gather, `gmm_glu`, `gmm`, combine) vs the plan-free kernels
    (`moe.experts_assigned`'s `assigned_glu` + `assigned_down` + combine) per tiling tm-tk-tn-warps-stages-splits;
    each chained call feeds its output back as the next z and goes through `rotate` weight copies."""

    e, lat, inter, k = (cfg.num_experts, cfg.routed_expert_hidden_size or cfg.hidden_size,
                        cfg.moe_intermediate_size, cfg.num_experts_per_token)
    rng = np.random.default_rng(4)
    experts = jnp.asarray(np.stack([rng.choice(e, size=k, replace=False) for _ in range(rows)]), jnp.int32)
    weights = jnp.asarray(rng.random((rows, k)) / k, jnp.float32)
    z = jnp.asarray(rng.standard_normal((rows, lat)), jnp.bfloat16)
    ws = [tuple(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16)
                for shape in ((e, lat, inter), (e, lat, inter), (e, inter, lat))) for _ in range(rotate)]
    interpret = backend == "interpret"
    kb = "interpret" if interpret else "gpu"
    out, ref = [], {}

    def planned(zz, w):
        return moe.experts_dropless(zz, weights, experts, *w, cfg)

    def assigned_call(zz, w, t: Tiling, splits: int, order: str):
        return moe.experts_assigned(zz, weights, experts, *w, cfg.replace(moe_assigned_order=order), kb, tiling=t,
                                    splits=splits)

    def emit(name, fn):
        row = {"op": "experts", "rows": rows, "impl": name}
        row.update(_timed_rotated(lambda c, i: (fn(c, ws[i]) * 4.0).astype(c.dtype), z, rotate, chain, iters))
        got = np.asarray(jax.jit(lambda zz: fn(zz, ws[0]))(z), np.float32)
        if "planned" in ref:
            row["err"] = _rel_err(got, ref["planned"])
        else:
            ref["planned"] = got
        _emit(out, row)


    real_backend = backend_lib.kernel_backend_here
    if interpret:  # the planned path's kernels through the interpreter as well (restored below)
        backend_lib.kernel_backend_here = lambda: "interpret"
    try:
        emit("planned (plan + gmm_glu + gmm)", planned)
    finally:
        backend_lib.kernel_backend_here = real_backend
    for text in tilings:
        parts = text.split("-")
        order = "column" if parts[-1] == "c" else "expert"
        tm, tk, tn, wp, st, sp = (int(v) for v in parts[:6])
        try:
            emit(f"assigned {text}", functools.partial(assigned_call, t=Tiling(tm, tk, tn, wp, st), splits=sp,
                                                       order=order))
        except Exception as ex:  # noqa: BLE001
            _emit(out, {"op": "experts", "rows": rows, "impl": f"assigned {text}", "error": str(ex)[:200]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--rows", default="64", help="decode batch sizes (tokens per step), comma-separated")
    ap.add_argument("--ops", default="kda,experts")
    ap.add_argument("--stream_tilings", default="64-128-4-3,128-128-4-3,64-256-4-4,128-64-4-4,32-128-4-6",
                    help="hbm op: the Pallas read-only stream's tk-tn-warps-stages")
    ap.add_argument("--kda_variants", default="128-4o,32-4,128-4",
                    help="fused KDA decode block_v-warps; suffix 'o': with the output epilogue (the model's default)")
    ap.add_argument("--experts_tilings", default="16-64-128-4-4-4,16-64-128-4-4-4-c,16-32-128-4-4-4,16-64-128-4-4-2",
                    help="experts op: assigned tm-tk-tn-warps-stages-splits, suffix '-c': column launch order")
    ap.add_argument("--rotate", type=int, default=4,
                    help="kda / hbm: distinct states / weight copies per chained call (defeats the 50 MB L2)")
    ap.add_argument("--chain", type=int, default=50)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="gpu", choices=("gpu", "interpret"))
    args = ap.parse_args(argv)

    cfg = configs.get_config(args.config)
    print(f"devices: {jax.devices()}  config {args.config}: D={cfg.hidden_size}, "
          f"E={cfg.num_experts}, k={cfg.num_experts_per_token}", flush=True)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        if "hbm" in args.ops:
            rows_out += bench_hbm(cfg, rows, args.chain, args.iters, args.backend, args.stream_tilings.split(","),
                                  args.rotate)
        if "experts" in args.ops:
            rows_out += bench_experts(cfg, rows, args.chain, args.iters, args.backend,
                                      args.experts_tilings.split(","), args.rotate)
        if "glu_lhs" in args.ops:
            rows_out += bench_glu_lhs(cfg, rows, args.chain, args.iters, args.backend, args.rotate)
        if "kda" in args.ops:
            rows_out += bench_kda(rows, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_short_conv_kernel_size - 1,
                                  args.kda_variants.split(","), args.backend, args.chain, args.iters, args.rotate)
    print("\n| op | rows | case | impl | µs per call | XLA / impl | check |")
    print("|---|---:|---|---|---:|---:|---|")
    for r in rows_out:
        case = {"kda": lambda: f"{r['gbs']:.0f} GB/s" if "gbs" in r else "",
                "hbm": lambda: f"{r['gbs']:.0f} GB/s" if "gbs" in r else "",
                "experts": lambda: "E={} k={}".format(cfg.num_experts, cfg.num_experts_per_token),
                "glu_lhs": lambda: "GLU alone"}[r["op"]]()
        check = (f"err {r['err']:.1e}" if "err" in r else f"{r['mismatches']} mismatches" if "mismatches" in r
                 else r.get("error", "(peer)"))
        if "o_err" in r:
            check += f", o err {r['o_err']:.1e}"
        us = f"{r['us']:.2f}" if "us" in r else "-"
        ratio = f"{r['vs_xla']:.2f}" if "vs_xla" in r else "-"
        print(f"| {r['op']} | {r['rows']} | {case} | {r['impl']} | {us} | {ratio} | {check} |")


if __name__ == "__main__":
    main()
