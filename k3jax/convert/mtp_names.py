"""HF names of the MTP layer (`k3jax.mtp.MTPLayer`), DeepSeek-V3 style: the layer after the last decoder layer,
`model.layers.{N}` with N = num_hidden_layers, holding

    enorm.weight, hnorm.weight, eh_proj.weight [D, 2D], shared_head.norm.weight      the MTP-specific tensors
    input_layernorm / self_attn.* / mlp or block_sparse_moe.* / post_attention_layernorm   its decoder block, named
                                                                                     like a main-model layer
    embed_tokens.weight, shared_head.head.weight                                     copies of the shared
                                                                                     embedding and head (export only)

DeepSeek-V3 projects cat([enorm(Emb(t_{i+1})), hnorm(h_i)]) (embedding FIRST); `MTPLayer` concatenates [h; emb], so
`eh_proj`'s two input halves swap on the way out and back. The block's tensors use the main model's tables and
layout changes (`hf_names`). Loading ignores the shared copies (the MTP layer uses the target's).

In a k3jax checkpoint the layer is the item `params/mtp` (MTP_ITEM: these HF-named arrays in HF layout, without the
shared copies; described by manifest["hf"]["mtp"]); `--to_hf` writes it back under these names (after the release
prefix of K3-format checkpoints) and conversion from HF keeps it (`hf_mtp_tensors`).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import numpy as np
from flax import nnx

from k3jax.convert import mxfp4
from k3jax.convert.hf_names import _DENSE_TABLE, _LAYER_TABLE, _MOE_TABLE, MissingTensorError, _to_hf, _to_ours
from k3jax.mtp import MTPLayer

MTP_ITEM = "mtp"  # the checkpoint item holding the MTP layer
PACKED, SCALE = "_packed", "_scale"  # suffixes of an MXFP4 expert weight's codes and scales (the release's names)
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # DeepSeek's copies of the shared tensors

_MTP_TABLE = {
    "hidden_norm.weight": ("hnorm.weight", "vector"),
    "embed_norm.weight": ("enorm.weight", "vector"),
    "eh_proj": ("eh_proj.weight", "eh_proj"),
    "norm.weight": ("shared_head.norm.weight", "vector"),
}


def mtp_prefix(cfg) -> str:
    return f"model.layers.{cfg.num_hidden_layers}."


def mtp_entries(mtp: MTPLayer) -> Iterator[tuple[tuple[str, ...], str, str, tuple[int, ...]]]:
    """(our path, HF name (experts: a template with {e}), layout kind, our shape) for every variable of `mtp`."""
    prefix = mtp_prefix(mtp.cfg)
    block = {**_LAYER_TABLE, **(_MOE_TABLE if hasattr(mtp.block.mlp, "router") else _DENSE_TABLE)}
    for path, var in nnx.to_flat_state(nnx.state(mtp, nnx.Variable)):
        path = tuple(str(p) for p in path)
        key = ".".join(path)
        if path[0] == "block":
            table, local = block, ".".join(path[1:])
        else:
            table, local = _MTP_TABLE, key
        if local not in table:
            raise KeyError(f"no HF name known for MTP parameter {key}")
        hf, kind = table[local]
        yield path, prefix + hf, kind, tuple(var.get_value().shape)


def _swap_halves(arr_2dd: np.ndarray) -> np.ndarray:
    """[h; emb] <-> [emb; h] along the input axis of eh_proj (its own inverse)."""
    d = arr_2dd.shape[0] // 2
    return np.concatenate([arr_2dd[d:], arr_2dd[:d]], axis=0)


def export_mtp_hf_weights(mtp: MTPLayer, target=None) -> dict[str, np.ndarray]:
    """The MTP layer as HF-named NumPy arrays (torch [out, in]); with `target` (the K3Model) also the DeepSeek-style
    copies of the shared embedding and head."""
    cfg = mtp.cfg
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(mtp, nnx.Variable))}
    out: dict[str, np.ndarray] = {}
    for path, name, kind, _ in mtp_entries(mtp):
        value = np.asarray(flat[path].get_value())
        if kind == "eh_proj":
            out[name] = np.ascontiguousarray(_swap_halves(value).T)
        elif kind == "experts":
            for e in range(cfg.num_experts):
                out[name.format(e=e)] = np.ascontiguousarray(value[e].T)
        else:
            out[name] = _to_hf(value, kind, name)
    if target is not None:
        prefix = mtp_prefix(cfg)
        out[prefix + "embed_tokens.weight"] = np.asarray(target.embed_tokens.get_value())
        head_dv = target.embed_tokens.get_value().T if cfg.tie_word_embeddings else target.lm_head.get_value()
        out[prefix + "shared_head.head.weight"] = np.ascontiguousarray(np.asarray(head_dv).T)
    return out


def load_mtp_hf_weights(mtp: MTPLayer, weights: Mapping[str, np.ndarray] | Callable[[str], np.ndarray]) -> None:
    """Copies HF-named MTP weights into `mtp` in place (cast to each variable's dtype), checking every shape."""
    cfg = mtp.cfg

    def get(name):
        if callable(weights):
            return np.asarray(weights(name))
        if name not in weights:
            raise MissingTensorError(f"missing tensor {name!r} in the HF weights (MTP layer)")
        return np.asarray(weights[name])

    def get_expert(name):  # dense [out, in], or decoded from the MXFP4 pair an --experts mxfp4 export writes
        try:
            return get(name)
        except MissingTensorError:
            try:
                packed, scale = get(name + PACKED), get(name + SCALE)
            except MissingTensorError:
                raise MissingTensorError(f"missing tensor {name!r} (dense or {name + PACKED!r} + "
                                         f"{name + SCALE!r}) in the HF weights (MTP layer)") from None
            return mxfp4.decode(packed, scale, np.float32)

    state = nnx.state(mtp, nnx.Variable)
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    for path, name, kind, shape in mtp_entries(mtp):
        if kind == "eh_proj":
            arr = _swap_halves(np.ascontiguousarray(get(name).T))
        elif kind == "experts":
            arr = np.stack([np.ascontiguousarray(get_expert(name.format(e=e)).T) for e in range(cfg.num_experts)])
        else:
            arr = _to_ours(get(name), kind, shape)
        if arr.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {arr.shape} after layout change; expected {shape}")
        var = flat[path]
        var.set_value(arr.astype(var.get_value().dtype))
    nnx.update(mtp, state)


def hf_mtp_tensors(tensors: Mapping, cfg, prefix: str = "") -> dict:
    """The MTP layer's entries of an HF tensor index ({name: info}) under `prefix` (the release prefix), keyed by
    their names without it; the shared copies are left out (the MTP layer uses the target's)."""
    start = prefix + mtp_prefix(cfg)
    return {k[len(prefix):]: v for k, v in tensors.items()
            if k.startswith(start) and k[len(start):] not in SHARED_COPIES}


def mtp_expert_names(cfg) -> set[str]:
    """The HF names (one per expert and matrix, torch [out, in]) of the MTP layer's routed expert weights: what an
    `--experts mxfp4` export writes as `name + PACKED` / `name + SCALE` pairs."""
    mtp = nnx.eval_shape(lambda: MTPLayer(cfg, rngs=nnx.Rngs(0)))
    return {name.format(e=e) for _, name, kind, _ in mtp_entries(mtp) if kind == "experts"
            for e in range(cfg.num_experts)}


def mtp_hf_dtypes(cfg) -> dict[str, np.dtype]:
    """{HF name: dtype} of an MTP layer built with `cfg` (its param_dtype, except the tensors a model keeps in f32)."""
    mtp = nnx.eval_shape(lambda: MTPLayer(cfg, rngs=nnx.Rngs(0)))
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(mtp, nnx.Variable))}
    out = {}
    for path, name, kind, _ in mtp_entries(mtp):
        dtype = np.dtype(flat[path].get_value().dtype)
        for e in range(cfg.num_experts) if kind == "experts" else (None,):
            out[name if e is None else name.format(e=e)] = dtype
    return out
