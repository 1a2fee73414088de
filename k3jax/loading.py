"""Python API for loading models: from an HF directory or a k3jax Orbax checkpoint.

    config, model = k3jax.load_hf("/path/to/Kimi-K3")            # or a Kimi-Linear directory
    config, model = k3jax.load_checkpoint("/path/to/orbax_out")   # written by `python -m k3jax.convert`
    logits = model(input_ids)                                     # int32[B, T] -> [B, T, V]
    tokenizer = k3jax.load_tokenizer("/path/to/Kimi-K3", config)

The model is built without random initialisation (`nnx.eval_shape`) and filled one checkpoint item (one layer)
at a time, each tensor placed straight into its device sharding (`mesh=`), so host memory never holds the model.
"""

from __future__ import annotations

import os

import numpy as np

from k3jax.config import ModelConfig


def _assemble(plan, values, mesh=None):
    """A model for `plan.cfg` filled from `(slot, value)` pairs (one layer's tensors on the host at a time).

    Each value goes straight to its parameter's sharding: with `mesh`, the one `sharding.shard.plan_shardings`
    gives it (`jax.make_array_from_callback`: every device receives only its slice; a scan-stacked parameter is
    allocated sharded and filled one layer row at a time by a donated in-place update), without a mesh the
    default device. Missing or unknown parameters are errors naming them.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from k3jax.convert.checkpoint import _abstract_model

    graphdef, state = nnx.split(_abstract_model(plan.cfg))
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    if mesh is not None:
        from sharding.shard import plan_shardings

        shard_plan = plan_shardings(state, mesh)
        shardings = {tuple(str(p) for p in path): v.get_value() if isinstance(v, nnx.Variable) else v
                     for path, v in nnx.to_flat_state(shard_plan.shardings)}
    else:
        device = jax.devices()[0]
        shardings = {key: jax.sharding.SingleDeviceSharding(device) for key in flat}

    def place(value: np.ndarray, sharding):
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def row_sharding(sharding):
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return sharding

    set_row_fns = {}

    def set_row(stack, index, row, sharding):
        key = (stack.shape, stack.dtype, sharding)
        if key not in set_row_fns:
            set_row_fns[key] = jax.jit(lambda s, i, r: jax.lax.dynamic_update_index_in_dim(s, r, i, 0),
                                       out_shardings=sharding, donate_argnums=0)
        return set_row_fns[key](stack, index, row)

    filled: dict[tuple[str, ...], object] = {}
    rows_left: dict[tuple[str, ...], int] = {}
    for slot, value in values:
        key = tuple(slot.path)
        if key not in flat:
            raise KeyError(f"value for unknown parameter {'.'.join(key)}")
        sharding = shardings[key]
        value = np.asarray(value, dtype=flat[key].get_value().dtype)
        if slot.index is None:
            filled[key] = place(value, sharding)
            continue
        if key not in filled:
            shape, dtype = flat[key].get_value().shape, flat[key].get_value().dtype
            filled[key] = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
            rows_left[key] = shape[0]
        filled[key] = set_row(filled[key], slot.index, place(value, row_sharding(sharding)), sharding)
        rows_left[key] -= 1
    missing = sorted(".".join(k) for k in flat if k not in filled)
    incomplete = sorted(".".join(k) for k, n in rows_left.items() if n)
    if missing or incomplete:
        raise KeyError(f"no value for parameter(s) {(missing + incomplete)[:5]}")
    for key, var in flat.items():
        var.set_value(filled[key])
    return nnx.merge(graphdef, state)


def _runtime(cfg: ModelConfig, overrides) -> ModelConfig:
    from k3jax.convert.hf_config import RUNTIME_FIELDS

    if not overrides:
        return cfg
    bad = [o for o in overrides if o.split("=", 1)[0].strip() not in RUNTIME_FIELDS - {"param_dtype", "dtype"}]
    if bad:
        raise ValueError(f"only runtime fields can be overridden when loading weights, not {bad}")
    return cfg.with_overrides(list(overrides))


def load_hf(hf_dir: str, dtype=None, config: ModelConfig | str | None = None, overrides=(), mesh=None):
    """(config, model) from an HF directory (K3 or Kimi-Linear format; MXFP4 experts decoded).

    `dtype`: "bf16"/"f32" (or "bfloat16"/"float32"); None takes the config.json `torch_dtype` (bf16 default).
    `config`: a ModelConfig or registry name to check the HF config against (and to take runtime choices from).
    `overrides`: `key=value` runtime choices (kda_impl, moe_impl, kda_chunk_size, scan_layers, remat, ...).
    `mesh`: place every parameter directly in its sharding on this mesh (`sharding.mesh.make_mesh`); tensors are
    read and converted one layer at a time, so host memory holds at most one layer besides the devices' shards.
    """
    from k3jax.convert.checkpoint import hf_values, make_plan, open_hf

    src = open_hf(hf_dir, config=config, dtype=_dtype_name(dtype))
    if overrides:
        src.plan = make_plan(_runtime(src.plan.cfg, overrides))
    return src.plan.cfg, _assemble(src.plan, hf_values(src), mesh)


def load_checkpoint(orbax_dir: str, dtype=None, overrides=(), mesh=None):
    """(config, model) from a k3jax Orbax checkpoint (kept MXFP4 experts are decoded to the parameter dtype).
    `overrides`, `mesh`: as for `load_hf`."""
    from k3jax.convert.checkpoint import checkpoint_values

    plan, values = checkpoint_values(orbax_dir, _dtype_name(dtype), lambda c: _runtime(c, overrides))
    return plan.cfg, _assemble(plan, values, mesh)


def save_checkpoint(model, out: str, overwrite: bool = False) -> str:
    """Writes `model` as a k3jax Orbax checkpoint (convertible to HF with `python -m k3jax.convert --to_hf`)."""
    from k3jax.convert.checkpoint import save_checkpoint as _save

    return _save(model, out, overwrite=overwrite)


def load_tokenizer(path: str, config: ModelConfig):
    """The tokenizer of an HF directory or k3jax checkpoint (see `k3jax.convert.tokenizer.load_tokenizer`)."""
    from k3jax.convert.tokenizer import load_tokenizer as _load

    if os.path.isdir(os.path.join(path, "tokenizer")):
        path = os.path.join(path, "tokenizer")
    return _load(path, config)


def _dtype_name(dtype):
    if dtype is None:
        return None
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return {"bfloat16": "bf16", "float32": "f32"}.get(name, name)
