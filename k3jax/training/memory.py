"""Per-device memory of one training step, estimated before anything is allocated; `check_fit` fails early.

Shapes come from `nnx.eval_shape` of the model (+ MTP layer), never from tracing the forward, and shardings from
`sharding.shard.resolve_spec` on an `AbstractMesh` of the mesh sizes (no devices needed, so any slice size can be
asked about from a laptop): `k3` answers in about a second. All figures are bytes per device:

    params       Σ_Params elements / shards × param_dtype bytes (shards: product of the mesh axes of its spec; a
                 dim the rules cannot split is replicated, as `plan_shardings` does)
    master       elements × 4 of every parameter stored narrower than f32 (an f32 master copy for the update)
    gradients    the same elements × param_dtype bytes (one gradient tree is live at the update)
    optimizer    Muon parameters (`optimizer.label_table`): momentum, 1 × state bytes; AdamW parameters: mu + nu,
                 2 × state bytes (`state_dtype`, default f32); `optimizer='adamw'`: 2 × for every parameter
    other_state  non-Param variables (router biases, routing statistics) in their shardings
    gathered     the largest decoder layer's weights with their FSDP axes (`FSDP_AXES`)
                 all-gathered, in the compute dtype, + their gradient (param dtype) before its reduce-scatter: with
                 few expert or model ranks this is GBs (k3, expert=8: ~22 GB for one layer's 112 local experts)
    activations  the formula below
    batch        the step's input rows (5 int32/f32 [b, T] arrays)

Activations (conservative: every figure is an upper-side estimate; b = ceil(B / (data·expert)) rows,
t = ceil(T / context), n = b·t tokens per device, a = bytes of cfg.runtime.dtype, D = hidden, S = AttnRes snapshots,
m = model size, X/m = ceil(X / m)):

    carry        (1 + S)·n·D·a: the residual stream and the AttnRes bank at a unit boundary
    layer(kind)  2 × (values a layer keeps for its backward + their cotangents), per token:
                 common 8·D·a + 2·(S+1)·D·4 (norms, residual adds, two AttnRes reads with f32 weights)
                 KDA    6·(H/m)·K·a + 3·(H/m)·C·4 + (H/m)·K·K·4 / C (q, k, v, g, gates; chunk-local f32 [C, C]
                        blocks; one f32 state per chunk)
                 MLA    6·(H/m)·(dn + dr)·a + 2·(q_lora + kv_lora)·a + 3·(H/m)·T·4 (projections; the XLA attention's
                        f32 logits, probabilities and their gradient over all T keys; with mla_attention_impl flash,
                        cudnn or auto, or context > 1 (H/m)·(dv + 1)·4 instead: the f32 output and logsumexp)
                 dense  3·(I/m)·a;  MoE: 2·E·4 (router) + 3·shared·(M/m)·a + k·L·a (sent rows) +
                        rows/n · (3·L + 3·(M/m))·a, rows = n·k on one expert rank (min(n, moe_token_chunk)·k
                        when the experts run in pieces); with expert parallelism R > 1
                        the dropless receive buffer's static worst case R·n·min(k, E/R)
                        (`sharding/expert_parallel.py`), 'capacity:F': R·min(ceil(F·n·k/R), n·min(k, E/R))
    saved        remat_policy "unit": scanned groups num_repeats·n·D·a + 2·S·n·D·a (the stream per unit, the bank
                 twice: `k3jax.model.scan_units_rebuilding_bank`), unscanned layers layer(kind) each; "layer": the
                 same per scanned group and one carry per unscanned layer; no remat or "dots": every layer's
                 layer(kind) (for "dots" an upper bound)
    recompute    "unit": the largest scanned unit's Σ layer(kind) (rebuilt during its backward); "layer": a unit's
                 layer carries + the largest layer(kind)
    head         n·(V/(m·c))·4·3 (f32 logits, softmax, gradient of one of c = loss_vocab_chunks slices, c = 1 when
                 0) + n·D·4, once more for the MTP head, plus one MTP layer(kind)

`check_fit` compares the total with the device's memory less a headroom (default 10%, for XLA temporaries and
fragmentation) and, when it does not fit, names the smallest TPU v5p slice that would (by the config's mesh plan).
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer
from k3jax.training.optimizer import MUON, label_table
from sharding.aot import GPU_TARGETS
from sharding.expert_parallel import parse_mode
from sharding.plan import MeshPlan, auto_mesh, plan_for, plan_text
from sharding.rules import LOGICAL_AXIS_RULES, MESH_AXES
from sharding.shard import resolve_spec

GIB = 1 << 30
# Chips per TPU v5p slice (2x2x1 ... 16x16x24), smallest first; 95 GiB HBM per chip.
V5P_SLICE_CHIPS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144)
V5P_CHIP_BYTES = 95 * GIB
# Device memory when the runtime reports none (`memory_stats()` is preferred): device_kind substring -> GiB.
# Checked in order (the "lite" kinds before the plain "v5").
DEVICE_MEMORY_GIB = (("v5 lite", 16), ("v5e", 16), ("v6 lite", 32), ("v6e", 32), ("v5p", 95), ("v5", 95),
                     ("v4", 32), *((k, round(t["device_memory_size"] / GIB, 2)) for k, t in GPU_TARGETS.items()))
COMPONENTS = ("params", "master", "gradients", "optimizer", "other_state", "gathered", "activations", "batch")
# The components counted from shapes alone (no model of what the compiler keeps live): exact up to padding.
STATE_COMPONENTS = ("params", "master", "gradients", "optimizer", "other_state", "batch")
# Logical axes that only shard storage (FSDP): a layer's weights are all-gathered over their mesh axes at use.
FSDP_AXES = ("embed", "expert_latent", "mtp_concat", "q_lora", "kv_lora", "kda_gate_rank")
_LAYER_PATH = re.compile(r"groups/(\d+)/(?:units/)?layers/(\d+)/")


class DoesNotFitError(MemoryError):
    """The estimated per-device memory of a training step exceeds what the devices have."""


class _Trainable(nnx.Module):
    """The shapes the trainer optimises: the model and, with MTP, its MTP layer (same attribute names)."""

    def __init__(self, cfg: ModelConfig, *, mtp: bool, rngs: nnx.Rngs):
        self.model = K3Model(cfg, rngs=rngs)
        self.mtp = MTPLayer(cfg, rngs=rngs) if mtp else None


@functools.lru_cache(maxsize=8)
def _variable_table(cfg: ModelConfig, mtp: bool) -> tuple[tuple[str, tuple[int, ...], tuple, int, str], ...]:
    """(path, shape, logical axes, itemsize, kind) of every variable; kind: 'muon' | 'adamw' | 'other'."""
    abstract = nnx.eval_shape(lambda: _Trainable(cfg, mtp=mtp, rngs=nnx.Rngs(0)))
    labels = {r.path: r.label for r in label_table(abstract)}
    rows = []
    for key, var in nnx.to_flat_state(nnx.state(abstract)):
        value = var.get_value()
        if not hasattr(value, "shape"):
            continue
        path = "/".join(map(str, key))
        axes = tuple(getattr(var, "out_sharding", None) or (None,) * len(value.shape))
        kind = labels.get(path, "adamw") if isinstance(var, nnx.Param) else "other"
        rows.append((path, tuple(value.shape), axes, np.dtype(value.dtype).itemsize, kind))
    return tuple(rows)


def _mesh_sizes(mesh: Mesh | AbstractMesh | Mapping[str, int] | Sequence[int]) -> dict[str, int]:
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return {a: int(mesh.shape.get(a, 1)) for a in MESH_AXES}
    if isinstance(mesh, Mapping):
        unknown = [a for a in mesh if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; axes are {MESH_AXES}")
        return {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    sizes = tuple(mesh)
    if len(sizes) != len(MESH_AXES):
        raise ValueError(f"mesh sizes {sizes} must give {len(MESH_AXES)} axes {MESH_AXES}")
    return dict(zip(MESH_AXES, map(int, sizes)))


def _dtype_bytes(name: str) -> int:
    return np.dtype(jax.numpy.dtype(name)).itemsize


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def _layer_bytes(cfg: ModelConfig, attn: str, ffn: str, *, n: int, t_full: int, sizes: Mapping[str, int],
                 attn_res: bool = True) -> int:
    """layer(kind) of the module docstring: 2 × (kept forward values + cotangents) of one decoder layer."""
    a = _dtype_bytes(cfg.runtime.dtype)
    m = sizes["model"]
    d = cfg.hidden_size
    s = cfg.num_attn_res_snapshots if attn_res else 0
    per_token = 8 * d * a + (2 * (s + 1) * d * 4 if s else 0)
    if attn == "kda":
        h, k, c = _ceil_div(cfg.kda_num_heads, m), cfg.kda_head_dim, cfg.runtime.kda_chunk_size
        per_token += 6 * h * k * a + 3 * h * c * 4 + h * k * k * 4 // c
    else:
        h = _ceil_div(cfg.num_attention_heads, m)
        per_token += 6 * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * a
        per_token += 2 * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank) * a
        # the XLA core's f32 [T, T] logits, probabilities and gradient; flash/cuDNN: the f32 output and logsumexp
        # "auto" counts as flash/cuDNN (what it picks on accelerators; CPU runs are small)
        t_by_t = cfg.runtime.mla_attention_impl == "xla" and sizes["context"] == 1  # context-parallel: blockwise
        per_token += 3 * h * t_full * 4 if t_by_t else h * (cfg.v_head_dim + 1) * 4
    total = n * per_token
    if ffn == "dense":
        total += n * 3 * _ceil_div(cfg.intermediate_size, m) * a
    else:
        e, k, lat = cfg.num_experts, cfg.num_experts_per_token, cfg.expert_input_size
        mi = _ceil_div(cfg.moe_intermediate_size, m)
        total += n * (2 * e * 4 + 3 * cfg.num_shared_experts * mi * a + k * lat * a)
        total += _routed_rows(cfg, n, sizes["expert"]) * (3 * lat + 3 * mi) * a
    return 2 * total


def _routed_rows(cfg: ModelConfig, n: int, ranks: int) -> int:
    """Rows the routed experts process per device (see the module docstring)."""
    k, e = cfg.num_experts_per_token, cfg.num_experts
    mode, factor = parse_mode(cfg.runtime.moe_expert_parallel)
    if cfg.runtime.moe_impl == "dense":
        return n * e
    if ranks == 1 or mode == "off":  # single program (or each device's own tokens): one piece at a time
        chunk = cfg.runtime.moe_token_chunk
        return (min(n, chunk) if chunk > 0 else n) * k
    worst = n * min(k, e // ranks)
    if mode == "capacity":
        return ranks * min(max(1, math.ceil((factor or 1.25) * n * k / ranks)), worst)
    return ranks * worst


def activation_bytes(cfg: ModelConfig, mesh_sizes: Mapping[str, int], *, batch_size: int, seq_len: int,
                     mtp: bool = True) -> dict[str, int]:
    """The activation estimate of the module docstring: {'saved', 'recompute', 'head', 'rows_per_device',
    'tokens_per_device'}."""
    sizes = _mesh_sizes(mesh_sizes)
    b = _ceil_div(batch_size, sizes["data"] * sizes["expert"])
    t = _ceil_div(seq_len, sizes["context"])
    n = b * t
    a = _dtype_bytes(cfg.runtime.dtype)
    d = cfg.hidden_size
    carry = (1 + cfg.num_attn_res_snapshots) * n * d * a
    # a scanned group under remat saves the stream per unit and the bank twice (`scan_units_rebuilding_bank`)
    scanned_saved = lambda repeats: repeats * n * d * a + 2 * (carry - n * d * a)  # noqa: E731

    def layer(kind) -> int:
        return _layer_bytes(cfg, kind[0], kind[1], n=n, t_full=seq_len, sizes=sizes)

    run = cfg.runtime
    per_layer = run.remat and run.remat_policy == "layer"
    saved = recompute = 0
    for group in cfg.layer_groups():
        unit = sum(layer(kind) for kind in group.pattern)
        if per_layer:  # unit carries saved; its backward rebuilds layer carries, then one layer at a time
            saved += scanned_saved(group.num_repeats) if group.num_repeats > 1 else len(group.pattern) * carry
            inner = len(group.pattern) * carry if group.num_repeats > 1 else 0
            recompute = max(recompute, inner + max(layer(kind) for kind in group.pattern))
        elif group.num_repeats > 1 and run.scan_layers and run.remat and run.remat_policy == "unit":
            saved += scanned_saved(group.num_repeats)
            recompute = max(recompute, unit)
        else:  # no remat, unscanned layers, or "dots" (bounded above by keeping everything)
            saved += group.num_repeats * unit
    vocab_slice = _ceil_div(cfg.vocab_size, sizes["model"] * max(1, run.loss_vocab_chunks))
    logits_one = n * vocab_slice * 4 * 3
    head = logits = logits_one
    head += n * d * 4
    if mtp:
        ffn = "moe" if cfg.first_k_dense_replace < cfg.num_hidden_layers else "dense"
        head += logits_one + n * d * 4 + _layer_bytes(cfg, "mla", ffn, n=n, t_full=seq_len, sizes=sizes,
                                                      attn_res=False)
        logits += logits_one
    return {"saved": saved, "recompute": recompute, "head": head, "head_logits": logits, "rows_per_device": b,
            "tokens_per_device": n}


def gathered_layer_bytes(cfg: ModelConfig, mesh_sizes: Mapping[str, int], *, mtp: bool = True) -> int:
    """`gathered` of the module docstring: the largest decoder layer's weights as its matmuls use them (FSDP axes
    all-gathered, tensor/expert-parallel axes still split) in the compute dtype, plus their gradient in the
    parameter dtype before its reduce-scatter."""
    sizes = _mesh_sizes(mesh_sizes)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    a = _dtype_bytes(cfg.runtime.dtype)
    per_layer: dict[tuple[str, str], int] = {}
    for path, shape, axes, itemsize, kind in _variable_table(cfg, mtp):
        found = _LAYER_PATH.search(path)
        if kind == "other" or not found:
            continue
        spec, _ = resolve_spec(axes, shape, abstract_mesh, path=path, rules=LOGICAL_AXIS_RULES)
        shards = math.prod(sizes[m] for name, entry in zip(axes, spec) if entry is not None and name not in FSDP_AXES
                           for m in (entry if isinstance(entry, tuple) else (entry,)))
        repeats = shape[axes.index("layers")] if "layers" in axes else 1
        elements = math.prod(shape) // repeats // shards
        key = found.groups()
        per_layer[key] = per_layer.get(key, 0) + elements * (a + itemsize)
    return max(per_layer.values(), default=0)


def estimate_memory(cfg: ModelConfig, mesh, *, batch_size: int, seq_len: int, optimizer: str = "muon",
                    state_dtype: str = "float32", master_dtype: str | None = "auto", mtp: bool = True) -> dict:
    """Per-device bytes of one training step of `cfg` on `mesh` (a Mesh, AbstractMesh, {axis: size} or
    (data, expert, context, model)); see the module docstring. `master_dtype`: 'auto' (f32 when param_dtype is
    narrower), a dtype name, or None (no master copy). Returns {component: bytes, 'total': ..., 'mesh': sizes,
    'fallbacks': dims the rules could not split, 'rows_per_device', 'tokens_per_device'}."""
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    sizes = _mesh_sizes(mesh)
    if not cfg.runtime.record_routing_stats:
        cfg = cfg.replace(record_routing_stats=True)  # as the trainer runs it (routing statistics variables)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    param_bytes = _dtype_bytes(cfg.runtime.param_dtype)
    if master_dtype == "auto":
        master_dtype = "float32" if param_bytes < 4 else None
    master_bytes = _dtype_bytes(master_dtype) if master_dtype else 0
    state_bytes = _dtype_bytes(state_dtype)
    out = dict.fromkeys(COMPONENTS, 0)
    fallbacks = 0
    for path, shape, axes, itemsize, kind in _variable_table(cfg, mtp):
        spec, fb = resolve_spec(axes, shape, abstract_mesh, path=path, rules=LOGICAL_AXIS_RULES)
        fallbacks += len(fb)
        shards = math.prod(sizes[a] for entry in spec if entry is not None
                           for a in (entry if isinstance(entry, tuple) else (entry,)))
        elements = math.prod(shape) // shards
        if kind == "other":
            out["other_state"] += elements * itemsize
            continue
        out["params"] += elements * itemsize
        out["gradients"] += elements * itemsize
        out["master"] += elements * master_bytes if master_bytes > itemsize else 0
        slots = 1 if (optimizer == "muon" and kind == MUON) else 2
        out["optimizer"] += slots * elements * state_bytes
    out["gathered"] = gathered_layer_bytes(cfg, sizes, mtp=mtp)
    act = activation_bytes(cfg, sizes, batch_size=batch_size, seq_len=seq_len, mtp=mtp)
    out["activations"] = act["saved"] + act["recompute"] + act["head"]
    out["batch"] = 5 * act["tokens_per_device"] * 4
    out["total"] = sum(out[c] for c in COMPONENTS)
    out.update(head_activations=act["head"], head_logits=act["head_logits"], mesh=sizes, fallbacks=fallbacks,
               rows_per_device=act["rows_per_device"],
               tokens_per_device=act["tokens_per_device"], param_dtype=cfg.runtime.param_dtype,
               master_dtype=master_dtype, state_dtype=state_dtype, optimizer_name=optimizer)
    return out


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory jax's allocator takes: XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75), or all of
    it (1.0) with XLA_PYTHON_CLIENT_PREALLOCATE=false."""
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return 1.0
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def device_memory_bytes(device: Any = None) -> tuple[int, str]:
    """(bytes one device can hold, where the figure came from): the runtime's `memory_stats()['bytes_limit']` when
    it reports one (GPU, TPU), else `DEVICE_MEMORY_GIB` by device kind, else (CPU) the host's memory shared by its
    local devices."""
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats"
    kind = str(getattr(device, "device_kind", "")).lower()
    if device.platform != "cpu":
        for key, gib in DEVICE_MEMORY_GIB:
            if key in kind:
                if device.platform == "gpu":  # a compile-only GPU: what jax's allocator would take of it
                    frac = gpu_memory_fraction()
                    share = f"{gib} GiB x {frac:g}, the allocator's share"
                    return int(gib * GIB * frac), f"{device.device_kind} table ({share})"
                return gib * GIB, f"{device.device_kind} table ({gib} GiB)"
    local = max(1, sum(1 for d in jax.local_devices() if d.platform == device.platform))
    return host_memory_bytes() // local, f"host RAM / {local} local {device.platform} devices"


def smallest_fitting_slice(cfg: ModelConfig, *, batch_size: int, seq_len: int, plan=None,
                           chip_bytes: int = V5P_CHIP_BYTES, slices: Sequence[int] = V5P_SLICE_CHIPS,
                           headroom: float = 0.1, **kwargs) -> tuple[int, tuple[int, ...], dict] | None:
    """(chips, mesh sizes, estimate) of the smallest of `slices` whose `auto_mesh` by `plan` (default: the
    config's) fits `chip_bytes` less the headroom; None when none does. A slice whose data x expert size exceeds
    `batch_size` is estimated with one row per data-parallel shard (the batch must grow with it)."""
    plan = plan_for(cfg if plan is None else plan)
    for chips in sorted(slices):
        mesh = auto_mesh(plan, chips)
        est = estimate_memory(cfg, mesh, batch_size=batch_size, seq_len=seq_len, **kwargs)
        if est["total"] <= chip_bytes * (1 - headroom):
            return chips, mesh, est
    return None


def format_breakdown(est: Mapping[str, Any]) -> str:
    """'params 1.2 GiB, master 2.4 GiB, ...' (components with bytes)."""
    return ", ".join(f"{c} {est[c] / GIB:.2f} GiB" for c in COMPONENTS if est.get(c))


def _usable(device_bytes: int | None, headroom: float) -> tuple[int, str, int]:
    """(device bytes, where the figure came from, bytes usable after the headroom); `device_memory_bytes()` when
    no figure is given."""
    source = "the device_bytes argument"
    if device_bytes is None:
        device_bytes, source = device_memory_bytes()
    return device_bytes, source, int(device_bytes * (1 - headroom))


def _mesh_text(sizes: Mapping[str, int]) -> str:
    return " ".join(f"{a}={sizes[a]}" for a in MESH_AXES)


def check_fit(cfg: ModelConfig, mesh, *, batch_size: int, seq_len: int, device_bytes: int | None = None,
              headroom: float = 0.1, plan: MeshPlan | Mapping[str, int] | str | None = None,
              compiled_check_follows: bool = False, **kwargs) -> dict:
    """The `estimate_memory` breakdown when it fits `device_bytes` (default `device_memory_bytes()`) less the
    headroom; otherwise `DoesNotFitError` naming bytes needed vs available and the smallest TPU v5p slice that fits
    by the mesh plan (`plan`, default the config's). Allocates nothing.

    With `compiled_check_follows` (the caller compiles the step and calls `check_compiled_fit` before allocating),
    only the exact part (`STATE_COMPONENTS`) must fit: the activation model is only an estimate (an upper bound on
    one device, an under-count with context parallelism), so a total over the limit sets `est["over"] = True`
    instead of refusing a run the compiler may fit."""
    est = estimate_memory(cfg, mesh, batch_size=batch_size, seq_len=seq_len, **kwargs)
    device_bytes, source, usable = _usable(device_bytes, headroom)
    est.update(device_bytes=device_bytes, usable_bytes=usable, device_bytes_source=source, over=False)
    if est["total"] <= usable:
        return est
    if compiled_check_follows and sum(est[c] for c in STATE_COMPONENTS) <= usable:
        est["over"] = True
        return est
    mesh_text = _mesh_text(est["mesh"])
    plan = plan_for(cfg if plan is None else plan)
    found = smallest_fitting_slice(cfg, batch_size=batch_size, seq_len=seq_len, plan=plan, headroom=headroom,
                                   **kwargs)
    if found is None:
        hint = (f"no TPU v5p slice up to {max(V5P_SLICE_CHIPS)} chips fits by the mesh plan ({plan_text(plan)}); "
                f"lower --batch_size/--seq_len or pass a --mesh with more sharding")
    else:
        chips, fit_mesh, fit = found
        dp = fit_mesh[0] * fit_mesh[1]
        hint = (f"smallest TPU v5p slice that fits by the mesh plan ({plan_text(plan)}): {chips} chips, "
                f"--mesh={','.join(map(str, fit_mesh))}, {fit['total'] / GIB:.1f} GiB per chip"
                + (f" (with --batch_size a multiple of {dp})" if batch_size % dp else ""))
    knobs = knob_hints(cfg, est)
    raise DoesNotFitError(
        f"config {cfg.name!r} (batch {batch_size} x seq {seq_len}) on mesh {mesh_text} needs "
        f"{est['total'] / GIB:.2f} GiB per device ({format_breakdown(est)}) but {usable / GIB:.2f} GiB are "
        f"usable ({device_bytes / GIB:.2f} GiB from {source}, {headroom:.0%} kept as headroom); "
        + (f"{knobs}; or: " if knobs else "") + hint)


def knob_hints(cfg: ModelConfig, est: Mapping[str, Any]) -> str:
    """The runtime knobs that shrink this estimate's largest activation terms, as `--set` advice ('' if none
    applies): the chunked loss head when the full-vocabulary f32 logits are a tenth or more of the total, and
    per-layer rematerialisation unless it is on."""
    run, hints = cfg.runtime, []
    if not run.loss_vocab_chunks and est.get("head_logits", 0) >= 0.1 * est["total"]:
        chunks = next((c for c in (16, 8, 4, 2) if cfg.vocab_size % c == 0), 0)
        if chunks:
            hints.append(f"--set loss_vocab_chunks={chunks} (the loss heads' f32 logits take "
                         f"{est['head_logits'] / GIB:.1f} GiB; chunks keep 1/{chunks} of them)")
    if not run.remat or run.remat_policy != "layer":
        hints.append("--set remat_policy=layer (the backward then holds one layer's activations at a time)")
    return "; ".join(hints)


def compiled_memory(compiled) -> tuple[dict[str, int], int]:
    """(the compiler's per-device byte counts, their total: arguments + outputs - aliased + temporaries) of a
    compiled program; ({}, 0) where the backend reports none."""
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    per_chip = {f: int(getattr(mem, f)) for f in fields if mem is not None and hasattr(mem, f)}
    total = per_chip.get("argument_size_in_bytes", 0) + per_chip.get("output_size_in_bytes", 0) \
        - per_chip.get("alias_size_in_bytes", 0) + per_chip.get("temp_size_in_bytes", 0)
    return per_chip, total


def format_compiled(per_device: Mapping[str, int]) -> str:
    """'arguments 1.20 GiB, outputs ..., aliased ..., temporaries ...' of `compiled_memory`'s counts."""
    names = (("argument_size_in_bytes", "arguments"), ("output_size_in_bytes", "outputs"),
             ("alias_size_in_bytes", "aliased"), ("temp_size_in_bytes", "temporaries"))
    return ", ".join(f"{label} {per_device[f] / GIB:.2f} GiB" for f, label in names if f in per_device)


def check_compiled_fit(compiled, cfg: ModelConfig, est: Mapping[str, Any], *, batch_size: int, seq_len: int,
                       device_bytes: int | None = None, headroom: float = 0.05) -> dict:
    """The compiled step's per-device figures (`compiled_memory`: counts, total, usable bytes) when they fit the
    device less `headroom` (5%: the figures are the compiler's own buffer assignment, only fragmentation is left
    over); otherwise `DoesNotFitError` naming them, the estimate beside them and the knobs that shrink activations.
    A backend that reports no figures passes with total 0 (the estimate's check is then the only one)."""
    per_device, total = compiled_memory(compiled)
    device_bytes, source, usable = _usable(device_bytes, headroom)
    out = {"per_device": per_device, "total": total, "usable_bytes": usable, "device_bytes": device_bytes}
    if total <= usable:
        return out
    knobs = knob_hints(cfg, est)
    raise DoesNotFitError(
        f"config {cfg.name!r} (batch {batch_size} x seq {seq_len}) on mesh {_mesh_text(est['mesh'])}: the compiled "
        f"training step "
        f"needs {total / GIB:.2f} GiB per device ({format_compiled(per_device)}; the estimate said "
        f"{est['total'] / GIB:.2f} GiB) but {usable / GIB:.2f} GiB are usable ({device_bytes / GIB:.2f} GiB from "
        f"{source}, {headroom:.0%} kept as headroom); nothing was allocated; "
        + (f"{knobs}; or: " if knobs else "") + "lower --batch_size/--seq_len or pass a --mesh over more devices")
