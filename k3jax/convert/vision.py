"""Vision tensors (`vision_tower.*`, `mm_projector.*`) between a release checkpoint and `k3jax.vision.VisionModel`,
and what a text-only conversion drops and rewrites.

Our parameter paths are the release names except the projector's `proj.0` / `proj.2` (`proj_0` / `proj_2`, NNX
attribute names) and `encoder.` kept under `vision_tower.`. Layout changes: linear weights [out, in] <-> [in, out];
the patch conv [D, 3, p, p] <-> [3*p*p, D] (flattened over channel, row, column). The position grid, norms and
biases are copied. Every expected tensor must be present with its shape, and no unknown vision tensor is accepted.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import numpy as np
from flax import nnx

from k3jax.convert.safetensors_io import CheckpointError, index_directory
from k3jax.vision.config import VisionConfig
from k3jax.vision.tower import VisionModel

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
# config.json keys that describe the multimodal wrapper; a text-only export drops them.
MULTIMODAL_CONFIG_KEYS = ("vision_config", "media_placeholder_token_id", "image_token_id", "video_token_id",
                          "vision_start_token_id", "vision_end_token_id", "projection_hidden_size",
                          "projection_layer_norm_eps")


class VisionTensorError(ValueError):
    """A vision tensor is missing, unexpected or the wrong shape. The message names it."""


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def vision_config_from_hf(hf: Mapping[str, Any]) -> VisionConfig | None:
    """The `VisionConfig` of a release config.json (None when it has no `vision_config`)."""
    vision = hf.get("vision_config")
    if not vision:
        return None
    text = hf.get("text_config") or hf
    overrides = {}
    if "text_hidden_size" not in vision and "hidden_size" in text:
        overrides["text_hidden_size"] = text["hidden_size"]
    return VisionConfig.from_dict(vision, **overrides)


def _our_to_release(path: str) -> str:
    return path.replace("mm_projector.proj_0.", "mm_projector.proj.0.").replace("mm_projector.proj_2.",
                                                                               "mm_projector.proj.2.")


def _kind(path: str, ndim: int) -> str:
    if path == "vision_tower.patch_embed.proj.weight":
        return "patch"
    return "linear" if ndim == 2 and path.endswith(".weight") else "copy"


def vision_entries(model: VisionModel):
    """Yields (our dotted path, release name, kind, our shape) for every parameter of `model`."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        ours = ".".join(str(p) for p in path)
        shape = tuple(var.get_value().shape)
        yield ours, _our_to_release(ours), _kind(ours, len(shape)), shape


def _to_ours(arr: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return np.ascontiguousarray(arr.T)
    if kind == "patch":
        return np.ascontiguousarray(arr.reshape(arr.shape[0], -1).T)
    return arr


def _to_release(arr: np.ndarray, kind: str, patch_size: int) -> np.ndarray:
    if kind == "linear":
        return np.ascontiguousarray(arr.T)
    if kind == "patch":
        return np.ascontiguousarray(arr.T.reshape(arr.shape[1], 3, patch_size, patch_size))
    return arr


def load_vision_weights(model: VisionModel, weights: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
                        names: list[str] | None = None) -> None:
    """Copies release-named vision tensors into `model` in place (cast to each parameter's dtype).

    `weights`: a mapping, or a getter with `names` listing the vision tensors on offer (to refuse unknown ones)."""
    if callable(weights):
        get, offered = weights, set(names or [])
    else:
        get, offered = (lambda n: np.asarray(weights[n])), {n for n in weights if is_vision_tensor(n)}
    entries = list(vision_entries(model))
    expected = {release for _, release, _, _ in entries}
    missing = sorted(expected - offered)
    if missing:
        raise VisionTensorError(f"missing vision tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = sorted(offered - expected)
    if unexpected:
        raise VisionTensorError(f"unexpected vision tensor {unexpected[0]!r} ({len(unexpected)} not in the "
                                "vision_config's tower)")
    state = nnx.state(model, nnx.Param)
    flat = {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    for ours, release, kind, shape in entries:
        arr = _to_ours(np.asarray(get(release)), kind)
        if arr.shape != shape:
            raise VisionTensorError(f"vision tensor {release!r} has shape {np.asarray(get(release)).shape}; "
                                    f"expected {_to_release(np.zeros(shape), kind, model.cfg.patch_size).shape}")
        var = flat[ours]
        var.set_value(arr.astype(var.get_value().dtype))
    nnx.update(model, state)


def export_vision_weights(model: VisionModel) -> dict[str, np.ndarray]:
    """Our vision parameters as release-named NumPy arrays (the inverse of `load_vision_weights`)."""
    flat = {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return {release: _to_release(np.asarray(flat[ours].get_value()), kind, model.cfg.patch_size)
            for ours, release, kind, _ in vision_entries(model)}


def vision_tensors_to_drop(hf_dir: str, text_only: bool) -> list[str]:
    """The vision tensors of an HF directory, which a conversion of the text model drops. Without `text_only`
    their presence is an error: k3jax does not convert the vision tower yet, and dropping it silently would give a
    checkpoint that looks multimodal and is not."""
    names = sorted(n for n in index_directory(hf_dir) if is_vision_tensor(n))
    if names and not text_only:
        raise CheckpointError(f"{hf_dir}: holds {_counts(names)}; the converter writes the text model only: pass "
                              "--text_only to drop them")
    return names


def _counts(names) -> str:
    counts: dict[str, int] = {}
    for n in names:
        prefix = n.split(".", 1)[0]
        counts[prefix] = counts.get(prefix, 0) + 1
    return ", ".join(f"{counts[p]} {p}.* tensor(s)" for p in sorted(counts))


def drop_report(names) -> str:
    """One line naming what a text-only conversion leaves out: tensor counts per top-level prefix."""
    return f"text-only conversion: dropped {_counts(names)}" if names else "text-only conversion: no vision tensors"


def text_only_hf_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json for the text model alone: the multimodal keys removed (`vision_config`, media token ids,
    projector fields), `...ForConditionalGeneration` renamed `...ForCausalLM`, vision/processor `auto_map` entries
    dropped. The `text_config` nesting (K3 format) is kept, so the text fields read back unchanged."""
    out = copy.deepcopy(dict(hf))
    for key in MULTIMODAL_CONFIG_KEYS:
        out.pop(key, None)
    archs = out.get("architectures")
    if isinstance(archs, list):
        out["architectures"] = [a.replace("ForConditionalGeneration", "ForCausalLM") for a in archs]
    auto_map = out.get("auto_map")
    if isinstance(auto_map, dict):
        out["auto_map"] = {k: v for k, v in auto_map.items()
                           if "Vision" not in k and "Processor" not in k and "ConditionalGeneration" not in v}
    return out
