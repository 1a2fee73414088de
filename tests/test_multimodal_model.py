"""Multimodal K3: image tokens replace the placeholder embeddings before layer 0, checked end to end in float64
against the NumPy references (text: tests/reference/numpy_k3.py, tower + projector: tests/reference/numpy_vision.py),
and the cached (serving) forward from merged embeddings against the full forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.convert.vision import export_vision_weights, load_vision_weights
from k3jax.vision import K3VisionLanguageModel, VisionConfig, VisionModel, expand_media_placeholders
from tests.conftest import build_model
from tests.reference import numpy_k3 as ref
from tests.reference import numpy_vision as vref

TEXT = ["num_hidden_layers=5", "full_attn_layers=(4,5)"]  # KDA, MLA, dense and MoE FFNs, two AttnRes blocks
TINY_VISION = dict(patch_size=2, init_pos_emb_height=5, init_pos_emb_width=7, vt_num_attention_heads=2,
                   vt_num_hidden_layers=2, vt_hidden_size=16, vt_intermediate_size=32, qkv_hidden_size=16,
                   mm_hidden_size=16)
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 8, 4)]  # 6 + 1 + 8 image tokens; grids below and above the 5 x 7 table


def _vision_config(variant: str, text_hidden: int) -> VisionConfig:
    if variant == "k25":
        return VisionConfig.kimi_k25(**TINY_VISION, text_hidden_size=text_hidden)
    return VisionConfig(**TINY_VISION, text_hidden_size=text_hidden)


def _random_vision(cfg: VisionConfig, dtype, seed: int = 0) -> tuple[VisionModel, dict]:
    """A VisionModel with random release-named weights: norm gains near 1, nonzero biases, scaled matrices."""
    model = VisionModel(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed), attn_block_q=None)
    rng = np.random.RandomState(seed)
    weights = {}
    for name, arr in export_vision_weights(model).items():
        shape = arr.shape
        if len(shape) >= 2:
            fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[-1]
            w = rng.randn(*shape) / np.sqrt(fan_in)
        elif name.endswith(".bias"):
            w = 0.1 * rng.randn(*shape)
        else:
            w = 1.0 + 0.1 * rng.randn(*shape)
        weights[name] = w.astype(np.float64 if dtype == jnp.float64 else np.float32)
    load_vision_weights(model, weights)
    return model, weights


def _prompt(cfg, placeholder: int, seed: int = 0) -> np.ndarray:
    """[2, 30]: row 0 holds images 0 and 1, row 1 image 2 (6, 1, 8 placeholders), the rest random text."""
    ids = np.random.RandomState(seed).randint(0, placeholder, (2, 30)).astype(np.int32)
    ids[0, 3:9] = placeholder
    ids[0, 20] = placeholder
    ids[1, 10:18] = placeholder
    return ids


def _pixels(seed: int = 0) -> np.ndarray:
    n = sum(t * h * w for t, h, w in GRIDS)
    return np.random.RandomState(seed + 1).uniform(-1, 1, (n, 3, 2, 2))


@pytest.mark.parametrize("variant", ["k3", pytest.param("k25", marks=pytest.mark.slow)])
def test_image_and_text_logits_float64_match_numpy_reference(x64, variant):
    cfg = configs.get_config("tiny", TEXT + ["param_dtype=float64", "dtype=float64"])
    placeholder = cfg.vocab_size - 1
    text, text_w = build_model(cfg)
    vcfg = _vision_config(variant, cfg.hidden_size)
    vision, vision_w = _random_vision(vcfg, jnp.float64)
    model = K3VisionLanguageModel(text, vision, placeholder_id=placeholder)
    ids, pixels = _prompt(cfg, placeholder), _pixels()
    layout = model.layout(GRIDS)

    want_tokens = vref.encode(vision_w, vcfg, pixels, GRIDS)
    tokens = np.asarray(nnx.jit(lambda m, p: m.image_tokens(p, layout))(model, jnp.asarray(pixels)))
    np.testing.assert_allclose(tokens, want_tokens, rtol=0, atol=1e-10 * np.abs(want_tokens).max())

    embeds = np.asarray(text_w["model.embed_tokens.weight"], np.float64)[ids]
    embeds[ids == placeholder] = want_tokens  # row-major over the batch, images in order
    want = ref.forward(text_w, cfg, ids, inputs_embeds=embeds)
    ours = np.asarray(nnx.jit(lambda m, i, p: m(i, p, layout))(model, jnp.asarray(ids), jnp.asarray(pixels)))
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-8 * np.abs(want).max())
    text_only = ref.forward(text_w, cfg, ids)  # the images matter: the placeholders' own embeddings differ
    assert np.abs(text_only - want).max() > 1e-3 * np.abs(want).max()


def test_video_chunks_float64_match_numpy_reference_pooling(x64):
    """Video chunks of 4, 3 and 2 frames packed with an image through the K3 tower in float64 against the NumPy
    reference (time sinusoid per frame, attention across a chunk's frames, each merged block averaged over them);
    the frames matter (pooling one frame differs)."""
    vcfg = VisionConfig(**TINY_VISION, text_hidden_size=24, init_pos_emb_time=4)
    vision, w = _random_vision(vcfg, jnp.float64, seed=2)
    grids = [(4, 2, 4), (1, 4, 2), (3, 2, 2), (2, 4, 4)]
    n = sum(t * h * wd for t, h, wd in grids)
    pixels = np.random.RandomState(3).uniform(-1, 1, (n, 3, 2, 2))
    got = np.asarray(nnx.jit(lambda m, p: m.encode(p, grids))(vision, jnp.asarray(pixels)))
    want = vref.encode(w, vcfg, pixels, grids)
    assert got.shape == want.shape == (2 + 2 + 1 + 4, 24)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * np.abs(want).max())
    first = vref.encode(w, vcfg, pixels[:8], [(1, 2, 4)])  # the first frame alone
    assert np.abs(first - want[:2]).max() > 1e-3 * np.abs(want).max()


def test_chunked_cached_prefill_with_images_equals_full_forward_and_counts_are_checked(x64):
    cfg = configs.get_config("tiny", TEXT + ["param_dtype=float64", "dtype=float64"])
    placeholder = cfg.vocab_size - 1
    text, _ = build_model(cfg)
    vision, _ = _random_vision(_vision_config("k3", cfg.hidden_size), jnp.float64)
    model = K3VisionLanguageModel(text, vision, placeholder_id=placeholder)
    ids = _prompt(cfg, placeholder)[:1]  # images 0 and 1: 7 placeholders, split by the chunk boundary at 6
    layout = model.layout(GRIDS[:2])
    pixels = jnp.asarray(_pixels()[:layout.num_patches])
    tokens_md = model.image_tokens(pixels, layout)
    full = np.asarray(nnx.jit(lambda m, i, t: m(i, image_tokens_md=t))(model, jnp.asarray(ids), tokens_md))

    # one compile for every chunk: under jit the rows are padded to a fixed count (the surplus is never read)
    step = nnx.jit(lambda m, i, c, t: m.forward_cached(i, c, image_tokens_md=t))
    cache, parts = text.init_cache(1, 32), []
    for start in range(0, 30, 6):  # image 0 (positions 3..8) straddles the first boundary; image 1 at 20
        rows = model.placeholder_rows(ids[0], tokens_md, start, start + 6)
        rows_md = jnp.zeros_like(tokens_md) if rows is None else jnp.pad(rows, ((0, 7 - rows.shape[0]), (0, 0)))
        logits, cache = step(model, jnp.asarray(ids[:, start:start + 6]), cache, rows_md)
        parts.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=0, atol=1e-9 * np.abs(full).max())

    with pytest.raises(ValueError, match="7 image placeholder"):  # concrete ids: the counts must agree
        model.embed(jnp.asarray(ids), tokens_md[:6])
    with pytest.raises(ValueError, match="text_hidden_size"):
        K3VisionLanguageModel(text, VisionModel(_vision_config("k3", 32), rngs=nnx.Rngs(0)))


def test_media_placeholders_expand_to_one_per_image_token():
    assert expand_media_placeholders([1, 9, 2, 9], [3, 1], placeholder_id=9) == [1, 9, 9, 9, 2, 9]
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_media_placeholders([9, 9], [4], placeholder_id=9)
