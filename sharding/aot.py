"""TPU and GPU devices without the hardware, for compile-only runs (optional dependencies, see below).

`tpu_topology('v5p:2x2x1')` describes a TPU slice through `jax.experimental.topologies.get_topology_desc`; its
devices can build a mesh that programs are lowered and compiled for with the real TPU compiler on a CPU host
(`python -m k3jax.training.aot`, the kernels' compile-only checks in benchmarks/). Nothing is allocated.
`gpu_topology('h200')` (or 'h100', 'h200:8' for eight GPUs of one host) does the same for NVIDIA GPUs: XLA's
GPU compiler takes a target description (`GPU_TARGETS`: the chip's published figures) instead of a device
(deviceless compilation). What only a device can settle is left out of such a compile: autotuning (XLA's
defaults are used), CUB sort scratch (XLA's own sort instead) and cuDNN's workspaces (0 bytes: cuDNN sizes them on
the device; `k3jax.training.aot` adds the packed attention backward's from its formula).

Install libtpu matching jax (`pip install "jax[tpu]==<jax version>"` pins it), or the CUDA plugin with its
libraries (`pip install "jax[cuda12]==<jax version>"`; no GPU or driver needed for compiling), only where wanted.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import jax
from jax._src import xla_bridge
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

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


# Published figures of each GPU the deviceless compile can target: XLA's GPU cost model and memory limits read them.
_HOPPER = {"core_count": 132, "threads_per_block_limit": 1024, "threads_per_warp": 32,
           "shared_memory_per_block": 49152, "shared_memory_per_core": 233472, "shared_memory_per_block_optin": 232448,
           "threads_per_core_limit": 2048, "fpus_per_core": 128, "registers_per_core_limit": 65536,
           "registers_per_block_limit": 65536, "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535,
           "block_dim_limit_z": 65535, "l2_cache_size": 52428800, "clock_rate_ghz": 1.98, "cc": (9, 0)}
GPU_TARGETS = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", device_memory_size=81559 * 2**20,
                 memory_bandwidth=3_350_000_000_000),
    "h200": dict(_HOPPER, name="NVIDIA H200 141GB HBM3e", device_memory_size=143771 * 2**20,
                 memory_bandwidth=4_800_000_000_000),
}
_GPU_NAME = re.compile(r"^([a-z0-9]+)(?::(\d+))?$")


def parse_gpu_target(name: str) -> tuple[str, int] | None:
    """('h200', 8) for 'h200:8' (GPUs of one host; 'h200' is one), or None when `name` names no GPU target."""
    m = _GPU_NAME.match(name.strip().lower())
    if not m or m.group(1) not in GPU_TARGETS:
        return None
    count = int(m.group(2) or 1)
    if count < 1:
        raise ValueError(f"GPU topology {name!r}: the GPU count must be >= 1")
    return m.group(1), count


def gpu_target_config(model: str) -> str:
    """The target description of `model` (a key of GPU_TARGETS) as XLA's GpuTargetConfigProto text."""
    t = GPU_TARGETS[model]
    fields = "\n".join(f"  {k}: {v}" for k, v in t.items() if k not in ("name", "cc"))
    major, minor = t["cc"]
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 patch: 0 }}\n'
            f'device_description_str: "{t["name"]}"\n')


def cuda_plugin_available() -> bool:
    """Whether jax's CUDA plugin (12 or 13) is installed."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # no jax_plugins namespace at all
            return False
    return False


def gpu_topology(name: str):
    """The `TopologyDescription` for e.g. 'h200' or 'h100:8' (GPUs of one host), compiled for without a GPU."""
    parsed = parse_gpu_target(name)
    if parsed is None:
        raise ValueError(f"unknown GPU topology {name!r}; known: {', '.join(sorted(GPU_TARGETS))} (optionally :N)")
    model, count = parsed
    need = missing_compiler(name)
    if need:
        raise RuntimeError(f"compiling for {name} needs {need}")
    # the plugin's import-time check wants a working driver, which a deviceless compile does not need; jax loads
    # every installed plugin, so an installed libtpu gets its no-hardware environment too
    for k, v in {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", **_TPU_ENV}.items():
        os.environ.setdefault(k, v)
    from jax.experimental import topologies  # after the environment above: it loads the plugins

    topo = topologies.get_topology_desc(platform="cuda", topology_name=name, target_config=gpu_target_config(model),
                                        topology=f"1x1x{count}")
    _cudnn_checks_for(GPU_TARGETS[model]["cc"])
    return topo


def _cudnn_checks_for(cc: tuple[int, int]) -> None:
    """jax's cuDNN attention checks the compute capability of the default backend's first GPU at trace time; in a
    deviceless compile there is none (the default backend is the CPU), so the checks are answered for the target.
    Private jax functions: this process only compiles."""
    cudnn_attention.check_compute_capability = lambda c: cc >= tuple(int(x) for x in c.split("."))
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: cc == tuple(int(x) for x in c.split("."))


def aot_topology(name: str):
    """A compile-only topology by name: a GPU target ('h200', 'h100:8') or a TPU slice ('v5p:2x2x1')."""
    return gpu_topology(name) if parse_gpu_target(name) else tpu_topology(name)


def missing_compiler(name: str) -> str | None:
    """What to install to compile for `name` (GPU: jax's CUDA plugin; TPU: libtpu), or None when it is there."""
    if parse_gpu_target(name):
        return None if cuda_plugin_available() else \
            "jax's CUDA plugin (pip install 'jax[cuda12]==<jax version>'; no GPU needed)"
    return None if libtpu_available() else "libtpu (pip install 'jax[tpu]==<jax version>')"


def quiet_compile_only_process(name: str) -> None:
    """For a process that only compiles for `name`: with a GPU target no accelerator runtime is started (jax's
    default backend stays the CPU) and XLA's warnings about what a compile without the device leaves to it (e.g.
    the sort's scratch) are not printed. Call before anything initialises jax's backends."""
    if parse_gpu_target(name):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if not xla_bridge.backends_are_initialized():  # no public query
            jax.config.update("jax_platforms", "cpu")

