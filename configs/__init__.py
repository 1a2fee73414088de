"""The registry of named model configs. `get_config(name)` is the one way to obtain a config by name."""

from __future__ import annotations

from configs import k3, kimi_linear, small, vision
from k3jax.config import ConfigError, ModelConfig

_REGISTRY = {
    "k3": k3.config,
    "kimi_linear": kimi_linear.config,
    "tiny": small.tiny,
    "tiny_kimi_linear": small.tiny_kimi_linear,
    "k3_gpu": small.k3_gpu,
}


# Default mesh plans ({axis: largest size}; sharding/plan.py). Configs not listed put every device on 'data'.
_MESH_PLANS = {
    "k3": k3.MESH_PLAN,
    "kimi_linear": kimi_linear.MESH_PLAN,
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """Returns the named config with optional `key=value` overrides applied (each validated)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown config {name!r}; known configs: {', '.join(names())}")
    cfg = _REGISTRY[name]()
    return cfg.with_overrides(list(overrides)) if overrides else cfg


def mesh_plan(name: str) -> dict[str, int]:
    """The named config's default parallelism plan: {'model' | 'expert' | 'context': largest size}; {} (all on
    'data') for configs without one (the tiny and single-GPU configs)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown config {name!r}; known configs: {', '.join(names())}")
    return dict(_MESH_PLANS.get(name, {}))


_VISION_REGISTRY = {"k3": vision.k3, "tiny": vision.tiny}


def vision_names() -> list[str]:
    return sorted(_VISION_REGISTRY)


def get_vision_config(name: str) -> dict:
    """The named vision tower + projector config's fields (`configs/vision.py`; a `k3jax.vision.VisionConfig` from
    `k3jax.training.multimodal.named_vision_config`)."""
    if name not in _VISION_REGISTRY:
        raise ConfigError(f"unknown vision config {name!r}; known vision configs: {', '.join(vision_names())}")
    return _VISION_REGISTRY[name]()
