"""The map between released HF tensor names (docs/spec.md#checkpoint, without the `language_model.` prefix) and k3jax
parameters, with the layout change of each tensor. Used by loading, conversion and the tests.

HF linear weights are torch `[out, in]`; ours are `[in..., out...]` (inputs first, heads split out), so a linear
maps as `W.T.reshape(our_shape)`. Scanned layer groups stack a leading repeat axis; this module handles it.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
from flax import nnx

from k3jax.config import ModelConfig

# kind of a tensor's layout change: linear ([out,in] -> [in,out] reshaped), vector (reshape), conv ([P,1,W] ->
# [W,P]), a_log (flatten and keep the first H), experts (stack experts.{e}.<name>.weight, each transposed)
_LAYER_TABLE = {
    # norms and AttnRes
    "input_layernorm.weight": ("input_layernorm.weight", "vector"),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", "vector"),
    "self_attention_res.norm_weight": ("self_attention_res_norm.weight", "vector"),
    "self_attention_res.query": ("self_attention_res_proj.weight", "vector"),
    "mlp_res.norm_weight": ("mlp_res_norm.weight", "vector"),
    "mlp_res.query": ("mlp_res_proj.weight", "vector"),
    # KDA
    "self_attn.q_proj": ("self_attn.q_proj.weight", "linear"),
    "self_attn.k_proj": ("self_attn.k_proj.weight", "linear"),
    "self_attn.v_proj": ("self_attn.v_proj.weight", "linear"),
    "self_attn.q_conv1d": ("self_attn.q_conv1d.weight", "conv"),
    "self_attn.k_conv1d": ("self_attn.k_conv1d.weight", "conv"),
    "self_attn.v_conv1d": ("self_attn.v_conv1d.weight", "conv"),
    "self_attn.f_a_proj": ("self_attn.f_a_proj.weight", "linear"),
    "self_attn.f_b_proj": ("self_attn.f_b_proj.weight", "linear"),
    "self_attn.A_log": ("self_attn.A_log", "a_log"),
    "self_attn.dt_bias": ("self_attn.dt_bias", "vector"),
    "self_attn.b_proj": ("self_attn.b_proj.weight", "linear"),
    "self_attn.g_proj": ("self_attn.g_proj.weight", "linear"),  # KDA full-rank gate and MLA output gate
    "self_attn.g_a_proj": ("self_attn.g_a_proj.weight", "linear"),
    "self_attn.g_b_proj": ("self_attn.g_b_proj.weight", "linear"),
    "self_attn.o_norm": ("self_attn.o_norm.weight", "vector"),
    "self_attn.o_proj": ("self_attn.o_proj.weight", "linear"),
    # MLA
    "self_attn.q_a_proj": ("self_attn.q_a_proj.weight", "linear"),
    "self_attn.q_a_layernorm.weight": ("self_attn.q_a_layernorm.weight", "vector"),
    "self_attn.q_b_proj": ("self_attn.q_b_proj.weight", "linear"),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.kv_a_proj_with_mqa.weight", "linear"),
    "self_attn.kv_a_layernorm.weight": ("self_attn.kv_a_layernorm.weight", "vector"),
    "self_attn.kv_b_proj": ("self_attn.kv_b_proj.weight", "linear"),
}
_DENSE_TABLE = {
    "mlp.gate_proj": ("mlp.gate_proj.weight", "linear"),
    "mlp.up_proj": ("mlp.up_proj.weight", "linear"),
    "mlp.down_proj": ("mlp.down_proj.weight", "linear"),
}
_MOE_TABLE = {
    "mlp.router": ("block_sparse_moe.gate.weight", "linear"),
    "mlp.router_bias": ("block_sparse_moe.gate.e_score_correction_bias", "vector"),
    "mlp.routed_expert_down_proj": ("block_sparse_moe.routed_expert_down_proj.weight", "linear"),
    "mlp.routed_expert_up_proj": ("block_sparse_moe.routed_expert_up_proj.weight", "linear"),
    "mlp.routed_expert_norm": ("block_sparse_moe.routed_expert_norm.weight", "vector"),
    "mlp.w1": ("block_sparse_moe.experts.{e}.w1.weight", "experts"),
    "mlp.w3": ("block_sparse_moe.experts.{e}.w3.weight", "experts"),
    "mlp.w2": ("block_sparse_moe.experts.{e}.w2.weight", "experts"),
    "mlp.shared_experts.gate_proj": ("block_sparse_moe.shared_experts.gate_proj.weight", "linear"),
    "mlp.shared_experts.up_proj": ("block_sparse_moe.shared_experts.up_proj.weight", "linear"),
    "mlp.shared_experts.down_proj": ("block_sparse_moe.shared_experts.down_proj.weight", "linear"),
}
_GLOBAL_TABLE = {
    "embed_tokens": ("model.embed_tokens.weight", "vector"),
    "lm_head": ("lm_head.weight", "linear"),
    "norm.weight": ("model.norm.weight", "vector"),
    "output_attn_res.norm_weight": ("model.output_attn_res_norm.weight", "vector"),
    "output_attn_res.query": ("model.output_attn_res_proj.weight", "vector"),
}


class MissingTensorError(KeyError):
    """A tensor the config needs is absent from the HF weights."""


def _to_ours(arr: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "linear":
        return np.ascontiguousarray(arr.T).reshape(shape)
    if kind == "conv":
        return np.ascontiguousarray(arr.reshape(arr.shape[0], arr.shape[-1]).T).reshape(shape)
    if kind == "a_log":
        return arr.reshape(-1)[: shape[0]]
    return arr.reshape(shape)


def _to_hf(arr: np.ndarray, kind: str, name: str) -> np.ndarray:
    if kind == "linear":
        n_in = 2 if name.endswith("self_attn.o_proj.weight") else 1  # per-head output projections split the input
        in_size = int(np.prod(arr.shape[:n_in]))
        return np.ascontiguousarray(arr.reshape(in_size, -1).T)
    if kind == "conv":
        return np.ascontiguousarray(arr.T)[:, None, :]
    if name.endswith("_res_proj.weight"):
        return arr.reshape(1, -1)
    if name.endswith("dt_bias"):
        return arr.reshape(-1)  # ours [H, K], released [P]
    return arr


def param_entries(model: nnx.Module):
    """Yields (our_path, hf_names, kind, local_shape, stacked) for every parameter and router bias of `model`.

    `hf_names` is a list (one HF tensor per stacked layer; experts tensors are name templates with `{e}`).
    """
    cfg: ModelConfig = model.cfg
    specs = cfg.layer_specs()
    state = nnx.state(model, nnx.Variable)
    for path, var in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        shape = tuple(var.get_value().shape)
        if path[0] != "groups":
            key = ".".join(path)
            hf, kind = _GLOBAL_TABLE[key]
            yield path, [hf], kind, shape, False
            continue
        group = cfg.layer_groups()[int(path[1])]
        if path[2] == "units":  # groups.i.units.layers.j.<local>
            j, local, stacked = int(path[4]), ".".join(path[5:]), True
            layers = [group.start + r * len(group.pattern) + j for r in range(group.num_repeats)]
            shape = shape[1:]
        else:  # groups.i.layers.j.<local>
            j, local, stacked = int(path[3]), ".".join(path[4:]), False
            layers = [group.start + j]
        table = {**_LAYER_TABLE, **(_DENSE_TABLE if specs[layers[0]].ffn == "dense" else _MOE_TABLE)}
        if local not in table:
            raise KeyError(f"no HF name known for parameter {'.'.join(path)} (local name {local!r})")
        hf, kind = table[local]
        yield path, [f"model.layers.{l}.{hf}" for l in layers], kind, shape, stacked


def _fetch(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in weights:
        raise MissingTensorError(f"missing tensor {name!r} in the HF weights")
    return np.asarray(weights[name])


def load_hf_weights(model: nnx.Module, weights: Mapping[str, np.ndarray] | Callable[[str], np.ndarray]) -> None:
    """Copies HF-named weights into `model` in place (cast to each parameter's dtype), checking every shape."""
    get = weights if callable(weights) else (lambda n: _fetch(weights, n))
    cfg: ModelConfig = model.cfg
    state = nnx.state(model, nnx.Variable)
    flat = dict(nnx.to_flat_state(state))
    for path, hf_names, kind, shape, stacked in param_entries(model):
        per_layer = []
        for name in hf_names:
            if kind == "experts":
                mats = [get(name.format(e=e)) for e in range(cfg.num_experts)]
                arr = np.stack([np.ascontiguousarray(m.T) for m in mats])
            else:
                arr = _to_ours(get(name), kind, shape)
            if arr.shape != shape:
                raise ValueError(f"tensor {name!r} has shape {arr.shape} after layout change; expected {shape}")
            per_layer.append(arr)
        value = np.stack(per_layer) if stacked else per_layer[0]
        var = _lookup(flat, path)
        var.set_value(np.asarray(value).astype(var.get_value().dtype))
    nnx.update(model, state)


def export_hf_weights(model: nnx.Module) -> dict[str, np.ndarray]:
    """Our parameters as an HF-named dict of NumPy arrays (torch [out, in] layout), the inverse of load."""
    cfg: ModelConfig = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Variable)))
    out: dict[str, np.ndarray] = {}
    for path, hf_names, kind, shape, stacked in param_entries(model):
        value = np.asarray(_lookup(flat, path).get_value())
        for r, name in enumerate(hf_names):
            arr = value[r] if stacked else value
            if kind == "experts":
                for e in range(cfg.num_experts):
                    out[name.format(e=e)] = np.ascontiguousarray(arr[e].T)
            else:
                out[name] = _to_hf(arr, kind, name)
    return out


def _lookup(flat, path):
    for key, var in flat.items():
        if tuple(str(p) for p in key) == tuple(path):
            return var
    raise KeyError(".".join(path))
