"""Grain input pipeline for interleaved image-text records (`k3jax.data.prepare_multimodal`): static-shape batches
of B rows, each T tokens and P patches.

    ArrayRecord shards -> slice (this process's share) -> shuffle -> repeat -> per document: (input, next-token
    target) pairs + its images' patches in merge-block order with their per-patch arrays (`k3jax.vision.rows`)
    -> FirstFitPackIterDataset (whole documents into rows: a row takes documents while its T tokens and its P
       patches both have room; documents are never cut, so an image's placeholders stay with its patches)
    -> batch -> batch dict

Batch dict (numpy; the text keys as in `k3jax.data.pipeline`):
    input_ids, targets, segment_ids, positions   int32 [B, T]   (pad_id / 0 on padding)
    loss_mask           f32   [B, T]     1 on text targets: 0 on padding AND where the target is an image
                                         placeholder (the loss is on text tokens only)
    pixels              uint8 [B, P, 3*p*p]   0 on padding patches
    patch_segment_ids   int32 [B, P]     0, 1, ... one per image of the row, -1 on padding patches
    patch_rc, patch_pos_index, patch_pos_weight   [B, P, ...]   (`k3jax.vision.rows`; 0 on padding)
Padding: rows end with pad tokens (segment 0, masked) and with padding patches (segment -1: they attend only
to each other, their merged tokens are computed and never placed). P must be a multiple of merge^2; a row's
placeholders are exactly its images' merged tokens, in order.

Documents longer than T + 1 tokens or with more than P patches cannot be packed: `build_multimodal_dataset` checks
the directory's recorded maxima and refuses before reading. Iterator state (Grain's) is JSON, saved per data-parallel
shard by `global_batch.GlobalBatchIterator` like the text pipeline's.
"""

from __future__ import annotations

import functools
import os

import grain
import numpy as np
from jax.sharding import Mesh

from k3jax.data import prepare_multimodal as mm
from k3jax.data.global_batch import GlobalBatchIterator
from k3jax.vision.config import VisionConfig
from k3jax.vision.rows import TAPS, patch_features

PATCH_KEYS = ("pixels", "patch_image", "patch_rc", "patch_pos_index", "patch_pos_weight")
BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask", "pixels", "patch_segment_ids",
              "patch_rc", "patch_pos_index", "patch_pos_weight")


def document_features(record: bytes, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """One record -> its (input, target) pairs [L-1] and per-patch arrays [N, ...] in merge-block order."""
    ids, pixels, grids = mm.decode_record(record)
    if pixels.shape[0] and pixels.shape[2] != cfg.patch_size:
        raise ValueError(f"record patches are {pixels.shape[2]} px, the vision config's patch_size is "
                         f"{cfg.patch_size}")
    feats = patch_features(grids, cfg)
    order = feats.pop("order")
    return {"input_ids": ids[:-1], "targets": ids[1:],
            "pixels": pixels.reshape(pixels.shape[0], -1)[order], **feats}


def image_segments(doc_segment_bp: np.ndarray, image_bp: np.ndarray) -> np.ndarray:
    """int32 [B, P]: 0, 1, ... per (document, image) run of a row, -1 where `doc_segment_bp` is 0 (padding)."""
    key = doc_segment_bp.astype(np.int64) * (1 << 32) + image_bp.astype(np.int64)
    change = np.concatenate([np.zeros_like(key[:, :1]), (key[:, 1:] != key[:, :-1]).astype(np.int64)], axis=1)
    return np.where(doc_segment_bp > 0, np.cumsum(change, axis=1), -1).astype(np.int32)


def to_batch(packed: dict[str, np.ndarray], *, pad_id: int, placeholder_id: int) -> dict[str, np.ndarray]:
    """Grain's packed features -> the batch dict (module docstring)."""
    segment_ids = packed["input_ids_segment_ids"].astype(np.int32)
    valid = segment_ids > 0
    targets = np.where(valid, packed["targets"], pad_id).astype(np.int32)
    patch_valid = packed["pixels_segment_ids"] > 0
    return {
        "input_ids": np.where(valid, packed["input_ids"], pad_id).astype(np.int32),
        "targets": targets,
        "segment_ids": segment_ids,
        "positions": np.where(valid, packed["input_ids_positions"], 0).astype(np.int32),
        "loss_mask": (valid & (targets != placeholder_id)).astype(np.float32),
        "pixels": np.where(patch_valid[..., None], packed["pixels"], 0).astype(np.uint8),
        "patch_segment_ids": image_segments(packed["pixels_segment_ids"], packed["patch_image"]),
        "patch_rc": packed["patch_rc"].astype(np.int32),
        "patch_pos_index": packed["patch_pos_index"].astype(np.int32),
        "patch_pos_weight": packed["patch_pos_weight"].astype(np.float32),
    }


def batch_shapes(cfg: VisionConfig, *, batch_size: int, seq_len: int,
                 max_patches: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every array of a batch `to_batch` makes (what the step is compiled for ahead)."""
    b, taps = batch_size, TAPS[cfg.pos_emb_interpolation_mode] ** 2
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    return {"input_ids": ((b, seq_len), i32), "targets": ((b, seq_len), i32), "segment_ids": ((b, seq_len), i32),
            "positions": ((b, seq_len), i32), "loss_mask": ((b, seq_len), f32),
            "pixels": ((b, max_patches, 3 * cfg.patch_size ** 2), np.dtype(np.uint8)),
            "patch_segment_ids": ((b, max_patches), i32), "patch_rc": ((b, max_patches, 2), i32),
            "patch_pos_index": ((b, max_patches, taps), i32), "patch_pos_weight": ((b, max_patches, taps), f32)}


def check_fits(meta: dict, cfg: VisionConfig, *, seq_len: int, max_patches: int, where: str = "") -> None:
    """ValueError (one line) when the directory's documents cannot be packed into rows of `seq_len` tokens and
    `max_patches` patches, or were prepared for another patch size or merge kernel."""
    kh, kw = cfg.merge_kernel_size
    if max_patches < 1 or max_patches % (kh * kw):
        raise ValueError(f"max_patches={max_patches} must be a positive multiple of the merge kernel {kh}x{kw}")
    if meta["patch_size"] != cfg.patch_size or (meta["merge_size"], meta["merge_size"]) != (kh, kw):
        raise ValueError(f"{where}: prepared for patch_size={meta['patch_size']} merge_size={meta['merge_size']}, "
                         f"the vision config has patch_size={cfg.patch_size} merge_kernel_size={kh}x{kw}")
    if meta["max_document_tokens"] - 1 > seq_len:
        raise ValueError(f"{where}: its longest document has {meta['max_document_tokens']} tokens, more than "
                         f"seq_len + 1 = {seq_len + 1} (documents with images are never cut): raise --seq_len")
    if meta["max_document_patches"] > max_patches:
        raise ValueError(f"{where}: a document has {meta['max_document_patches']} image patches, more than "
                         f"--max_patches={max_patches} per row: raise --max_patches or prepare with a smaller "
                         f"--max_image_patches")


def build_multimodal_dataset(data_dir: str, cfg: VisionConfig, *, batch_size: int, seq_len: int, max_patches: int,
                             seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
                             shard_index: int = 0, shard_count: int = 1, vocab_size: int | None = None,
                             num_packing_bins: int | None = None, read_threads: int = 4) -> grain.IterDataset:
    """The Grain `IterDataset` of batch dicts from a `prepare_multimodal` directory (module docstring).
    `num_packing_bins` (default `batch_size`): rows filled at once by first-fit packing."""
    meta = mm.read_metadata(data_dir)
    check_fits(meta, cfg, seq_len=seq_len, max_patches=max_patches, where=data_dir)
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise ValueError(f"{data_dir}: token ids up to {meta['vocab_size'] - 1} (placeholder "
                         f"{meta['placeholder_id']}), beyond the model's vocab_size={vocab_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    files = [os.path.join(data_dir, s["file"]) for s in meta["shards"] if s["num_documents"] > 0]
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
    if shard_count > len(ds):
        raise ValueError(f"{data_dir} has {len(ds)} documents, fewer than shard_count={shard_count} shards")
    per_shard = len(ds) // shard_count
    ds = ds[shard_index * per_shard:(shard_index + 1) * per_shard]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs).map(functools.partial(document_features, cfg=cfg))
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=16))
    lengths = {"input_ids": seq_len, "targets": seq_len, **{k: max_patches for k in PATCH_KEYS}}
    it_ds = grain.experimental.FirstFitPackIterDataset(it_ds, length_struct=lengths,
                                                       num_packing_bins=num_packing_bins or batch_size,
                                                       shuffle_bins=False)
    it_ds = it_ds.batch(batch_size, batch_fn=functools.partial(grain.experimental.batch_and_pad,
                                                               batch_size=batch_size))
    return it_ds.map(functools.partial(to_batch, pad_id=int(meta["pad_id"]),
                                       placeholder_id=int(meta["placeholder_id"])))


def make_global_multimodal_dataset(data_dir: str, mesh: Mesh, cfg: VisionConfig, *, batch_size: int, seq_len: int,
                                   max_patches: int, seed: int = 0, shuffle: bool = True,
                                   num_epochs: int | None = None, vocab_size: int | None = None,
                                   process_index: int | None = None) -> GlobalBatchIterator:
    """Global multimodal batches on `mesh` (each process reads its data-parallel shards, as
    `global_batch.make_global_dataset`)."""
    def make_shard(index: int, count: int, rows: int) -> grain.DatasetIterator:
        return iter(build_multimodal_dataset(data_dir, cfg, batch_size=rows, seq_len=seq_len,
                                             max_patches=max_patches, seed=seed, shuffle=shuffle,
                                             num_epochs=num_epochs, shard_index=index, shard_count=count,
                                             vocab_size=vocab_size))

    return GlobalBatchIterator(mesh, batch_size, make_shard, process_index=process_index)
