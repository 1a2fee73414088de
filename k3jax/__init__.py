"""k3jax: Kimi K3 in JAX / Flax NNX. Top-level helpers are imported lazily (importing k3jax stays light)."""

_LAZY = {"load_hf": "k3jax.loading", "load_checkpoint": "k3jax.loading", "save_checkpoint": "k3jax.loading",
         "load_tokenizer": "k3jax.loading", "load_vision_language_model": "k3jax.loading",
         "save_vision_language_model": "k3jax.loading"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
