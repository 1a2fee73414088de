"""Lower a config's serving decode step for CUDA on a CPU host (no GPU needed) and list what it launches: the
Triton kernels by name and the StableHLO ops around them (sorts, scatters, dots). A static check that the decode
fusions are chosen on the GPU path and how much XLA work they remove; not a timing.

    python -m benchmarks.lower_decode k3_gpu [key=value ...]      # e.g. kda_decode_fusion=step
"""
import collections
import re
import sys

import jax
from flax import nnx

import k3jax.ops.backend as kernel_backend  # noqa: E402

kernel_backend.traced_platform = lambda: "gpu"  # trace as for a GPU on this host
import k3jax.ops.kda as kda_ops  # noqa: E402

kda_ops.decode_kernel_backend = lambda: "gpu"
import configs  # noqa: E402
from benchmarks import decode_bench as db  # noqa: E402
from k3jax.inference import slot_steps  # noqa: E402
from k3jax.model import K3Model  # noqa: E402

sets = ["scan_layers=False"] + sys.argv[2:]
cfg = configs.get_config(sys.argv[1], sets)
abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
graphdef, state = nnx.split(abstract)
leaves, treedef = jax.tree.flatten(state)
leaves = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
spec = slot_steps.intern_static((graphdef, treedef))
b = 64
cache = jax.eval_shape(lambda: db.init_cache(cfg, b, 640))
state_s = jax.eval_shape(lambda: db.slot_state(b, 100))
text = slot_steps.decode_slots.trace(leaves, cache, state_s, spec=spec, greedy_only=True, steps=1,
                                    mesh=slot_steps.intern_static(None)).lower(lowering_platforms=("cuda",)).as_text()
names = re.findall(r'name = "([a-z0-9_]+)"', text)
print(sets, "triton calls:", text.count("__gpu$xla.gpu.triton"))
print(collections.Counter(n for n in names if n.startswith(("k3_", "kda_"))))
print("stablehlo ops:", len(re.findall(r"stablehlo\.\w+", text)), "| sort:", text.count("stablehlo.sort"),
      "| scatter:", text.count("stablehlo.scatter"), "| dot_general:", text.count("stablehlo.dot_general"))
