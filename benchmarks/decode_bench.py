"""Prefill and decode throughput of the serving path on one GPU, with the decode step's memory-bandwidth floor.

    python -m benchmarks.decode_bench --config=k3_gpu --batches=1,16,64,256 --context=512 [--decode_steps=16]
        [--iters=5] [--prefill_iters=3] [--prefill_max_batch=64] [--budget_s=240] [--out_dir=$OUT]

Decode: the continuous-batching scheduler's own jitted decode (`k3jax.inference.slot_steps.decode_slots`: recurrent KDA
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

--hf_peer: the issue-8 side-by-side peer, HF transformers `KimiLinearForCausalLM.generate` vs our `Engine.generate`
on the same random weights of a Kimi-Linear-shaped config (`benchmarks/hf_generate_peer.py`; needs torch and
transformers, imported only then). Order of a run: --profile, then the peer (which frees torch's memory when done),
then the sweep.

--profile: captures a `jax.profiler` trace of `--profile_calls` decode calls (`--decode_steps` steps each) of
`--config` at `--profile_batch` slots and prints where the step's time goes: device busy time vs the call's span,
kernels per step, per model source line (from the optimised HLO) its kernel time, exclusive time (while it is the
only kernel running: what it adds to the critical path when the CUDA graph runs kernels concurrently) and share of
busy time, kernel categories, top kernels by total time, device copies and time by JAX name stack (jax 0.11 puts it
on every kernel), host CUDA-API calls (graph launches), and the median idle time per step by offset from the step's
start (`trace_summary.step_idle`). The raw .xplane.pb and the HLO are copied to --out_dir.

--variants: a same-process A/B of runtime choices on the same weights, e.g.
    --variants="base:;step:kda_decode_fusion=step;planned:kda_decode_fusion=step,moe_decode_experts=planned"
(name:key=value,... separated by ';'; the first is the baseline). Each variant's decode step is compiled once, then
the variants are timed in interleaved rounds (`--variant_rounds`, median per variant) at `--variant_batch` slots,
and a table gives each step time, its floor fraction and its ratio to the baseline. Runs before the profile. Each
variant also reports its first greedy tokens and the f32 logits of two teacher-forced steps against the baseline's
(per row: a random-init router has near-tied experts, so a variant that changes rounding moves a few rows a lot; a
broken one moves all of them; list the baseline twice, e.g. "base:;base2:", to see run-to-run determinism).
Variants whose compile would start after --budget_s are skipped.

--device_smoke: tiny shapes everywhere (CPU check of every path): `--config=tiny --hf_peer --profile --device_smoke`.
    python -m benchmarks.decode_bench --config=k3_gpu --batches= --hf_peer --profile --out_dir=$OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback

if "--hf_peer" in sys.argv:  # torch shares the device: JAX must not grab 75% of it at start-up
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import configs  # noqa: E402
from benchmarks import hf_generate_peer as peer_lib  # noqa: E402  (torch + transformers are imported inside, lazily)
from benchmarks.trace_summary import (  # noqa: E402
    annotate_kernels,
    hlo_sources,
    kernel_group,
    load_profile,
    overlap_by_group,
    step_idle,
    summarize_xplane,
    trace_xplane,
)
from k3jax.inference import slot_steps  # noqa: E402
from k3jax.inference.xla_flags import apply_serving_flags  # noqa: E402
from k3jax.model import K3Model, init_cache  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
ROUTED_NAMES = ("w1", "w2", "w3")


def build_params(cfg, init_on: str = "cpu"):
    """(spec, flat params) of a randomly initialised model, initialised in one jitted call on the host CPU (then
    copied to the accelerator: the GPU compile of the whole-model init program took 157 s on the H200, the CPU one
    ~11 s) or on the accelerator (`init_on="device"`)."""
    t0 = time.perf_counter()
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    init_device = jax.devices("cpu")[0] if init_on == "cpu" else jax.devices()[0]
    with jax.default_device(init_device):
        lowered = jax.jit(lambda: nnx.state(K3Model(cfg, rngs=nnx.Rngs(0)))).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        state = jax.block_until_ready(compiled())
    t3 = time.perf_counter()
    if init_device != jax.devices()[0]:  # via host memory, so the arrays stay uncommitted (like jit outputs):
        # committed parameters beside the uncommitted cache made every decode call recompile (2 s steps on CPU)
        state = jax.block_until_ready(jax.device_put(jax.tree.map(np.asarray, state)))
    print(f"init on {init_device.platform}: trace+lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s, run {t3 - t2:.1f}s, "
          f"copy to {jax.devices()[0].platform} {time.perf_counter() - t3:.1f}s", flush=True)
    leaves, treedef = jax.tree.flatten(state)
    return slot_steps.intern_static((graphdef, treedef)), tuple(leaves), abstract


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
    return slot_steps.SlotState(
        last_s=jnp.arange(batch, dtype=jnp.int32) % 1000, done_s=jnp.zeros((batch,), bool),
        count_s=jnp.ones((batch,), jnp.int32), max_new_s=jnp.full((batch,), max_new, jnp.int32),
        temperature_s=jnp.zeros((batch,), jnp.float32), top_k_s=jnp.zeros((batch,), jnp.int32),
        top_p_s=jnp.ones((batch,), jnp.float32), keys_s=jax.random.split(jax.random.key(0), batch),
        eos_se=jnp.full((batch, slot_steps.MAX_EOS_IDS), -1, jnp.int32))


def _decode(params, cache, state, spec, steps):
    """The scheduler's jitted decode call (greedy, no mesh): (cache, state, tokens, ran, done)."""
    return slot_steps.decode_slots(params, cache, state, spec=spec, greedy_only=True, steps=steps,
                                   mesh=slot_steps.intern_static(None))


def bench_decode(cfg, spec, params, batch, context, steps, iters):
    max_len = context + steps * (iters + 2)
    cache = init_cache(cfg, batch, max_len)
    cache = jax.tree.map(lambda x: jnp.array(x, copy=True), cache)._replace(
        lengths=jnp.full((batch,), context, jnp.int32))
    state = slot_state(batch, 1 << 30)
    t0 = time.perf_counter()
    cache, state, tok, _, _ = _decode(params, cache, state, spec, steps)
    tok.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        cache, state, tok, _, _ = _decode(params, cache, state, spec, steps)
        tok.block_until_ready()
        times.append(time.perf_counter() - t0)
    call_s = statistics.median(times)
    return {"step_ms": call_s / steps * 1e3, "tokens_per_s": batch * steps / call_s, "compile_s": compile_s,
            "max_len": max_len}


def _two_step_logits(params, cache, spec, vocab: int) -> list[np.ndarray]:
    """f32 logits [B, V] of two teacher-forced decode steps from `cache` (not donated: the timed runs reuse it),
    with distinct tokens per row: the exactness check of a variant against the first one."""
    @jax.jit
    def two_steps(params, cache):
        model = slot_steps.merge_model(spec, params)
        b = cache.lengths.shape[0]
        ones = jnp.ones((b,), jnp.int32)
        out = []
        for i in range(2):
            ids = ((jnp.arange(b, dtype=jnp.int32) * 7919 + 104729 * (i + 1)) % vocab)[:, None]
            logits, cache = model.forward_cached(ids, cache, ones)
            out.append(logits[:, 0].astype(jnp.float32))
        return out
    return [np.asarray(x) for x in two_steps(params, cache)]


def parse_variants(text: str) -> list[tuple[str, list[str]]]:
    """'base:;step:kda_decode_fusion=step,x=y' -> [("base", []), ("step", ["kda_decode_fusion=step", "x=y"])]."""
    out = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        name, _, sets = item.partition(":")
        if not name.strip():
            raise SystemExit(f"--variants: every variant needs a name ('name:key=value,...'), got {item!r}")
        out.append((name.strip(), [x.strip() for x in sets.split(",") if x.strip()]))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit(f"--variants: duplicate names in {text!r}")
    return out


def bench_variants(config_name, base_sets, variants, params, treedef, batch, context, steps, rounds, floor_ms,
                   record, deadline=float("inf")):
    """Same weights, several runtime configs: compile each decode step, then time them in interleaved rounds.
    Variants whose compile would start after `deadline` (perf_counter seconds) are skipped, so that the ones
    compiled are still timed inside the caller's time limit."""
    runs = []
    for name, sets in variants:
        if time.perf_counter() > deadline:
            print(f"variant {name}: skipped (--budget_s reached before its compile)", flush=True)
            record({"kind": "variant", "name": name, "sets": sets, "skipped": "budget"})
            continue
        cfg_v = configs.get_config(config_name, base_sets + sets)
        graphdef_v, _ = nnx.split(nnx.eval_shape(lambda: K3Model(cfg_v, rngs=nnx.Rngs(0))))
        spec_v = slot_steps.intern_static((graphdef_v, treedef))
        max_len = context + steps * (rounds + 2)
        cache = jax.tree.map(lambda x: jnp.array(x, copy=True), init_cache(cfg_v, batch, max_len))._replace(
            lengths=jnp.full((batch,), context, jnp.int32))
        state = slot_state(batch, 1 << 30)
        t0 = time.perf_counter()
        try:
            logits = _two_step_logits(params, cache, spec_v, cfg_v.vocab_size)
            cache, state, tok, _, _ = _decode(params, cache, state, spec_v, steps)
            tok.block_until_ready()
        except Exception as e:  # a variant that fails to compile or run must not lose the others
            traceback.print_exc()
            record({"kind": "variant", "name": name, "sets": sets, "error": repr(e)[:500]})
            continue
        runs.append({"name": name, "sets": sets, "spec": spec_v, "cache": cache, "state": state,
                     "compile_s": time.perf_counter() - t0, "times": [], "tokens": np.asarray(tok),
                     "logits": logits})
        print(f"variant {name}: compiled + first call {runs[-1]['compile_s']:.1f}s", flush=True)
    for _ in range(rounds):
        for r in runs:
            t0 = time.perf_counter()
            r["cache"], r["state"], tok, _, _ = _decode(params, r["cache"], r["state"], r["spec"], steps)
            tok.block_until_ready()
            r["times"].append((time.perf_counter() - t0) / steps * 1e3)
    rows = []
    for r in runs:
        step_ms = statistics.median(r["times"])
        # exactness smoke check: every variant starts from the same cache, so its first greedy tokens should equal
        # the first variant's (bf16 rounding may flip a near-tie; a broken kernel disagrees almost everywhere)
        agree = float(np.mean(r["tokens"] == runs[0]["tokens"]))
        base_logits = runs[0]["logits"]
        # per row (sequence) and step: max |Δlogit| / max |logit|; a routing flip (near-tied expert scores) moves a
        # few rows a lot, a broken kernel moves all of them
        row_err = np.concatenate([np.max(np.abs(a - b), 1) / np.max(np.abs(b), 1)
                                  for a, b in zip(r["logits"], base_logits)])
        logits_err = float(np.max(row_err))
        rows.append({"kind": "variant", "name": r["name"], "sets": r["sets"], "batch": batch, "context": context,
                     "step_ms": step_ms, "step_ms_all": r["times"], "floor_ms": floor_ms,
                     "floor_frac": floor_ms / step_ms, "vs_first": step_ms / statistics.median(runs[0]["times"]),
                     "compile_s": r["compile_s"], "tokens_agree": agree,
                     "logits_max_rel_err": logits_err,
                     "logits_median_row_rel_err": float(np.median(row_err)),
                     "logits_rows_over_1e-2": int(np.sum(row_err > 1e-2)), "logits_rows": int(row_err.size)})
        record(rows[-1])
    print(f"\n| variant (B={batch}, context {context}) | overrides | step ms | floor/step | vs {rows[0]['name']} "
          f"| first {steps} greedy tokens = {rows[0]['name']}'s | 2-step logits rel err: max / median row "
          f"| rows > 1e-2 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {', '.join(r['sets']) or '-'} | {r['step_ms']:.3f} | {100 * r['floor_frac']:.1f}% | "
              f"{r['vs_first']:.3f} | {100 * r['tokens_agree']:.1f}% | {r['logits_max_rel_err']:.1e} / "
              f"{r['logits_median_row_rel_err']:.1e} | {r['logits_rows_over_1e-2']} of {r['logits_rows']} |")
    return rows


def bench_prefill(cfg, spec, params, n, context, iters):
    def prefill(params, ids):
        model = slot_steps.merge_model(spec, params)
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


# ---------------------------------------------------------------------- --profile

def profile_decode(cfg, spec, params, batch, context, steps, calls, out_dir):
    """Traces `calls` jitted decode calls (after a compile + warm call) and returns the trace summary."""
    import shutil
    import tempfile

    max_len = context + steps * (calls + 3)
    cache = init_cache(cfg, batch, max_len)
    cache = jax.tree.map(lambda x: jnp.array(x, copy=True), cache)._replace(
        lengths=jnp.full((batch,), context, jnp.int32))
    state = slot_state(batch, 1 << 30)

    def call(cache, state):
        cache, state, tok, _, _ = _decode(params, cache, state, spec, steps)
        tok.block_until_ready()
        return cache, state

    for _ in range(2):  # compile, then one warm call
        cache, state = call(cache, state)
    t0 = time.perf_counter()
    cache, state = call(cache, state)
    untraced_step_ms = (time.perf_counter() - t0) / steps * 1e3
    log_dir = tempfile.mkdtemp(prefix="decode_profile_")

    def run():
        nonlocal cache, state
        cache, state = call(cache, state)

    xplane = trace_xplane(run, calls, log_dir)
    trace = load_profile(xplane)  # parsed once for both summaries
    summary = summarize_xplane(trace, steps * calls)
    sources = {}
    try:  # map kernel names to model source lines through the optimised HLO (one more compile, best effort)
        hlo = slot_steps.decode_slots.lower(params, cache, state, spec=spec, greedy_only=True, steps=steps,
                                            mesh=slot_steps.intern_static(None)).compile().as_text()
        sources = hlo_sources(hlo)
        annotate_kernels(summary, sources)
        summary["large_concatenates"] = large_concatenates(hlo)
        if out_dir:
            with open(os.path.join(out_dir, f"decode_hlo_b{batch}.txt"), "w") as f:
                f.write(hlo)
    except Exception as e:  # noqa: BLE001 -- the profile stands without the sources
        print(f"(no HLO sources: {type(e).__name__}: {str(e)[:200]})", flush=True)
    if summary.get("backend") == "gpu":
        summary["overlap_by_source"] = overlap_by_group(trace, steps * calls, kernel_group(sources))
        summary["step_idle"] = step_idle(trace, steps * calls)
    summary.update(batch=batch, context=context, steps_per_call=steps, calls=calls,
                   untraced_step_ms=untraced_step_ms, xplane_bytes=os.path.getsize(xplane))
    if out_dir and os.path.getsize(xplane) < 15 << 20:
        shutil.copy(xplane, os.path.join(out_dir, f"decode_profile_b{batch}.xplane.pb"))
    shutil.rmtree(log_dir, ignore_errors=True)
    return summary


_HLO_CONCAT = re.compile(r"=\s*([a-z]+[0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?\s+concatenate\(")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}


def large_concatenates(hlo_text: str, min_bytes: int = 1 << 20) -> dict:
    """Concatenates of at least `min_bytes` in an optimised HLO module (fused or not): at decode sizes mostly
    weights joined in the step by XLA's dot merger (matmuls that share an input run as one over their concatenated
    weights): a copy when the concatenate is its own kernel or a loop fusion's root, read in place when it sits
    inside a gemm fusion (k3_gpu on an H200: in place, benchmarks/RESULTS.md, 2026-12-01; check the HLO and the
    profile's kernels). {"count", "mb", "shapes": {"bf16[1536,6144]": n, ...}}."""
    shapes: dict[str, int] = {}
    total = 0
    for dtype, dims in _HLO_CONCAT.findall(hlo_text):
        size = _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        if size >= min_bytes:
            key = f"{dtype}[{dims}]"
            shapes[key] = shapes.get(key, 0) + 1
            total += size
    return {"count": sum(shapes.values()), "mb": total / 1e6, "shapes": shapes}


def print_profile(s: dict) -> None:
    print(f"\nprofile: {s['batch']} slots x {s['context']} cached tokens, {s['calls']} calls x {s['steps_per_call']} "
          f"steps; untraced step {s['untraced_step_ms']:.3f} ms; trace {s['xplane_bytes'] / 1e6:.1f} MB")
    if s.get("backend") == "gpu":
        print(f"per step: span {s['span_per_step_ms']:.3f} ms = device busy {s['busy_per_step_ms']:.3f} ms + idle "
              f"{s['idle_per_step_ms']:.3f} ms; {s['kernels_per_step']:.0f} kernels/step, mean "
              f"{s['mean_kernel_us']:.1f} us; device copies {s['copy_mb_per_step']:.1f} MB/step; lines {s['lines']}")
        sections = [("kernel category", "kernel_categories"), ("kernels", "top_kernels"), ("XLA ops", "top_ops"),
                    ("source line", "top_sources"), ("JAX scope", "top_scopes"), ("device copies by JAX scope",
                    "copies_by_scope"), ("host CUDA API", "host_cuda_api")]
    else:
        sections = [("host XLA events", "top_events")]
    if s.get("large_concatenates") is not None:
        lc = s["large_concatenates"]
        print(f"concatenates >= 1 MB in the optimised HLO (weights joined in the step: copies unless inside a gemm "
              f"fusion): {lc['count']}, {lc['mb']:.1f} MB: {lc['shapes']}")
    if s.get("overlap_by_source"):  # the critical path of a step whose kernels overlap (concurrent regions)
        print("\n| source (top by share of busy time) | kernels/step | kernel us/step | exclusive us/step | "
              "share us/step |")
        print("|---|---:|---:|---:|---:|")
        for r in s["overlap_by_source"]:
            print(f"| `{r['name']}` | {r['count_per_step']:.1f} | {r['kernel_us']:.1f} | {r['exclusive_us']:.1f} | "
                  f"{r['share_us']:.1f} |")
        print("(exclusive: while the only kernel running; share: each instant split over the kernels running)")
    idle = s.get("step_idle")
    if idle:  # the loop-iteration boundary showed up as idle at each step's start (RESULTS.md, 2026-12-01)
        bins = ", ".join(f"{i * idle['bin_us']}-{(i + 1) * idle['bin_us']}: {t:.1f}"
                         for i, t in enumerate(idle["idle_us_per_bin"][:-1]))
        print(f"\nidle per step (median of {idle['steps']} steps, each from the end of `{idle['anchor'][:60]}`): "
              f"{idle['idle_us_per_step']:.1f} us; by offset in us: {bins}, rest: {idle['idle_us_per_bin'][-1]:.1f}")
    for title, key in sections:
        if not s.get(key):
            continue
        print(f"\n| {title} (top by total time) | us/step | count/step | avg us |")
        print("|---|---:|---:|---:|")
        for r in s[key]:
            src = f" ({r['src']})" if r.get("src") else ""
            print(f"| `{r['name']}`{src} | {r['per_step_us']:.1f} | {r['count_per_step']:.1f} | {r['avg_us']:.2f} |")


SMOKE = dict(batches="1,2", context=16, decode_steps=2, iters=1, prefill_iters=1, prefill_max_batch=2,
             peer_config="tiny_kimi_linear", peer_batches="2,1", peer_prompt_len=8, peer_new_tokens=6, peer_iters=1,
             profile_batch=2, profile_calls=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_gpu")
    ap.add_argument("--set", action="append", default=[],
                    help="config override key=value (default adds scan_layers=False, as serve.py does)")
    ap.add_argument("--batches", default="1,16,64,256", help="decode/prefill sweep batches ('' skips the sweep)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode_steps", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prefill_iters", type=int, default=3)
    ap.add_argument("--prefill_max_batch", type=int, default=64)
    ap.add_argument("--budget_s", type=float, default=1e9, help="skip what would start after this many seconds")
    ap.add_argument("--out_dir", default=None)
    ap.add_argument("--hf_peer", action="store_true", help="HF KimiLinearForCausalLM.generate vs ours (first)")
    ap.add_argument("--peer_config", default="kimi_linear_small",
                    help="a hf_generate_peer.PEER_PRESETS name or a Kimi-Linear-shaped registry config")
    ap.add_argument("--peer_batches", default="64,1,16", help="in this order (the target batch first)")
    ap.add_argument("--peer_prompt_len", type=int, default=128)
    ap.add_argument("--peer_new_tokens", type=int, default=64)
    ap.add_argument("--peer_iters", type=int, default=3)
    ap.add_argument("--peer_agree_prompt_len", type=int, default=None, help="default: --peer_prompt_len")
    ap.add_argument("--peer_agree_new_tokens", type=int, default=None, help="default: --peer_new_tokens")
    ap.add_argument("--peer_no_fla", action="store_true", help="force HF's pure-torch KDA (no fla kernels)")
    ap.add_argument("--peer_budget_s", type=float, default=1e9, help="skip peer batches starting after this")
    ap.add_argument("--profile", action="store_true", help="trace decode calls of --config and summarise (last)")
    ap.add_argument("--profile_batch", type=int, default=64)
    ap.add_argument("--profile_calls", type=int, default=2)
    ap.add_argument("--init_on", choices=("cpu", "device"), default="cpu",
                    help="where the random init runs (cpu: compiles in seconds, then copied to the device)")
    ap.add_argument("--init_prng", default=None,
                    help="PRNG for the random init only, e.g. unsafe_rbg (same distributions; compiles faster than "
                         "threefry on GPU); default: JAX's")
    ap.add_argument("--variants", default="", help="same-process A/B: 'name:key=value,...;name2:...' (first = base)")
    ap.add_argument("--variant_batch", type=int, default=64)
    ap.add_argument("--variant_rounds", type=int, default=7)
    ap.add_argument("--device_smoke", action="store_true", help="tiny shapes for every path (CPU check)")
    ap.add_argument("--no_xla_defaults", action="store_true",
                    help="leave XLA_FLAGS as it is (default: add the serving flags, k3jax/inference/xla_flags.py)")
    args = ap.parse_args()
    if args.device_smoke:
        explicit = {a.split("=")[0].lstrip("-") for a in sys.argv[1:]}
        for k, v in SMOKE.items():
            if k not in explicit:
                setattr(args, k, v)
    if not args.no_xla_defaults:  # as serve.py does, before the backend starts
        apply_serving_flags()
    start = time.perf_counter()
    if not any(s.split("=")[0].strip().removeprefix("runtime.") == "scan_layers" for s in args.set):
        args.set.append("scan_layers=False")  # serve.py's default (--unroll_layers)
    cfg = configs.get_config(args.config, args.set)
    variants = parse_variants(args.variants)
    for _, sets in variants:  # fail on a bad key before the model is built
        configs.get_config(args.config, args.set + sets)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, config {cfg.name} ({cfg.runtime.dtype}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    records = []
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    out = open(os.path.join(args.out_dir, "decode_bench.jsonl"), "a") if args.out_dir else None

    def record(rec):
        records.append(rec)
        line = rec if isinstance(rec, str) else json.dumps(rec, default=lambda x: x.tolist() if hasattr(
            x, "tolist") else str(x))
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    spec = params = None
    if batches or args.profile or variants:
        t0 = time.perf_counter()
        if args.init_prng:
            jax.config.update("jax_default_prng_impl", args.init_prng)
        spec, params, abstract = build_params(cfg, args.init_on)
        jax.block_until_ready(params)
        wb = weight_bytes(abstract, cfg)
        print(f"init {time.perf_counter() - t0:.1f}s; weight bytes: {json.dumps(wb)}", flush=True)

    # order: the variant A/B, the profile (fixed cost, what the team needs first), the HF peer, then the sweep
    jobs = [("variants", args.variant_batch)] if variants else []
    jobs += [("profile", args.profile_batch)] if args.profile else []
    jobs += [("hf_peer", 0)] if args.hf_peer else []
    order = sorted(batches, key=lambda b: (b != 64, b))  # the target batch first
    jobs += [("decode", b) for b in order] + [("prefill", n) for n in sorted(
        {min(b, args.prefill_max_batch) for b in batches}, key=lambda n: (n != 16, n))]
    peer_rows = []
    sweep = []
    for kind, b in jobs:
        if kind != "hf_peer" and time.perf_counter() - start > args.budget_s:  # the peer has its own budget
            record({"kind": kind, "batch": b, "skipped": "budget"})
            continue
        if kind == "hf_peer":
            try:
                peer_rows = peer_lib.run_peer(
                    peer=args.peer_config, batches=[int(b) for b in args.peer_batches.split(",") if b.strip()],
                    prompt_len=args.peer_prompt_len, new_tokens=args.peer_new_tokens, iters=args.peer_iters,
                    agree_prompt_len=args.peer_agree_prompt_len, agree_new_tokens=args.peer_agree_new_tokens,
                    no_fla=args.peer_no_fla, deadline=start + args.peer_budget_s, record=record)
                peer_lib.print_table(peer_rows)
            except Exception as e:  # keep going: the JAX-only parts must still run
                traceback.print_exc()
                record({"kind": "peer", "error": repr(e)[:500]})
            continue
        try:
            if kind == "variants":
                floor_ms = floor_bytes(cfg, wb, b, args.context)["total"] / HBM_BYTES_PER_S * 1e3
                bench_variants(args.config, args.set, variants, params, spec.value[1], b, args.context,
                               args.decode_steps, args.variant_rounds, floor_ms, record,
                               deadline=start + args.budget_s)
            elif kind == "profile":
                summary = profile_decode(cfg, spec, params, b, args.context, args.decode_steps, args.profile_calls,
                                         args.out_dir)
                record({"kind": "profile", **summary})
                print_profile(summary)
                if args.out_dir:
                    with open(os.path.join(args.out_dir, f"decode_profile_b{b}.json"), "w") as f:
                        json.dump(summary, f, indent=1)
            elif kind == "decode":
                r = bench_decode(cfg, spec, params, b, args.context, args.decode_steps, args.iters)
                fb = floor_bytes(cfg, wb, b, args.context)
                floor_ms = fb["total"] / HBM_BYTES_PER_S * 1e3
                sweep.append({"kind": kind, "batch": b, "context": args.context, **r, "floor_ms": floor_ms,
                              "floor_frac": floor_ms / r["step_ms"], "floor_bytes": fb})
                record(sweep[-1])
            else:
                sweep.append({"kind": kind, "batch": b, "context": args.context,
                              **bench_prefill(cfg, spec, params, b, args.context, args.prefill_iters)})
                record(sweep[-1])
        except Exception as e:  # keep going: one OOM must not lose the other rows
            sweep.append({"kind": kind, "batch": b, "error": repr(e)[:500]})
            record(sweep[-1])
            traceback.print_exc()
    if sweep:
        print("\n| kind | batch | step / call ms | tokens/s | floor ms | floor/step | compile s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sweep:
        if "error" in r or "skipped" in r:
            print(f"| {r['kind']} | {r['batch']} | {r.get('error') or r.get('skipped')} | | | | |")
        elif r["kind"] == "decode":
            print(f"| decode | {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['floor_ms']:.3f} | "
                  f"{100 * r['floor_frac']:.0f}% | {r['compile_s']:.0f} |")
        else:
            print(f"| prefill | {r['batch']}x{r['context']} | {r['prefill_ms']:.1f} | {r['tokens_per_s']:,.0f} | | | "
                  f"{r['compile_s']:.0f} |")
    if peer_rows:
        peer_lib.print_table(peer_rows)  # again at the end, next to the sweep
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
