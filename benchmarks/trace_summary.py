"""Where a traced GPU run's time goes, from a `jax.profiler` .xplane.pb (no TensorBoard needed).

Shared by the benchmarks' `--profile` options (decode_bench.py, kda_bench.py): per-kernel, per-op, per-JAX-scope and
per-source-line device time, busy vs span, host CUDA API calls and device copies.
"""

from __future__ import annotations

import re

__all__ = ["annotate_kernels", "hlo_sources", "idle_by_offset", "kernel_group", "load_profile", "overlap_by_group",
           "overlap_times", "summarize_xplane", "short_source", "scope_group", "step_idle", "trace_xplane",
           "traced_summary"]


# Name-stack components that say how an op was traced, not which part of the model it belongs to.
_NOISE_SCOPES = {"while", "body", "cond", "eval_jaxpr", "closed_call", "core_call", "checkpoint", "remat",
                 "custom_jvp_call", "custom_vjp_call"}


def trace_xplane(run, calls: int, log_dir: str) -> str:
    """Runs ``run()`` `calls` times under `jax.profiler` (device activity only: a small trace) into `log_dir`; returns
    the path of the .xplane.pb it wrote. ``run`` must block until its work is done."""
    import glob
    import os

    import jax

    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        ctx = jax.profiler.trace(log_dir, profiler_options=opts)
    except (AttributeError, TypeError):
        ctx = jax.profiler.trace(log_dir)
    with ctx:
        for _ in range(calls):
            run()
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
    return paths[-1]


def traced_summary(run, calls: int, steps: int) -> dict:
    """`summarize_xplane` of a trace (in a temporary directory) of `calls` runs of ``run`` (which must block until
    its work is done), per-step figures counted over `steps` steps."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return summarize_xplane(trace_xplane(run, calls, tmp), steps=steps)


def _stats(event) -> dict:
    try:
        return {str(k): v for k, v in event.stats}
    except Exception:  # noqa: BLE001 -- stats are best-effort metadata
        return {}


# Kernel-name patterns -> category (first match wins), for a per-step breakdown by kind of work.
_KERNEL_CATEGORIES = (
    ("copy/memset", r"memcpy|memset|copy"),
    ("matmul (cuBLAS/cutlass/XLA gemm)", r"gemm|cublas|cutlass|nvjet|xmma|sm90|dot"),
    ("Triton / Pallas (incl. gmm)", r"triton|pallas|gmm|kernel_call"),
    ("sort / top-k / scan (cub)", r"sort|cub|topk|top_k|scan"),
    ("reductions", r"reduce|reduction"),
    ("other fusions", r"fusion"),
)


def _categories(kernels: dict) -> dict:
    out = {}
    for name, (t, c) in kernels.items():
        cat = next((k for k, pat in _KERNEL_CATEGORIES if re.search(pat, name, re.IGNORECASE)), "other")
        tt, cc = out.get(cat, (0, 0))
        out[cat] = (tt + t, cc + c)
    return out


def scope_group(name_stack: str) -> str:
    """A JAX name stack (`jit(_decode)/while/body/.../dot_general`) without its transform scopes."""
    parts = [p for p in name_stack.split("/") if p and p not in _NOISE_SCOPES]
    if parts and parts[0].startswith("jit("):  # the jitted entry point itself (jit(_decode))
        parts = parts[1:]
    return "/".join(parts)[-100:] or name_stack[-100:]


def short_source(src: str) -> str:
    """`/abs/path/k3jax/layers/moe.py:123` -> `k3jax/layers/moe.py:123` (from the repo's top-level package on)."""
    m = re.search(r"((?:k3jax|pallas_kernels|sharding|benchmarks|flax|jax|optax)/.*)$", src)
    return m.group(1) if m else src[-100:]


def _union_ns(intervals) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def overlap_times(events) -> dict[str, tuple[int, int, int, int]]:
    """Per group, from kernel events ``(start_ns, end_ns, group)`` that may overlap (concurrent CUDA-graph regions):
    (kernel time, exclusive time = while it is the only kernel running, share = every instant split evenly over
    the kernels running then, count). Shares add up to the busy time (the union of the events); exclusive time is
    what a group certainly adds to the step's critical path, kernel time minus share what overlap hid."""
    points = []
    for i, (start, end, _) in enumerate(events):
        points += [(start, 1, i), (end, -1, i)]
    points.sort()  # at equal times ends (-1) come before starts: back-to-back kernels do not overlap
    total, exclusive, share, count = {}, {}, {}, {}
    for start, end, group in events:
        total[group] = total.get(group, 0) + end - start
        count[group] = count.get(group, 0) + 1
    active, last = set(), None
    for t, kind, i in points:
        if active and t > last:
            dt = t - last
            if len(active) == 1:
                g = events[next(iter(active))][2]
                exclusive[g] = exclusive.get(g, 0) + dt
            for j in active:
                g = events[j][2]
                share[g] = share.get(g, 0) + dt / len(active)
        if kind == 1:
            active.add(i)
        else:
            active.discard(i)
        last = t
    return {g: (total[g], exclusive.get(g, 0), round(share.get(g, 0)), count[g]) for g in total}


def idle_by_offset(events, anchor: str, bin_ns: int, bins: int) -> dict:
    """Where a step's idle time sits: kernel events ``(start_ns, end_ns, name)`` that may overlap, and `anchor`, a
    kernel that runs once per step (decode: the LM head). A step runs from one anchor's end to the next's; its idle
    time (the gaps in the union of its kernels) is counted in bins of `bin_ns` from the step's start, the last bin
    taking the rest. Returns {"steps", "idle_ns_per_step", "idle_ns_per_bin"}: medians over the steps, so the one
    step that spans two traced calls (and their host gap) does not count."""
    import statistics

    events = sorted(events)
    ends = sorted(e for _, e, name in events if name == anchor)
    rows, first, reach = [], 0, float("-inf")  # first: the first event starting at or after this step's start
    for lo, hi in zip(ends, ends[1:]):
        while first < len(events) and events[first][0] < lo:  # earlier kernels may run into this step
            reach = max(reach, events[first][1])
            first += 1
        row, covered, i = [0] * bins, max(lo, min(reach, hi)), first
        while i < len(events) and events[i][0] < hi:
            start, end, _ = events[i]
            if start > covered:
                row[min(int((covered - lo) // bin_ns), bins - 1)] += start - covered
            covered = max(covered, min(end, hi))
            i += 1
        rows.append(row)
    if not rows:
        return {"steps": 0, "idle_ns_per_step": 0.0, "idle_ns_per_bin": [0.0] * bins}
    return {"steps": len(rows), "idle_ns_per_step": statistics.median(sum(r) for r in rows),
            "idle_ns_per_bin": [statistics.median(r[b] for r in rows) for b in range(bins)]}


def step_idle(path, steps: int, bin_us: int = 200, bins: int = 8) -> dict | None:
    """`idle_by_offset` of a GPU trace (medians per step, in µs), anchored on the longest kernel that runs exactly
    once per step (`steps` traced); None without GPU kernels or such a kernel. `path`: as `overlap_by_group`."""
    events = _kernel_events(path, lambda name: name)
    if not events:
        return None
    counts, longest = {}, {}
    for start, end, name in events:
        counts[name] = counts.get(name, 0) + 1
        longest[name] = max(longest.get(name, 0), end - start)
    once = [name for name, c in counts.items() if c == steps]
    if not once:
        return None
    anchor = max(once, key=longest.get)
    got = idle_by_offset(events, anchor, bin_us * 1000, bins)
    return {"anchor": anchor, "steps": got["steps"], "bin_us": bin_us,
            "idle_us_per_step": got["idle_ns_per_step"] / 1e3,
            "idle_us_per_bin": [t / 1e3 for t in got["idle_ns_per_bin"]]}


def load_profile(path):
    """A `jax.profiler.ProfileData` from an .xplane.pb path (or the ProfileData itself: parse a trace once)."""
    from jax.profiler import ProfileData

    return path if isinstance(path, ProfileData) else ProfileData.from_file(path)


def _device_plane(pd):
    """The first device plane of a trace (GPU: kernels and copies on its "Stream" lines), or None (CPU)."""
    return next((p for p in pd.planes if p.name.startswith("/device:")), None)


def _kernel_events(path, group_of) -> list[tuple]:
    """A GPU trace's kernels and copies (its device plane's "Stream" lines) as ``(start_ns, end_ns,
    group_of(name))``; empty without a device plane. `path`: an .xplane.pb or the `load_profile` of one."""
    plane = _device_plane(load_profile(path))
    return [(e.start_ns, e.start_ns + e.duration_ns, group_of(e.name))
            for line in (plane.lines if plane is not None else ()) if line.name.startswith("Stream")
            for e in line.events]


def overlap_by_group(path, steps: int, group_of, top: int = 25) -> list[dict]:
    """`overlap_times` of a GPU trace's kernels grouped by ``group_of(kernel name)`` (e.g. the model source line
    from the optimised HLO), per step, the `top` groups by share of busy time first. `path`: an .xplane.pb or the
    `load_profile` of one."""
    events = _kernel_events(path, group_of)
    rows = sorted(overlap_times(events).items(), key=lambda kv: -kv[1][2])[:top]
    return [{"name": g[:140], "kernel_us": t / 1e3 / steps, "exclusive_us": x / 1e3 / steps,
             "share_us": sh / 1e3 / steps, "count_per_step": c / steps} for g, (t, x, sh, c) in rows]


def _top(agg: dict, steps: int, n: int) -> list[dict]:
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k[:140], "total_ms": t / 1e6, "per_step_us": t / 1e3 / steps, "count_per_step": c / steps,
             "avg_us": t / 1e3 / max(c, 1)} for k, (t, c) in rows]


def summarize_xplane(path: str, steps: int, top: int = 25) -> dict:
    """Where the time of `steps` traced decode steps goes, from a jax.profiler .xplane.pb (no TensorBoard needed).

    GPU: the "/device:*" planes' "Stream*" lines hold kernels and copies, "XLA Ops" the HLO ops (with their JAX name
    stack in a stat when present), "XLA Modules" the executions (one per jitted call). CPU (smoke runs): the host
    plane's XLA threads, summarised by event name only."""
    pd = load_profile(path)
    plane = _device_plane(pd)
    out = {"planes": [p.name for p in pd.planes], "steps": steps}
    if plane is None:  # CPU: XLA work runs on the host's client/Eigen threads
        agg, count = {}, 0
        for p in pd.planes:
            if p.name != "/host:CPU":
                continue
            for line in p.lines:
                if line.name == "python" or not line.name.startswith("tf_XLA"):
                    continue
                for e in line.events:
                    t, c = agg.get(e.name, (0, 0))
                    agg[e.name] = (t + e.duration_ns, c + 1)
                    count += 1
        out.update(backend="cpu", events=count, top_events=_top(agg, steps, top))
        return out
    kernels, ops, scopes, sources, copies, modules, intervals, stat_names = {}, {}, {}, {}, {}, [], [], {}
    n_kernels = copy_bytes = 0
    line_counts = []
    for line in plane.lines:
        events = list(line.events)
        line_counts.append((line.name, len(events)))
        names = set()
        if line.name.startswith("Stream"):
            for e in events:
                t, c = kernels.get(e.name, (0, 0))
                kernels[e.name] = (t + e.duration_ns, c + 1)
                intervals.append((e.start_ns, e.start_ns + e.duration_ns))
                n_kernels += 1
                st = _stats(e)
                names.update(st)
                if "name" in st:  # jax 0.11 puts the op's JAX name stack on each kernel / copy
                    g = scope_group(str(st["name"]))
                    t, c = scopes.get(g, (0, 0))
                    scopes[g] = (t + e.duration_ns, c + 1)
                m = re.search(r"size:(\d+)", str(st.get("memcpy_details", "")))
                if m:
                    copy_bytes += int(m.group(1))
                    g = scope_group(str(st.get("name", e.name)))
                    t, c = copies.get(g, (0, 0))
                    copies[g] = (t + e.duration_ns, c + 1)
        elif "Ops" in line.name:
            for e in events:
                st = _stats(e)
                names.update(st)
                t, c = ops.get(e.name, (0, 0))
                ops[e.name] = (t + e.duration_ns, c + 1)
                stack = next((str(st[k]) for k in ("tf_op", "name_stack") if k in st), None)
                hlo = str(st.get("long_name", ""))
                if stack is None and hlo:  # HLO text: the name stack is in its metadata
                    m = re.search(r'op_name="([^"]+)"', hlo)
                    stack = m.group(1) if m else None
                src = next((str(st[k]) for k in ("source", "source_info") if k in st), None)
                m = re.search(r'source_file="([^"]+)" source_line=(\d+)', hlo) if src is None and hlo else None
                src = f"{m.group(1)}:{m.group(2)}" if m else src
                for key, agg in ((scope_group(stack) if stack else None, scopes),
                                 (short_source(src) if src else None, sources)):
                    if key:
                        t, c = agg.get(key, (0, 0))
                        agg[key] = (t + e.duration_ns, c + 1)
        elif "Modules" in line.name:
            modules += [(e.name, e.duration_ns) for e in events]
        stat_names[line.name] = sorted(names)[:20]
    host_api = {}  # CUDA driver/runtime calls the host made (CUPTI): launches, copies, synchronisations
    for p in pd.planes:
        if p.name == "/host:CPU":
            for line in p.lines:
                for e in line.events:
                    if e.name.startswith(("cu", "Cu")):
                        t, c = host_api.get(e.name, (0, 0))
                        host_api[e.name] = (t + e.duration_ns, c + 1)
    busy = _union_ns(intervals)
    span = sum(d for _, d in modules) or (max(e for _, e in intervals) - min(s for s, _ in intervals))
    out.update(backend="gpu", plane=plane.name, lines=line_counts, op_stat_names=stat_names,
               modules=[(n[:80], d / 1e6) for n, d in modules[:8]], span_ms=span / 1e6,
               span_per_step_ms=span / 1e6 / steps, busy_per_step_ms=busy / 1e6 / steps,
               idle_per_step_ms=(span - busy) / 1e6 / steps, kernels_per_step=n_kernels / steps,
               mean_kernel_us=(sum(t for t, _ in kernels.values()) / 1e3 / max(n_kernels, 1)),
               top_kernels=_top(kernels, steps, top), top_ops=_top(ops, steps, top),
               top_scopes=_top(scopes, steps, top), top_sources=_top(sources, steps, top),
               host_cuda_api=_top(host_api, steps, 12), copies_by_scope=_top(copies, steps, 12),
               copy_mb_per_step=copy_bytes / 1e6 / steps,
               kernel_categories=_top(_categories(kernels), steps, len(_KERNEL_CATEGORIES) + 1))
    return out


# ---------------------------------------------------------------------- optimised-HLO sources of kernels

_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")


def _hlo_tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The optimised HLO text's FileNames / FunctionNames / FileLocations / StackFrames tables (id -> body)."""
    tables, current = {}, None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            current[int(m.group(1))] = m.group(2)
        else:
            current = None
    return tables


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """Optimised-HLO instruction name (dots as underscores, as GPU kernel names spell them) -> "op_name @
    file:line (function)" from its metadata (a `source_file`/`source_line` pair, or a `stack_frame_id` into the
    module's stack-frame tables), so profiled kernels (`loop_add_fusion_11`) point back at the model code."""
    t = _hlo_tables(hlo_text)

    def frame_source(frame_id: int) -> str:
        frame = re.search(r"file_location_id=(\d+)", t.get("StackFrames", {}).get(frame_id, ""))
        loc = t.get("FileLocations", {}).get(int(frame.group(1)), "") if frame else ""
        m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", loc)
        if not m:
            return ""
        file = t.get("FileNames", {}).get(int(m.group(1)), "").strip('"')
        func = t.get("FunctionNames", {}).get(int(m.group(2)), "").strip('"')
        return f"{short_source(file)}:{m.group(3)} ({func})"

    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        meta = dict(re.findall(r'(\w+)=("[^"]*"|\d+)', m.group(2)))
        op = scope_group(meta.get("op_name", "").strip('"'))
        src = meta.get("source_file", "").strip('"')
        if src and "source_line" in meta:
            where = f"{short_source(src)}:{meta['source_line']}"
        else:
            where = frame_source(int(meta["stack_frame_id"])) if "stack_frame_id" in meta else ""
        if op or where:
            out[m.group(1).replace(".", "_")] = f"{op} @ {where}".strip(" @")
    return out


def _kernel_source(sources: dict[str, str], name: str) -> str | None:
    """The `hlo_sources` entry of a GPU kernel name (also for a repeated kernel's "__N" suffix)."""
    return sources.get(name) or sources.get(re.sub(r"__\d+$", "", name))


def kernel_group(sources: dict[str, str]):
    """Kernel name -> the model source line it comes from (`hlo_sources`, without the op name), or for kernels the
    HLO does not name (Pallas / Triton calls, library kernels) the name without its numeric suffixes."""
    def group_of(name: str) -> str:
        src = _kernel_source(sources, name)
        if src:
            return src.split(" @ ", 1)[-1]
        return re.sub(r"(_\d+)+$", "", name) or name

    return group_of


def annotate_kernels(summary: dict, sources: dict[str, str]) -> None:
    """Adds each top kernel's HLO source ("src") to the profile summary in place."""
    for row in summary.get("top_kernels", []):
        src = _kernel_source(sources, row["name"])
        if src:
            row["src"] = src[-160:]
