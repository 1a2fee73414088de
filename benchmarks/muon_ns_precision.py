"""Relative error of Muon's Newton–Schulz update in bf16 (bf16 matmul operands, f32 accumulation) and in f32,
against float64, on K3-shaped blocks.

    python -m benchmarks.muon_ns_precision                     # 768x768 and 3584x3072 (per head / per expert)
    python -m benchmarks.muon_ns_precision --shapes 1536x192 --seeds 3

For each shape and input kind it prints one JSON line: the relative Frobenius error ‖U − U₆₄‖/‖U₆₄‖ and the max
elementwise error over max |U₆₄| of `newton_schulz(..., ns_dtype=...)` (5 quintic steps, the optimizer's) against
the same function on the float64 input. Input kinds: 'gaussian' (i.i.d. normal entries) and 'lowrank' (singular
values decaying as 1/i, like a momentum buffer dominated by a few directions). Numbers only, no timings.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from k3jax.training.optimizer import newton_schulz


def make_block(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> np.ndarray:
    g = rng.standard_normal(shape)
    if kind == "gaussian":
        return g
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    s = 1.0 / np.arange(1, min(shape) + 1)
    return (u * s) @ vt


def errors(x: np.ndarray) -> dict[str, float]:
    with jax.enable_x64(True):
        want = np.asarray(jax.jit(newton_schulz)(x.astype(np.float64)))
    out = {}
    for dtype in ("float32", "bfloat16"):
        got = np.asarray(jax.jit(lambda v, d=dtype: newton_schulz(v, ns_dtype=d))(x.astype(np.float32)),
                         np.float64)
        out[f"{dtype}_rel_fro"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        out[f"{dtype}_rel_max"] = float(np.abs(got - want).max() / np.abs(want).max())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="768x768,3584x3072", help="comma-separated MxN block shapes")
    parser.add_argument("--kinds", default="gaussian,lowrank")
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args(argv)
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.lower().split("x"))
        for kind in args.kinds.split(","):
            for seed in range(args.seeds):
                row = {"shape": list(shape), "kind": kind, "seed": seed}
                row.update(errors(make_block(shape, kind, np.random.default_rng(seed))))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
