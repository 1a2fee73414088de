"""Images packed per text row with static shapes: the vision tower for training batches.

`VisionModel(pixels, layout)` takes one packed sequence whose grids are static Python values (one compile per
set of grids). A training batch instead holds, for each of its B rows, a fixed budget of P patches (P a multiple
of the merge kernel kh*kw), and everything that depends on an image's size arrives as per-patch arrays, so one
compiled step serves every mix of image sizes:

    pixels             uint8 [B, P, 3*p*p]  the processor's resized, padded pixels (normalised on device)
    patch_segment_ids  int32 [B, P]         attention segment of each patch (one per image in a row), -1 = padding
    patch_rc           int32 [B, P, 2]      (row, column) of the patch in its image (2-D rotary)
    patch_pos_index    int32 [B, P, K]      flat rows of the learned [H*W, D] position grid that the patch's
    patch_pos_weight   f32   [B, P, K]      resampled position is made of, and their weights (K = 4 bilinear,
                                            16 bicubic: the nonzero taps of `packing.interpolation_matrix`)

Each image's patches are stored in merge-block order (the kh*kw patches of one merged token adjacent, blocks
row-major), so `sd2_tpool` of a still image is a reshape [B, P, D] -> [B, P/(kh*kw), kh*kw, D]: merged token m of
a row is block m, images in row order, padding blocks last. `patch_features` computes these arrays for one
document on the host; `encode_rows` runs tower + projector; `merge_rows` puts the k-th image token of a row at
the row's k-th placeholder. Still images only (t = 1): video frames are not packed here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.numerics import upcast, wide
from k3jax.vision.config import VisionConfig
from k3jax.vision.packing import interpolation_matrix
from k3jax.vision.preprocess import IMAGE_MEAN, IMAGE_STD
from k3jax.vision.tower import VisionModel

__all__ = ["block_order", "encode_rows", "merge_rows", "normalize_pixels", "patch_features", "pos_taps"]

TAPS = {"bilinear": 2, "bicubic": 4}  # nonzero taps per axis of one resampled position


def block_order(h: int, w: int, kernel: tuple[int, int]) -> np.ndarray:
    """int64 [h*w]: raster patch indices in merge-block order (blocks row-major, the kh x kw patches of a block
    row-major), the order `tower.sd2_tpool` groups them in."""
    kh, kw = kernel
    return np.arange(h * w).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3).reshape(-1)


def _axis_taps(out_size: int, in_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 [out, T], weights float64 [out, T]): the T largest-magnitude entries of each row of the
    resampling matrix, which hold all of its nonzeros (T = TAPS[mode])."""
    m = interpolation_matrix(out_size, in_size, mode)
    taps = min(TAPS[mode], in_size)
    idx = np.argsort(-np.abs(m), axis=1, kind="stable")[:, :taps]
    weight = np.take_along_axis(m, idx, axis=1)
    if taps < TAPS[mode]:  # a grid axis shorter than the tap count: pad with zero-weight taps
        pad = TAPS[mode] - taps
        idx = np.pad(idx, ((0, 0), (0, pad)))
        weight = np.pad(weight, ((0, 0), (0, pad)))
    return idx, weight


def pos_taps(h: int, w: int, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(flat grid rows int32 [h*w, K], weights float32 [h*w, K]) of the position embedding resampled to h x w,
    raster order: position(r, c) = sum_k weight[k] * grid.reshape(H*W, D)[index[k]]."""
    big_h, big_w, mode = cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.pos_emb_interpolation_mode
    ir, wr = _axis_taps(h, big_h, mode)
    ic, wc = _axis_taps(w, big_w, mode)
    index = ir[:, None, :, None] * big_w + ic[None, :, None, :]  # [h, w, Tr, Tc]
    weight = wr[:, None, :, None] * wc[None, :, None, :]
    k = index.shape[2] * index.shape[3]
    return index.reshape(h * w, k).astype(np.int32), weight.reshape(h * w, k).astype(np.float32)


def patch_features(grids_hw, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """Per-patch arrays of one document's still images (`grids_hw`: (h, w) patches each, in document order):
    `order` int64 [N] (the raster patches, concatenated per image, to take in merge-block order), `patch_image`
    int32 [N] (image index in the document), `patch_rc` int32 [N, 2], `patch_pos_index` / `patch_pos_weight`
    [N, K]. N = sum h*w, every array already in merge-block order."""
    kernel = cfg.merge_kernel_size
    k = TAPS[cfg.pos_emb_interpolation_mode] ** 2
    order, image, rc, index, weight = [], [], [], [], []
    start = 0
    for i, (h, w) in enumerate(grids_hw):
        h, w = int(h), int(w)
        if h % kernel[0] or w % kernel[1]:
            raise ValueError(f"image {i}: grid {h}x{w} patches is not a multiple of the merge kernel "
                             f"{kernel[0]}x{kernel[1]}")
        perm = block_order(h, w, kernel)
        idx, wt = pos_taps(h, w, cfg)
        order.append(start + perm)
        image.append(np.full(h * w, i, np.int32))
        rc.append(np.stack([perm // w, perm % w], axis=1).astype(np.int32))
        index.append(idx[perm])
        weight.append(wt[perm])
        start += h * w
    if not order:
        return {"order": np.zeros((0,), np.int64), "patch_image": np.zeros((0,), np.int32),
                "patch_rc": np.zeros((0, 2), np.int32), "patch_pos_index": np.zeros((0, k), np.int32),
                "patch_pos_weight": np.zeros((0, k), np.float32)}
    return {"order": np.concatenate(order), "patch_image": np.concatenate(image), "patch_rc": np.concatenate(rc),
            "patch_pos_index": np.concatenate(index), "patch_pos_weight": np.concatenate(weight)}


def normalize_pixels(pixels_u8: jax.Array, dtype) -> jax.Array:
    """uint8 pixels -> (x - 127.5) / 127.5 in f32 (the processor's `normalize`, exactly), cast to `dtype`."""
    mean = np.float32(IMAGE_MEAN[0] * 255.0)
    std = np.float32(IMAGE_STD[0] * 255.0)
    if len(set(IMAGE_MEAN)) != 1 or len(set(IMAGE_STD)) != 1:
        raise ValueError("per-channel normalisation constants are not supported here")
    return ((pixels_u8.astype(jnp.float32) - mean) / std).astype(dtype)


def _rope_cos_sin(rc_bp2: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, P, head_dim/2] of `packing.rope_angles` (even pairs by column, odd pairs by row), in `dtype`."""
    quarter = head_dim // 4
    inv_freq = jnp.asarray(theta ** (-4.0 * np.arange(quarter, dtype=np.float64) / head_dim), jnp.float32)
    rows = rc_bp2[..., 0].astype(jnp.float32)[..., None] * inv_freq
    cols = rc_bp2[..., 1].astype(jnp.float32)[..., None] * inv_freq
    ang = jnp.stack([cols, rows], axis=-1).reshape(*rc_bp2.shape[:-1], 2 * quarter)
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def encode_rows(vision: VisionModel, pixels_bpc: jax.Array, patch_segment_ids_bp: jax.Array,
                patch_rc_bp2: jax.Array, patch_pos_index_bpk: jax.Array, patch_pos_weight_bpk: jax.Array
                ) -> jax.Array:
    """Image tokens [B, P/(kh*kw), D_text] of every row (module docstring for the inputs); tokens of padding
    blocks are computed and never placed. Each row's patches attend within their image only (the tower runs
    vmapped over rows: attention cost B x P^2, not (B x P)^2)."""
    tower, cfg = vision.vision_tower, vision.cfg
    dtype = tower.dtype
    b, p = pixels_bpc.shape[:2]
    kh, kw = cfg.merge_kernel_size
    if p % (kh * kw):
        raise ValueError(f"{p} patches per row is not a multiple of the merge kernel {kh}x{kw}")
    x_bpc = normalize_pixels(pixels_bpc.reshape(b, p, 3 * cfg.patch_size ** 2), dtype)
    table = upcast(tower.patch_embed.pos_emb.weight[...])
    table = table.reshape(-1, table.shape[-1])
    pos_bpd = jnp.einsum("bpk,bpkd->bpd", patch_pos_weight_bpk.astype(table.dtype), table[patch_pos_index_bpk])
    h_bpd = (tower.patch_embed.proj(x_bpc) + pos_bpd.astype(dtype)).astype(dtype)
    cos, sin = _rope_cos_sin(patch_rc_bp2, cfg.head_dim, cfg.rope_theta, wide(dtype))
    h_bpd = jax.vmap(lambda x, s, c, si: tower.encoder(x, s, c, si))(h_bpd, patch_segment_ids_bp, cos, sin)
    merged = h_bpd.reshape(b * (p // (kh * kw)), kh * kw, h_bpd.shape[-1])
    return vision.mm_projector(merged).reshape(b, p // (kh * kw), -1)


def merge_rows(embeds_btd: jax.Array, ids_bt: jax.Array, tokens_bmd: jax.Array, placeholder_id: int) -> jax.Array:
    """`embeds_btd` with the k-th placeholder of each row replaced by `tokens_bmd[row, k]` (cast to the
    embeddings' dtype). The data guarantees that a row's placeholders number its images' tokens; a surplus
    placeholder would repeat the row's last token row."""
    mask_bt = ids_bt == placeholder_id
    index_bt = jnp.clip(jnp.cumsum(mask_bt, axis=1) - 1, 0, tokens_bmd.shape[1] - 1)
    rows_btd = jnp.take_along_axis(tokens_bmd, index_bt[..., None], axis=1).astype(embeds_btd.dtype)
    return jnp.where(mask_bt[..., None], rows_btd, embeds_btd)
