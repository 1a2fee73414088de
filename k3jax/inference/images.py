"""Images of chat requests: `image_url` data URLs decoded to RGB arrays and preprocessed for the vision tower.

Only `data:` URLs are accepted (the server never fetches anything): `data:application/x-npy;base64,...` (a NumPy
`.npy` file of a uint8 [H, W, 3] or [H, W] array; no extra dependency) and `data:image/png|jpeg|webp|gif;base64,...`
(decoded with Pillow, the optional `[vision]` extra: `pip install 'k3jax[vision]'`). Decoded images go through
`k3jax.vision.preprocess` (NaViT resize within a patch budget, normalise, patchify) into an `ImageInput`: the
tower's patches, the grid, the number of merged image tokens (placeholders the prompt reserves for it) and a
SHA-256 digest of the decoded pixels (shape and bytes: the same picture sent as PNG or .npy has the same digest).
Batch mode reads image files (`load_image_file`: a `.npy` array by its magic bytes, anything else with Pillow) and
decodes them the same way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import NamedTuple

import numpy as np

from k3jax.vision import VisionConfig
from k3jax.vision.preprocess import (
    K3_MAX_PATCHES,
    K3_MAX_SIZE_PER_SIDE,
    VIDEO_MAX_PATCHES,
    preprocess_frames,
    preprocess_video,
)

DATA_URL_ONLY = "image_url: only data: URLs are accepted (no network fetches)"
NPY_MEDIA_TYPE = "application/x-npy"
PILLOW_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
MAX_IMAGE_PIXELS = 64 << 20  # decoded pixels per image (a decompression-bomb bound)
NPY_MAGIC = b"\x93NUMPY"


class ImageInput(NamedTuple):
    """One preprocessed image: patches float32 [t*h*w, 3, p, p], grid (t, h, w), merged tokens, pixel digest."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    num_tokens: int
    digest: str


def check_image_url(url) -> str:
    """The URL if it is a data URL; ValueError (DATA_URL_ONLY) for anything else, http(s) included."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(DATA_URL_ONLY)
    return url


def decode_data_url(url: str) -> np.ndarray:
    """A data URL -> uint8 [H, W, 3] (grey images: [H, W]). ValueError naming the problem."""
    header, sep, payload = check_image_url(url)[5:].partition(",")
    if not sep:
        raise ValueError("image_url: a data URL needs a ',' before its data")
    params = header.split(";")
    media = params[0].strip().lower()
    if "base64" not in [p.strip().lower() for p in params[1:]]:
        raise ValueError("image_url: only base64 data URLs are accepted (data:<type>;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL's base64 payload is invalid") from None
    if media == NPY_MEDIA_TYPE:
        return _decode_npy(data)
    if media in PILLOW_MEDIA_TYPES:
        return _decode_with_pillow(data, "image_url", media)
    raise ValueError(f"image_url: media type {media!r} is not supported (use {NPY_MEDIA_TYPE} or "
                     f"{', '.join(PILLOW_MEDIA_TYPES[:2])})")


def load_image_file(path: str) -> np.ndarray:
    """An image file -> uint8 [H, W, 3] (grey: [H, W]): a NumPy `.npy` array (recognised by its magic bytes) or
    any format Pillow reads. ValueError (reason only; the caller names the file) when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError("file not found") from None
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or type(e).__name__})") from None
    if data.startswith(NPY_MAGIC):
        return _decode_npy(data, "image file")
    return _decode_with_pillow(data, "image file", "an image file",
                               "or save the pixels as a .npy of a uint8 [H, W, 3] array")


def _decode_npy(data: bytes, what: str = "image_url") -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{what}: not a valid .npy array ({e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or not (
            arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] == 3)) or min(arr.shape[:2]) < 1:
        raise ValueError(f"{what}: a .npy image must be uint8 [H, W, 3] or [H, W], got {getattr(arr, 'dtype', '?')}"
                         f" {list(getattr(arr, 'shape', ()))}")
    _check_size(arr.shape[0], arr.shape[1], what)
    return arr


def _decode_with_pillow(data: bytes, what: str, media: str, instead: str = "") -> np.ndarray:
    try:
        from PIL import Image  # optional dependency: the [vision] extra
    except ImportError:
        raise ValueError(f"{what}: decoding {media} needs Pillow, which is not installed (pip install "
                         f"'k3jax[vision]'); {instead or f'or send the pixels as data:{NPY_MEDIA_TYPE};base64,...'}"
                         ) from None
    try:
        with Image.open(io.BytesIO(data)) as im:
            _check_size(im.height, im.width, what)
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for damaged data
        raise ValueError(f"{what}: cannot decode {media} ({type(e).__name__})") from None


def _check_size(h: int, w: int, what: str = "image_url") -> None:
    if h * w > MAX_IMAGE_PIXELS:
        raise ValueError(f"{what}: image of {h} x {w} pixels is over the limit of {MAX_IMAGE_PIXELS} pixels")


def pixel_digest(image: np.ndarray) -> str:
    """SHA-256 of an image's shape and bytes (the prefix-cache key of its placeholders)."""
    image = np.ascontiguousarray(image)
    return hashlib.sha256(repr((image.shape, image.dtype.str)).encode() + image.tobytes()).hexdigest()


def prepare_image(image: np.ndarray, cfg: VisionConfig, *, max_patches: int = K3_MAX_PATCHES,
                  max_size_per_side: int = K3_MAX_SIZE_PER_SIDE) -> ImageInput:
    """A decoded image -> `ImageInput` for the tower of `cfg` (the release's preprocessing)."""
    kh, kw = cfg.merge_kernel_size
    if kh != kw:
        raise ValueError(f"vision_config.merge_kernel_size {cfg.merge_kernel_size}: serving needs a square merge")
    pixels, grid = preprocess_frames(np.asarray(image), patch_size=cfg.patch_size, merge_size=kh,
                                     max_patches=max_patches, max_size_per_side=max_size_per_side)
    t, h, w = grid
    return ImageInput(pixels, (int(t), int(h), int(w)), int(h * w // (kh * kw)), pixel_digest(image))


def prepare_video(frames, cfg: VisionConfig, *, max_patches: int = VIDEO_MAX_PATCHES,
                  max_size_per_side: int = K3_MAX_SIZE_PER_SIDE) -> tuple[ImageInput, ...]:
    """A video's sampled frames -> one `ImageInput` per chunk of `cfg.init_pos_emb_time` frames (grid (t, h, w),
    h*w/4 tokens: its frames pooled; digest over the chunk's frames). Not reachable from the API yet."""
    kh, kw = cfg.merge_kernel_size
    if kh != kw:
        raise ValueError(f"vision_config.merge_kernel_size {cfg.merge_kernel_size}: serving needs a square merge")
    frames = [np.asarray(f) for f in frames]
    chunks = preprocess_video(frames, frames_per_chunk=cfg.init_pos_emb_time, patch_size=cfg.patch_size,
                              merge_size=kh, max_patches=max_patches, max_size_per_side=max_size_per_side)
    out, start = [], 0
    for pixels, (t, h, w) in chunks:
        digest = hashlib.sha256("".join(pixel_digest(f) for f in frames[start:start + t]).encode()).hexdigest()
        out.append(ImageInput(pixels, (int(t), int(h), int(w)), int(h * w // (kh * kw)), digest))
        start += t
    return tuple(out)


def load_image_url(url: str, cfg: VisionConfig) -> ImageInput:
    return prepare_image(decode_data_url(url), cfg)


def npy_data_url(image: np.ndarray) -> str:
    """`image` (uint8 [H, W, 3]) as a data:application/x-npy URL (for clients and tests)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(image), allow_pickle=False)
    return f"data:{NPY_MEDIA_TYPE};base64,{base64.b64encode(buf.getvalue()).decode()}"
