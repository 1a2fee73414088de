"""Every per-layer tensor of a k3jax checkpoint or an opened HF directory as `(slot, value)` pairs, one item
(layer) in host memory at a time: what `k3jax.loading` assembles a model from."""

from __future__ import annotations

import os
from typing import Callable, Iterator

from k3jax.config import ModelConfig
from k3jax.convert.checkpoint import (
    Plan,
    Source,
    _decode_stack,
    convert_item,
    dtype_from_flag,
    make_plan,
    read_manifest,
    restore_item,
)
from k3jax.convert.safetensors_io import CheckpointError


def checkpoint_values(ckpt: str, dtype: str | None = None,
                      adjust: Callable[[ModelConfig], ModelConfig] | None = None) -> tuple[Plan, Iterator]:
    """The plan of a checkpoint and an iterator of `(slot, value)` over every per-layer tensor, one item (layer)
    in host memory at a time; MXFP4 items decoded. `adjust` may change runtime config fields (e.g. scan_layers)
    before the parameter tree is planned."""
    manifest, cfg = read_manifest(ckpt)
    dtype = dtype_from_flag(dtype)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    if adjust is not None:
        cfg = adjust(cfg)
    plan = make_plan(cfg)
    if set(plan.items) != set(manifest["items"]):
        raise CheckpointError(f"{ckpt}: items {sorted(set(manifest['items']) ^ set(plan.items))[:5]} do not fit "
                              f"its config.json")

    def values():
        for name, slots in plan.items.items():
            item = restore_item(os.path.join(ckpt, "params", name), manifest.get("hashes", {}).get(name))
            for slot in slots:
                if slot.local + ".packed" in item:
                    value = _decode_stack(item[slot.local + ".packed"], item[slot.local + ".scale"], slot.dtype)
                else:
                    value = item[slot.local]
                if tuple(value.shape) != tuple(slot.shape):
                    raise CheckpointError(f"{ckpt}: {name}/{slot.local} has shape {list(value.shape)}; expected "
                                          f"{list(slot.shape)}")
                yield slot, value
            del item

    return plan, values()


def hf_values(src: Source) -> Iterator:
    """`(slot, value)` over every per-layer tensor of an opened HF directory, one layer in memory at a time."""
    for slots in src.plan.items.values():
        item = convert_item(src, slots, "bf16")
        for slot in slots:
            yield slot, item.pop(slot.local)
        del item
