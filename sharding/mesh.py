"""The device mesh over (data, expert, context, model), and multi-host start-up.

`make_mesh(data=2, model=4)` builds a `jax.sharding.Mesh` whose axes are always all four of `MESH_AXES` (sizes of 1
are kept, so every rule in `sharding/rules.py` names an axis that exists). Axes are `AxisType.Auto`: the partitioner
propagates shardings from the parameters and inputs (activation constraints are added by the model where needed).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Mapping, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from sharding.rules import MESH_AXES

log = logging.getLogger(__name__)


class MeshShapeError(ValueError):
    """The requested mesh axis sizes do not multiply to the number of devices given (or available)."""


def make_mesh(data: int = 1, expert: int = 1, context: int = 1, model: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ('data', 'expert', 'context', 'model') of the given sizes over `devices` (all by default).

    The product of the sizes must equal the number of devices; pass `devices=jax.devices()[:n]` to use fewer.
    """
    sizes = {"data": data, "expert": expert, "context": context, "model": model}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise MeshShapeError(f"mesh axis {name!r} must be a positive int, got {size!r}")
    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        described = " x ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
        raise MeshShapeError(
            f"mesh {described} needs {math.prod(shape)} devices but {len(devices)} "
            f"{'were given' if given else 'are available'} "
            f"(platform {devices[0].platform if devices else '?'}); choose sizes whose product is {len(devices)}")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:  # a TPU torus whose axes no subset multiplies to a mesh axis (64 on 8x8x16)
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)


def parse_mesh(text: str) -> dict[str, int]:
    """'2,1,1,4' (data, expert, context, model) -> {'data': 2, 'expert': 1, 'context': 1, 'model': 4}.

    Also accepts 'data=2,model=4' (unnamed axes default to 1). Returns keyword arguments for `make_mesh`.
    """
    parts = [p.strip() for p in text.strip().split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty mesh spec {text!r}; expected e.g. '2,1,1,4' (data,expert,context,model)")
    if all("=" in p for p in parts):
        out = dict.fromkeys(MESH_AXES, 1)
        for p in parts:
            name, _, value = p.partition("=")
            name = name.strip()
            if name not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {name!r} in {text!r}; axes are {MESH_AXES}")
            out[name] = _positive_int(value, text)
        return out
    if any("=" in p for p in parts):
        raise ValueError(f"mesh spec {text!r} mixes positional and name=size entries")
    if len(parts) != len(MESH_AXES):
        raise ValueError(f"mesh spec {text!r} has {len(parts)} sizes; expected {len(MESH_AXES)} "
                         f"({','.join(MESH_AXES)})")
    return {a: _positive_int(p, text) for a, p in zip(MESH_AXES, parts)}


def _positive_int(value: str, text: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"mesh size {value!r} in {text!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"mesh size {n} in {text!r} must be >= 1")
    return n


def is_multi_host_launch(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment says this process is one of several (so `jax.distributed` must be initialised).

    Recognised: explicit `JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` > 1; a multi-host Cloud TPU slice
    (`TPU_WORKER_HOSTNAMES` listing more than one host, or `MEGASCALE_NUM_SLICES` > 1); SLURM with more than one task;
    Open MPI with more than one rank. A single-host TPU VM, or `TPU_WORKER_HOSTNAMES=localhost` as used for
    compile-only runs, is not multi-host.
    """
    env = os.environ if env is None else env

    def count(name: str) -> int:
        try:
            return int(env.get(name, "1") or "1")
        except ValueError:
            return 1

    if env.get("JAX_COORDINATOR_ADDRESS") and count("JAX_NUM_PROCESSES") > 1:
        return True
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 or count("MEGASCALE_NUM_SLICES") > 1:
        return True
    if env.get("SLURM_JOB_ID") and count("SLURM_NTASKS") > 1:
        return True
    if count("OMPI_COMM_WORLD_SIZE") > 1:
        return True
    return False


def initialize_distributed(env: Mapping[str, str] | None = None, **kwargs) -> bool:
    """Calls `jax.distributed.initialize(**kwargs)` when launched multi-host; a no-op otherwise.

    Must run before anything touches the devices. Returns True if this call (or an earlier one) initialised the
    distributed runtime. Explicit `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` are passed
    through; otherwise jax's cluster auto-detection (Cloud TPU, SLURM, Open MPI) fills them in.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ if env is None else env
    if not is_multi_host_launch(env):
        return False
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs.setdefault("coordinator_address", env["JAX_COORDINATOR_ADDRESS"])
        kwargs.setdefault("num_processes", int(env["JAX_NUM_PROCESSES"]))
        if env.get("JAX_PROCESS_ID"):
            kwargs.setdefault("process_id", int(env["JAX_PROCESS_ID"]))
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def describe(mesh: Mesh) -> str:
    """'data=2 expert=1 context=1 model=4 (8 cpu devices)'."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{sizes} ({mesh.size} {mesh.devices.flat[0].platform} devices)"
