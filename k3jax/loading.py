"""Python API for loading models: from an HF directory or a k3jax Orbax checkpoint.

    config, model = k3jax.load_hf("/path/to/Kimi-K3")            # or a Kimi-Linear directory
    config, model = k3jax.load_checkpoint("/path/to/orbax_out")   # written by `python -m k3jax.convert`
    config, model = k3jax.load_hf("/path/to/Kimi-K3", expert_weights="mxfp4")   # serving: experts kept at 4 bits
    logits = model(input_ids)                                     # int32[B, T] -> [B, T, V]
    tokenizer = k3jax.load_tokenizer("/path/to/Kimi-K3", config)
    config, vlm = k3jax.load_vision_language_model("/path/to/orbax_out")   # + the vision tower (multimodal)
    logits = vlm(input_ids, pixels, grids)                        # placeholders filled with the images' tokens

The model is built without random initialisation (`nnx.eval_shape`) and filled one checkpoint item (one layer)
at a time, each tensor placed straight into its device sharding (`mesh=`), so host memory never holds the model.

`expert_weights="mxfp4"` (or the override `expert_weights=mxfp4`) builds the inference-only model whose routed
experts stay packed (uint8 E2M1 nibbles + E8M0 scales, 4.25 bits per weight): MXFP4 experts of an HF release or of a
checkpoint converted with `--experts mxfp4` are copied byte for byte (never decoded); bf16/f32 experts are quantized
(round to nearest, `k3jax.ops.gmm.quantize_mxfp4`) on the host CPU one layer at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import ConfigError, ModelConfig, RuntimeConfig
from k3jax.convert.checkpoint import (
    NonFiniteError,
    abstract_model,
    convert_item,
    make_plan,
    open_hf,
    read_manifest,
    restore_item,
)
from k3jax.convert.checkpoint import save_checkpoint as _save_converted
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.convert.values import checkpoint_values, hf_values
from k3jax.convert.vision_load import load_vision_checkpoint
from k3jax.data.tokenizer import load_tokenizer as _load_tokenizer
from k3jax.ops.gmm import MXFP4Experts
from k3jax.vision import MEDIA_PLACEHOLDER_ID, K3VisionLanguageModel
from sharding.rules import LOGICAL_AXIS_RULES
from sharding.shard import plan_shardings

EXPERT_WEIGHTS = ("bf16", "mxfp4")
# Knobs a load may override: every runtime knob but the dtypes (the `dtype` argument sets both).
_OVERRIDABLE = frozenset(f.name for f in dataclasses.fields(RuntimeConfig)) - {"param_dtype", "dtype"}
_QUANTIZE_CHUNK_BYTES = 256 << 20  # f32 bytes of dense experts quantized per host call


def _assemble(plan, values, mesh=None, cfg: ModelConfig | None = None, rules=None, allow_nonfinite: bool = False,
              source: str = "", prefix: str = ""):
    """A model for `cfg` (default `plan.cfg`) filled from `(slot, value)` pairs (one layer's tensors on the host at
    a time; a slot's `path` names the model variable, so packed experts arrive as `wN_packed` / `wN_scale`).

    Each value goes straight to its parameter's sharding: with `mesh`, the one `sharding.shard.plan_shardings`
    gives it (`jax.make_array_from_callback`: every device receives only its slice; a scan-stacked parameter is
    allocated sharded and filled one layer row at a time by a donated in-place update), without a mesh the
    default device. Missing or unknown parameters are errors naming them.

    Unless `allow_nonfinite`, every placed value is checked for NaN/Inf on its devices (a reduction per value,
    dispatched as it is placed and read back once at the end: no host pass over the weights) and NonFiniteError
    names the first offending tensor (HF name with `prefix`, expert index, parameter path; `source`: the checkpoint).
    """
    graphdef, state = nnx.split(abstract_model(plan.cfg if cfg is None else cfg))
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    if mesh is not None:
        shard_plan = plan_shardings(state, mesh) if rules is None else plan_shardings(state, mesh, rules=rules)
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

    filled: dict[tuple[str, ...], object] = {}
    rows_left: dict[tuple[str, ...], int] = {}
    finite: list[tuple[object, object]] = []  # (slot, device flags) to read back at the end
    for slot, value in values:
        key = tuple(slot.path)
        if key not in flat:
            raise KeyError(f"value for unknown parameter {'.'.join(key)}")
        sharding = shardings[key]
        value = np.asarray(value, dtype=flat[key].get_value().dtype)
        want = flat[key].get_value().shape[0 if slot.index is None else 1:]
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"value for {'.'.join(key)} has shape {list(value.shape)}; the model expects "
                             f"{list(want)}")
        placed = place(value, sharding if slot.index is None else row_sharding(sharding))
        if not allow_nonfinite:
            finite.append((slot, _finite_flags(placed, slot.kind == "experts", slot.path[-1].endswith("_scale"))))
        if slot.index is None:
            filled[key] = placed
            continue
        if key not in filled:
            shape, dtype = flat[key].get_value().shape, flat[key].get_value().dtype
            filled[key] = _zeros_maker(tuple(shape), np.dtype(dtype), sharding)()
            rows_left[key] = shape[0]
        filled[key] = _row_setter(sharding)(filled[key], slot.index, placed)
        rows_left[key] -= 1
    missing = sorted(".".join(k) for k in flat if k not in filled)
    incomplete = sorted(".".join(k) for k, n in rows_left.items() if n)
    if missing or incomplete:
        raise KeyError(f"no value for parameter(s) {(missing + incomplete)[:5]}")
    _check_finite(finite, source, prefix)
    for key, var in flat.items():
        var.set_value(filled[key])
    return nnx.merge(graphdef, state)


def _finite_flags(x, per_expert: bool, mxfp4_scale: bool):
    """Device-side int32 [3]: (number of experts, or 1, holding NaN/Inf; the first of them; 0), reduced to a
    replicated result; None for integer tensors other than MXFP4 scales (E8M0 255 is NaN)."""
    if mxfp4_scale and x.dtype == jnp.uint8:
        return _all_finite(x.ndim, per_expert, True)(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    return _all_finite(x.ndim, per_expert, False)(x)


@functools.lru_cache(maxsize=None)
def _all_finite(ndim: int, per_expert: bool, mxfp4_scale: bool):
    axes = tuple(range(1 if per_expert else 0, ndim))

    def flags(x):
        ok = jnp.all(x != 255 if mxfp4_scale else jnp.isfinite(x), axis=axes).reshape(-1)
        return jnp.stack([jnp.sum(~ok, dtype=jnp.int32), jnp.argmin(ok).astype(jnp.int32), jnp.int32(0)])

    return jax.jit(flags)


def _check_finite(finite, source: str, prefix: str) -> None:
    """Raises NonFiniteError naming the first tensor whose flags (from `_finite_flags`) are not all True."""
    for slot, flags in finite:
        if flags is None:
            continue
        n_bad, first, _ = (int(v) for v in np.asarray(flags.addressable_data(0)))
        if not n_bad:
            continue
        hf_name = prefix + slot.hf_name
        if slot.kind == "experts":
            hf_name = prefix + slot.hf_name.format(e=first) + (f" (and {n_bad - 1} more experts)" if n_bad > 1 else "")
        row = "" if slot.index is None else f" row {slot.index}"
        raise NonFiniteError(f"{source + ': ' if source else ''}tensor {hf_name} (parameter "
                             f"{'.'.join(slot.path)}{row}) holds NaN/Inf values; refusing non-finite weights "
                             f"(allow_nonfinite=True / --allow_nonfinite to load them anyway)")


@functools.lru_cache(maxsize=None)
def _row_setter(sharding):
    """Jitted in-place `stack[i] = row` (donated) with the output in `sharding`; kept across loads, so loading the
    same model again in one process reuses the compiled programs."""
    return jax.jit(lambda s, i, r: jax.lax.dynamic_update_index_in_dim(s, r, i, 0), out_shardings=sharding,
                   donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _zeros_maker(shape: tuple, dtype: np.dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _expert_weights_choice(overrides, expert_weights, config=None):
    """(overrides without `expert_weights=...`, the requested expert format or None): the argument wins over an
    override, which wins over a given ModelConfig's own field. Raises ConfigError for an unknown format."""
    rest, chosen = [], None
    for o in overrides:
        key, _, value = str(o).partition("=")
        if key.strip().removeprefix("runtime.") == "expert_weights":
            chosen = value.strip()
        else:
            rest.append(o)
    chosen = expert_weights if expert_weights is not None else chosen
    if chosen is None and isinstance(config, ModelConfig) and config.runtime.expert_weights != "bf16":
        chosen = config.runtime.expert_weights
    if chosen is not None and chosen not in EXPERT_WEIGHTS:
        raise ConfigError(f"expert_weights must be one of {', '.join(EXPERT_WEIGHTS)}, got {chosen!r}")
    return rest, chosen


def _runtime(cfg: ModelConfig, overrides) -> ModelConfig:
    if not overrides:
        return cfg
    bad = [o for o in overrides if o.split("=", 1)[0].strip().removeprefix("runtime.") not in _OVERRIDABLE]
    if bad:
        raise ValueError(f"only runtime fields can be overridden when loading weights, not {bad}")
    return cfg.with_overrides(list(overrides))


def load_hf(hf_dir: str, dtype=None, config: ModelConfig | str | None = None, overrides=(), mesh=None,
            expert_weights: str | None = None, rules=None, allow_nonfinite: bool = False):
    """(config, model) from an HF directory (K3 or Kimi-Linear format).

    `dtype`: "bf16"/"f32" (or "bfloat16"/"float32"); None takes the config.json `torch_dtype` (bf16 default).
    `config`: a ModelConfig or registry name to check the HF config against (and to take runtime choices from).
    `overrides`: `key=value` runtime choices (kda_impl, moe_impl, kda_chunk_size, scan_layers, remat, ...).
    `mesh`: place every parameter directly in its sharding on this mesh (`sharding.mesh.make_mesh`); tensors are
    read and converted one layer at a time, so host memory holds at most one layer besides the devices' shards.
    `rules`: the logical-axis table for `mesh` (default: training's; `sharding.rules.SERVING_AXIS_RULES` to serve).
    `expert_weights`: "bf16" (default: MXFP4 experts decoded exactly to the parameter dtype) or "mxfp4" (kept
    packed; inference only, see the module docstring).
    `allow_nonfinite`: accept weights holding NaN/Inf (default: NonFiniteError naming the tensor).
    """
    overrides, chosen = _expert_weights_choice(overrides, expert_weights, config)
    if isinstance(config, ModelConfig):
        config = config.replace(expert_weights="bf16")  # the plan (HF names) is for the parameter layout
    src = open_hf(hf_dir, config=config, dtype=_dtype_name(dtype))
    if overrides:
        src.plan = make_plan(_runtime(src.plan.cfg, overrides))
    check = dict(rules=rules, allow_nonfinite=allow_nonfinite, source=hf_dir, prefix=src.prefix)
    if chosen != "mxfp4":
        return src.plan.cfg, _assemble(src.plan, hf_values(src), mesh, **check)
    cfg = src.plan.cfg.replace(expert_weights="mxfp4")
    return cfg, _assemble(src.plan, _hf_packed_values(src), mesh, cfg, **check)


def load_checkpoint(orbax_dir: str, dtype=None, overrides=(), mesh=None, expert_weights: str | None = None,
                    rules=None, allow_nonfinite: bool = False):
    """(config, model) from a k3jax Orbax checkpoint. `expert_weights`: "bf16" (default: experts kept MXFP4 by
    `--experts mxfp4` are decoded to the parameter dtype) or "mxfp4" (kept packed, byte for byte; bf16 experts are
    quantized). `overrides`, `mesh`, `rules`, `allow_nonfinite`: as for `load_hf`."""
    overrides, chosen = _expert_weights_choice(overrides, expert_weights)
    plan, values = checkpoint_values(orbax_dir, _dtype_name(dtype), lambda c: _runtime(c, overrides))
    check = dict(rules=rules, allow_nonfinite=allow_nonfinite, source=orbax_dir)
    if chosen != "mxfp4":
        return plan.cfg, _assemble(plan, values, mesh, **check)
    values.close()  # not started: nothing was read
    cfg = plan.cfg.replace(expert_weights="mxfp4")
    return cfg, _assemble(plan, _checkpoint_packed_values(orbax_dir, plan), mesh, cfg, **check)


def _hf_packed_values(src):
    """`(slot, value)` of an opened HF directory with the routed experts as MXFP4 bytes, one layer at a time."""
    for slots in src.plan.items.values():
        item = convert_item(src, slots, "mxfp4")  # MXFP4 sources: experts come back packed, unread by any decoder
        for slot in slots:
            yield from _packed_slot_values(slot, item)
        del item


def _checkpoint_packed_values(ckpt: str, plan):
    """`(slot, value)` of a k3jax checkpoint with the routed experts as MXFP4 bytes, one item at a time."""
    hashes = read_manifest(ckpt)[0].get("hashes", {})
    for name, slots in plan.items.items():
        item = restore_item(os.path.join(ckpt, "params", name), hashes.get(name))
        for slot in slots:
            yield from _packed_slot_values(slot, item)
        del item


def _packed_slot_values(slot, item: dict):
    """One slot's values from an item: experts as `wN_packed` u8 [E, out, in/2] and `wN_scale` u8 [E, out, in/32]
    (stored packed: as is; stored dense [E, in, out]: quantized), every other tensor unchanged."""
    if slot.kind != "experts":
        yield slot, item.pop(slot.local)
        return
    if slot.local + ".packed" in item:
        packed, scales = item.pop(slot.local + ".packed"), item.pop(slot.local + ".scale")
    else:
        packed, scales = quantize_experts_on_host(item.pop(slot.local))
    for suffix, value in (("_packed", packed), ("_scale", scales)):
        yield dataclasses.replace(slot, local=slot.local + suffix, path=slot.path[:-1] + (slot.path[-1] + suffix,),
                                  shape=tuple(value.shape), dtype=np.dtype(np.uint8)), value


def quantize_experts_on_host(w_ein: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense experts [E, in, out] -> MXFP4 (packed u8 [E, out, in/2], scales u8 [E, out, in/32]), computed on the
    host CPU a few experts at a time (never on the accelerator, never the whole f32 stack at once)."""
    e_count, in_f, out_f = w_ein.shape
    packed = np.empty((e_count, out_f, in_f // 2), np.uint8)
    scales = np.empty((e_count, out_f, in_f // 32), np.uint8)
    chunk = max(1, _QUANTIZE_CHUNK_BYTES // (4 * in_f * out_f))
    quantize = _host_quantizer()
    with jax.default_device(jax.devices("cpu")[0]):
        for start in range(0, e_count, chunk):
            p, s = quantize(np.asarray(w_ein[start:start + chunk]))
            packed[start:start + chunk], scales[start:start + chunk] = np.asarray(p), np.asarray(s)
    return packed, scales


@functools.lru_cache(maxsize=None)
def _host_quantizer():
    return jax.jit(lambda w: tuple(MXFP4Experts.quantize(w)))


def save_checkpoint(model, out: str, overwrite: bool = False, mtp=None) -> str:
    """Writes `model` as a k3jax Orbax checkpoint (convertible to HF with `python -m k3jax.convert --to_hf`);
    `mtp` (a `k3jax.mtp.MTPLayer`, e.g. the one train.py trains): also its `mtp` item (`--to_hf` writes it under
    DeepSeek-style names; `serve.py --speculative=mtp` drafts with it)."""
    if model.cfg.runtime.expert_weights != "bf16":
        raise ConfigError(f"save_checkpoint writes parameter (bf16/f32) experts; this model holds them as "
                          f"{model.cfg.runtime.expert_weights!r} (inference-only). Keep MXFP4 experts in a "
                          f"checkpoint by converting the HF release with `python -m k3jax.convert --experts mxfp4`")

    return _save_converted(model, out, overwrite=overwrite, mtp=mtp)


def load_vision_language_model(path: str, dtype=None, overrides=(), mesh=None, expert_weights: str | None = None,
                               rules=None, allow_nonfinite: bool = False, placeholder_id: int | None = None
                               ) -> tuple[ModelConfig, K3VisionLanguageModel]:
    """(config, K3VisionLanguageModel) from a converted k3jax Orbax checkpoint that holds the vision tower and
    projector (`python -m k3jax.convert` of a multimodal release without --text_only, or
    `save_vision_language_model`). The text model loads as `load_checkpoint` (same arguments); the tower and
    projector compute in the text model's dtype with parameters in its parameter dtype, placed by `rules` on
    `mesh` when given. `placeholder_id`: the image placeholder token, default the checkpoint's
    `media_placeholder_token_id` (hf_config.json or the manifest), else the release's 163605. A checkpoint
    without a vision tower raises CheckpointError."""
    manifest, _ = read_manifest(path)
    if not manifest.get("hf", {}).get("vision"):
        raise CheckpointError(f"{path} holds no vision tower (a text-only conversion or model); load it with "
                              f"load_checkpoint")
    cfg, text = load_checkpoint(path, dtype, overrides, mesh, expert_weights, rules, allow_nonfinite)
    vision = load_vision_checkpoint(path, dtype=cfg.runtime.jnp_dtype, param_dtype=cfg.runtime.jnp_param_dtype)
    # the vision weights arrive as host arrays: place them (on `mesh` in their shardings, else the default device)
    shardings = (plan_shardings(nnx.state(vision), mesh, rules=rules or LOGICAL_AXIS_RULES).shardings
                 if mesh is not None else None)
    nnx.update(vision, jax.device_put(nnx.state(vision), shardings))
    placeholder = checkpoint_placeholder_id(path, manifest) if placeholder_id is None else int(placeholder_id)
    if not 0 <= placeholder < cfg.vocab_size:
        raise ConfigError(f"image placeholder id {placeholder} is outside the vocabulary [0, {cfg.vocab_size})")
    return cfg, K3VisionLanguageModel(text, vision, placeholder_id=placeholder)


def checkpoint_placeholder_id(path: str, manifest: dict | None = None) -> int:
    """The image placeholder token of a checkpoint: `media_placeholder_token_id` of its hf_config.json (top level
    or text_config), else of its manifest, else the release's 163605."""
    hf_path = os.path.join(path, "hf_config.json")
    if os.path.exists(hf_path):
        with open(hf_path) as f:
            hf = json.load(f)
        for where in (hf, hf.get("text_config") or {}):
            if isinstance(where.get("media_placeholder_token_id"), int):
                return where["media_placeholder_token_id"]
    manifest = read_manifest(path)[0] if manifest is None else manifest
    saved = manifest.get("hf", {}).get("media_placeholder_token_id")
    return MEDIA_PLACEHOLDER_ID if saved is None else int(saved)


def save_vision_language_model(model: K3VisionLanguageModel, out: str, overwrite: bool = False) -> str:
    """Writes a K3VisionLanguageModel as a k3jax Orbax checkpoint: the text model as `save_checkpoint`, plus the
    `vision` item and the placeholder id (`load_vision_language_model` reads it back)."""
    if model.language_model.cfg.runtime.expert_weights != "bf16":
        raise ConfigError("save_vision_language_model writes parameter (bf16/f32) experts, not packed MXFP4 ones")
    return _save_converted(model.language_model, out, overwrite=overwrite, vision=model.vision,
                           placeholder_id=model.placeholder_id)


def load_tokenizer(path: str, config: ModelConfig):
    """The tokenizer of an HF directory or k3jax checkpoint (see `k3jax.data.tokenizer.load_tokenizer`)."""
    if os.path.isdir(os.path.join(path, "tokenizer")):
        path = os.path.join(path, "tokenizer")
    return _load_tokenizer(path, config)


def _dtype_name(dtype):
    if dtype is None:
        return None
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return {"bfloat16": "bf16", "float32": "f32"}.get(name, name)
