"""`--init_from`: a converted k3jax checkpoint's weights (`python -m k3jax.convert`, `save_checkpoint`,
`train.py --export_to`) as the start of a training run instead of a random init."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.convert.checkpoint import read_manifest
from k3jax.convert.hf_config import check_config
from k3jax.convert.mtp_load import load_mtp_weights
from k3jax.layers.params import RouterBias
from k3jax.loading import load_checkpoint
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer


def init_weights(model: K3Model, ckpt: str, mesh) -> None:
    """Copies a converted checkpoint's parameters and router biases into `model` (placed on `mesh`); the
    architectures must agree (runtime fields such as kda_impl may differ)."""
    ckpt_cfg, loaded = load_checkpoint(ckpt, dtype=model.cfg.runtime.param_dtype, mesh=mesh)
    check_config(ckpt_cfg, model.cfg)
    nnx.update(model, nnx.state(loaded, nnx.Any(nnx.Param, RouterBias)))


def init_mtp(mtp: MTPLayer, ckpt: str) -> bool:
    """Copies a converted checkpoint's MTP layer (`save_checkpoint(..., mtp=)`, `--export_to`) into `mtp`, each
    array kept in its sharding; False (nothing changed) when the checkpoint holds none."""
    if not read_manifest(ckpt)[0].get("hf", {}).get("mtp"):
        return False
    weights = nnx.Any(nnx.Param, RouterBias)  # the training layer also holds routing statistics: not in checkpoints
    loaded = nnx.eval_shape(lambda: MTPLayer(mtp.cfg.replace(record_routing_stats=False), rngs=nnx.Rngs(0)))
    load_mtp_weights(loaded, ckpt)
    shardings = jax.tree.map(lambda x: x.sharding, nnx.state(mtp, weights))
    nnx.update(mtp, jax.device_put(nnx.state(loaded, weights), shardings))
    return True
