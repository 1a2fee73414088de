"""Python API for loading models: from an HF directory or a k3jax Orbax checkpoint.

    config, model = k3jax.load_hf("/path/to/Kimi-K3")            # or a Kimi-Linear directory
    config, model = k3jax.load_checkpoint("/path/to/orbax_out")   # written by `python -m k3jax.convert`
    logits = model(input_ids)                                     # int32[B, T] -> [B, T, V]
    tokenizer = k3jax.load_tokenizer("/path/to/Kimi-K3", config)

The model is built without random initialisation (`nnx.eval_shape`) and filled one checkpoint item (one layer)
at a time; the full parameter set is necessarily resident at the end.
"""

from __future__ import annotations

import os

import numpy as np

from k3jax.config import ModelConfig


def _build(cfg: ModelConfig, arrays: dict[tuple[str, ...], np.ndarray]):
    import jax.numpy as jnp
    from flax import nnx

    from k3jax.convert.checkpoint import _abstract_model

    graphdef, state = nnx.split(_abstract_model(cfg))
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(p) for p in path)
        if key not in arrays:
            raise KeyError(f"no value for parameter {'.'.join(key)}")
        var.set_value(jnp.asarray(arrays.pop(key)))
    if arrays:
        raise KeyError(f"values for unknown parameters: {sorted('.'.join(k) for k in arrays)[:5]}")
    return nnx.merge(graphdef, state)


def _runtime(cfg: ModelConfig, overrides) -> ModelConfig:
    from k3jax.convert.hf_config import RUNTIME_FIELDS

    if not overrides:
        return cfg
    bad = [o for o in overrides if o.split("=", 1)[0].strip() not in RUNTIME_FIELDS - {"param_dtype", "dtype"}]
    if bad:
        raise ValueError(f"only runtime fields can be overridden when loading weights, not {bad}")
    return cfg.with_overrides(list(overrides))


def load_hf(hf_dir: str, dtype=None, config: ModelConfig | str | None = None, overrides=()):
    """(config, model) from an HF directory (K3 or Kimi-Linear format; MXFP4 experts decoded).

    `dtype`: "bf16"/"f32" (or "bfloat16"/"float32"); None takes the config.json `torch_dtype` (bf16 default).
    `config`: a ModelConfig or registry name to check the HF config against (and to take runtime choices from).
    `overrides`: `key=value` runtime choices (kda_impl, moe_impl, kda_chunk_size, scan_layers, remat, ...).
    """
    from k3jax.convert.checkpoint import convert_item, open_hf

    from k3jax.convert.checkpoint import make_plan

    src = open_hf(hf_dir, config=config, dtype=_dtype_name(dtype))
    if overrides:
        src.plan = make_plan(_runtime(src.plan.cfg, overrides))
    plan = src.plan
    full = {path: np.empty(shape, dt) for path, (shape, dt) in plan.params.items()}
    for slots in plan.items.values():
        item = convert_item(src, slots, "bf16")
        for slot in slots:
            if slot.index is None:
                full[slot.path][...] = item[slot.local]
            else:
                full[slot.path][slot.index] = item[slot.local]
    return plan.cfg, _build(plan.cfg, full)


def load_checkpoint(orbax_dir: str, dtype=None, overrides=()):
    """(config, model) from a k3jax Orbax checkpoint (kept MXFP4 experts are decoded to the parameter dtype).
    `overrides`: `key=value` runtime choices, as for `load_hf`."""
    from k3jax.convert.checkpoint import load_params

    cfg, full = load_params(orbax_dir, _dtype_name(dtype), lambda c: _runtime(c, overrides))
    return cfg, _build(cfg, full)


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
