"""Expert parallelism (EP) for the latent MoE's routed experts: a `shard_map` over the mesh.

The routed experts (w1, w3 [E, L, M], w2 [E, M, L]) are partitioned over the `expert` mesh axis (R ranks, E/R local
experts each); tokens stay sharded as the rules put activations (batch over ('data', 'expert'), sequence over
'context'). Per device: each token's k latent rows z (width L, not D: the spec's traffic) are dispatched to the rank
owning the chosen expert, the local experts run as one grouped matmul (`k3jax.ops.gmm.gmm`: inside `shard_map` the
Pallas kernel is used on GPU/TPU), the results (L wide, compute dtype) go back, and each token sums its rows weighted
by the routing weights in f32. Ranks along 'data' / 'context' exchange only within their own expert group.

Modes (the config field `moe_expert_parallel`):
- 'dropless': sizes exchanged first (an all_to_all of per-(rank, local expert) counts), then
  `jax.lax.ragged_all_to_all` both ways; the receive buffer has the static worst-case size
  R * local tokens * min(k, E/R) rows (L wide), so no row is ever dropped. XLA:CPU does not implement
  ragged-all-to-all, so on CPU the same offsets/sizes protocol runs through `ragged_all_to_all_emulated` (plain
  all_to_all of padded chunks, identical semantics).
- 'capacity[:F]': static shapes with plain `jax.lax.all_to_all`; each (source, destination rank) pair has
  C = ceil(F * rows / R) slots (F defaults to 1.25; rows = local tokens * k; C is capped at the most a source can
  send one rank, local tokens * min(k, E/R), so a large F drops nothing). Rows claim slots in row order
  (token-major, then routing slot); rows past C are dropped: they contribute zero, and are counted.
- 'auto': 'dropless' when the layer runs under a mesh with expert axis > 1 (and moe_impl is not 'dense');
  'off': never (the single-program path, partitioned by GSPMD).
- 'local' (chosen, never configured): the expert axis is 1 but tokens are split over 'data' / 'context'. Each device
  runs the single-program dropless experts (`k3jax.ops.moe.experts_dropless`, in pieces of `moe_token_chunk` tokens
  when set) on its own tokens, with every expert's weights, no exchange. Left to GSPMD, that path's expert sort over
  all N * k rows cannot be split along the sorted axis: every data rank gathered and computed the whole global
  batch's expert rows (found in a v5p compile of `k3_gpu` with data = 4: 8 GiB row buffers of the global 1,048,576
  rows per chip).

Model axis: the expert widths M are split over 'model' when divisible (w1/w3 on M, w2 on its M rows); each model rank
dispatches the same tokens and computes its M slice, and the combined [tokens, L] output is summed over 'model'
(psum). Otherwise the weights are replicated over 'model' inside (gathered on entry). The latent L dim (FSDP over
'data' in the rules) is gathered on entry. MXFP4 experts (`k3jax.ops.gmm.MXFP4Experts`, stored [E, out, in]) get
their own specs (`expert_weight_specs`): w1/w3 packed [E, M, L/2] + scales [E, M, L/32] split on dim 1, w2 packed
[E, L, M/2] + scales [E, L, M/32] on dim 2; M is split only when each rank's slice is whole 32-column scale groups
(M divisible by 32 * model).

Statistics (per MoE layer and step, f32 [4]): max and mean over expert ranks of the routed rows each rank is sent
(global batch, before drops), dropped rows, routed rows (tokens * k). Recorded by `LatentMoE` in its
`expert_parallel_stats` variable; `expert_parallel_metrics(model)` reduces them to per-step metrics.
"""

from __future__ import annotations

import logging
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.numerics import wide
from k3jax.ops.backend import kernel_backend_here, traced_platform
from k3jax.ops.glu import grouped_glu
from k3jax.ops.gmm import MXFP4_GROUP, MXFP4Experts, gmm
from k3jax.ops.moe import decode_tiling, experts_dropless, inverse_permutation, take_rows

log = logging.getLogger(__name__)

MODES = ("auto", "dropless", "capacity", "off")  # configurable; 'local' is chosen by `active_mode`
DEFAULT_CAPACITY_FACTOR = 1.25
EXPERT_AXIS = "expert"
BATCH_AXES = ("data", "expert")  # the rules' 'batch'
SEQ_AXIS = "context"  # the rules' 'seq'
MODEL_AXIS = "model"
STATS_FIELDS = ("rank_load_max", "rank_load_mean", "dropped_rows", "routed_rows")
_MODE_PATTERN = re.compile(r"^(auto|dropless|off|capacity)(?::([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?))?$")


class ExpertParallelError(ValueError):
    """Expert parallelism was requested but cannot run on this mesh / these shapes."""


def parse_mode(text: str) -> tuple[str, float | None]:
    """'auto' | 'dropless' | 'off' | 'capacity' | 'capacity:F' -> (mode, capacity factor or None)."""
    match = _MODE_PATTERN.match(str(text).strip())
    if match is None or (match.group(2) is not None and match.group(1) != "capacity"):
        raise ValueError(f"moe_expert_parallel must be one of 'auto', 'dropless', 'off', 'capacity' or "
                         f"'capacity:<factor>' (e.g. 'capacity:1.25'), got {text!r}")
    mode = match.group(1)
    if mode != "capacity":
        return mode, None
    factor = DEFAULT_CAPACITY_FACTOR if match.group(2) is None else float(match.group(2))
    if not factor > 0:
        raise ValueError(f"moe_expert_parallel capacity factor must be > 0, got {text!r}")
    return mode, factor


def _axis(mesh, name: str) -> int:
    return mesh.shape[name] if name in mesh.axis_names else 1


def active_mode(cfg: ModelConfig, batch: int, seq: int) -> tuple[str, float | None] | None:
    """The EP mode for a MoE call on [batch, seq] tokens traced now, or None for the single-program path.

    EP runs when the context mesh (`jax.sharding.get_abstract_mesh()`, set by `jax.set_mesh`) has an 'expert' axis
    of size > 1, outside any `shard_map`. With an expert axis of 1 and tokens split over other axes, ('local',
    None): each device runs the experts on its own tokens (unless 'off' or `moe_impl='dense'`, which GSPMD splits
    per token). With 'auto', shapes the mesh cannot split evenly fall back (logged); an explicit mode raises
    `ExpertParallelError` instead.
    """
    mode, factor = parse_mode(cfg.runtime.moe_expert_parallel)
    if mode == "off":
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return None
    if _axis(mesh, EXPERT_AXIS) == 1:
        token_ways = math.prod(_axis(mesh, a) for a in BATCH_AXES + (SEQ_AXIS,))
        if token_ways == 1 or cfg.runtime.moe_impl == "dense" or EXPERT_AXIS not in mesh.axis_names:
            return None
        mode, factor = "local", None
    if mode == "auto":
        if cfg.runtime.moe_impl == "dense":
            return None
        mode = "dropless"
    problem = _shape_problem(cfg, mesh, batch, seq)
    if problem:
        if mode == "local":  # still exact: the single-program path, split by GSPMD
            log.info("per-device experts off for this MoE call: %s", problem)
            return None
        if cfg.runtime.moe_expert_parallel == "auto":
            log.warning("expert parallelism off for this MoE call: %s", problem)
            return None
        raise ExpertParallelError(f"moe_expert_parallel={cfg.runtime.moe_expert_parallel!r}: {problem}")
    return mode, factor


def _shape_problem(cfg: ModelConfig, mesh, batch: int, seq: int) -> str | None:
    r = _axis(mesh, EXPERT_AXIS)
    ways = math.prod(_axis(mesh, a) for a in BATCH_AXES)
    if cfg.num_experts % r:
        return f"num_experts={cfg.num_experts} is not divisible by the expert axis size {r}"
    if batch % ways:
        return f"batch {batch} is not divisible by data*expert = {ways}"
    if seq % _axis(mesh, SEQ_AXIS):
        return f"sequence length {seq} is not divisible by the context axis size {_axis(mesh, SEQ_AXIS)}"
    return None


# ---------------------------------------------------------------------------------------------------- collectives
def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name: str):
    """`jax.lax.ragged_all_to_all` semantics (one slice per peer) from plain all_to_all: each peer's slice is padded
    to the operand's length, exchanged, and written at the sender's output offset. For platforms without the op
    (XLA:CPU); costs R x operand of traffic."""
    r = jax.lax.axis_size(axis_name)
    m = operand.shape[0]
    if input_offsets.shape[0] != r:
        raise ValueError(f"emulated ragged_all_to_all takes one slice per peer ({r}), got {input_offsets.shape[0]}")
    col = jnp.arange(m, dtype=jnp.int32)
    src = jnp.clip(input_offsets[:, None] + col[None, :], 0, m - 1)  # [R, m]
    valid = col[None, :] < send_sizes[:, None]
    mask = valid.reshape(valid.shape + (1,) * (operand.ndim - 1))
    packed = jnp.where(mask, operand[src], jnp.zeros((), operand.dtype))  # [R, m, ...]
    received = jax.lax.all_to_all(packed.reshape((r * m,) + operand.shape[1:]), axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's slice lands here
    dst = jnp.where(col[None, :] < recv_sizes[:, None], at[:, None] + col[None, :], output.shape[0])
    return output.at[dst.reshape(-1)].set(received, mode="drop")


def _ragged_all_to_all(native: bool):
    if native:
        return lambda *a, axis_name: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
    return ragged_all_to_all_emulated


# ---------------------------------------------------------------------------------------------------- local compute
def _local_experts(rows_rl, local_expert_r, w1_elm, w3_elm, w2_eml, cfg: ModelConfig):
    """The local experts on received rows (`local_expert_r` in [0, E_local]; E_local marks an empty slot):
    sorted by expert, grouped matmuls, back in the input order. Empty slots give zeros. Returns `rows_rl.dtype`
    (the down projection stores it straight from its f32 accumulator: no f32 [rows, L] copy)."""
    n_local = w1_elm.shape[0]
    order = jnp.argsort(local_expert_r, stable=True).astype(jnp.int32)
    inverse = inverse_permutation(order)
    group_sizes = jnp.zeros((n_local + 1,), jnp.int32).at[local_expert_r].add(1)[:n_local]
    rows = take_rows(rows_rl, order, inverse[:, None])
    hidden = grouped_glu(rows, w1_elm, w3_elm, group_sizes, cfg)
    out = gmm(hidden, w2_eml, group_sizes, preferred_element_type=_down_dtype(rows_rl.dtype))
    return take_rows(out.astype(rows_rl.dtype), inverse, order[:, None])


def _down_dtype(dtype):
    """The down projection's output dtype: the rows' own where a kernel runs (it accumulates in f32 and rounds
    once, as f32-then-cast would), f32 on XLA's ragged_dot (whose narrow output need not accumulate wide)."""
    return dtype if kernel_backend_here() is not None else wide(dtype)


def _dispatch_dropless(z_nl, experts_r, w1, w3, w2, cfg, *, native: bool, recv_rows: int | None):
    """Returns (out rows [rows, L] in row order, rows sent per rank, dropped rows = 0)."""
    r = jax.lax.axis_size(EXPERT_AXIS)
    n_local = w1.shape[0]
    rows = experts_r.shape[0]
    k = rows // z_nl.shape[0]
    exchange = _ragged_all_to_all(native)
    a2a = lambda x: jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0, tiled=True)  # noqa: E731

    order = jnp.argsort(experts_r, stable=True).astype(jnp.int32)  # by global expert: contiguous per rank
    position = inverse_permutation(order)  # where each row (n, j) sits in the send buffer
    send = take_rows(z_nl, order // k, position.reshape(-1, k))
    counts_re = jnp.zeros((r * n_local,), jnp.int32).at[experts_r].add(1).reshape(r, n_local)
    send_sizes = counts_re.sum(1)
    input_offsets = _exclusive_cumsum(send_sizes)
    recv_counts_re = a2a(counts_re)  # [source, local expert]: the sizes, exchanged first
    recv_sizes = recv_counts_re.sum(1)
    recv_offsets = _exclusive_cumsum(recv_sizes)  # sources' slices back to back, in source order
    output_offsets = a2a(recv_offsets)  # where my slice lands on each destination
    back_offsets = a2a(input_offsets)  # where each source's slice started in its own send buffer

    capacity = r * most_rows_per_rank(z_nl.shape[0], k, n_local) if recv_rows is None else recv_rows
    buffer = jnp.zeros((capacity, z_nl.shape[1]), z_nl.dtype)
    received = exchange(send, buffer, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EXPERT_AXIS)
    # Each source's slice is sorted by expert: segment (source s, local expert j) starts at seg_start[s, j].
    seg_start = (recv_offsets[:, None] + _exclusive_cumsum(recv_counts_re, axis=1)).reshape(-1)
    pos = jnp.arange(capacity, dtype=jnp.int32)
    segment = jnp.searchsorted(seg_start, pos, side="right", method="compare_all").astype(jnp.int32) - 1
    local_expert = jnp.where(pos < recv_sizes.sum(), segment % n_local, n_local)
    out = _local_experts(received, local_expert, w1, w3, w2, cfg)
    back = exchange(out, jnp.zeros((rows, out.shape[1]), out.dtype), recv_offsets, recv_sizes, back_offsets,
                    send_sizes, axis_name=EXPERT_AXIS)
    return take_rows(back, position, order[:, None]), send_sizes, jnp.zeros((), jnp.int32)


def most_rows_per_rank(tokens: int, k: int, experts_per_rank: int) -> int:
    """The most rows `tokens` tokens can send one rank: each token's k experts are distinct, so it sends a rank at
    most min(k, experts on that rank) rows."""
    return tokens * min(k, experts_per_rank)


def capacity_per_rank(tokens: int, k: int, num_ranks: int, experts_per_rank: int, factor: float) -> int:
    """Slots per (source, destination rank) pair in 'capacity' mode: ceil(factor * tokens * k / R), at least 1 and
    at most what the source could ever send one rank (so a large factor never drops and costs no more)."""
    return max(1, min(most_rows_per_rank(tokens, k, experts_per_rank), math.ceil(factor * tokens * k / num_ranks)))


def _dispatch_capacity(z_nl, experts_r, w1, w3, w2, cfg, *, factor: float):
    """Returns (out rows [rows, L] in row order, zero where dropped; rows sent per rank before drops; dropped
    rows). The send buffer and the returned rows are gathers (`take_rows`), not scatters: on TPU a 16-bit scatter
    widens to a 32-bit [slots, L] copy."""
    r = jax.lax.axis_size(EXPERT_AXIS)
    n_local = w1.shape[0]
    rows = experts_r.shape[0]
    k = rows // z_nl.shape[0]
    c = capacity_per_rank(z_nl.shape[0], k, r, n_local, factor)
    a2a = lambda x: jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0, tiled=True)  # noqa: E731

    dest = experts_r // n_local
    onehot = (dest[:, None] == jnp.arange(r, dtype=jnp.int32)[None, :]).astype(jnp.int32)  # [rows, R]
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # among earlier rows to the same rank
    keep = position < c
    slot = jnp.where(keep, dest * c + position, r * c).astype(jnp.int32)  # r * c: dropped (out of range)
    row_of_slot = jnp.full((r * c + 1,), rows, jnp.int32).at[slot].set(
        jnp.arange(rows, dtype=jnp.int32))[:r * c]  # `rows`: an empty slot (out of range)
    token_of_slot = jnp.where(row_of_slot < rows, row_of_slot // k, z_nl.shape[0])
    send = take_rows(z_nl, token_of_slot, slot.reshape(-1, k))
    send_expert = jnp.where(row_of_slot < rows, experts_r[jnp.minimum(row_of_slot, rows - 1)] % n_local, n_local)
    out = _local_experts(a2a(send), a2a(send_expert), w1, w3, w2, cfg)
    out_rows = take_rows(a2a(out), slot, row_of_slot[:, None])
    return out_rows, onehot.sum(0), rows - keep.sum()


# ---------------------------------------------------------------------------------------------------- entry point
def routed_experts(z_btl, weights_btk, experts_btk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, *, mode: str,
                   capacity_factor: float | None = None, mesh=None, ragged: str = "auto",
                   recv_rows: int | None = None):
    """Σ_j w_j E_{idx_j}(z) with the experts partitioned over the 'expert' mesh axis.

    z [B, T, L] (compute dtype), weights f32 [B, T, k], experts int32 [B, T, k], expert weights [E, L, M] / [E, M, L]
    (global arrays, any sharding; or `MXFP4Experts` of those logical shapes, see `expert_weight_specs`). `mode`:
    'dropless' or 'capacity' (with `capacity_factor`), or 'local' (every expert on each device's own tokens: an
    expert axis of 1, see the module docstring). `mesh`: default the context mesh. `ragged` (dropless):
    'native' (`jax.lax.ragged_all_to_all`), 'emulated', or 'auto' (native except on CPU). `recv_rows`: dropless
    receive buffer rows per device (default the worst case R * local tokens * min(k, E/R); a smaller bound is the
    caller's promise that no rank receives more).
    Returns (u [B, T, L] in the wide dtype, stats f32 [4] as in `STATS_FIELDS`).
    """
    if mode not in ("dropless", "capacity", "local"):
        raise ValueError(f"routed_experts mode must be 'dropless', 'capacity' or 'local', got {mode!r}")
    if mode == "capacity" and not (capacity_factor and capacity_factor > 0):
        raise ValueError(f"capacity mode needs a capacity_factor > 0, got {capacity_factor!r}")
    if ragged not in ("auto", "native", "emulated"):
        raise ValueError(f"ragged must be 'auto', 'native' or 'emulated', got {ragged!r}")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        raise ExpertParallelError(f"expert parallelism needs a mesh with an {EXPERT_AXIS!r} axis, got {mesh}")
    if mode == "local" and _axis(mesh, EXPERT_AXIS) != 1:
        raise ExpertParallelError("mode 'local' keeps every expert on every device: it needs an expert axis of 1")
    b, t, _ = z_btl.shape
    problem = _shape_problem(cfg, mesh, b, t)
    if problem:
        raise ExpertParallelError(problem)
    native = ragged == "native" or (ragged == "auto" and traced_platform() != "cpu")
    out_dtype = wide(z_btl.dtype)

    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    token_axes = batch_axes + tuple(a for a in (SEQ_AXIS,) if a in mesh.axis_names)
    tokens = P(batch_axes, SEQ_AXIS if SEQ_AXIS in mesh.axis_names else None, None)
    w13_spec, w2_spec, split_m = expert_weight_specs(w1_elm, w2_eml, mesh)

    def body(z_btl, weights_btk, experts_btk, w1, w3, w2):
        bl, tl, l = z_btl.shape
        k = experts_btk.shape[-1]
        z_nl = z_btl.reshape(bl * tl, l)
        experts_r = experts_btk.reshape(-1).astype(jnp.int32)
        weights_r = weights_btk.reshape(-1)
        if mode == "local":
            u_nl = experts_dropless(z_nl, weights_btk.reshape(-1, k), experts_btk.reshape(-1, k), w1, w3, w2, cfg,
                                    decode_tiling=decode_tiling(cfg, tl)).astype(out_dtype)
            return _finish_local(u_nl.reshape(bl, tl, l), experts_r.shape[0], split_m, token_axes)
        if mode == "dropless":
            out_rows, sent_per_rank, dropped = _dispatch_dropless(z_nl, experts_r, w1, w3, w2, cfg,
                                                                  native=native, recv_rows=recv_rows)
        else:
            out_rows, sent_per_rank, dropped = _dispatch_capacity(z_nl, experts_r, w1, w3, w2, cfg,
                                                                  factor=capacity_factor)
        # rows are in row order (token-major): each token sums its k rows weighted, in f32, in j order
        weighted = out_rows.astype(out_dtype) * weights_r.astype(out_dtype)[:, None]
        u_nl = weighted.reshape(bl * tl, k, l).sum(axis=1)
        if split_m:
            u_nl = jax.lax.psum(u_nl, MODEL_AXIS)
        rank_load = jax.lax.psum(sent_per_rank.astype(jnp.float32), token_axes)  # global rows per expert rank
        stats = jnp.stack([rank_load.max(), rank_load.mean(),
                           jax.lax.psum(dropped.astype(jnp.float32), token_axes),
                           jax.lax.psum(jnp.float32(experts_r.shape[0]), token_axes)])
        return u_nl.reshape(bl, tl, l), stats

    # check_vma=False: a Pallas kernel's output (the GPU/TPU gmm) carries no varying-axes type, which the check
    # rejects; autodiff stays exact without it (the gradient tests compare against the dense reference).
    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(tokens, tokens, tokens, w13_spec, w13_spec, w2_spec),
        out_specs=(tokens, P()), check_vma=False)
    return fn(z_btl, weights_btk, experts_btk.astype(jnp.int32), w1_elm, w3_elm, w2_eml)


def _finish_local(u_btl, rows: int, split_m: bool, token_axes) -> tuple[jax.Array, jax.Array]:
    """'local' mode's output (summed over 'model' when it splits M) and its statistics: one 'rank' received every
    routed row of the global batch, none dropped (as `single_program_stats`)."""
    if split_m:
        u_btl = jax.lax.psum(u_btl, MODEL_AXIS)
    return u_btl, single_program_stats_of(jax.lax.psum(jnp.float32(rows), token_axes))


def expert_weight_specs(w1_elm, w2_eml, mesh) -> tuple:
    """(spec of w1 and w3, spec of w2, whether 'model' splits the expert width M) for `routed_experts`' shard_map.

    Array weights [E, L, M] / [E, M, L]: P(expert, None, model) / P(expert, model, None). `MXFP4Experts` (stored in
    the HF orientation [E, out, in], a (packed, scales) pytree): w1/w3 packed [E, M, L/2] + scales [E, M, L/32] ->
    P(expert, model, None) each, w2 packed [E, L, M/2] + scales [E, L, M/32] -> P(expert, None, model) each.
    M is split when 'model' > 1 divides it (packed: into whole 32-column scale groups, M % (32 * model) == 0),
    else the weights are replicated over 'model'."""
    packed = isinstance(w1_elm, MXFP4Experts)
    if packed != isinstance(w2_eml, MXFP4Experts):
        raise ValueError("w1 and w2 must both be arrays or both MXFP4Experts")
    model = _axis(mesh, MODEL_AXIS) if MODEL_AXIS in mesh.axis_names else 1
    m = w1_elm.shape[2]
    split_m = model > 1 and m % (model * (MXFP4_GROUP if packed else 1)) == 0
    m_axis = MODEL_AXIS if split_m else None
    if packed:
        w13 = P(EXPERT_AXIS, m_axis, None)
        w2 = P(EXPERT_AXIS, None, m_axis)
        return MXFP4Experts(w13, w13), MXFP4Experts(w2, w2), split_m
    return P(EXPERT_AXIS, None, m_axis), P(EXPERT_AXIS, m_axis, None), split_m


def single_program_stats(routed_rows: int) -> jax.Array:
    """The statistics of the single-program path: one 'rank' receives every routed row, none dropped."""
    return single_program_stats_of(jnp.float32(routed_rows))


def single_program_stats_of(rows: jax.Array) -> jax.Array:
    """`single_program_stats` for a traced f32 row count."""
    return jnp.stack([rows, rows, jnp.float32(0), rows])


def expert_parallel_metrics(model) -> dict[str, jax.Array]:
    """Per-step EP metrics over every MoE layer that records `expert_parallel_stats` (last forward pass):
    ep_rank_load_max / ep_rank_load_mean (routed rows per expert rank, worst layer / average over layers),
    ep_rank_load_max_over_mean (worst layer), ep_dropped_rows (sum over layers), ep_dropped_fraction."""
    stats = [m.expert_parallel_stats[...].reshape(-1, len(STATS_FIELDS)) for _, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module) and hasattr(m, "expert_parallel_stats")]
    if not stats:
        return {}
    s = jnp.concatenate(stats)
    load_max, load_mean, dropped, routed = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    return {"ep_rank_load_max": load_max.max(), "ep_rank_load_mean": load_mean.mean(),
            "ep_rank_load_max_over_mean": (load_max / jnp.maximum(load_mean, 1e-9)).max(),
            "ep_dropped_rows": dropped.sum(), "ep_dropped_fraction": dropped.sum() / jnp.maximum(routed.sum(), 1.0)}
