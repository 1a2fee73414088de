"""Vision tensors (`vision_tower.*`, `mm_projector.*`) between a release checkpoint, `k3jax.vision.VisionModel` and
the `vision` item of a k3jax checkpoint, and what a text-only conversion drops and rewrites.

Our parameter paths are the release names except the projector's `proj.0` / `proj.2` (`proj_0` / `proj_2`, NNX
attribute names) and `encoder.` kept under `vision_tower.`. Layout changes: linear weights [out, in] <-> [in, out];
the patch conv [D, 3, p, p] <-> [3*p*p, D] (flattened over channel, row, column). The position grid, norms and
biases are copied. Every expected tensor must be present with its shape, and no unknown vision tensor is accepted.
In a k3jax checkpoint the vision item holds our layout in the source's dtypes, so HF -> Orbax -> HF is bit-exact.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import numpy as np
from flax import nnx

from k3jax.convert.safetensors_io import CheckpointError, TensorInfo, index_directory, read_tensor
from k3jax.vision.config import VisionConfig
from k3jax.vision.tower import VisionModel

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
VISION_ITEM = "vision"  # OUT/params/vision; described by manifest["hf"]["vision"]
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


def _release_shape(shape: tuple[int, ...], kind: str, patch_size: int) -> tuple[int, ...]:
    if kind == "linear":
        return tuple(reversed(shape))
    if kind == "patch":
        return (shape[1], 3, patch_size, patch_size)
    return tuple(shape)


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
                                    f"expected {_release_shape(shape, kind, model.cfg.patch_size)}")
        var = flat[ours]
        var.set_value(arr.astype(var.get_value().dtype))
    nnx.update(model, state)


def vision_item(model: VisionModel) -> dict[str, np.ndarray]:
    """A live model's `vision` checkpoint item: our dotted path -> array in our layout and dtype (what `read_vision`
    gives for a release)."""
    flat = {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return {ours: np.asarray(flat[ours].get_value()) for ours, _, _, _ in vision_entries(model)}


def export_vision_weights(model: VisionModel) -> dict[str, np.ndarray]:
    """Our vision parameters as release-named NumPy arrays (the inverse of `load_vision_weights`)."""
    flat = {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return {release: _to_release(np.asarray(flat[ours].get_value()), kind, model.cfg.patch_size)
            for ours, release, kind, _ in vision_entries(model)}


@dataclasses.dataclass(frozen=True)
class VisionSource:
    """The validated vision tensors of an HF directory: (our path, release name, kind, TensorInfo) per parameter."""

    cfg: VisionConfig
    entries: tuple[tuple[str, str, str, TensorInfo], ...]


def abstract_vision_model(cfg: VisionConfig) -> VisionModel:
    """A VisionModel of shapes only (nothing allocated), for names and shapes."""
    return nnx.eval_shape(lambda: VisionModel(cfg, rngs=nnx.Rngs(0)))


def open_vision(hf_dir: str, hf_config: Mapping[str, Any], text_only: bool,
                tensors: Mapping[str, TensorInfo] | None = None) -> tuple[VisionSource | None, list[str]]:
    """(the vision tensors to convert, the vision tensor names dropped). `text_only` drops every vision tensor.
    Otherwise they must be exactly the `vision_config`'s tower and projector, with the release shapes; any problem
    raises CheckpointError naming the tensor, before anything is written."""
    tensors = index_directory(hf_dir) if tensors is None else tensors
    names = sorted(n for n in tensors if is_vision_tensor(n))
    if not names:
        return None, []
    if text_only:
        return None, names
    try:
        cfg = vision_config_from_hf(hf_config)
    except ValueError as e:
        raise CheckpointError(f"{hf_dir}: config.json: {e}") from None
    if cfg is None:
        raise CheckpointError(f"{hf_dir}: holds {_counts(names)} but config.json has no vision_config; pass "
                              "--text_only to drop them")
    entries, problems, expected = [], [], set()
    for ours, release, kind, shape in vision_entries(abstract_vision_model(cfg)):
        expected.add(release)
        info = tensors.get(release)
        want = _release_shape(shape, kind, cfg.patch_size)
        if info is None:
            problems.append(f"missing {release!r}")
        elif tuple(info.shape) != want:
            problems.append(f"{release!r} has shape {list(info.shape)}, expected {list(want)}")
        else:
            entries.append((ours, release, kind, info))
    problems += [f"unexpected {n!r}" for n in names if n not in expected]
    if problems:
        raise CheckpointError(f"{hf_dir}: vision tensors disagree with vision_config ({len(problems)} problem(s)): "
                              + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else ""))
    return VisionSource(cfg, tuple(entries)), []


def read_vision(src: VisionSource) -> dict[str, np.ndarray]:
    """The vision item: our dotted path -> array in our layout, in the tensor's stored dtype."""
    return {ours: _to_ours(read_tensor(info), kind) for ours, _, kind, info in src.entries}


def vision_item_to_release(arrays: Mapping[str, np.ndarray], cfg: VisionConfig) -> dict[str, np.ndarray]:
    """A vision item back to release names and layouts (dtypes kept): the inverse of `read_vision`."""
    out = {}
    for ours, release, kind, shape in vision_entries(abstract_vision_model(cfg)):
        if ours not in arrays:
            raise CheckpointError(f"vision item lacks {ours!r} (expected by its vision_config)")
        out[release] = _to_release(np.asarray(arrays[ours]), kind, cfg.patch_size)
    return out


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
