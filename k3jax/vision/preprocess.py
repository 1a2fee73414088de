"""Image preprocessing in NumPy: NaViT resize within a patch budget, padding, normalisation, patchification.

Follows transformers' `Kimi_K25ImageProcessor` (torchvision backend; tests/test_vision_preprocess.py checks it against
that processor's `navit_resize` and resize kernel, exactly for uint8 images):
1. `navit_size`: scale by min(1, sqrt(max_patches / patches), side cap / h, side cap / w) (never up), truncate,
   cap each side at `max_size_per_side` patches, then pad up to a multiple of patch * merge (28 px).
2. resize with antialiased bicubic (Keys a = -0.5, support widened by the downscale factor), width first then
   height; uint8 images in int16 fixed point with a uint8 intermediate, as PyTorch's CPU kernel does.
3. pad bottom/right with 0, normalise (x - 127.5) / 127.5 in float32 (mean = std = 0.5 after /255).
4. patchify to [gh * gw, 3, p, p] in raster order; grid (1, gh, gw).
K3 defaults (reading, docs/spec.md): 65536 patches, 512 patches per side. Video chunks: frames of one size -> t > 1.
Video (`preprocess_video`): its (already sampled) frames split into chunks of `VIDEO_FRAMES_PER_CHUNK` consecutive
frames, the last one shorter, each chunk one grid (t, gh, gw) at the frames' common NaViT size, as transformers'
`Kimi_K25VideoProcessor` does (temporal_patch_size 4, per-frame budget 4096 patches; read, not run: it needs
torchvision). The tower turns a chunk into gh*gw/4 tokens, averaging each merged block over its frames.
"""

from __future__ import annotations

import math

import numpy as np

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
K3_MAX_PATCHES = 65536
K3_MAX_SIZE_PER_SIDE = 512
VIDEO_FRAMES_PER_CHUNK = 4  # Kimi_K25VideoProcessor.temporal_patch_size (= vision_config.init_pos_emb_time)
VIDEO_MAX_PATCHES = 4096  # Kimi_K25VideoProcessor.max_patches: the per-frame budget of video frames


def navit_size(height: int, width: int, *, patch_size: int = 14, merge_size: int = 2,
               max_patches: int = K3_MAX_PATCHES, max_size_per_side: int = K3_MAX_SIZE_PER_SIDE
               ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized_h, resized_w), (padded_h, padded_w)) in pixels for an image of height x width."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    side = max_size_per_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    factor = merge_size * patch_size
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def aa_bicubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first tap [out] int64, normalised weights [out, taps] float64) of antialiased bicubic resampling: the
    kernel is stretched by the downscale factor, each output's window [xmin, xmin + taps) clipped to the input."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    j = np.arange(taps)[None, :]
    w = _cubic((j + xmin[:, None] - center[:, None] + 0.5) * inv)
    w = np.where(j < (xmax - xmin)[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    return xmin, w / np.where(total == 0, 1.0, total)


def _resample_axis(x: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """One separable pass along `axis` of a [C, H, W] image (float64 math; uint8 in int16 fixed point)."""
    in_size = x.shape[axis]
    xmin, w = aa_bicubic_weights(in_size, out_size)
    idx = np.minimum(xmin[:, None] + np.arange(w.shape[1])[None, :], in_size - 1)  # zero-weight taps clipped
    src = np.moveaxis(x, axis, -1)[..., idx]  # [..., out, taps]
    if x.dtype == np.uint8:
        prec = 0
        while prec < 22 and int(0.5 + w.max() * (1 << (prec + 1))) < (1 << 15):
            prec += 1
        w16 = np.trunc(w * (1 << prec) + np.where(w < 0, -0.5, 0.5)).astype(np.int64)
        acc = (1 << (prec - 1)) + np.einsum("...ot,ot->...o", src.astype(np.int64), w16)
        out = np.clip(acc >> prec, 0, 255).astype(np.uint8)
    else:
        out = np.einsum("...ot,ot->...o", src.astype(np.float64), w).astype(x.dtype)
    return np.moveaxis(out, -1, axis)


def resize(image_chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased bicubic resize of a [C, H, W] image (uint8 or float), width first; same size: unchanged."""
    if image_chw.shape[1:] == (height, width):
        return image_chw
    out = image_chw
    if out.shape[2] != width:
        out = _resample_axis(out, 2, width)
    if out.shape[1] != height:
        out = _resample_axis(out, 1, height)
    return out


def to_chw(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] (or [H, W] grey) -> [3, H, W]; other channel counts are refused."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3] (or grey [H, W]), got shape {image.shape}")
    return np.ascontiguousarray(image.transpose(2, 0, 1))


def normalize(image_chw: np.ndarray, mean=IMAGE_MEAN, std=IMAGE_STD, rescale: float = 1 / 255) -> np.ndarray:
    """float32 (x - mean/rescale) / (std/rescale): the processor's fused rescale + normalise."""
    m = np.asarray(mean, np.float32) * np.float32(1 / rescale)
    s = np.asarray(std, np.float32) * np.float32(1 / rescale)
    return (image_chw.astype(np.float32) - m[:, None, None]) / s[:, None, None]


def patchify(images_tchw: np.ndarray, patch_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, C, H, W] -> ([T * gh * gw, C, p, p] frame-major, raster order within a frame; (T, gh, gw))."""
    t, c, h, w = images_tchw.shape
    gh, gw = h // patch_size, w // patch_size
    x = images_tchw.reshape(t, c, gh, patch_size, gw, patch_size).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(t * gh * gw, c, patch_size, patch_size)), (t, gh, gw)


def preprocess_frames(frames, *, patch_size: int = 14, merge_size: int = 2, max_patches: int = K3_MAX_PATCHES,
                      max_size_per_side: int = K3_MAX_SIZE_PER_SIDE) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image (a single [H, W, 3] array) or one video chunk (a list of equal-size frames) -> (pixel patches
    float32 [t*gh*gw, 3, p, p], grid (t, gh, gw))."""
    frames = [frames] if isinstance(frames, np.ndarray) else list(frames)
    chw = [to_chw(f) for f in frames]
    if any(f.shape != chw[0].shape for f in chw):
        raise ValueError(f"video frames differ in size: {sorted({f.shape for f in chw})}")
    _, h, w = chw[0].shape
    (rh, rw), (ph, pw) = navit_size(h, w, patch_size=patch_size, merge_size=merge_size, max_patches=max_patches,
                                    max_size_per_side=max_size_per_side)
    out = []
    for f in chw:
        f = resize(f, rh, rw)
        f = np.pad(f, ((0, 0), (0, ph - rh), (0, pw - rw)))
        out.append(normalize(f))
    return patchify(np.stack(out), patch_size)


def preprocess_video(frames, *, frames_per_chunk: int = VIDEO_FRAMES_PER_CHUNK, max_patches: int = VIDEO_MAX_PATCHES,
                     **kw) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
    """A video's frames (equal-size [H, W, 3] arrays, sampled already) -> one (patches, grid (t, gh, gw)) per chunk
    of `frames_per_chunk` consecutive frames (the last may be shorter), all at one NaViT size."""
    frames = [np.asarray(f) for f in frames]
    if not frames:
        raise ValueError("a video needs at least one frame")
    if frames_per_chunk < 1:
        raise ValueError(f"frames_per_chunk must be >= 1, got {frames_per_chunk}")
    return [preprocess_frames(frames[i:i + frames_per_chunk], max_patches=max_patches, **kw)
            for i in range(0, len(frames), frames_per_chunk)]


def preprocess_images(images, **kw) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Several images -> (concatenated patches [N, 3, p, p], grids): the tower's packed input."""
    pixels, grids = zip(*(preprocess_frames(np.asarray(im), **kw) for im in images))
    return np.concatenate(pixels, axis=0), list(grids)
