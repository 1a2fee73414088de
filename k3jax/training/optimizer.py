"""K3's optimizer (docs/spec.md#muon): Muon for matrices, AdamW for everything else, one cosine schedule.

Muon: momentum 0.95 with Nesterov, Newton–Schulz quintic (3.4445, −4.7750, 2.0315) for 5 steps, applied per
*block*:

- q/k/v/g projections of KDA and MLA (`q_proj`, `k_proj`, `v_proj`, `g_proj`, and the LoRA B halves `q_b_proj`,
  `kv_b_proj`, `g_b_proj`), stored `[in..., heads, head_dim]`: each head's `[in, head_dim]` block on its own
  (reduction axes = the input axes, output axis = head_dim, the heads axis is a batch axis);
- routed experts `w1, w3 [E, L, M]`, `w2 [E, M, L]`: each expert's matrix on its own (experts axis = batch axis);
- every other matrix whole; a heads axis *leading* the layout (`o_proj [H, K, D]`) is an input axis, so `o_proj`
  is one `[H·K, D]` matrix; a heads axis after the input (`f_b_proj [r, H, K]`) makes `(H, K)` the output axes;
- a leading scan-stacking axis ('layers') is always a batch axis: scanned layers are independent matrices.

Each block's orthogonalised update is multiplied by `0.2·√max(fan_in, fan_out)` of that block (Moonlight's
AdamW-RMS matching, arXiv:2502.16982), so one learning rate serves both Muon and AdamW — what
`optax.contrib.muon(..., consistent_rms=0.2)` computes. The direction is computed here by
`scale_by_blockwise_muon` (EMA momentum `μ ← βμ + (1−β)g`, the bias-corrected Nesterov mix `β·μ̂ + (1−β)·ĝ` fed
to Newton–Schulz, as optax's Muon) instead of optax's own transform for one reason: memory. optax orthogonalises
all blocks of a parameter at once (`vmap`); K3's stacked routed experts are 22 × 896 blocks per tensor, whose
Newton–Schulz temporaries need ~0.6 TB per chip on a v5p-1024 slice. `orthogonalize_blocks` maps over the
scan-stacking axis (one layer's blocks at a time) and vmaps the rest: same result, 22× smaller peak.

Under a multi-device mesh (the train step traced under `jax.set_mesh`) Newton–Schulz is distributed
(`distributed_orthogonalize`, in `shard_map`): blocks whose batch axis is sharded (experts over 'expert', heads over
'model') stay on their rank; matrix dims sharded by FSDP / tensor parallelism are exchanged by all_to_all so each
rank holds whole blocks of its share; leaves replicated over an axis are split over it and the results
all-gathered. `ns_dtype="bfloat16"` runs the matmuls with bf16 operands and f32 accumulation.

AdamW (β = (0.9, 0.95), eps 1e-8): embeddings and `lm_head` (a 'vocab' axis), norm gains ('norm' axis, and any
parameter with fewer than two non-stacking axes: `A_log`, `o_norm`, `routed_expert_norm`, AttnRes pseudo-queries,
…), biases (`dt_bias`), short-conv kernels ('conv_window' axis). Weight decay (decoupled, multiplied by the
learning rate) is 0.1 on both. Schedule: linear warmup over the first 1% of steps, then cosine decay.

Composition: `optax.partition({'muon': chain(scale_by_blockwise_muon, add_decayed_weights, scale_by_learning_rate),
'adamw': optax.adamw(...)}, labels)`.

Labels come from each `nnx.Param`'s logical axis names (`out_sharding` metadata) and the last path component; see
`muon_dimension_numbers` and `label_table`. The router bias (`RouterBias`) is not an `nnx.Param`: Quantile
Balancing (`k3jax.training.balancing`) updates it, not the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from k3jax.numerics import upcast
from sharding.rules import MESH_AXES
from sharding.shard import resolve_spec

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
MUON_RMS_SCALE = 0.2  # Moonlight: update scale 0.2·sqrt(max(fan_in, fan_out)) per block

NS_DTYPES = ("float32", "bfloat16")
# Relative Frobenius error of one block's Newton–Schulz output against float64 (benchmarks/muon_ns_precision.py,
# 2026-12-03, CPU): bfloat16 1.4e-2 (768x768) and 1.0e-2 (3584x3072) on Gaussian blocks, 2.6e-3 / 1.1e-3 on
# blocks with 1/i singular values; float32 3e-6 to 5e-6. The bound tests/test_muon_ns_precision.py holds bf16 to:
NS_BF16_REL_ERROR_BOUND = 3e-2

MUON = "muon"
ADAMW = "adamw"

# Projections whose `[in..., heads, head_dim]` weight is orthogonalised one head block at a time.
PER_HEAD_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "g_proj", "q_b_proj", "kv_b_proj", "g_b_proj"})
HEADS_AXES = frozenset({"heads", "kda_heads"})
HEAD_DIM_AXES = frozenset({"head_dim", "kda_head_dim"})
STACKING_AXES = frozenset({"layers"})  # nnx.scan stacking: always a batch axis
EXPERT_AXES = frozenset({"experts"})  # routed experts: one block per expert
# embeddings / lm_head, norm gains, conv kernels, the vision tower's learned position grid
ADAMW_AXES = frozenset({"vocab", "norm", "conv_window", "vision_pos_h"})


def muon_dimension_numbers(path: Sequence[Any] | str, axes: Sequence[str | None], shape: Sequence[int], *,
                           per_head_names: Iterable[str] = PER_HEAD_PROJECTIONS) -> MuonDimensionNumbers | None:
    """Muon block layout of one parameter, or None when it is trained with AdamW.

    `path`: the parameter's path (its last string component is the attribute name, e.g. 'q_proj'); `axes`: its
    logical axis names (`out_sharding` metadata); `shape`: its shape. Axes that are neither reduction nor output
    axes are batch axes: every index along them is a separate matrix.
    """
    shape = tuple(shape)
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"{_path_str(path)}: {len(axes)} axis names {axes} for shape {shape}")
    name = _param_name(path)
    core = [i for i, a in enumerate(axes) if a not in STACKING_AXES and a not in EXPERT_AXES]
    if len(core) < 2 or any(a in ADAMW_AXES for a in axes) or "bias" in name.lower():
        return None
    heads = [i for i in core if axes[i] in HEADS_AXES]
    if not heads:
        if len(core) == 2:
            return MuonDimensionNumbers(reduction_axis=(core[0],), output_axis=(core[1],))
        raise ValueError(f"{_path_str(path)}: no Muon rule for axes {axes} (shape {shape})")
    (h,) = heads
    if h == core[0]:  # heads lead: an input axis (o_proj [H, K, D] is one [H*K, D] matrix)
        return MuonDimensionNumbers(reduction_axis=tuple(core[:-1]), output_axis=(core[-1],))
    inputs = tuple(i for i in core if i < h)
    outputs = tuple(i for i in core if i >= h)
    if name in frozenset(per_head_names):
        if len(outputs) != 2 or axes[outputs[1]] not in HEAD_DIM_AXES:
            raise ValueError(f"{_path_str(path)}: per-head projection needs [in..., heads, head_dim] axes, got "
                             f"{axes}")
        return MuonDimensionNumbers(reduction_axis=inputs, output_axis=(outputs[1],))
    # a whole matrix with the heads axis on the output side: KDA f_b_proj [r, H, K] → [r, H*K], b_proj [D, H]
    return MuonDimensionNumbers(reduction_axis=inputs, output_axis=outputs)


def block_shape(shape: Sequence[int], dim_nums: MuonDimensionNumbers) -> tuple[int, int, int]:
    """(number of blocks, fan_in, fan_out) of a Muon parameter."""
    red = _as_tuple(dim_nums.reduction_axis)
    out = _as_tuple(dim_nums.output_axis)
    n = len(shape)
    red = tuple(a % n for a in red)
    out = tuple(a % n for a in out)
    fan_in = math.prod(shape[a] for a in red)
    fan_out = math.prod(shape[a] for a in out)
    return math.prod(shape) // (fan_in * fan_out), fan_in, fan_out


def muon_update_scale(shape: Sequence[int], dim_nums: MuonDimensionNumbers,
                      rms_scale: float = MUON_RMS_SCALE) -> float:
    """The factor applied to each orthogonalised block: rms_scale·sqrt(max(fan_in, fan_out))."""
    _, fan_in, fan_out = block_shape(shape, dim_nums)
    return rms_scale * math.sqrt(max(fan_in, fan_out))


class ParamLabel(NamedTuple):
    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    label: str  # MUON or ADAMW
    dimension_numbers: MuonDimensionNumbers | None
    num_blocks: int  # Muon: number of independently orthogonalised blocks; AdamW: 0
    block: tuple[int, int] | None  # Muon: (fan_in, fan_out) of each block
    update_scale: float | None  # Muon: rms_scale·sqrt(max(fan_in, fan_out))


def label_table(model_or_params: Any, *, per_head_names: Iterable[str] = PER_HEAD_PROJECTIONS,
                rms_scale: float = MUON_RMS_SCALE) -> list[ParamLabel]:
    """One row per nnx.Param: path → label, block layout, update scale (for inspection and tests)."""
    rows = []
    for path, shape, axes in _param_specs(model_or_params):
        dn = muon_dimension_numbers(path, axes, shape, per_head_names=per_head_names)
        if dn is None:
            rows.append(ParamLabel(path, shape, axes, ADAMW, None, 0, None, None))
        else:
            nb, fi, fo = block_shape(shape, dn)
            rows.append(ParamLabel(path, shape, axes, MUON, dn, nb, (fi, fo), muon_update_scale(shape, dn, rms_scale)))
    return rows


def format_label_table(rows: Sequence[ParamLabel]) -> str:
    """The label table as aligned text."""
    lines = []
    width = max((len(r.path) for r in rows), default=4)
    for r in rows:
        if r.label == MUON:
            red = _as_tuple(r.dimension_numbers.reduction_axis)
            out = _as_tuple(r.dimension_numbers.output_axis)
            detail = (f"{r.num_blocks:>4} x [{r.block[0]:>4}, {r.block[1]:>4}]  red={red} out={out}  "
                      f"scale={r.update_scale:.3f}")
        else:
            detail = ""
        lines.append(f"{r.path:<{width}}  {r.shape!s:<18} {r.label:<5}  {detail}".rstrip())
    return "\n".join(lines)


def lr_schedule(peak_learning_rate: float, total_steps: int, *, warmup_fraction: float = 0.01,
                end_fraction: float = 0.0) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_fraction` of the steps (at least one), then cosine decay to
    `end_fraction·peak` at `total_steps`."""
    total_steps = max(int(total_steps), 2)
    warmup = min(max(1, round(warmup_fraction * total_steps)), total_steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak_learning_rate, warmup, total_steps,
                                              end_value=end_fraction * peak_learning_rate)


def make_optimizer(model_or_params: Any, *, learning_rate: float | optax.Schedule,
                   total_steps: int | None = None, warmup_fraction: float = 0.01, end_fraction: float = 0.0,
                   weight_decay: float = 0.1, momentum: float = MUON_MOMENTUM, nesterov: bool = True,
                   ns_coeffs: tuple[float, float, float] = NS_COEFFS, ns_steps: int = NS_STEPS,
                   rms_scale: float = MUON_RMS_SCALE, adamw_b1: float = 0.9, adamw_b2: float = 0.95,
                   eps: float = 1e-8, mu_dtype: Any = None, max_grad_norm: float | None = None,
                   per_head_names: Iterable[str] = PER_HEAD_PROJECTIONS, ns_dtype: str = "float32",
                   ns_distributed: bool = True) -> optax.GradientTransformation:
    """Per-head Muon + AdamW for a K3 model.

    `model_or_params`: an nnx.Module, or an nnx.State of its nnx.Param variables (the labels need each Param's
    `out_sharding` axis names; an `nnx.eval_shape` model works). The returned transformation expects params /
    updates with the same paths (an nnx.State of Params or its pure-array form), as `nnx.Optimizer(model, tx,
    wrt=nnx.Param)` passes them.

    `learning_rate`: a schedule, or the peak learning rate; with `total_steps` the peak becomes
    `lr_schedule(peak, total_steps)` (1% linear warmup, cosine decay), without it a constant. Muon and AdamW share
    it (the 0.2·√max(fan_in, fan_out) scale matches Muon's update RMS to AdamW's). `max_grad_norm` optionally clips
    the global gradient norm first. `ns_dtype`: Newton–Schulz matmuls in "float32" or "bfloat16" (f32
    accumulation); `ns_distributed`: under a multi-device mesh each rank orthogonalises only its share of the blocks
    (`distributed_orthogonalize`; off: the single-program computation, partitioned by GSPMD).
    """
    if callable(learning_rate):
        schedule = learning_rate
    elif total_steps is not None:
        schedule = lr_schedule(learning_rate, total_steps, warmup_fraction=warmup_fraction, end_fraction=end_fraction)
    else:
        schedule = learning_rate
    rows = {r.path: r for r in label_table(model_or_params, per_head_names=per_head_names, rms_scale=rms_scale)}

    def lookup(path) -> ParamLabel:
        key = _path_str(_normalize_path(path))
        if key not in rows:
            raise KeyError(f"optimizer: no label for parameter {key!r} (was the optimizer built for this model?)")
        return rows[key]

    def labels(tree):
        return jax.tree_util.tree_map_with_path(lambda p, _: lookup(p).label, tree)

    muon = optax.chain(
        scale_by_blockwise_muon(lookup, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=momentum, eps=eps,
                                mu_dtype=mu_dtype, nesterov=nesterov, ns_dtype=ns_dtype, distributed=ns_distributed),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule))
    adamw = optax.adamw(schedule, b1=adamw_b1, b2=adamw_b2, eps=eps, weight_decay=weight_decay, mu_dtype=mu_dtype)
    tx = optax.partition({MUON: muon, ADAMW: adamw}, labels)
    if max_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    return tx


def newton_schulz(x_mn: jax.Array, ns_coeffs: Sequence[float] = NS_COEFFS, ns_steps: int = NS_STEPS,
                  eps: float = 1e-8, ns_dtype: str = "float32") -> jax.Array:
    """Quintic Newton–Schulz orthogonalisation of one [m, n] block in f32 (f64 for f64 input; on its wide
    orientation, after dividing by its Frobenius norm): X ← aX + (bA + cA²)X with A = XXᵀ.

    `ns_dtype="bfloat16"`: the three matmuls of each step take bf16 operands and accumulate in f32
    (`preferred_element_type`); X, A and the linear combinations stay f32 (see `NS_DTYPES` for the error)."""
    a, b, c = ns_coeffs
    x = upcast(x_mn)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (jnp.linalg.norm(x) + eps)
    if _ns_dtype(ns_dtype) == "float32":
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if transposed else x
    acc = x.dtype

    def mm(p, q):
        return jnp.matmul(p.astype(jnp.bfloat16), q.astype(jnp.bfloat16), preferred_element_type=acc)

    for _ in range(ns_steps):
        gram = mm(x, x.T)
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
    return x.T if transposed else x


def orthogonalize_blocks(x: jax.Array, dim_nums: MuonDimensionNumbers, map_axes: Sequence[int] = (),
                         **ns_kwargs) -> jax.Array:
    """Newton–Schulz on every [fan_in, fan_out] block of `x` (batch axes: all but the reduction / output axes).

    Blocks along `map_axes` (the scan-stacking 'layers' axis) are processed one slice after another with
    `map_in_place`, the rest at once with `vmap`: a stacked expert weight [layers, E, L, M] keeps only one layer's
    Newton–Schulz temporaries live instead of all layers' (at K3 scale the difference between fitting and ~0.6 TB
    of temporaries per chip), and each layer's result overwrites its input. The result is identical to
    orthogonalising each block on its own.
    """
    n = x.ndim
    red = tuple(a % n for a in _as_tuple(dim_nums.reduction_axis))
    out = tuple(a % n for a in _as_tuple(dim_nums.output_axis))
    mapped = tuple(a % n for a in map_axes if a % n not in red + out)
    batch = tuple(a for a in range(n) if a not in red + out + mapped)
    perm = mapped + batch + red + out
    xt = jnp.transpose(x, perm)
    sizes = [math.prod(x.shape[a] for a in grp) for grp in (mapped, batch, red, out)]
    blocks = xt.reshape(sizes)
    y = map_in_place(jax.vmap(lambda blk: newton_schulz(blk, **ns_kwargs)), blocks)
    y = y.reshape(xt.shape)
    inverse = sorted(range(n), key=lambda i: perm[i])
    return jnp.transpose(y, tuple(inverse))


class NSMove(NamedTuple):
    """One step of `ns_plan` that brings whole blocks onto a rank. kind 'a2a': `axis` shards matrix dim `dim`; one
    all_to_all splits the blocks over it and gathers that dim. 'gather': too few blocks to split; `dim` is
    all-gathered (each rank then orthogonalises the same blocks). 'slice': the leaf is replicated over `axis`; each
    rank takes its share of the blocks (no communication; the results are all-gathered afterwards)."""

    kind: str
    axis: str
    size: int
    dim: int  # matrix dim in the local [blocks, *reduction dims, *output dims] layout ('a2a' / 'gather'), else 0
    blocks: int  # blocks per rank before this step
    padded: int  # `blocks` padded to a multiple of `size` with zero blocks ('a2a' / 'slice')


def ns_plan(shape: Sequence[int], dim_nums: MuonDimensionNumbers, spec: Sequence[Any],
            mesh_shape: Mapping[str, int]) -> list[NSMove]:
    """How one Muon leaf laid out by PartitionSpec `spec` is orthogonalised on a mesh (`distributed_orthogonalize`).

    Mesh axes on batch axes (experts, heads, stacked layers) need nothing: each rank holds whole blocks. Each mesh
    axis on a matrix dim (tensor parallel over 'model', FSDP over 'data'/'expert') is an 'a2a' move (blocks split
    over it, the dim gathered), or a 'gather' when a rank has a single block left; axes minor-to-major within a dim,
    so the gathered pieces land in order. Then each mesh axis the leaf is replicated over is a 'slice' move while
    a rank has two or more blocks. Block counts are padded up to the axis size with zero blocks (NS maps 0 to 0).
    """
    n = len(shape)
    red = tuple(a % n for a in _as_tuple(dim_nums.reduction_axis))
    out = tuple(a % n for a in _as_tuple(dim_nums.output_axis))
    spec = tuple(spec) + (None,) * (n - len(tuple(spec)))
    used = {a for entry in spec for a in _mesh_axes(entry)}
    blocks = math.prod(shape[i] // _ways(spec[i], mesh_shape) for i in range(n) if i not in red + out)
    moves = []
    for j, d in enumerate(red + out):
        for axis in reversed(_mesh_axes(spec[d])):
            size = mesh_shape[axis]
            if size == 1:
                continue
            if blocks >= 2:
                padded = -(-blocks // size) * size
                moves.append(NSMove("a2a", axis, size, 1 + j, blocks, padded))
                blocks = padded // size
            else:
                moves.append(NSMove("gather", axis, size, 1 + j, blocks, blocks))
    for axis, size in mesh_shape.items():
        if axis in used or size == 1 or blocks < 2:
            continue
        padded = -(-blocks // size) * size
        moves.append(NSMove("slice", axis, size, 0, blocks, padded))
        blocks = padded // size
    return moves


def distributed_orthogonalize(x: jax.Array, dim_nums: MuonDimensionNumbers, spec: Sequence[Any], mesh,
                              map_axes: Sequence[int] = (), **ns_kwargs) -> jax.Array:
    """`orthogonalize_blocks` of a leaf sharded by `spec` on `mesh`, inside `jax.shard_map`: each rank
    orthogonalises only its own blocks (`ns_plan`), so no Newton–Schulz work is repeated across ranks that own
    different blocks, and no rank gathers blocks it does not orthogonalise (a rank's experts stay local). The
    result has `x`'s dtype and layout `spec`; each block's result is the single-device one.

    Memory: with a scan-stacking axis in `map_axes`, the leaf goes a few stacked layers at a time (`lax.map`)
    through the whole exchange — moves in, Newton–Schulz, moves out — so only those layers' moved blocks and
    temporaries are live besides the result (moving the whole leaf first kept ~2x every Muon leaf live: 21 GB per
    chip of the `k3` step on v5p-1024, benchmarks/RESULTS.md 2026-12-04). A step takes as many layers as it needs
    for every rank of the exchange to get a block (a stacked dense weight with one block per layer and 1,024 ranks
    still goes whole: no rank repeats another's Newton–Schulz). Without a mapped axis, all local blocks at once."""
    shape = tuple(x.shape)
    n = len(shape)
    red = tuple(a % n for a in _as_tuple(dim_nums.reduction_axis))
    out = tuple(a % n for a in _as_tuple(dim_nums.output_axis))
    mapped = tuple(a % n for a in map_axes if a % n not in red + out)
    batch = tuple(a for a in range(n) if a not in red + out + mapped)
    perm = mapped + batch + red + out
    inverse = tuple(sorted(range(n), key=lambda i: perm[i]))
    spec = tuple(spec) + (None,) * (n - len(tuple(spec)))
    mesh_shape = dict(mesh.shape)
    local = [shape[i] // _ways(spec[i], mesh_shape) for i in range(n)]
    layers = math.prod(local[i] for i in mapped)  # local stacked layers (1 without a mapped axis)
    blocks = math.prod(local[i] for i in batch)  # local blocks per layer
    ranks = math.prod(m.size for m in ns_plan(shape, dim_nums, spec, mesh_shape) if m.kind != "gather")
    per_step = min(layers, -(-ranks // blocks))  # layers per step
    steps = -(-layers // per_step)
    # one step's leaf: the mapped dims replaced by `per_step` local layers (their mesh axes already applied)
    first = mapped[0] if mapped else None
    step_shape = tuple(per_step if i == first else 1 if i in mapped else shape[i] for i in range(n))
    step_spec = tuple(None if i in mapped else spec[i] for i in range(n))
    moves = ns_plan(step_shape, dim_nums, step_spec, mesh_shape)
    fan_in = math.prod(shape[i] for i in red)

    def one_step(y):  # [per_step * blocks, *matrix dims]
        for m in moves:
            y = _move_in(y, m)
        z = jax.vmap(lambda blk: newton_schulz(blk, **ns_kwargs))(y.reshape(y.shape[0], fan_in, -1))
        y = z.astype(x.dtype).reshape(y.shape)
        for m in reversed(moves):
            y = _move_out(y, m)
        return y

    def body(x_local):
        xt = jnp.transpose(x_local, perm)
        lead, mat = xt.shape[:len(mapped + batch)], xt.shape[len(mapped + batch):]
        y = _pad_blocks(xt.reshape((layers, blocks) + mat), steps * per_step)  # zero layers: NS maps 0 to 0
        y = y.reshape((steps, per_step * blocks) + mat)
        y = map_in_place(one_step, y)
        y = y.reshape((steps * per_step, blocks) + mat)[:layers]
        return jnp.transpose(y.reshape(lead + mat), inverse)

    pspec = jax.sharding.PartitionSpec(*spec)
    return jax.shard_map(body, mesh=mesh, in_specs=pspec, out_specs=pspec, check_vma=False)(x)


def map_in_place(fn, y: jax.Array) -> jax.Array:
    """`fn` on each `y[s]` in turn, each result (cast to y's dtype) written over `y[s]`: a loop whose carry is `y`
    and whose body updates one slice, so XLA updates the buffer in place (`jax.lax.map` would write a second
    stacked buffer beside its input: one more f32 copy of every Muon leaf, live until the parameter update)."""
    if y.shape[0] == 1:
        return fn(y[0]).astype(y.dtype)[None]

    def body(s, y):
        return jax.lax.dynamic_update_index_in_dim(y, fn(y[s]).astype(y.dtype), s, 0)

    return jax.lax.fori_loop(0, y.shape[0], body, y)


def _move_in(y: jax.Array, m: NSMove) -> jax.Array:
    if m.kind == "gather":
        return jax.lax.all_gather(y, m.axis, axis=m.dim, tiled=True)
    y = _pad_blocks(y, m.padded)
    if m.kind == "a2a":
        return jax.lax.all_to_all(y, m.axis, 0, m.dim, tiled=True)
    share = m.padded // m.size
    return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(m.axis) * share, share, axis=0)


def _move_out(y: jax.Array, m: NSMove) -> jax.Array:
    if m.kind == "gather":
        width = y.shape[m.dim] // m.size
        return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(m.axis) * width, width, axis=m.dim)
    if m.kind == "a2a":
        y = jax.lax.all_to_all(y, m.axis, m.dim, 0, tiled=True)
    else:
        y = jax.lax.all_gather(y, m.axis, axis=0, tiled=True)
    return y[:m.blocks]


def _pad_blocks(y: jax.Array, count: int) -> jax.Array:
    if count == y.shape[0]:
        return y
    return jnp.pad(y, [(0, count - y.shape[0])] + [(0, 0)] * (y.ndim - 1))


def ns_mesh():
    """The mesh Newton–Schulz is distributed over: the context mesh of the trace (`jax.set_mesh`, as the sharded
    train step sets it) when it has the rules' axes and more than one device, outside `shard_map`; else None
    (the single-device computation, partitioned by GSPMD if at all)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes or math.prod(mesh.shape.values()) == 1:
        return None
    if not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


class BlockwiseMuonState(NamedTuple):
    count: jax.Array
    mu: Any


def scale_by_blockwise_muon(lookup, *, ns_coeffs=NS_COEFFS, ns_steps: int = NS_STEPS, beta: float = MUON_MOMENTUM,
                            eps: float = 1e-8, mu_dtype: Any = None, nesterov: bool = True,
                            ns_dtype: str = "float32", distributed: bool = True) -> optax.GradientTransformation:
    """Muon's direction (the computation of `optax.contrib.scale_by_muon` + `scale_by_shape(consistent_rms)`),
    block by block: EMA momentum μ ← βμ + (1−β)g, the bias-corrected Nesterov mix β·μ̂ + (1−β)·ĝ, Newton–Schulz per
    block (`orthogonalize_blocks`, scan-stacked layers one at a time), times 0.2·√max(fan_in, fan_out).
    `lookup(path) -> ParamLabel` gives each leaf's block layout and scale.

    Traced under a multi-device mesh (`ns_mesh`) with `distributed`, each leaf goes through
    `distributed_orthogonalize` with the layout the rules give its logical axes (`sharding.shard.resolve_spec`,
    what `plan_shardings` places it with): every rank orthogonalises only its share of the blocks. `ns_dtype`:
    "float32" (the matmuls in f32) or "bfloat16" (bf16 operands, f32 accumulation)."""
    ns_dtype = _ns_dtype(ns_dtype)

    def init_fn(params):
        return BlockwiseMuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params, dtype=mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_int32_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_int32_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)

        mesh = ns_mesh() if distributed else None
        ns_kwargs = {"ns_coeffs": tuple(ns_coeffs), "ns_steps": ns_steps, "eps": eps, "ns_dtype": ns_dtype}

        def direction(path, x):
            row = lookup(path)
            stacking = tuple(i for i, a in enumerate(row.axes) if a in STACKING_AXES)
            spec = None if mesh is None else resolve_spec(row.axes, x.shape, mesh, path=row.path)[0]
            if spec is None or not (any(e is not None for e in spec)
                                    or ns_plan(x.shape, row.dimension_numbers, spec, dict(mesh.shape))):
                y = orthogonalize_blocks(x, row.dimension_numbers, stacking, **ns_kwargs)
            else:
                y = distributed_orthogonalize(x, row.dimension_numbers, spec, mesh, stacking, **ns_kwargs)
            return (y * row.update_scale).astype(x.dtype)

        updates = jax.tree_util.tree_map_with_path(direction, mu_hat)
        return updates, BlockwiseMuonState(count, optax.tree.cast(mu, mu_dtype))

    return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _as_tuple(axis: Sequence[int] | int) -> tuple[int, ...]:
    return (axis,) if isinstance(axis, int) else tuple(axis)


def _mesh_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, a mesh axis, or a tuple of them, major first) as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(entry, mesh_shape: Mapping[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in _mesh_axes(entry))




def _ns_dtype(ns_dtype) -> str:
    name = jnp.dtype(ns_dtype).name
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    return name


def _key_part(k) -> Any:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return k.key
    return k


def _normalize_path(path) -> tuple:
    """A pytree key path (DictKey/GetAttrKey/...) or a plain tuple → plain tuple, without the trailing `.value`
    that an nnx.Variable leaf adds."""
    if isinstance(path, str):
        return tuple(path.split("/"))
    parts = list(path)
    if parts and isinstance(parts[-1], jax.tree_util.GetAttrKey) and parts[-1].name == "value":
        parts = parts[:-1]
    return tuple(_key_part(k) for k in parts)


def _path_str(path) -> str:
    return path if isinstance(path, str) else "/".join(str(p) for p in path)


def _param_name(path) -> str:
    parts = path.split("/") if isinstance(path, str) else list(path)
    for p in reversed(parts):
        p = _key_part(p)
        if isinstance(p, str):
            return p
    return ""


def _param_specs(model_or_params: Any) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(path, shape, logical axes) of every nnx.Param."""
    if isinstance(model_or_params, nnx.Module):
        state = nnx.state(model_or_params, nnx.Param)
    elif isinstance(model_or_params, nnx.State):
        state = model_or_params
    elif isinstance(model_or_params, Mapping):
        state = nnx.State(model_or_params)
    else:
        raise TypeError(f"make_optimizer needs an nnx.Module or an nnx.State of Params, got "
                        f"{type(model_or_params).__name__}")
    specs = []
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Variable):
            raise TypeError(f"{_path_str(path)}: needs nnx.Param variables (with out_sharding axis names), got "
                            f"{type(var).__name__}; pass the model or nnx.state(model, nnx.Param)")
        if not isinstance(var, nnx.Param):
            continue
        axes = var.get_metadata().get("out_sharding")
        shape = tuple(var.shape)
        if axes is None:
            if len(shape) >= 2:
                raise ValueError(f"{_path_str(path)}: Param of shape {shape} has no out_sharding axis names")
            axes = (None,) * len(shape)
        specs.append((_path_str(_normalize_path(path)), shape, tuple(axes)))
    return specs
