"""Checkpoint conversion between the released HF layout and k3jax parameters."""
