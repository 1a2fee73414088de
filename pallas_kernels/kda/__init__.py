"""Pallas KDA kernels: the chunkwise forward (chunk_fwd.py) and backward (chunk_bwd.py) on GPU / interpret, the
Mosaic TPU kernels (tpu.py), their gradient wrappers (api.py) and the one-token decode kernels (decode.py,
decode_fused.py), and the training input prologue (conv_prologue.py: short conv, SiLU, L2 norm; its wrapper is
`k3jax.ops.conv`). The dispatch between these and the XLA cores is `k3jax.ops.kda.kda`."""

from pallas_kernels.kda.api import (
           BACKENDS,
           chunk_kda_kernel,
           chunk_kda_kernel_forward,
           chunk_kda_raw_gate_kernel,
)
from pallas_kernels.kda.common import GATE_IN_KERNEL, KernelConfig, activate_gate
from pallas_kernels.kda.decode import kda_decode_step
from pallas_kernels.kda.decode_fused import kda_decode_fused

__all__ = ["BACKENDS", "GATE_IN_KERNEL", "KernelConfig", "activate_gate", "chunk_kda_kernel",
           "chunk_kda_kernel_forward", "chunk_kda_raw_gate_kernel", "kda_decode_fused", "kda_decode_step"]
