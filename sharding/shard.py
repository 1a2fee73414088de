"""Logical axis names on variables -> `NamedSharding`s on a mesh; placing a model and batches; the context mesh.

Every `nnx.Variable` carries `out_sharding` metadata: a tuple of logical axis names, one per dimension
(`k3jax/layers/params.py`). `plan_shardings` resolves them through the one table in `sharding/rules.py`:

1. every name must have a rule (`rules.mesh_axes_for` raises `UnknownLogicalAxisError` otherwise);
2. per dimension, mesh axes whose size does not divide the dimension are dropped (greedily, in rule order:
   `embed: ('data', 'expert')` on a dim of 4 with data=2, expert=4 keeps `data` only);
3. no mesh axis is used twice in one spec: flax's `logical_to_mesh_axes` assigns rules in the table's order and
   leaves a later dimension whose rule wants an already-used mesh axis replicated (e.g. the latent down-projection
   `('embed', 'expert_latent')` -> `(('data', 'expert'), None)`).

Every dropped mesh axis of size > 1 is recorded as a `Fallback` (path, dim, size, what was dropped, why) in the
returned `ShardingPlan` and logged once at INFO level as a summary, so a too-small or odd-sized config (like `tiny`
on 8 devices) shards what it can instead of failing. Variables without `out_sharding` (e.g. an optimizer's step
count) are replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import LOGICAL_AXIS_RULES, mesh_axes_for

log = logging.getLogger(__name__)

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A mesh axis the rules asked for on one dimension but that could not be used there."""

    path: str
    dim: int
    size: int
    logical: str | None
    dropped: tuple[str, ...]
    reason: str  # "indivisible": size % mesh-axis size != 0; "reused": the mesh axis already shards another dim

    def __str__(self) -> str:
        return (f"{self.path}[dim {self.dim}={self.size}, {self.logical!r}]: dropped {'+'.join(self.dropped)} "
                f"({self.reason})")


@dataclasses.dataclass
class ShardingPlan:
    """The resolved shardings of one state tree (an `nnx.State` of Variables holding `NamedSharding`s)."""

    mesh: Mesh
    shardings: Any
    specs: dict[str, PartitionSpec]
    fallbacks: list[Fallback]

    def summary(self) -> str:
        sharded = sum(1 for s in self.specs.values() if any(e is not None for e in s))
        lines = [f"{sharded}/{len(self.specs)} variables sharded, {len(self.fallbacks)} fallbacks"]
        lines += [f"  {f}" for f in self.fallbacks]
        return "\n".join(lines)


def rules_as_pairs(rules: dict[str, MeshAxes] = LOGICAL_AXIS_RULES) -> list[tuple[str, MeshAxes]]:
    """The rules table as flax's ordered `(logical, mesh_axes)` pairs (order = priority)."""
    return list(rules.items())


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return axes if isinstance(axes, tuple) else (axes,)


def resolve_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, *, path: str = "",
                 rules: dict[str, MeshAxes] = LOGICAL_AXIS_RULES) -> tuple[PartitionSpec, list[Fallback]]:
    """One tensor: logical axis names + shape -> a PartitionSpec valid on `mesh`, and the fallbacks taken."""
    logical = tuple(logical)
    if len(logical) != len(shape):
        raise ValueError(f"{path}: logical axes {logical} do not match shape {tuple(shape)}")
    wanted = mesh_axes_for(logical, rules)
    fallbacks: list[Fallback] = []
    # Step 2: per-dimension divisibility (mesh axes absent from the mesh are an error, not a fallback).
    divisible: dict[str, MeshAxes] = {}
    for dim, (name, axes, size) in enumerate(zip(logical, wanted, shape)):
        kept: list[str] = []
        dropped: list[str] = []
        for a in _as_tuple(axes):
            if a not in mesh.shape:
                raise ValueError(f"{path}: rule for {name!r} names mesh axis {a!r}, not in mesh {mesh.axis_names}")
            if size % (math.prod(mesh.shape[k] for k in kept) * mesh.shape[a]) == 0:
                kept.append(a)
            else:
                dropped.append(a)
        if any(mesh.shape[a] > 1 for a in dropped):
            fallbacks.append(Fallback(path, dim, size, name, tuple(dropped), "indivisible"))
        if name is not None:
            divisible[name] = tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)
    # Step 3: one use per mesh axis, by rule priority (flax's resolver; a name with no rule stays replicated).
    pairs = [(n, divisible[n]) for n in rules if n in divisible]
    spec = nn.logical_to_mesh_axes(logical, pairs)
    for dim, (name, got) in enumerate(zip(logical, spec)):
        lost = tuple(a for a in _as_tuple(divisible.get(name)) if a not in _as_tuple(got))
        if lost and any(mesh.shape[a] > 1 for a in lost):
            fallbacks.append(Fallback(path, dim, shape[dim], name, lost, "reused"))
    return spec, fallbacks


def plan_shardings(state: Any, mesh: Mesh, *, log_fallbacks: bool = True,
                   rules: dict[str, MeshAxes] = LOGICAL_AXIS_RULES) -> ShardingPlan:
    """`NamedSharding`s for every Variable in `state` (an `nnx.State`, concrete or abstract, or a module), by
    `rules` (training's table by default; `sharding.rules.SERVING_AXIS_RULES` for inference)."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    logical_specs = nnx.get_partition_spec(state)  # Variables holding PartitionSpec(*out_sharding), or P()
    flat_vars = dict(nnx.to_flat_state(state))
    specs: dict[str, PartitionSpec] = {}
    fallbacks: list[Fallback] = []
    out = []
    for key, spec_var in nnx.to_flat_state(logical_specs):
        var = flat_vars[key]
        path = ".".join(map(str, key))
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not hasattr(value, "shape"):  # an empty pytree node (e.g. optax.partition's MaskedNode): kept as is
            out.append((key, spec_var.replace(value) if isinstance(spec_var, nnx.Variable) else value))
            continue
        shape = value.shape
        logical = tuple(spec_var.get_value()) if isinstance(spec_var, nnx.Variable) else tuple(spec_var)
        if not logical:
            logical = (None,) * len(shape)
        spec, fb = resolve_spec(logical, shape, mesh, path=path, rules=rules)
        specs[path] = spec
        fallbacks += fb
        sharding = NamedSharding(mesh, spec)
        out.append((key, spec_var.replace(sharding) if isinstance(spec_var, nnx.Variable) else sharding))
    if log_fallbacks and fallbacks:  # one line; the list (one entry per array dim) only at debug level
        log.info("sharding: %d array dims kept whole on mesh %s where its axes do not divide them or are already "
                 "used (listed at --verbosity=1)", len(fallbacks), dict(mesh.shape))
        log.debug("sharding fallbacks:\n%s", "\n".join(f"  {f}" for f in fallbacks))
    return ShardingPlan(mesh, nnx.from_flat_state(out), specs, fallbacks)


def batch_spec(ndim: int = 2) -> PartitionSpec:
    """Input batches: the leading (batch) axis over the 'batch' rule's mesh axes, the rest replicated."""
    return PartitionSpec(LOGICAL_AXIS_RULES["batch"], *([None] * (ndim - 1)))


def shard_batch(batch: jax.Array, mesh: Mesh) -> jax.Array:
    """Puts a [B, ...] batch on `mesh` sharded over ('data', 'expert') on B (which must divide evenly)."""
    ways = math.prod(mesh.shape[a] for a in _as_tuple(LOGICAL_AXIS_RULES["batch"]))
    if batch.shape[0] % ways:
        raise ValueError(f"batch size {batch.shape[0]} is not divisible by data*expert = {ways} "
                         f"(mesh {dict(mesh.shape)})")
    return jax.device_put(batch, NamedSharding(mesh, batch_spec(batch.ndim)))


def mesh_context(mesh: Mesh):
    """`jax.set_mesh(mesh)` (or `jax.sharding.use_mesh` on jax versions without it): traced code can then read the
    mesh (`jax.sharding.get_abstract_mesh()`), e.g. the MoE's expert-parallel path."""
    setter = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    return setter(mesh)


def _shapes_key(tree) -> tuple:
    """(path, shape, dtype) of every leaf: what a compiled executable is specialised to."""
    return tuple((jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype))
                 for path, x in jax.tree_util.tree_flatten_with_path(tree)[0])


class TracedUnderMesh:
    """A jitted function that is always called, lowered or traced with `mesh` as the context mesh (the sharded
    train step's `jitted`, `k3jax.training.step`).

    `compile_ahead(*abstract_args)` compiles for the shapes of the last argument (the batch) and keeps the
    executable; a later call whose last argument has those shapes runs it without tracing again. The other
    arguments are the caller's to keep the same (the train step's state, whose shapes are fixed by the build;
    `adopt` moves executables compiled on an abstract build's step to the real one)."""

    def __init__(self, jitted, mesh: Mesh):
        self._jitted, self._mesh = jitted, mesh
        self._ahead: dict[tuple, Any] = {}

    def __call__(self, *args, **kwargs):
        if self._ahead and args and not kwargs:
            compiled = self._ahead.get(_shapes_key(args[-1]))
            if compiled is not None:
                try:
                    return compiled(*args)
                except (TypeError, ValueError) as e:  # other shardings or state structure: checked before running
                    log.warning("the step compiled ahead does not take these arguments (%s); compiling again",
                                str(e).splitlines()[0][:200])
                    self._ahead.clear()
        with mesh_context(self._mesh):
            return self._jitted(*args, **kwargs)

    def compile_ahead(self, *args):
        """Lowers and compiles for `args` (arrays or `jax.ShapeDtypeStruct`s), keeps and returns the executable."""
        compiled = self.lower(*args).compile()
        self._ahead[_shapes_key(args[-1])] = compiled
        return compiled

    def adopt(self, other: "TracedUnderMesh") -> None:
        """Takes `other`'s compiled-ahead executables (same function, same state shapes and shardings)."""
        self._ahead.update(other._ahead)

    def lower(self, *args, **kwargs):
        with mesh_context(self._mesh):
            return self._jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with mesh_context(self._mesh):
            return self._jitted.trace(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)
