"""Parallelism plans: which mesh axes grow with the slice, and the mesh they give for any device count.

A `MeshPlan` caps the non-data axes: `auto_mesh(plan, n)` gives 'model' the largest size dividing both `n` and the
plan's cap, then 'expert' the same out of what is left, then 'context', and every remaining factor goes to 'data'
(FSDP + batch). So `k3` ({'model': 8, 'expert': 64}, `configs/k3.py`) on 512 chips is (1, 64, 1, 8), on 2048 chips
(4, 64, 1, 8), on 8 CPU devices (1, 1, 1, 8); `tiny` (no plan) puts every device on 'data'. An axis named in
`exact` must get its full cap; a device count that cannot give it is a `MeshShapeError`.

`mesh_sizes_for(option, cfg_name, n)` is what a launcher calls: `--mesh` absent or 'auto' -> the config's plan,
otherwise `parse_mesh`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import configs
from k3jax.config import ModelConfig
from sharding.mesh import MeshShapeError, parse_mesh
from sharding.rules import MESH_AXES

# The axes a plan caps, in the order they are filled; 'data' takes the rest.
PLANNED_AXES = ("model", "expert", "context")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Largest size of each non-data axis (1: unused); `exact`: axes that must get exactly their cap."""

    model: int = 1
    expert: int = 1
    context: int = 1
    exact: tuple[str, ...] = ()

    def __post_init__(self):
        for axis in PLANNED_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh plan: {axis!r} must be a positive int, got {size!r}")
        bad = [a for a in self.exact if a not in PLANNED_AXES]
        if bad:
            raise ValueError(f"mesh plan: exact axes {bad} are not among {PLANNED_AXES} ('data' takes the rest)")

    @classmethod
    def from_dict(cls, values: Mapping[str, int]) -> MeshPlan:
        unknown = [k for k in values if k not in PLANNED_AXES and k != "exact"]
        if unknown:
            raise ValueError(f"mesh plan: unknown axes {unknown}; a plan caps {PLANNED_AXES} ('data' takes the rest)")
        return cls(**{k: (tuple(v) if k == "exact" else v) for k, v in values.items()})


def plan_for(cfg_name_or_plan: str | ModelConfig | MeshPlan | Mapping[str, int]) -> MeshPlan:
    """A MeshPlan from a config name (its `configs.mesh_plan`), a ModelConfig (by its name; unknown names: all on
    data), a mapping ({'model': 8, ...}) or a MeshPlan."""
    if isinstance(cfg_name_or_plan, MeshPlan):
        return cfg_name_or_plan
    if isinstance(cfg_name_or_plan, ModelConfig):
        name = cfg_name_or_plan.name
        return MeshPlan.from_dict(configs.mesh_plan(name)) if name in configs.names() else MeshPlan()
    if isinstance(cfg_name_or_plan, str):
        return MeshPlan.from_dict(configs.mesh_plan(cfg_name_or_plan))
    return MeshPlan.from_dict(cfg_name_or_plan)


def auto_mesh(cfg_name_or_plan, device_count: int) -> tuple[int, int, int, int]:
    """(data, expert, context, model) for `device_count` devices by the plan (see the module docstring)."""
    plan = plan_for(cfg_name_or_plan)
    if not isinstance(device_count, int) or device_count < 1:
        raise MeshShapeError(f"auto mesh needs a positive device count, got {device_count!r}")
    left = device_count
    sizes = {}
    for axis in PLANNED_AXES:
        cap = getattr(plan, axis)
        sizes[axis] = math.gcd(left, cap)
        if axis in plan.exact and sizes[axis] != cap:
            raise MeshShapeError(
                f"mesh plan {plan_text(plan)} needs {axis}={cap} exactly, but {device_count} devices "
                f"leave only {left} for it (largest usable: {sizes[axis]}); use a device count that is a multiple "
                f"of {math.prod(getattr(plan, a) for a in plan.exact)} or pass --mesh explicitly")
        left //= sizes[axis]
    sizes["data"] = left
    return tuple(sizes[a] for a in MESH_AXES)


def plan_text(plan: MeshPlan) -> str:
    """'model<=8 expert<=64' (or 'all on data')."""
    parts = [f"{a}{'=' if a in plan.exact else '<='}{getattr(plan, a)}" for a in PLANNED_AXES
             if getattr(plan, a) > 1]
    return " ".join(parts) or "all on data"


def mesh_sizes_for(option: str | None, cfg_name_or_plan, device_count: int) -> dict[str, int]:
    """`--mesh` semantics: None or 'auto' -> `auto_mesh` by the config's plan; anything else -> `parse_mesh`
    (whose product may be below `device_count`: the launcher then uses the first devices)."""
    if option is None or option.strip().lower() == "auto":
        return dict(zip(MESH_AXES, auto_mesh(cfg_name_or_plan, device_count)))
    return parse_mesh(option)


def plan_problems(plan: MeshPlan, cfg: ModelConfig) -> list[str]:
    """Config dimensions that a plan's caps do not divide (each would be replicated on that axis instead of split);
    empty for a consistent plan. Checked by the tests for every named config."""
    problems = []
    widths = {"model": {"num_attention_heads": cfg.num_attention_heads, "kda_num_heads": cfg.kda_num_heads,
                        "vocab_size": cfg.vocab_size, "moe_intermediate_size": cfg.moe_intermediate_size,
                        "intermediate_size": cfg.intermediate_size},
              "expert": {"num_experts": cfg.num_experts}}
    for axis, dims in widths.items():
        cap = getattr(plan, axis)
        problems += [f"{axis}={cap} does not divide {name}={size}" for name, size in dims.items() if size % cap]
    return problems
