"""Multimodal training: the vision tower + projector beside the text model (`train.py --vision_config NAME`).

The trainer's `Trainable` holds `vision` (a `k3jax.vision.VisionModel`) next to `model`; a step encodes every row's
images (`k3jax.vision.rows.encode_rows`: static shapes, B rows x P patches), puts the image tokens at the rows'
placeholder positions before layer 0 (`merge_rows`) and runs the text model from those embeddings. The loss is the
text loss on `loss_mask`, which the multimodal pipeline zeroes where the target is an image placeholder (text
tokens only). `cfg.runtime.vision_trainable=False` (`--set vision_trainable=false`) freezes the tower: its
parameters are left out of the differentiated state and of the optimizer (no gradients, no optimizer state, the
weights never change). The tower's parameters shard by their own logical axes (`vision_*` in sharding/rules.py).
Data: a `k3jax.data.prepare_multimodal` directory, read by `k3jax.data.multimodal_pipeline`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import configs
from k3jax.config import ConfigError, ModelConfig
from k3jax.convert.checkpoint import read_manifest
from k3jax.convert.vision_load import load_vision_checkpoint
from k3jax.data import prepare_multimodal
from k3jax.data.multimodal_pipeline import check_fits, make_global_multimodal_dataset
from k3jax.vision.config import VisionConfig
from k3jax.vision.rows import encode_rows, merge_rows
from k3jax.vision.tower import VisionModel

VISION_ATTR = "vision"  # the Trainable attribute holding the VisionModel (its parameters' paths contain it)


def named_vision_config(name: str) -> VisionConfig:
    """The VisionConfig registered as `name` in configs/vision.py."""
    return VisionConfig(**configs.get_vision_config(name))


def vision_setup(cfg: ModelConfig, vision_config: str | None, data: str | None
                 ) -> tuple[VisionConfig, int] | tuple[None, None]:
    """(the named vision config, the data's placeholder id), or (None, None) for text-only training. ConfigError
    (one line) when the tower does not fit the text model or the data is not multimodal."""
    if vision_config is None:
        return None, None
    vcfg = named_vision_config(vision_config)
    if vcfg.text_hidden_size != cfg.hidden_size:
        raise ConfigError(f"vision config {vision_config!r} projects into {vcfg.text_hidden_size} wide text, config "
                          f"{cfg.name!r} has hidden_size={cfg.hidden_size}")
    if data is None:
        raise ConfigError("--vision_config needs --data: a directory from `python -m k3jax.data.prepare_multimodal`")
    try:
        meta = prepare_multimodal.read_metadata(data)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    placeholder = int(meta["placeholder_id"])
    if not 0 <= placeholder < cfg.vocab_size:
        raise ConfigError(f"{data}: placeholder id {placeholder} is outside config {cfg.name!r}'s vocabulary "
                          f"[0, {cfg.vocab_size})")
    return vcfg, placeholder


def make_vision_model(cfg: ModelConfig, vcfg: VisionConfig, rngs: nnx.Rngs) -> VisionModel:
    """The trainable tower + projector, in the text model's compute and parameter dtypes."""
    run = cfg.runtime
    return VisionModel(vcfg, dtype=run.jnp_dtype, param_dtype=run.jnp_param_dtype, rngs=rngs)


def trainable_params(cfg: ModelConfig):
    """The nnx filter of what the optimizer trains: every Param, less the vision tower's when it is frozen."""
    if cfg.runtime.vision_trainable:
        return nnx.Param
    return nnx.All(nnx.Param, nnx.Not(nnx.PathContains(VISION_ATTR)))


def hidden_states(trainable, batch: dict) -> jax.Array:
    """The text model's final hidden states [B, T, D] with each row's image tokens at its placeholders."""
    model = trainable.model
    tokens_bmd = encode_rows(trainable.vision, batch["pixels"], batch["patch_segment_ids"], batch["patch_rc"],
                             batch["patch_pos_index"], batch["patch_pos_weight"])
    embeds_btd = merge_rows(model.embed(batch["input_ids"]), batch["input_ids"], tokens_bmd, trainable.placeholder_id)
    return model.hidden_states_from_embeddings(embeds_btd, batch.get("segment_ids"))


def check_data(cfg: ModelConfig, vcfg: VisionConfig, data: str, *, seq_len: int, max_patches: int) -> dict:
    """The data directory's metadata, checked against the run (ConfigError naming the problem)."""
    meta = prepare_multimodal.read_metadata(data)
    try:
        check_fits(meta, vcfg, seq_len=seq_len, max_patches=max_patches, where=data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if int(meta["vocab_size"]) > cfg.vocab_size:
        raise ConfigError(f"data in {data} holds ids up to {meta['vocab_size'] - 1}, beyond config {cfg.name!r}'s "
                          f"vocab_size={cfg.vocab_size}")
    return meta


def open_data(cfg: ModelConfig, vcfg: VisionConfig, data: str, mesh, *, batch_size: int, seq_len: int,
              max_patches: int, seed: int, log_fn):
    """Global multimodal batches on `mesh` (each process reads its data-parallel shards)."""
    meta = check_data(cfg, vcfg, data, seq_len=seq_len, max_patches=max_patches)
    log_fn(f"data: {data} ({meta['num_documents']} documents, {meta['num_images']} images, {meta['num_tokens']} "
           f"tokens), seq_len {seq_len}, {max_patches} patches per row")
    return make_global_multimodal_dataset(data, mesh, vcfg, batch_size=batch_size, seq_len=seq_len,
                                          max_patches=max_patches, seed=seed, vocab_size=cfg.vocab_size)


def init_vision(vision: VisionModel, ckpt: str) -> bool:
    """Copies a converted checkpoint's vision tower + projector into `vision` (each array kept in the sharding
    `vision`'s holds); False when the checkpoint has none. ConfigError when its vision config differs."""
    saved = read_manifest(ckpt)[0].get("hf", {}).get("vision")
    if not saved:
        return False
    if VisionConfig.from_dict(saved["config"]) != vision.cfg:
        raise ConfigError(f"{ckpt}: its vision config differs from the run's --vision_config")
    loaded = load_vision_checkpoint(ckpt, dtype=vision.vision_tower.dtype, param_dtype=jnp.float32)
    current = nnx.state(vision, nnx.Param)
    new = jax.tree.map(lambda old, value: jax.device_put(value.astype(old.dtype), old.sharding), current,
                       nnx.state(loaded, nnx.Param))
    nnx.update(vision, new)
    return True
