"""NumPy image preprocessing against transformers' Kimi K2.5 image processor on the same random images.

The processor (`Kimi_K25ImageProcessor`) runs on torchvision, which does not import beside this machine's CPU torch
build. So the oracle here is made of the processor's own parts: its `navit_resize`, executed from the installed
transformers source, and the kernel its resize dispatches to on a CPU (`torch.nn.functional.interpolate`, bicubic,
antialias, native uint8: torchvision's `resize_image`), with its pad (zeros, bottom/right), fused rescale+normalise
and patchify steps as its `_preprocess` writes them. Where torchvision imports, the processor itself is compared too.
"""

from __future__ import annotations

import ast
import importlib.util
import math

import numpy as np
import pytest

from k3jax.inference.images import prepare_video
from k3jax.vision import VisionConfig
from k3jax.vision.preprocess import (
    VIDEO_FRAMES_PER_CHUNK,
    VIDEO_MAX_PATCHES,
    navit_size,
    preprocess_frames,
    preprocess_images,
    preprocess_video,
)

torch = pytest.importorskip("torch")
BUDGET = dict(max_patches=64, max_size_per_side=12)


def _transformers_navit_resize():
    """`navit_resize` from the installed transformers source (its module imports torchvision, so the function is
    taken from the file and executed alone)."""
    spec = importlib.util.find_spec("transformers.models.kimi_k25.image_processing_kimi_k25")
    tree = ast.parse(open(spec.origin).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    scope = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), spec.origin, "exec"), scope)
    return scope["navit_resize"]


navit_resize = _transformers_navit_resize()


def _oracle(images, max_patches, max_size_per_side):
    """The processor's pipeline on torch tensors: navit size, resize, pad, normalise, patchify."""
    pixels, grids = [], []
    for im in images:
        x = torch.from_numpy(np.ascontiguousarray(im)).permute(2, 0, 1).contiguous()[None]
        h, w = x.shape[-2:]
        (rh, rw), (ph, pw) = navit_resize(h, w, patch_size=14, merge_kernel_size=2, max_patches=max_patches,
                                          max_size_per_side=max_size_per_side)
        if (rh, rw) != (h, w):
            x = torch.nn.functional.interpolate(x, size=[rh, rw], mode="bicubic", align_corners=False,
                                                antialias=True)
        x = torch.nn.functional.pad(x, (0, pw - rw, 0, ph - rh), value=0)
        mean = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
        std = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
        x = (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
        gh, gw = ph // 14, pw // 14
        x = x.reshape(1, 3, gh, 14, gw, 14).permute(0, 2, 4, 1, 3, 5).reshape(gh * gw, 3, 14, 14)
        pixels.append(x.numpy())
        grids.append((1, gh, gw))
    return np.concatenate(pixels), grids


def _images(sizes, dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3)).astype(dtype) for h, w in sizes]


def test_navit_sizes_match_transformers():
    for h in (1, 13, 14, 29, 100, 333, 1000, 4097):
        for w in (1, 15, 56, 250, 777, 3000):
            for budget, side in ((16384, 512), (64, 12), (65536, 512), (4, 2)):
                want = navit_resize(h, w, patch_size=14, merge_kernel_size=2, max_patches=budget,
                                    max_size_per_side=side)
                assert navit_size(h, w, max_patches=budget, max_size_per_side=side) == want, (h, w, budget, side)


def test_unresized_images_are_padded_normalised_and_patchified_exactly():
    images = _images([(30, 45), (28, 28), (5, 60)])
    want, want_grids = _oracle(images, max_patches=1000, max_size_per_side=64)
    got, grids = preprocess_images(images, max_patches=1000, max_size_per_side=64)
    assert grids == want_grids == [(1, 4, 4), (1, 2, 2), (1, 2, 6)]
    np.testing.assert_array_equal(got, want)


def test_downscaled_uint8_images_match_torch_antialiased_bicubic_exactly():
    images = _images([(200, 150), (300, 60), (97, 211), (1000, 37)], seed=1)
    want, want_grids = _oracle(images, **BUDGET)
    got, grids = preprocess_images(images, **BUDGET)
    assert grids == want_grids
    np.testing.assert_array_equal(got, want)


def test_downscaled_float_images_match_torch_antialiased_bicubic():
    images = _images([(200, 150), (97, 211)], dtype=np.float32, seed=2)
    want, want_grids = _oracle(images, **BUDGET)
    got, grids = preprocess_images(images, **BUDGET)
    assert grids == want_grids
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_matches_the_transformers_processor_where_torchvision_imports():
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    images = _images([(200, 150), (30, 45), (97, 211)], seed=5)
    side = BUDGET["max_size_per_side"]
    proc = Kimi_K25ImageProcessor(max_patches=BUDGET["max_patches"], size={"max_height": side, "max_width": side})
    out = proc(images=images, return_tensors="np")
    got, grids = preprocess_images(images, **BUDGET)
    assert grids == [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
    np.testing.assert_array_equal(got, np.asarray(out["pixel_values"]))


def test_video_chunk_stacks_frames_frame_major():
    frames = _images([(60, 90)] * 3, seed=3)
    pixels, grid = preprocess_frames(frames, **BUDGET)
    one, one_grid = preprocess_frames(frames[1], **BUDGET)
    assert grid == (3, *one_grid[1:]) and one_grid[0] == 1
    n = one.shape[0]
    np.testing.assert_array_equal(pixels[n:2 * n], one)
    with pytest.raises(ValueError, match="video frames differ in size"):
        preprocess_frames([frames[0], frames[1][:50]], **BUDGET)
    with pytest.raises(ValueError, match=r"expected an RGB image \[H, W, 3\]"):
        preprocess_frames(np.zeros((10, 10, 4), np.uint8))


def _video_processor_defaults() -> dict:
    """Class-level settings of transformers' `Kimi_K25VideoProcessor`, read from the installed source (its module
    imports torchvision, so it is parsed rather than imported)."""
    spec = importlib.util.find_spec("transformers.models.kimi_k25.video_processing_kimi_k25")
    tree = ast.parse(open(spec.origin).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kimi_K25VideoProcessor")
    return {t.id: ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}


def test_video_splits_into_chunks_of_four_frames_at_one_size():
    """Frames 0-3 and 4-5 of a 6-frame video: grids (4, h, w) and (2, h, w), each chunk exactly the frames'
    `preprocess_frames`; the chunk length and per-frame budget are transformers' video processor's defaults."""
    defaults = _video_processor_defaults()
    assert (defaults["temporal_patch_size"], defaults["max_patches"]) == (VIDEO_FRAMES_PER_CHUNK, VIDEO_MAX_PATCHES)
    frames = _images([(60, 90)] * 6, seed=5)
    chunks = preprocess_video(frames, **BUDGET)
    assert [g[0] for _, g in chunks] == [4, 2] and chunks[0][1][1:] == chunks[1][1][1:]
    for (pixels, grid), part in zip(chunks, (frames[:4], frames[4:])):
        want, want_grid = preprocess_frames(part, **BUDGET)
        assert grid == want_grid
        np.testing.assert_array_equal(pixels, want)
    assert [g for _, g in preprocess_video(frames[:5], frames_per_chunk=2, **BUDGET)] == [
        (2, *chunks[0][1][1:]), (2, *chunks[0][1][1:]), (1, *chunks[0][1][1:])]
    with pytest.raises(ValueError, match="at least one frame"):
        preprocess_video([], **BUDGET)

    cfg = VisionConfig(patch_size=14, init_pos_emb_time=4, text_hidden_size=8)
    inputs = prepare_video(frames, cfg, max_patches=64, max_size_per_side=12)
    assert [(im.grid, im.num_tokens) for im in inputs] == [(g, g[1] * g[2] // 4) for _, g in chunks]
    assert inputs[0].digest != prepare_video(frames[1:], cfg, max_patches=64, max_size_per_side=12)[0].digest
