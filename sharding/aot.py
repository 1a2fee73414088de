"""TPU devices without TPUs, for compile-only runs (needs `libtpu`; not a default dependency).

`tpu_topology('v5p:2x2x1')` describes a TPU slice through `jax.experimental.topologies.get_topology_desc`; its
devices can build a mesh that programs are lowered and compiled for with the real TPU compiler on a CPU host
(`python -m k3jax.training.aot`, the kernels' compile-only checks in benchmarks/). Nothing is allocated.

Install libtpu matching jax (`pip install "jax[tpu]==<jax version>"` pins it) only where this is wanted.
"""

from __future__ import annotations

import importlib.util
import math
import os

# Without TPU hardware libtpu must not query the GCE metadata server; set before libtpu is loaded.
# ALLOW_MULTIPLE_LIBTPU_LOAD: several compile-only processes may run at once (no chip is opened).
_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def tpu_topology(name: str):
    """The `TopologyDescription` for e.g. 'v5p:2x2x1' (devices usable in a Mesh for lowering and compiling)."""
    for k, v in _TPU_ENV.items():
        os.environ.setdefault(k, v)
    gen, _, dims = name.partition(":")
    chips = math.prod(int(d) for d in dims.split("x")) if dims else 0
    if chips:  # accelerator types count TensorCores: two per chip on v4/v5p, one on v5e/v6e
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{gen}-{chips * (2 if gen in ('v4', 'v5p') else 1)}")
    from jax.experimental import topologies  # after the environment above: it reaches libtpu

    return topologies.get_topology_desc(platform="tpu", topology_name=name)
