"""Fused input projections for serving: one matmul for the projections a layer applies to the same input.

Each layer projects its (normed) input several times: KDA q, k, v, the decay gate's down projection, β and the
output gate; MLA the query LoRA, the latent and the output gate; the latent MoE its expert down projection and
the shared experts' gate and up. XLA's dot merger already turns such siblings into one matmul, but it builds the
concatenated weight inside the jitted step, so every decode step re-copies those weights in HBM (k3_gpu: ~465 MB
per step, by our reading of XLA's GPU pipeline and a session-9 trace; not yet confirmed by a timing).
`fuse_input_projections` concatenates them once, into a `FusedInputs` variable beside the originals; the layers
then run one matmul on it (`project_inputs`) and split its columns.

Serving only: the fused copy is not a parameter (training, Muon and checkpoints see the original `nnx.Param`s),
and it is built only without a device mesh (a concatenation of differently sharded weights has no sharding of its
own; `k3jax.inference` skips it on a mesh). Costs the fused weights' memory once more (k3_gpu: 0.50 GB).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.ops.linear import project as dense

__all__ = ["FusedInputs", "fuse_input_projections", "fused_copy", "project_inputs", "serving_model"]

log = logging.getLogger(__name__)


class FusedInputs(nnx.Variable):
    """``[..., D, N]``: a module's input projections (`input_projection_names()`) flattened to ``[D, n_i]`` and
    concatenated along N, in that order (serving-time state, not a gradient parameter)."""


def _weight(module: nnx.Module, name: str) -> nnx.Variable:
    """``module.<name>``, following dots into child modules (``"shared_experts.gate_proj"``)."""
    return functools.reduce(getattr, name.split("."), module)


def project_inputs(module: nnx.Module, x: jax.Array, cfg) -> dict[str, jax.Array]:
    """``dense(x, module.<name>)`` for every name of ``module.input_projection_names()``, by name, each shaped
    ``x.shape[:-1] + w.shape[1:]`` in x's dtype: one matmul on ``module.fused_inputs`` when
    `fuse_input_projections` built it, else one matmul per weight."""
    names = tuple(module.input_projection_names())
    dt = x.dtype
    weights = [_weight(module, n) for n in names]
    fused = getattr(module, "fused_inputs", None)
    if fused is None:
        return {n: dense(x, w[...].astype(dt), cfg) for n, w in zip(names, weights)}
    out_shapes = [tuple(w.shape[1:]) for w in weights]
    widths = [math.prod(shape) for shape in out_shapes]
    if sum(widths) != fused.shape[-1]:
        raise ValueError(f"{type(module).__name__}: fused inputs have {fused.shape[-1]} columns, the weights of "
                         f"{names} {sum(widths)}")
    y = dense(x, fused[...].astype(dt), cfg)
    outs, start = {}, 0
    for n, shape, width in zip(names, out_shapes, widths):
        outs[n] = y[..., start:start + width].reshape(x.shape[:-1] + shape)
        start += width
    return outs


def _lead_axes(w: nnx.Variable) -> int:
    """Leading stacked axes (a scanned unit's 'layers') before the contracted 'embed' axis of a projection."""
    axes = w.get_metadata().get("out_sharding") or ()
    return list(axes).index("embed") if "embed" in axes else 0


def fuse_input_projections(model: nnx.Module) -> int:
    """Adds a `FusedInputs` to every module (in place) whose `input_projection_names()` lists two or more
    weights; a module's names may reach into a child (``"shared_experts.gate_proj"``), which then fuses nothing
    itself. Returns the number of modules fused. Stacked (scanned) weights fuse per layer."""
    owners = [m for _, m in nnx.iter_graph(model)
              if isinstance(m, nnx.Module) and hasattr(m, "input_projection_names")]
    claimed = set()
    for m in owners:
        for name in m.input_projection_names():
            if "." in name:
                claimed.add(id(functools.reduce(getattr, name.split(".")[:-1], m)))
    count = 0
    for m in owners:
        names = tuple(m.input_projection_names())
        if id(m) in claimed or len(names) < 2 or getattr(m, "fused_inputs", None) is not None:
            continue
        weights = [_weight(m, n) for n in names]
        lead = _lead_axes(weights[0])
        head = tuple(weights[0].shape[:lead + 1])
        for n, w in zip(names, weights):
            if tuple(w.shape[:lead + 1]) != head or w.dtype != weights[0].dtype:
                raise ValueError(f"{type(m).__name__}: {n} {w.dtype}{list(w.shape)} does not share the leading "
                                 f"axes {list(head)} / dtype {weights[0].dtype} of {names[0]}")
        value = jnp.concatenate([w.get_value().reshape(head + (-1,)) for w in weights], axis=-1)
        axes = tuple((weights[0].get_metadata().get("out_sharding") or (None,) * (lead + 1))[:lead + 1])
        m.fused_inputs = FusedInputs(value, out_sharding=axes + (None,), eager_sharding=False)
        count += 1
    return count


def fused_copy(model: nnx.Module) -> tuple[nnx.Module, int]:
    """A new module graph holding `model`'s weight variables (shared, not copied), with fused input projections
    added to its modules (`model`'s modules are unchanged). The fused weights are a snapshot: weights updated in
    place later do not reach them. Returns (the copy, the number of modules fused)."""
    copy = nnx.merge(*nnx.split(model))
    return copy, fuse_input_projections(copy)


def serving_model(model: nnx.Module, mesh=None) -> nnx.Module:
    """The model a serving engine runs: `model` itself, or with ``cfg.fuse_input_projections`` a `fused_copy`
    (not on a device mesh: a warning says it is skipped)."""
    if not model.cfg.fuse_input_projections:
        return model
    if mesh is not None:
        log.warning("fuse_input_projections: skipped on a device mesh (the fused weights would have no sharding)")
        return model
    fused, count = fused_copy(model)
    log.info("fuse_input_projections: %d layer modules fused", count)
    return fused
