"""NaViT packing: the host-side (NumPy) description of several variable-resolution images in one sequence.

Each image (or video chunk) is a grid `(t, h, w)` of patches, `t` frames of `h x w`. Its `t*h*w` patches are
laid out frame-major, then row-major within a frame (the processor's order), and the images follow one another;
`pad_to` appends padding patches. Everything the tower needs besides the weights is derived here from the static
grids: segment ids (the block-diagonal attention mask), the 2-D rotary angles, the per-image position-grid
resampling matrices and the frames' sinusoidal time offsets.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from k3jax.vision.config import VisionConfig

Grid = tuple[int, int, int]
PAD_SEGMENT = -1


def check_grids(grids, cfg: VisionConfig) -> tuple[Grid, ...]:
    """Validated `(t, h, w)` tuples: positive, h and w multiples of the merge kernel, t within the time table."""
    out = []
    kh, kw = cfg.merge_kernel_size
    for i, g in enumerate(grids):
        t, h, w = (int(v) for v in g)
        if min(t, h, w) < 1:
            raise ValueError(f"image {i}: grid (t, h, w) = {(t, h, w)} must be positive")
        if h % kh or w % kw:
            raise ValueError(f"image {i}: grid {h}x{w} patches is not a multiple of the merge kernel {kh}x{kw}")
        if t > 1 and t > cfg.init_pos_emb_time:
            raise ValueError(f"image {i}: {t} frames exceed the time table's {cfg.init_pos_emb_time} "
                             "(vision_config.init_pos_emb_time); split the video into chunks")
        out.append((t, h, w))
    if not out:
        raise ValueError("no images to encode")
    return tuple(out)


def interpolation_matrix(out_size: int, in_size: int, mode: str) -> np.ndarray:
    """float64 [out, in]: resampling one axis of the learned position grid, half-pixel centres
    (align_corners=False), taps past the border clamped to it (as `torch.nn.functional.interpolate`).
    "bilinear": 2 taps; "bicubic": 4 taps of the Keys kernel with a = -0.75 (PyTorch's). Same size: identity."""
    m = np.zeros((out_size, in_size), np.float64)
    src = (np.arange(out_size) + 0.5) * in_size / out_size - 0.5
    if mode == "bilinear":
        src = np.clip(src, 0.0, in_size - 1)  # PyTorch clamps negative source coordinates for linear modes
        lo = np.floor(src)
        frac = src - lo
        taps = [(lo, 1.0 - frac), (lo + 1, frac)]
    elif mode == "bicubic":
        lo = np.floor(src)
        a = -0.75
        taps = []
        for off in (-1, 0, 1, 2):
            d = np.abs(src - (lo + off))
            near = ((a + 2) * d - (a + 3)) * d * d + 1
            far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
            taps.append((lo + off, np.where(d <= 1, near, far)))
    else:
        raise ValueError(f"unknown interpolation mode {mode!r}")
    rows = np.arange(out_size)
    for idx, weight in taps:
        np.add.at(m, (rows, np.clip(idx, 0, in_size - 1).astype(np.int64)), weight)
    return m


def time_embedding(frames: int, dim: int) -> np.ndarray:
    """float64 [frames, dim]: frame f -> concat(sin(f w), cos(f w)), w_j = 10000^(-2j/dim). Added only when a
    grid has t > 1 (a still image gets no time term)."""
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(frames, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=1)


def rope_angles(rows_n: np.ndarray, cols_n: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
    """float64 [N, head_dim/2]: the angle of each interleaved rotary pair (dims 2i, 2i+1 of a head). Even pairs
    rotate by the patch's column, odd pairs by its row, both at frequency theta^(-4 floor(i/2) / head_dim)."""
    quarter = head_dim // 4
    inv_freq = theta ** (-4.0 * np.arange(quarter, dtype=np.float64) / head_dim)
    ang = np.empty((rows_n.shape[0], quarter, 2), np.float64)
    ang[:, :, 0] = cols_n[:, None] * inv_freq[None, :]
    ang[:, :, 1] = rows_n[:, None] * inv_freq[None, :]
    return ang.reshape(rows_n.shape[0], 2 * quarter)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Static layout of a packed image sequence (hashable by its grids and length, so it can key a jit cache).

    `segment_ids_n` int32 [length]: image index per patch, `PAD_SEGMENT` for padding. `rope_cos_nr`/`rope_sin_nr`
    float64 [length, head_dim/2]. `offsets`: first patch of each image. `merged_counts`: merged tokens per image
    (`h*w / (kh*kw)`, frames pooled)."""

    grids: tuple[Grid, ...]
    length: int
    segment_ids_n: np.ndarray = dataclasses.field(compare=False, repr=False)
    rope_cos_nr: np.ndarray = dataclasses.field(compare=False, repr=False)
    rope_sin_nr: np.ndarray = dataclasses.field(compare=False, repr=False)
    offsets: tuple[int, ...] = ()
    merged_counts: tuple[int, ...] = ()

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    @property
    def num_merged(self) -> int:
        return sum(self.merged_counts)


def pack(grids, cfg: VisionConfig, *, pad_to: int | None = None) -> PackedLayout:
    """The layout of `grids` packed into one sequence of `pad_to` patches (default: exactly their total)."""
    grids = check_grids(grids, cfg)
    total = sum(t * h * w for t, h, w in grids)
    length = total if pad_to is None else int(pad_to)
    if length < total:
        raise ValueError(f"pad_to={length} is shorter than the {total} patches of the images")
    seg = np.full((length,), PAD_SEGMENT, np.int32)
    rows = np.zeros((length,), np.float64)
    cols = np.zeros((length,), np.float64)
    offsets, counts, start = [], [], 0
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        seg[start:start + n] = i
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows[start:start + n] = np.tile(r.reshape(-1), t)
        cols[start:start + n] = np.tile(c.reshape(-1), t)
        offsets.append(start)
        counts.append(h * w // cfg.merge_size)
        start += n
    ang = rope_angles(rows, cols, cfg.head_dim, cfg.rope_theta)
    return PackedLayout(grids=grids, length=length, segment_ids_n=seg, rope_cos_nr=np.cos(ang),
                        rope_sin_nr=np.sin(ang), offsets=tuple(offsets), merged_counts=tuple(counts))


def bucket_length(num_patches: int, multiple: int = 256) -> int:
    """A padded length for `num_patches` (next multiple of `multiple`), so nearby sizes share one compile."""
    return max(multiple, int(math.ceil(num_patches / multiple)) * multiple)
