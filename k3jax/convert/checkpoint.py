"""Streaming HF safetensors -> k3jax Orbax checkpoint conversion and the checkpoint layout (the way back,
`--to_hf`, is `k3jax.convert.to_hf`).

Checkpoint layout (`FORMAT`), written atomically (`OUT.tmp-<pid>-<random>`, renamed when complete):

    OUT/manifest.json      format, items (name -> {key: [dtype, shape]}), hashes (name -> SHA-256 of the item's
                           arrays), expert format, HF export info; written last
    OUT/config.json        ModelConfig.to_dict()
    OUT/hf_config.json     the source HF config.json (when converted from HF), used by --to_hf
    OUT/tokenizer/         tiktoken.model / tokenizer_config.json copied from the HF directory, when present
    OUT/params/<item>/     one Orbax PyTree checkpoint per item: `global.<param>` or `layer_NNNN`

An item holds one decoder layer's parameters in OUR layout (`[in..., out...]`, heads split, experts stacked
`[E, in, out]`) but unstacked over the scan axis, keyed by the parameter's local name (`self_attn.q_proj`), so the
converter only ever holds one layer (the largest tensor group: one layer's routed experts) in host memory. Kept
MXFP4 experts are stored as `<local>.packed` u8 [E, out, in/2] and `<local>.scale` u8 [E, out, in/32] in the HF
orientation; loading decodes them.

Every item's arrays are hashed as written (`item_hash`: SHA-256 of names, dtypes, shapes and bytes) and checked
when the item is restored (`restore_item`), so bytes damaged on disk are an error naming the item rather than
silently wrong weights (Orbax/tensorstore keep no checksums). The cost is one SHA-256 pass over the host arrays,
~1.5 GB/s on one core: some 17 minutes of CPU over K3's 1.5 TB per conversion and per load (next to reading them).
Checkpoints written before the hashes existed load unverified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections import OrderedDict
from typing import Callable

import numpy as np
from flax import nnx

import configs
from k3jax.atomic import AtomicDir  # noqa: F401  (re-exported: conversion's atomic output)
from k3jax.config import ConfigError, ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert.hf_config import check_config, config_from_hf, is_k3_format
from k3jax.convert.hf_names import _to_ours, param_entries
from k3jax.convert.mtp_names import MTP_ITEM, export_mtp_hf_weights, hf_mtp_tensors, mtp_prefix
from k3jax.convert.safetensors_io import (
    DTYPES,
    CheckpointError,
    TensorInfo,
    index_directory,
    read_tensor,
)
from k3jax.convert.vision import (
    VISION_ITEM,
    VISION_PREFIXES,
    drop_report,
    open_vision,
    read_vision,
    text_only_hf_config,
    vision_item,
)
from k3jax.model import K3Model

FORMAT = "k3jax-orbax-v1"
K3_PREFIX = "language_model."
IGNORED_PREFIXES = VISION_PREFIXES  # the vision part: its own item, or dropped with --text_only (convert/vision.py)
_FLOATS = {"BF16", "F16", "F32"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_DTYPE_FLAGS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32"}
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def hf_param_dtype(hf_config: dict) -> str:
    """"float32" or "bfloat16": the parameter dtype an HF config.json declares (bf16 when it says nothing)."""
    text = hf_config.get("text_config", hf_config)
    src = str(text.get("torch_dtype") or text.get("dtype") or hf_config.get("torch_dtype") or "bfloat16")
    return "float32" if src in ("float32", "torch.float32") else "bfloat16"


def dtype_from_flag(flag: str | None) -> str | None:
    if flag is None:
        return None
    if str(flag) not in _DTYPE_FLAGS:
        raise ConfigError(f"dtype must be one of bf16, f32 (got {flag!r})")
    return _DTYPE_FLAGS[str(flag)]


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass
class Slot:
    """One per-layer tensor of our parameter tree and where it comes from in the HF checkpoint."""

    local: str  # key inside the item
    path: tuple[str, ...]  # full parameter path in the model
    index: int | None  # position on the scan axis (None: not stacked)
    kind: str  # hf_names layout kind
    hf_name: str  # release name, without prefix (experts: template with {e})
    shape: tuple[int, ...]  # our per-layer shape
    dtype: np.dtype  # our parameter dtype


@dataclasses.dataclass
class Plan:
    cfg: ModelConfig
    items: "OrderedDict[str, list[Slot]]"  # item name -> slots
    params: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]  # full path -> (full shape, dtype)


def abstract_model(cfg: ModelConfig):
    """A shape-only `K3Model` for `cfg` (`nnx.eval_shape`: nothing is allocated)."""
    return nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))


def make_plan(cfg: ModelConfig) -> Plan:
    """Items and slots for `cfg`, from `hf_names.param_entries` on an abstract (never allocated) model."""
    model = abstract_model(cfg)
    dtypes = {tuple(str(p) for p in path): np.dtype(var.get_value().dtype)
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable))}
    layers: dict[int, list[Slot]] = {}
    globals_: list[tuple[str, list[Slot]]] = []
    params = {}
    for path, hf_names, kind, shape, stacked in param_entries(model):
        dtype = dtypes[tuple(path)]
        params[tuple(path)] = ((len(hf_names),) + tuple(shape) if stacked else tuple(shape), dtype)
        if path[0] != "groups":
            key = ".".join(path)
            globals_.append((f"global.{key}", [Slot(key, tuple(path), None, kind, hf_names[0], shape, dtype)]))
            continue
        local = ".".join(path[5:] if path[2] == "units" else path[4:])
        for r, name in enumerate(hf_names):
            layer = int(_LAYER.match(name).group(1))
            layers.setdefault(layer, []).append(
                Slot(local, tuple(path), r if stacked else None, kind, name, shape, dtype))
    items: OrderedDict[str, list[Slot]] = OrderedDict()
    first = [g for g in globals_ if g[0] == "global.embed_tokens"]
    for name, slots in first:
        items[name] = slots
    for layer in sorted(layers):
        items[f"layer_{layer:04d}"] = layers[layer]
    for name, slots in globals_:
        if name not in items:
            items[name] = slots
    return Plan(cfg, items, params)


def hf_shape(slot: Slot) -> tuple[int, ...]:
    """The release shape of a slot's HF tensor (experts: one expert's [out, in])."""
    s = slot.shape
    if slot.kind == "linear":
        n_in = 2 if slot.hf_name.endswith("self_attn.o_proj.weight") else 1
        return (int(np.prod(s[n_in:])), int(np.prod(s[:n_in])))
    if slot.kind == "conv":
        return (s[1], 1, s[0])
    if slot.kind == "experts":
        return (s[2], s[1])
    if slot.hf_name.endswith("_res_proj.weight"):
        return (1,) + tuple(s)
    if slot.hf_name.endswith("dt_bias"):
        return (int(np.prod(s)),)
    return tuple(s)


def _candidates(name: str) -> list[str]:
    """Spellings of a release name found in other writers' files (transformers' save_pretrained)."""
    out = [name]
    m = re.match(r"^(model\.layers\.\d+\.)mlp\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if m:
        out.append(f"{m.group(1)}block_sparse_moe.{m.group(2)}.weight")
    m = re.match(r"^(model\.layers\.\d+\.self_attn\.)(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$", name)
    if m:
        out.append(f"{m.group(1)}forget_gate.{m.group(2)}")
    return out


@dataclasses.dataclass
class Source:
    """A validated HF directory: every tensor the plan needs, resolved to a file and byte range."""

    hf_dir: str
    hf_config: dict
    cfg: ModelConfig
    plan: Plan
    prefix: str
    experts: str  # "mxfp4" or "dense" (as stored in the HF files)
    a_log_shape: tuple[int, ...] | None
    resolved: dict[str, TensorInfo]  # release name (no prefix; experts expanded, .weight_packed/.weight_scale)
    check_finite: bool = False  # refuse a tensor holding NaN/Inf as it is read (conversion; loading checks on device)

    def read(self, name: str) -> np.ndarray:
        info = self.resolved[name]
        arr = read_tensor(info)
        if self.check_finite:
            problem = nonfinite_problem(arr, mxfp4_scale=info.dtype == "U8" and name.endswith("_scale"))
            if problem:
                raise NonFiniteError(f"tensor {info.name!r} in {info.file} {problem}; refusing non-finite weights "
                                     f"(--allow_nonfinite to convert them anyway)")
        return arr


class NonFiniteError(CheckpointError):
    """A weight tensor holds NaN or Inf (refused unless explicitly allowed)."""


def nonfinite_problem(arr: np.ndarray, *, mxfp4_scale: bool = False) -> str | None:
    """None when `arr` is finite, else what is wrong ("holds 3 NaN/Inf value(s), the first at index (0, 5)").
    Float tensors are checked with `np.isfinite` (one pass, ~1 GB/s on one core: some 25 minutes over K3's 1.5 TB
    release, about what the conversion's own per-tensor casts cost); MXFP4 scales (E8M0) are NaN at 255; integer
    tensors and packed E2M1 nibbles cannot be non-finite."""
    if mxfp4_scale:
        bad = arr == 255
    elif arr.dtype.kind == "f" or arr.dtype in (DTYPES["BF16"], DTYPES["F8_E4M3"], DTYPES["F8_E5M2"]):
        bad = ~np.isfinite(arr)
    else:
        return None
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), arr.shape))
    return f"holds {int(bad.sum())} NaN/Inf value(s), the first at index {first}"


def _expert_names(template: str, e: int, experts: str) -> list[str]:
    name = template.format(e=e)
    if experts == "mxfp4":
        return [name + "_packed", name + "_scale"]
    return [name]


def open_hf(hf_dir: str, *, config: ModelConfig | str | None = None, dtype: str | None = None) -> Source:
    """Reads and validates an HF directory (config.json and every safetensors header; A_log tails are read) and
    returns the plan for converting it. Raises CheckpointError / ConfigError listing every problem found, naming
    tensors and files, before anything is written."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"HF directory {hf_dir} does not exist")
    hf_config = _read_json(cfg_path, "HF config")
    try:
        cfg = config_from_hf(hf_config, name=os.path.basename(os.path.normpath(hf_dir)) or "hf")
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{cfg_path}: malformed HF config ({type(e).__name__}: {e})") from None
    if config is not None:
        if isinstance(config, str):
            config = configs.get_config(config)
        check_config(cfg, config)
        cfg = config
    dtype = dtype_from_flag(dtype)
    if dtype is None and not isinstance(config, ModelConfig):
        dtype = hf_param_dtype(hf_config)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    plan = make_plan(cfg)
    tensors = index_directory(hf_dir)

    prefix = K3_PREFIX if any(k.startswith(K3_PREFIX) for k in tensors) or is_k3_format(hf_config) else ""
    experts_kind = "dense"
    if any(k.endswith(".weight_packed") and ".experts." in k for k in tensors):
        experts_kind = "mxfp4"
    missing, bad, used = [], [], set()
    resolved: dict[str, TensorInfo] = {}

    def resolve(name: str) -> TensorInfo | None:
        for cand in _candidates(name):
            info = tensors.get(prefix + cand)
            if info is not None:
                used.add(prefix + cand)
                resolved[name] = info
                return info
        missing.append(prefix + name)
        return None

    def where(info: TensorInfo) -> str:
        return f"{info.name!r} in {os.path.basename(info.file)}"

    a_log_infos = []
    for item, slots in plan.items.items():
        for slot in slots:
            want = hf_shape(slot)
            if slot.kind == "experts":
                out_f, in_f = want
                for e in range(cfg.num_experts):
                    infos = [resolve(n) for n in _expert_names(slot.hf_name, e, experts_kind)]
                    if None in infos:
                        continue
                    if experts_kind == "mxfp4":
                        p, s = infos
                        if p.dtype != "U8" or s.dtype != "U8":
                            bad.append(f"{where(p)}: MXFP4 tensors must be U8, got {p.dtype} / {s.dtype}")
                        problem = mxfp4.check_shapes(p.shape, s.shape, out_f, in_f)
                        if problem:
                            bad.append(f"{where(p)} {list(p.shape)} / scale {list(s.shape)}: {problem} "
                                       f"(config: {_dims(cfg)})")
                    else:
                        _check(infos[0], want, bad, cfg)
                continue
            info = resolve(slot.hf_name)
            if info is None:
                continue
            if slot.kind == "a_log":
                n = int(np.prod(info.shape))
                if info.dtype not in _FLOATS or sum(d != 1 for d in info.shape) > 1 or n < want[0]:
                    bad.append(f"{where(info)} has {info.dtype}{list(info.shape)}; expected a float vector of at "
                               f"least kda_num_heads={cfg.kda_num_heads} entries")
                else:
                    a_log_infos.append(info)
                continue
            _check(info, want, bad, cfg)
    known = IGNORED_PREFIXES + (prefix + mtp_prefix(cfg),)  # the MTP layer: its own item (hf_to_orbax)
    unexpected = sorted(k for k in tensors if k not in used and not k.startswith(known))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) for this config: "
                        f"{_few([where(tensors[k]) for k in unexpected])}")
    if bad:
        problems.append(f"{len(bad)} tensor(s) with a wrong shape or dtype: {_few(bad)}")
    if problems:
        raise CheckpointError(f"{hf_dir}: " + "; ".join(problems))
    a_log_shape = None
    for info in a_log_infos:  # small: read them all now, so a disagreeing tail fails before writing
        arr = read_tensor(info).reshape(-1)
        if np.any(arr[cfg.kda_num_heads:] != 0):
            raise CheckpointError(f"{where(info)}: non-zero entries beyond kda_num_heads={cfg.kda_num_heads} (the "
                                  f"stored tail must be zero); config.json and the tensors disagree on the KDA heads")
        a_log_shape = a_log_shape or tuple(info.shape)
    return Source(hf_dir, hf_config, cfg, plan, prefix, experts_kind, a_log_shape, resolved)


def _dims(cfg: ModelConfig) -> str:
    return (f"hidden_size={cfg.hidden_size}, moe_intermediate_size={cfg.moe_intermediate_size}, "
            f"expert width={cfg.expert_input_size}")


def _check(info: TensorInfo, want, bad: list, cfg: ModelConfig) -> None:
    if info.dtype not in _FLOATS:
        bad.append(f"{info.name!r} in {os.path.basename(info.file)} has dtype {info.dtype}; expected BF16/F16/F32")
    if tuple(info.shape) != tuple(want):
        bad.append(f"{info.name!r} in {os.path.basename(info.file)} has shape {list(info.shape)}; config.json "
                   f"implies {list(want)}")


def _few(items: list, n: int = 8) -> str:
    return ", ".join(str(i) for i in items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


# ------------------------------------------------------------------------------------------------ HF -> ours


def convert_item(src: Source, slots: list[Slot], experts: str = "bf16") -> dict[str, np.ndarray]:
    """One item's arrays in our layout, read one tensor at a time. `experts="mxfp4"` keeps MXFP4 experts packed
    (only when the source stores them packed)."""
    out: dict[str, np.ndarray] = {}
    for slot in slots:
        if slot.kind != "experts":
            out[slot.local] = _to_ours(src.read(slot.hf_name), slot.kind, slot.shape).astype(slot.dtype, copy=False)
            continue
        e_count, in_f, out_f = slot.shape
        if experts == "mxfp4" and src.experts == "mxfp4":
            packed = np.empty((e_count, out_f, in_f // 2), np.uint8)
            scale = np.empty((e_count, out_f, in_f // mxfp4.GROUP), np.uint8)
            for e in range(e_count):
                p, s = _expert_names(slot.hf_name, e, "mxfp4")
                packed[e], scale[e] = src.read(p), src.read(s)
            out[slot.local + ".packed"], out[slot.local + ".scale"] = packed, scale
            continue
        stacked = np.empty(slot.shape, slot.dtype)
        for e in range(e_count):
            if src.experts == "mxfp4":
                p, s = _expert_names(slot.hf_name, e, "mxfp4")
                mat = mxfp4.decode(src.read(p), src.read(s), slot.dtype)  # exact in bf16 and f32
            else:
                mat = src.read(slot.hf_name.format(e=e))
            stacked[e] = mat.T  # casts to the parameter dtype
        out[slot.local] = stacked
    return out


def item_hash(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 (hex) of an item: each array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        arr = np.ascontiguousarray(arrays[key])
        h.update(json.dumps([key, str(arr.dtype), list(arr.shape)]).encode())
        h.update(arr.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _item_meta(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: [str(v.dtype), list(v.shape)] for k, v in arrays.items()}


# ------------------------------------------------------------------------------------------------ atomic output


def _save_item(path: str, arrays: dict[str, np.ndarray]) -> None:
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save(os.path.abspath(path), dict(arrays))


def _save_mtp(tmp: str, arrays: dict[str, np.ndarray]) -> dict | None:
    """The MTP layer's HF-named arrays as the `mtp` item; its manifest entry (None, nothing written, without)."""
    if not arrays:
        return None
    _save_item(os.path.join(tmp, "params", MTP_ITEM), arrays)
    return {"arrays": _item_meta(arrays), "hash": item_hash(arrays)}


def restore_item(path: str, expected_hash: str | None = None) -> dict[str, np.ndarray]:
    """One checkpoint item (`OUT/params/<item>`) as host arrays, keyed by local parameter name; checked against
    `expected_hash` (the manifest's, `item_hash`) when given."""
    import orbax.checkpoint as ocp

    try:  # Orbax takes absolute paths only; a relative one (`--init_from=ckpt`) names the same directory
        item = dict(ocp.PyTreeCheckpointer().restore(os.path.abspath(path)))
    except Exception as e:  # noqa: BLE001 - tensorstore / Orbax raise many types for a damaged item
        raise CheckpointError(f"{path}: unreadable checkpoint item ({type(e).__name__}: {str(e)[:300]})") from None
    if expected_hash is not None and item_hash(item) != expected_hash:
        raise CheckpointError(f"{path}: its arrays differ from the hash recorded in manifest.json (damaged on disk?)")
    return item


def hf_to_orbax(hf_dir: str, out: str, *, config: ModelConfig | str | None = None, dtype: str | None = None,
                experts: str = "bf16", overwrite: bool = False, log: Callable[[str], None] | None = None,
                allow_nonfinite: bool = False, text_only: bool = False) -> str:
    """Converts an HF directory to a k3jax Orbax checkpoint at `out` (streaming: one layer in memory). A tensor
    holding NaN/Inf raises NonFiniteError naming it (nothing is left behind) unless `allow_nonfinite`. Vision
    tensors go to the `vision` item in their stored dtypes (described by manifest["hf"]["vision"]), or with
    `text_only` are dropped (logged) and a text-only hf_config.json is kept."""
    if experts not in ("bf16", "mxfp4"):
        raise ConfigError(f"experts must be bf16 or mxfp4, got {experts!r}")
    atomic = AtomicDir(out, overwrite, log)
    atomic.check()
    src = open_hf(hf_dir, config=config, dtype=dtype)  # every check happens before anything is written
    vision_src, dropped = open_vision(hf_dir, src.hf_config, text_only)
    if text_only and log:
        log(drop_report(dropped))
    hf_config = text_only_hf_config(src.hf_config) if text_only else src.hf_config
    src.check_finite = not allow_nonfinite
    kept = "mxfp4" if experts == "mxfp4" and src.experts == "mxfp4" else "dense"
    with atomic as tmp:
        os.makedirs(os.path.join(tmp, "params"))
        items, hashes = OrderedDict(), {}
        for i, (name, slots) in enumerate(src.plan.items.items()):
            arrays = convert_item(src, slots, experts)
            _save_item(os.path.join(tmp, "params", name), arrays)
            items[name] = _item_meta(arrays)
            hashes[name] = item_hash(arrays)
            del arrays
            if log:
                log(f"[{i + 1}/{len(src.plan.items)}] {name}")
        vision = None
        if vision_src is not None:
            arrays = read_vision(vision_src)
            for key, arr in arrays.items():
                problem = nonfinite_problem(arr) if src.check_finite else None
                if problem:
                    raise NonFiniteError(f"vision tensor {key!r} {problem}; refusing non-finite weights "
                                         f"(--allow_nonfinite to convert them anyway)")
            _save_item(os.path.join(tmp, "params", VISION_ITEM), arrays)
            vision = {"config": vision_src.cfg.to_dict(), "arrays": _item_meta(arrays), "hash": item_hash(arrays)}
            if log:
                log(f"{VISION_ITEM}: {len(arrays)} tensors")
        mtp = _save_mtp(tmp, {k: read_tensor(v) for k, v in hf_mtp_tensors(index_directory(hf_dir), src.plan.cfg,
                                                                             src.prefix).items()})
        with open(os.path.join(tmp, "hf_config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        _copy_tokenizer(hf_dir, os.path.join(tmp, "tokenizer"))
        _write_meta(tmp, src.plan.cfg, items, hashes, kept, {
            "prefix": src.prefix, "a_log_shape": list(src.a_log_shape) if src.a_log_shape else None,
            "source_experts": src.experts, "dropped_vision_tensors": len(dropped), "vision": vision, "mtp": mtp})
    return atomic.out


def _copy_tokenizer(src_dir: str, dst: str) -> None:
    present = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(src_dir, f))]
    if present:
        os.makedirs(dst, exist_ok=True)
        for f in present:
            shutil.copyfile(os.path.join(src_dir, f), os.path.join(dst, f))


def _write_meta(tmp: str, cfg: ModelConfig, items, hashes, experts: str, hf: dict) -> None:
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    manifest = {"format": FORMAT, "complete": True, "experts": experts, "hf": hf, "items": items,
                "hashes": hashes}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:  # last: its presence marks a complete checkpoint
        json.dump(manifest, f, indent=1)


def save_checkpoint(model, out: str, *, overwrite: bool = False, vision=None,
                    placeholder_id: int | None = None, mtp=None) -> str:
    """Writes a live K3Model as a k3jax Orbax checkpoint (same layout as `hf_to_orbax`, one item at a time).
    `vision` (a `VisionModel`): also its `vision` item, described by manifest["hf"]["vision"], with the image
    placeholder id as manifest["hf"]["media_placeholder_token_id"]. `mtp` (a `k3jax.mtp.MTPLayer`): also its
    `mtp` item (`mtp_names.MTP_ITEM`), described by manifest["hf"]["mtp"]."""
    cfg = model.cfg
    plan = make_plan(cfg)
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable))}
    with AtomicDir(out, overwrite) as tmp:
        os.makedirs(os.path.join(tmp, "params"))
        items, hashes = OrderedDict(), {}
        for name, slots in plan.items.items():
            arrays = {}
            for slot in slots:
                value = np.asarray(flat[slot.path].get_value())
                arrays[slot.local] = value if slot.index is None else value[slot.index]
            _save_item(os.path.join(tmp, "params", name), arrays)
            items[name] = _item_meta(arrays)
            hashes[name] = item_hash(arrays)
        hf = {"prefix": K3_PREFIX if cfg.uses_attn_res else "", "a_log_shape": None, "source_experts": "dense"}
        if vision is not None:
            arrays = vision_item(vision)
            _save_item(os.path.join(tmp, "params", VISION_ITEM), arrays)
            hf.update(vision={"config": vision.cfg.to_dict(), "arrays": _item_meta(arrays),
                              "hash": item_hash(arrays)}, media_placeholder_token_id=placeholder_id)
        hf["mtp"] = _save_mtp(tmp, export_mtp_hf_weights(mtp) if mtp is not None else {})
        _write_meta(tmp, cfg, items, hashes, "dense", hf)
    return os.path.abspath(out)


# ------------------------------------------------------------------------------------------------ reading ours


def read_manifest(ckpt: str) -> tuple[dict, ModelConfig]:
    """(manifest, config) of a k3jax checkpoint; CheckpointError naming the file when either is missing or
    malformed."""
    path = os.path.join(ckpt, "manifest.json")
    if not os.path.exists(path):
        if not os.path.isdir(ckpt):
            raise CheckpointError(f"k3jax checkpoint {ckpt} does not exist")
        raise CheckpointError(f"{ckpt} is not a complete k3jax checkpoint (no manifest.json){_training_hint(ckpt)}")
    manifest = _read_json(path, "checkpoint manifest")
    if manifest.get("format") != FORMAT or not manifest.get("complete"):
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r} (expected {FORMAT})")
    if not isinstance(manifest.get("items"), dict) or not all(isinstance(v, dict) for v in manifest["items"].values()):
        raise CheckpointError(f"{path}: malformed manifest ('items' must map item names to their arrays)")
    cfg_path = os.path.join(ckpt, "config.json")
    raw = _read_json(cfg_path, "checkpoint config")
    try:
        cfg = ModelConfig.from_dict({k: tuple(v) if k == "full_attn_layers" else v for k, v in raw.items()})
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{cfg_path}: not a k3jax model config ({type(e).__name__}: {e})") from None
    return manifest, cfg


def _training_hint(path: str) -> str:
    """For a train.py --workdir or one of its checkpoints/<step> directories: how to export its model."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        workdir, step = path, ""
    elif os.path.isdir(os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta")):
        workdir, step = os.path.dirname(os.path.dirname(path)), f" --export_step={os.path.basename(path)}"
    else:
        return ""
    return (f"; it is a training run's checkpoint: export its model with `python train.py --config=NAME "
            f"--workdir={workdir}{step} --export_to=OUT`")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {what} (not JSON: {e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: unreadable {what} (a JSON {type(value).__name__}, not an object)")
    return value




def _decode_stack(packed: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """[E, out, in/2] + [E, out, in/32] -> our [E, in, out] in `dtype`."""
    e_count, out_f, half = packed.shape
    res = np.empty((e_count, 2 * half, out_f), dtype)
    for e in range(e_count):
        res[e] = mxfp4.decode(packed[e], scale[e], dtype).T
    return res
