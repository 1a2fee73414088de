"""Generation on a device mesh: where the parameters, the decode cache and the per-sequence fields live.

The mesh is `sharding.mesh.make_mesh`'s (data, expert, context, model). Inference needs context == 1 (prompts are
prefilled whole on each device; context parallelism is a training path). Layouts, all resolved through the one
table in `sharding/rules.py` with its divisibility fallbacks (`sharding.shard.resolve_spec`):

- parameters: the serving rules (`sharding.rules.SERVING_AXIS_RULES`, what `serve.py --mesh` loads with): heads,
  MLP widths and the vocabulary over 'model', routed experts over 'expert' (the MoE then runs expert-parallel,
  `sharding/expert_parallel.py`), everything else replicated — no FSDP, so a decode step gathers no weights.
- per-sequence cache leaves: the batch (slot) axis by the 'batch' rule, ('data', 'expert'): the layout the model's
  activation constraints and the expert-parallel MoE give tokens, so every device decodes its own sequences and the
  MoE exchanges only routed rows. KDA heads over 'model' like the KDA projections: recurrent state [B, H, K, V] on H,
  conv histories [B, W-1, H*K] on H*K (only when H splits, so a rank holds whole heads). Page table [B, P] and
  lengths [B] on B. Scanned groups' leading [repeats] axis is replicated, like their parameters' 'layers' axis.
- MLA page pools [N, page_size, C]: REPLICATED. Pages are shared by all slots through the page table (any slot maps
  any page; prefix-cache pages are shared between slots), so splitting N over the batch axes would need one
  allocator per shard; splitting the latent C over 'model' would put a psum into every attention logit while the
  heads already split over 'model'. Each device holds N * page_size * C per MLA layer (K3: a 576-wide row per token
  and MLA layer, one layer in four) and gathers each step's new rows from the other batch shards.
- per-sequence decode fields (last token, counts, limits, sampling parameters, PRNG keys, EOS ids): axis 0 over
  the 'batch' rule, like the cache.

The jitted prefill / decode functions take these layouts as input (arrays committed to them) and constrain their
outputs to the same layouts, so decode step n+1 receives exactly what step n produced: no resharding between steps,
and donation reuses the buffers.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.layers.kda import KDAState
from k3jax.model import init_cache
from sharding.mesh import make_mesh, parse_mesh
from sharding.rules import LOGICAL_AXIS_RULES, MESH_AXES, SERVING_AXIS_RULES
from sharding.shard import mesh_context, plan_shardings, resolve_spec

BATCH_RULE = "batch"


class InferenceMeshError(ValueError):
    """The mesh cannot run inference (wrong axes, or a context axis > 1)."""


def check_mesh(mesh: Mesh) -> Mesh:
    """`mesh` if it can serve: the four axes of `sharding.rules.MESH_AXES` with context == 1."""
    if not isinstance(mesh, Mesh):
        raise InferenceMeshError(f"mesh must be a jax.sharding.Mesh (sharding.mesh.make_mesh), got {type(mesh)}")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise InferenceMeshError(f"inference mesh axes must be {MESH_AXES} (sharding.mesh.make_mesh), got "
                                 f"{tuple(mesh.axis_names)}")
    if mesh.shape["context"] != 1:
        raise InferenceMeshError(
            f"inference needs the mesh's context axis to be 1, got context={mesh.shape['context']} (mesh "
            f"{dict(mesh.shape)}): context parallelism is for training; put those devices on 'data' (more "
            f"sequences), 'expert' or 'model' instead")
    return mesh


def batch_ways(mesh: Mesh | None) -> int:
    """How many ways the 'batch' rule splits a batch axis on `mesh` (1 without a mesh)."""
    if mesh is None:
        return 1
    axes = LOGICAL_AXIS_RULES[BATCH_RULE]
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in axes if a is not None)


def round_up_batch(n: int, mesh: Mesh | None) -> int:
    """`n` rounded up to a multiple of `batch_ways(mesh)`: a batch every device gets an equal share of (and that the
    expert-parallel MoE can split)."""
    ways = batch_ways(mesh)
    return -(-n // ways) * ways


def context(mesh: Mesh | None):
    """The mesh as the context mesh (the MoE's expert-parallel path and the activation constraints read it), or a
    no-op without one."""
    if mesh is None:
        return contextlib.nullcontext()
    return mesh_context(mesh)


def place_params(params: Any, mesh: Mesh) -> Any:
    """`params` (an nnx.State) placed by the serving rules (`sharding.rules.SERVING_AXIS_RULES`: tensor and expert
    parallel, no FSDP) on `mesh` (no copy for arrays already placed so, e.g. loaded with
    `k3jax.load_hf(..., mesh=mesh, rules=SERVING_AXIS_RULES)`)."""
    return jax.device_put(params, plan_shardings(params, mesh, rules=SERVING_AXIS_RULES).shardings)


def _spec(logical, shape, mesh: Mesh) -> PartitionSpec:
    return resolve_spec(logical, shape, mesh, path="decode cache")[0]


def _kda_shardings(state: KDAState, mesh: Mesh) -> KDAState:
    lead = state.state_bhkv.ndim - 4  # 1: a scanned group's stacked [repeats] axis
    pre = (None,) * lead
    state_spec = _spec(pre + (BATCH_RULE, "kda_heads", None, None), state.state_bhkv.shape, mesh)
    batch_part, heads_part = state_spec[lead], state_spec[lead + 1]
    # [B, W-1, 3 (q|k|v), H*K]: H*K split only where H is (whole heads per rank)
    conv_spec = PartitionSpec(*pre, batch_part, None, None, heads_part)
    return KDAState(NamedSharding(mesh, conv_spec), NamedSharding(mesh, state_spec))


def cache_shardings(cache, mesh: Mesh):
    """A `DecodeCache` of `NamedSharding`s for `cache` (arrays, tracers or ShapeDtypeStructs; see the module
    docstring for the layout)."""
    layers = []
    for group in cache.layers:
        unit = []
        for state in group:
            if isinstance(state, KDAState):
                unit.append(_kda_shardings(state, mesh))
            else:  # an MLA page pool, [repeats,] [N, page_size, C]: replicated
                unit.append(NamedSharding(mesh, PartitionSpec()))
        layers.append(tuple(unit))
    table = NamedSharding(mesh, _spec((BATCH_RULE, None), cache.page_table.shape, mesh))
    lengths = NamedSharding(mesh, _spec((BATCH_RULE,), cache.lengths.shape, mesh))
    return type(cache)(tuple(layers), table, lengths)


def batch_shardings(tree, mesh: Mesh):
    """Every leaf's axis 0 over the 'batch' rule (where it divides), the rest replicated."""
    return jax.tree.map(lambda x: NamedSharding(mesh, _spec((BATCH_RULE,) + (None,) * (x.ndim - 1), x.shape, mesh)),
                        tree)


def slot_axis_shardings(tree, axes: tuple[int, ...], mesh: Mesh):
    """A speculative draft's state (`k3jax.inference.drafts.Draft.slot_axes`): each leaf's slot axis over the
    'batch' rule (where it divides), the rest replicated; SHARED leaves (-1: pools every slot reads through the
    page table, like the MLA page pools) replicated."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x, a in zip(leaves, axes):
        logical = (None,) * x.ndim if a < 0 else (None,) * a + (BATCH_RULE,) + (None,) * (x.ndim - a - 1)
        out.append(NamedSharding(mesh, _spec(logical, x.shape, mesh)))
    return jax.tree.unflatten(treedef, out)


def constrain_slot_axes(tree, axes: tuple[int, ...], mesh: Mesh | None):
    """Inside a jitted function: a draft state pinned to `slot_axis_shardings` (identity without a mesh)."""
    if mesh is None or not jax.tree.leaves(tree):
        return tree
    return jax.lax.with_sharding_constraint(tree, slot_axis_shardings(tree, axes, mesh))


def put_slot_axes(tree, axes: tuple[int, ...], mesh: Mesh | None):
    """A draft state placed with `slot_axis_shardings`, every leaf its own buffer (unchanged without a mesh)."""
    if mesh is None or not jax.tree.leaves(tree):
        return tree
    return jax.jit(lambda t: t, out_shardings=slot_axis_shardings(tree, axes, mesh))(tree)


def place_draft_params(params: Any, mesh: Mesh | None) -> Any:
    """A speculative draft's parameters on `mesh`: an nnx.State (the MTP / EAGLE-3 layer) by the serving rules like
    the target's, any other pytree replicated (unchanged without a mesh)."""
    if mesh is None or not jax.tree.leaves(params):
        return params
    if isinstance(params, nnx.State):
        return place_params(params, mesh)
    return jax.device_put(params, replicated(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain_cache(cache, mesh: Mesh | None):
    """Inside a jitted function: `cache` pinned to `cache_shardings` (identity without a mesh)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def constrain_batch(tree, mesh: Mesh | None):
    """Inside a jitted function: every leaf pinned to `batch_shardings` (identity without a mesh)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, batch_shardings(tree, mesh))


def constrain_logits(logits, mesh: Mesh | None):
    """Inside a jitted function: logits [B, (T,) V] pinned to the model's layout (batch over the 'batch' rule, the
    vocabulary over 'model', `act_vocab`); identity without a mesh."""
    if mesh is None:
        return logits
    logical = (BATCH_RULE,) + (None,) * (logits.ndim - 2) + ("act_vocab",)
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, _spec(logical, logits.shape, mesh)))


def put_batch(tree, mesh: Mesh | None):
    """Host or device arrays placed with `batch_shardings` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, batch_shardings(tree, mesh))


def init_cache_on(cfg, mesh: Mesh, batch_size: int, max_len: int, *, page_size: int | None = None,
                  num_pages: int | None = None):
    """`k3jax.model.init_cache(...)` created directly in `cache_shardings` (no leaf ever sits whole on one device;
    every leaf its own buffer, so the cache can be donated)."""
    return _cache_maker(cfg, mesh, batch_size, max_len, page_size, num_pages)()


@functools.lru_cache(maxsize=32)
def _cache_maker(cfg, mesh, batch_size, max_len, page_size, num_pages):
    make = functools.partial(init_cache, cfg, batch_size, max_len, page_size=page_size, num_pages=num_pages)
    return jax.jit(make, out_shardings=cache_shardings(jax.eval_shape(make), mesh))


def mesh_from_spec(text: str | None, devices=None) -> Mesh | None:
    """`serve.py --mesh`: 'D,E,C,M' (or 'data=2,model=4'; `sharding.mesh.parse_mesh`) -> a checked inference mesh
    over `devices` (default all); None for None or ''. Raises ValueError naming the problem (context > 1 before the
    device count, so that error is the one reported)."""
    if text is None or not str(text).strip():
        return None
    sizes = parse_mesh(str(text))
    if sizes["context"] != 1:
        raise InferenceMeshError(f"--mesh={text}: inference needs context = 1 (the third size), got "
                                 f"{sizes['context']}; context parallelism is for training")
    return check_mesh(make_mesh(**sizes, devices=devices))
