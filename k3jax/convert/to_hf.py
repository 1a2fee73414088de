"""k3jax Orbax checkpoint -> HF safetensors (`python -m k3jax.convert --to_hf`): release names and dtypes, MXFP4
experts packed or dense, the vision part written back bit-exactly, the MTP layer (a checkpoint's `mtp` item) under
DeepSeek-style `model.layers.{num_hidden_layers}.*` names (`k3jax.convert.mtp_names`; its experts in the format
of the model's, without DeepSeek's copies of the embedding and head), one item in memory at a time, atomic output.
The HF -> Orbax direction and the checkpoint layout are in `k3jax.convert.checkpoint`."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

from k3jax.atomic import AtomicDir
from k3jax.config import ConfigError
from k3jax.convert import mxfp4
from k3jax.convert.checkpoint import (
    _copy_tokenizer,
    _decode_stack,
    dtype_from_flag,
    hf_param_dtype,
    hf_shape,
    make_plan,
    read_manifest,
    restore_item,
)
from k3jax.convert.hf_config import config_to_hf
from k3jax.convert.hf_names import _to_hf
from k3jax.convert.mtp_names import MTP_ITEM, PACKED, SCALE, mtp_expert_names, mtp_hf_dtypes
from k3jax.convert.safetensors_io import DTYPES, plan_shards, write_shard
from k3jax.convert.vision import VISION_ITEM, text_only_hf_config, vision_item_to_release
from k3jax.ops import mx_quant
from k3jax.vision.config import VisionConfig

_pack_mxfp4 = jax.jit(mx_quant.pack_mxfp4)

MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "group_size": mxfp4.GROUP, "scale_format": "e8m0",
                             "modules": ["experts"]}


def orbax_to_hf(ckpt: str, out: str, *, overwrite: bool = False, max_shard_bytes: int = 4 << 30,
                log: Callable[[str], None] | None = None, dtype: str | None = "auto",
                experts: str | None = None) -> str:
    """Writes a k3jax checkpoint as sharded HF safetensors + index + config.json (one item in memory at a time).
    Release names (with `language_model.` for K3-format sources), A_log re-padded to its source shape. Tensors are
    written in the dtypes a model with param_dtype `dtype` holds: "bf16" (K3's release: bf16 but for the tensors
    the model always keeps in f32), "f32", None (the checkpoint's own) or "auto" (default: the dtype of the HF source
    the checkpoint was converted from, else bf16, so f32 training masters are written as the release's bf16).
    `experts`: None (as stored: MXFP4 experts the checkpoint kept packed re-written bit-exactly, others dense),
    "bf16" (dense; kept-packed experts decoded exactly) or "mxfp4" (packed; dense experts quantized from the
    checkpoint's own values, before any dtype cast, by `k3jax.ops.mx_quant.pack_mxfp4`: the codes an
    `expert_qat=mxfp4` forward of those weights uses)."""
    if experts not in (None, "bf16", "mxfp4"):
        raise ConfigError(f"experts must be bf16 or mxfp4, got {experts!r}")
    source_config = os.path.join(ckpt, "hf_config.json")
    if dtype == "auto" and os.path.exists(source_config):
        with open(source_config) as f:
            dtype = hf_param_dtype(json.load(f))
    out_dtype = dtype_from_flag("bf16" if dtype == "auto" else dtype)
    manifest, cfg = read_manifest(ckpt)
    plan = make_plan(cfg)
    out_dtypes = {(name, slot.local): slot.dtype for name, slots in
                  make_plan(cfg.replace(param_dtype=out_dtype)).items.items() for slot in slots} if out_dtype else {}
    hf = manifest.get("hf", {})
    prefix = hf.get("prefix", "")
    a_log_shape = tuple(hf["a_log_shape"]) if hf.get("a_log_shape") else None
    entries = []  # (hf name, dtype, shape, item, producer)
    for name, slots in plan.items.items():
        meta = manifest["items"][name]
        for slot in slots:
            stored_packed = slot.kind == "experts" and slot.local + ".packed" in meta
            if stored_packed and experts != "bf16":
                for part, suffix in (("packed", "_packed"), ("scale", "_scale")):
                    dt, shape = meta[f"{slot.local}.{part}"]
                    for e in range(shape[0]):
                        entries.append((slot.hf_name.format(e=e) + suffix, np.dtype(dt), tuple(shape[1:]), name,
                                        (f"{slot.local}.{part}", e, "raw")))
                continue
            if stored_packed:
                e_count, out_f, half = meta[f"{slot.local}.packed"][1]
                dt, shape = str(slot.dtype), (e_count, 2 * half, out_f)
            else:
                dt, shape = meta[slot.local]
            dt = out_dtypes.get((name, slot.local), dt)
            dt = np.dtype(DTYPES["BF16"]) if dt == "bfloat16" else np.dtype(dt)
            if slot.kind == "experts" and experts == "mxfp4":
                e_count, in_f, out_f = shape
                if in_f % mxfp4.GROUP:
                    raise ConfigError(f"--experts mxfp4 needs expert input widths divisible by {mxfp4.GROUP}; "
                                      f"{name}/{slot.local} is {list(shape)} ([E, in, out])")
                for e in range(e_count):
                    for part, shp in (("packed", (out_f, in_f // 2)), ("scale", (out_f, in_f // mxfp4.GROUP))):
                        entries.append((slot.hf_name.format(e=e) + "_" + part, np.dtype(np.uint8), shp, name,
                                        (slot.local, e, part)))
                continue
            if slot.kind == "experts":
                for e in range(shape[0]):
                    entries.append((slot.hf_name.format(e=e), dt, (shape[2], shape[1]), name,
                                    (slot.local, e, "expert")))
            elif slot.kind == "a_log":
                entries.append((slot.hf_name, dt, a_log_shape or tuple(shape), name, (slot.local, None, "a_log")))
            else:
                entries.append((slot.hf_name, dt, hf_shape(slot), name, (slot.local, None, slot.kind)))

    packed_out = experts == "mxfp4" or (experts is None and manifest.get("experts") == "mxfp4")
    mtp = hf.get("mtp")
    if mtp:  # the MTP layer's HF-named arrays, in the dtypes a model of the output dtype holds
        mtp_dtypes = mtp_hf_dtypes(cfg.replace(param_dtype=out_dtype)) if out_dtype else {}
        mtp_experts = mtp_expert_names(cfg) if packed_out else set()
        for name, (dt, shape) in mtp["arrays"].items():
            if name in mtp_experts:  # MXFP4 like the model's experts
                out_f, in_f = shape
                if in_f % mxfp4.GROUP:
                    raise ConfigError(f"MXFP4 experts need input widths divisible by {mxfp4.GROUP}; the MTP "
                                      f"layer's {name} is {list(shape)} ([out, in])")
                for part, shp in ((PACKED, (out_f, in_f // 2)), (SCALE, (out_f, in_f // mxfp4.GROUP))):
                    entries.append((name + part, np.dtype(np.uint8), shp, MTP_ITEM, (name, None, "mtp" + part)))
                continue
            if experts == "bf16" and name.endswith(SCALE) and name[:-len(SCALE)] + PACKED in mtp["arrays"]:
                continue
            if experts == "bf16" and name.endswith(PACKED):  # a packed MTP expert from the HF source, written dense
                base = name[:-len(PACKED)]
                out_f, half = shape
                dt = np.dtype(DTYPES["BF16"]) if (out_dtype or "bfloat16") == "bfloat16" else np.dtype(out_dtype)
                entries.append((base, dt, (out_f, 2 * half), MTP_ITEM, (base, None, "mtp_decode")))
                continue
            dt = str(mtp_dtypes.get(name, dt))
            dt = np.dtype(DTYPES["BF16"]) if dt == "bfloat16" else np.dtype(dt)
            entries.append((name, dt, tuple(shape), MTP_ITEM, (name, None, "mtp")))
    hashes = dict(manifest.get("hashes", {}), **({MTP_ITEM: mtp["hash"]} if mtp else {}))

    vision = hf.get("vision")
    vision_arrays = {} if not vision else vision_item_to_release(
        restore_item(os.path.join(ckpt, "params", VISION_ITEM), vision.get("hash")),
        VisionConfig.from_dict(vision["config"]))  # written in the dtypes they were converted from
    shards = plan_shards([(prefix + e[0], e[1], e[2]) for e in entries]
                         + [(k, v.dtype, v.shape) for k, v in vision_arrays.items()], max_shard_bytes)
    by_name = {prefix + e[0]: e for e in entries}
    cache: dict[str, Any] = {"name": None, "item": None}

    def produce(full_name: str) -> np.ndarray:
        if full_name in vision_arrays:
            return vision_arrays[full_name]
        hf_name, dt, shape, item_name, (key, e, how) = by_name[full_name]
        if cache["name"] != item_name:
            cache["item"], cache["name"] = None, None
            cache["item"] = restore_item(os.path.join(ckpt, "params", item_name), hashes.get(item_name))
            cache["name"] = item_name
        item = cache["item"]
        if how in ("packed", "scale", "mtp" + PACKED, "mtp" + SCALE):
            # MXFP4 of the stored values, before any cast (the QAT forward's codes); an MTP expert is stored dense in
            # HF layout [out, in], the model's experts stacked in ours [E, in, out]
            if cache.get("packed_of") != (item_name, key, e):
                w_nk = item[key] if how.startswith("mtp") else item[key][e].T
                cache["packed"] = [np.asarray(a) for a in _pack_mxfp4(np.ascontiguousarray(w_nk))]
                cache["packed_of"] = (item_name, key, e)
            return cache["packed"][1 if how.endswith("scale") else 0]
        if how == "mtp_decode":
            return mxfp4.decode(item[key + PACKED], item[key + SCALE], np.float32).astype(dt)
        if key not in item:  # a kept-packed expert stack written dense (experts="bf16")
            item[key] = _decode_stack(item[key + ".packed"], item[key + ".scale"], np.float32)
        arr = item[key]
        if how == "raw":
            return arr[e]
        arr = arr.astype(dt) if arr.dtype != dt else arr
        if how == "mtp":  # stored in HF layout
            return arr
        if how == "expert":
            return np.ascontiguousarray(arr[e].T)
        if how == "a_log":
            padded = np.zeros(int(np.prod(shape)), arr.dtype)
            padded[:arr.size] = arr.reshape(-1)
            return padded.reshape(shape)
        return _to_hf(arr, how, hf_name).reshape(shape)

    atomic = AtomicDir(out, overwrite, log)
    with atomic as tmp:
        n = len(shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            write_shard(os.path.join(tmp, file), shard, (produce(name) for name, _, _ in shard))
            for name, dt, shape in shard:
                weight_map[name] = file
                total += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if log:
                log(f"wrote {file}")
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        hf_config = None
        if os.path.exists(os.path.join(ckpt, "hf_config.json")):
            with open(os.path.join(ckpt, "hf_config.json")) as f:
                hf_config = json.load(f)
            if "vision_config" in hf_config and not vision:  # the checkpoint holds no vision tower: declare none
                hf_config = text_only_hf_config(hf_config)
                if log:
                    log("config.json: text-only (vision_config dropped; the checkpoint holds the text model only)")
        if hf_config is None:
            torch_dtype = "float32" if (out_dtype or cfg.runtime.param_dtype) == "float32" else "bfloat16"
            hf_config = config_to_hf(cfg, k3_format=bool(prefix) or None, torch_dtype=torch_dtype,
                                     quantization_config=MXFP4_QUANTIZATION_CONFIG if packed_out else None)
        elif not packed_out:
            hf_config.pop("quantization_config", None)
            hf_config.get("text_config", {}).pop("quantization_config", None)
        elif "quantization_config" not in hf_config and "quantization_config" not in hf_config.get("text_config", {}):
            hf_config["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
        # the written file's MTP layers (DeepSeek's field): 1 with the checkpoint's MTP layer, else none
        text_config = hf_config.get("text_config", hf_config)
        text_config["num_nextn_predict_layers"] = 1 if mtp else 0
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        _copy_tokenizer(os.path.join(ckpt, "tokenizer"), tmp)
    return atomic.out
