"""Dense matmul kernels for decode-sized rows: `decode_matmul` (split-K, streams the weight once)."""

from pallas_kernels.dense.decode_matmul import BACKENDS, SplitTiling, decode_matmul, default_tiling

__all__ = ["BACKENDS", "SplitTiling", "decode_matmul", "default_tiling"]
