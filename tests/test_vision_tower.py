"""The vision tower + projector against transformers' Kimi K2.5 tower (tiny config, random weights, f32), NaViT
packing independence, the K3 variant's names and position resampling, and the vision tensor converter."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from k3jax.convert.vision import (
    VisionTensorError,
    export_vision_weights,
    load_vision_weights,
    vision_config_from_hf,
)
from k3jax.vision import VisionConfig, VisionModel, pack, split_images
from k3jax.vision.merge import merge_image_tokens
from k3jax.vision.packing import interpolation_matrix
from k3jax.vision.preprocess import preprocess_video
from k3jax.vision.tower import packed_attention

torch = pytest.importorskip("torch")
hf_k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config  # noqa: E402

HF_VISION = dict(patch_size=14, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=2,
                 num_hidden_layers=2, hidden_size=32, intermediate_size=48, merge_kernel_size=[2, 2])
HF_TEXT = dict(model_type="deepseek_v3", hidden_size=24, intermediate_size=32, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=64, n_group=1,
               topk_group=1)
SAVE_RENAMES = {"vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
                "model.mm_projector.": "mm_projector."}
GRIDS = [(1, 4, 6), (1, 8, 2)]  # two images of different sizes (one larger than the 6x6 grid: interpolated)


def _hf_model(seed: int = 0):
    config = Kimi_K25Config(text_config=HF_TEXT, vision_config=HF_VISION, projection_hidden_size=32)
    config._attn_implementation = "eager"
    model = hf_k25.Kimi_K25ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" not in name and "mm_projector" not in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif "pos_emb" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def _release_names_from_hf(model) -> dict[str, np.ndarray]:
    """transformers' in-memory K2.5 names -> release names (fused wqkv with the interleaved rotary layout)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    heads = HF_VISION["num_attention_heads"]
    out = {}

    def interleave(w):  # transformers' [h, 2, K/2] halves -> the release's [h, K/2, 2] pairs
        shape = w.shape
        return w.reshape(heads, 2, -1, *shape[1:]).swapaxes(1, 2).reshape(shape)

    for k, v in sd.items():
        if "vision_tower" not in k and "mm_projector" not in k:
            continue
        name = k.split("model.", 1)[1]
        name = name.replace("vision_tower.layers.", "vision_tower.encoder.blocks.")
        name = name.replace("vision_tower.final_layernorm", "vision_tower.encoder.final_layernorm")
        name = name.replace("pos_emb.position_embeddings", "pos_emb.weight")
        name = name.replace(".norm1.", ".norm0_").replace(".norm2.", ".norm1.").replace(".norm0_", ".norm0.")
        name = name.replace(".mlp.fc1.", ".mlp.fc0_").replace(".mlp.fc2.", ".mlp.fc1.").replace(".fc0_", ".fc0.")
        name = name.replace(".attn.proj.", ".wo.")
        name = name.replace("mm_projector.in_proj.", "mm_projector.proj.0.")
        name = name.replace("mm_projector.out_proj.", "mm_projector.proj.2.")
        out[name] = v
    for i in range(HF_VISION["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}"
        for leaf in ("weight", "bias"):
            q, k, v = (out.pop(f"{p}.attn.{n}_proj.{leaf}") for n in "qkv")
            out[f"{p}.wqkv.{leaf}"] = np.concatenate([interleave(q), interleave(k), v], axis=0)
    return out


def _inputs(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, 3, 14, 14)).astype(np.float32)


def _hf_features(model, pixels, grids) -> np.ndarray:
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), torch.tensor(grids))
    return torch.cat(out.pooler_output, dim=0).numpy()


def _ours(cfg, weights) -> VisionModel:
    model = VisionModel(cfg, rngs=nnx.Rngs(0))
    load_vision_weights(model, weights)
    return model


def _k25_config() -> VisionConfig:
    return VisionConfig.from_transformers_k25(HF_VISION, text_hidden_size=HF_TEXT["hidden_size"])


def test_tower_and_projector_match_transformers_k25_for_two_packed_images():
    hf = _hf_model()
    pixels = _inputs(GRIDS)
    ours = _ours(_k25_config(), _release_names_from_hf(hf))
    got = np.asarray(ours.encode(jnp.asarray(pixels), GRIDS))
    want = _hf_features(hf, pixels, GRIDS)
    assert got.shape == want.shape == (6 + 4, HF_TEXT["hidden_size"])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_video_chunk_packed_with_an_image_matches_transformers_k25():
    grids = [(2, 4, 4), (1, 2, 6)]  # two frames: time sinusoid, clip-wide attention, temporal mean pooling
    hf = _hf_model(seed=3)
    pixels = _inputs(grids, seed=4)
    got = np.asarray(_ours(_k25_config(), _release_names_from_hf(hf)).encode(jnp.asarray(pixels), grids))
    np.testing.assert_allclose(got, _hf_features(hf, pixels, grids), rtol=2e-5, atol=2e-5)


def test_video_as_frames_matches_transformers_k25_video_features():
    """A 6-frame video preprocessed as frames (`preprocess_video`: chunks of 4 and 2 frames) through our tower and
    transformers' `get_video_features`: the full time table (t = 4), a shorter chunk, pooling over each chunk."""
    frames = [np.random.default_rng(10 + i).integers(0, 256, (50, 80, 3)).astype(np.uint8) for i in range(6)]
    chunks = preprocess_video(frames, max_patches=64, max_size_per_side=12)
    grids = [g for _, g in chunks]
    assert grids == [(4, 4, 6), (2, 4, 6)]
    pixels = np.concatenate([p for p, _ in chunks], axis=0)
    hf = _hf_model(seed=8)
    got = np.asarray(_ours(_k25_config(), _release_names_from_hf(hf)).encode(jnp.asarray(pixels), grids))
    with torch.no_grad():
        want = torch.cat(hf.model.get_video_features(torch.from_numpy(pixels), torch.tensor(grids)).pooler_output,
                         dim=0).numpy()
    assert got.shape == want.shape == (2 * 6, HF_TEXT["hidden_size"])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_saved_transformers_checkpoint_loads_by_release_names(tmp_path):
    hf = _hf_model(seed=5)
    hf.save_pretrained(tmp_path)
    loaded = hf_k25.Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path).eval()
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(tmp_path, f)))
    with open(os.path.join(tmp_path, "config.json")) as f:
        hf_json = json.load(f)
    # save_pretrained writes the release layout (fused wqkv, interleaved rotary pairs) by reversing transformers'
    # load-time conversion; its reverse renaming misses two prefixes, put back here (nothing else is changed).
    vision = {}
    for k, v in tensors.items():
        for wrong, right in SAVE_RENAMES.items():
            k = k.replace(wrong, right) if k.startswith(wrong) else k
        if k.startswith(("vision_tower.", "mm_projector.")):
            vision[k] = v
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in vision
    cfg = VisionConfig.from_transformers_k25(hf_json["vision_config"],
                                             text_hidden_size=hf_json["text_config"]["hidden_size"],
                                             projection_layer_norm_eps=hf_json["projection_layer_norm_eps"])
    assert cfg == _k25_config()
    pixels = _inputs(GRIDS, seed=6)
    got = np.asarray(_ours(cfg, vision).encode(jnp.asarray(pixels), GRIDS))
    np.testing.assert_allclose(got, _hf_features(loaded, pixels, GRIDS), rtol=2e-5, atol=2e-5)


def test_each_image_output_is_independent_of_the_images_packed_with_it():
    cfg = VisionConfig(vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=48,
                       vt_num_attention_heads=2, qkv_hidden_size=48, mm_hidden_size=32, text_hidden_size=24,
                       init_pos_emb_height=6, init_pos_emb_width=6)
    model = VisionModel(cfg, rngs=nnx.Rngs(1))
    grids = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]
    pixels = _inputs(grids, seed=7)
    layout = pack(grids, cfg, pad_to=96)
    together = split_images(model(jnp.asarray(pixels), layout), layout)
    for i, grid in enumerate(grids):
        start = layout.offsets[i]
        alone = model.encode(jnp.asarray(pixels[start:start + int(np.prod(grid))]), [grid])
        np.testing.assert_allclose(np.asarray(together[i]), np.asarray(alone), rtol=1e-5, atol=1e-5)
    # changing one image's pixels changes only its own tokens
    bumped = pixels.copy()
    bumped[layout.offsets[1]:layout.offsets[2]] += 1.0
    moved = split_images(model(jnp.asarray(bumped), layout), layout)
    assert not np.allclose(np.asarray(moved[1]), np.asarray(together[1]))
    for i in (0, 2):
        np.testing.assert_allclose(np.asarray(moved[i]), np.asarray(together[i]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_position_grid_resampling_matches_torch_interpolate(mode):
    table = np.random.default_rng(0).standard_normal((6, 5, 3))
    for out_h, out_w in [(4, 8), (12, 2), (6, 5), (3, 3)]:
        want = torch.nn.functional.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(out_h, out_w),
                                               mode=mode, align_corners=False)[0].permute(1, 2, 0).numpy()
        got = np.einsum("hH,wW,HWd->hwd", interpolation_matrix(out_h, 6, mode), interpolation_matrix(out_w, 5, mode),
                        table)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


K3_TINY = dict(vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=48, vt_num_attention_heads=2,
               qkv_hidden_size=48, mm_hidden_size=32, text_hidden_size=24, init_pos_emb_height=6,
               init_pos_emb_width=6)


def test_k3_variant_has_the_release_tensor_names_and_shapes():
    cfg = VisionConfig(**K3_TINY)
    names = {k: v.shape for k, v in export_vision_weights(VisionModel(cfg, rngs=nnx.Rngs(0))).items()}
    want = {"vision_tower.patch_embed.proj.weight": (32, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (6, 6, 32),
            "vision_tower.encoder.final_layernorm.weight": (32,),
            "mm_projector.proj.0.weight": (128, 128), "mm_projector.proj.2.weight": (24, 128),
            "mm_projector.post_norm.weight": (24,)}
    for i in range(2):
        p = f"vision_tower.encoder.blocks.{i}"
        want.update({f"{p}.norm0.weight": (32,), f"{p}.norm1.weight": (32,), f"{p}.wqkv.weight": (144, 32),
                     f"{p}.wo.weight": (32, 48), f"{p}.mlp.fc0.weight": (48, 32), f"{p}.mlp.fc1.weight": (32, 48)})
    assert names == want


def test_vision_weights_round_trip_and_bad_tensors_are_named():
    cfg = VisionConfig(**K3_TINY)
    src = VisionModel(cfg, rngs=nnx.Rngs(2))
    weights = export_vision_weights(src)
    dst = VisionModel(cfg, rngs=nnx.Rngs(3))
    load_vision_weights(dst, weights)
    assert all(np.array_equal(weights[k], v) for k, v in export_vision_weights(dst).items())
    pixels = _inputs([(1, 2, 4)])
    np.testing.assert_array_equal(np.asarray(src.encode(pixels, [(1, 2, 4)])),
                                  np.asarray(dst.encode(pixels, [(1, 2, 4)])))
    missing = {k: v for k, v in weights.items() if k != "mm_projector.post_norm.weight"}
    with pytest.raises(VisionTensorError, match="missing vision tensor 'mm_projector.post_norm.weight'"):
        load_vision_weights(dst, missing)
    with pytest.raises(VisionTensorError, match="unexpected vision tensor 'mm_projector.proj.0.bias'"):
        load_vision_weights(dst, {**weights, "mm_projector.proj.0.bias": np.zeros(128, np.float32)})
    bad = {**weights, "vision_tower.encoder.blocks.1.wo.weight": np.zeros((32, 32), np.float32)}
    with pytest.raises(VisionTensorError, match=r"'vision_tower.encoder.blocks.1.wo.weight' has shape \(32, 32\)"):
        load_vision_weights(dst, bad)


def test_bad_grids_are_refused_with_one_line():
    cfg = VisionConfig(**K3_TINY)
    with pytest.raises(ValueError, match="not a multiple of the merge kernel"):
        pack([(1, 3, 4)], cfg)
    with pytest.raises(ValueError, match="exceed the time table"):
        pack([(5, 2, 2)], cfg)
    with pytest.raises(ValueError, match="shorter than"):
        pack([(1, 2, 2)], cfg, pad_to=2)


def test_release_vision_config_reads_with_k3_defaults_and_the_text_width():
    hf = {"text_config": {"hidden_size": 7168}, "vision_config": {"vt_hidden_size": 1024, "merge_type": "sd2_tpool",
                                                                  "mm_projector_type": "patchmergerv2",
                                                                  "some_future_field": 1}}
    cfg = vision_config_from_hf(hf)
    assert cfg == VisionConfig() and cfg.head_dim == 128 and cfg.merged_hidden_size == 4096
    assert vision_config_from_hf({"text_config": {}}) is None
    with pytest.raises(ValueError, match="vision_config.merge_type = 'avg' is not supported"):
        vision_config_from_hf({"vision_config": {"merge_type": "avg"}})


def test_jitted_forward_with_a_static_layout_matches_eager_and_runs_in_bf16():
    cfg = VisionConfig(**K3_TINY)
    model = VisionModel(cfg, rngs=nnx.Rngs(4))
    grids = [(1, 4, 6), (1, 2, 2)]
    pixels = jnp.asarray(_inputs(grids, seed=8))
    layout = pack(grids, cfg, pad_to=40)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, x, lay: nnx.merge(graphdef, st)(x, lay), static_argnums=2)
    eager = np.asarray(model(pixels, layout))
    np.testing.assert_allclose(np.asarray(forward(state, pixels, layout)), eager, rtol=1e-6, atol=1e-6)
    bf16 = VisionModel(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    load_vision_weights(bf16, export_vision_weights(model))
    got = np.asarray(bf16(pixels, layout)).astype(np.float32)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.linalg.norm(got - eager) < 0.05 * np.linalg.norm(eager)


def test_image_tokens_fill_the_placeholders_in_order_like_masked_scatter():
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 50, (2, 7))
    ids[0, [1, 2, 6]] = 163605
    ids[1, [0, 4]] = 163605
    embeds = rng.standard_normal((2, 7, 5)).astype(np.float32)
    tokens = rng.standard_normal((5, 5)).astype(np.float32)
    mask = torch.from_numpy(ids == 163605)[..., None].expand(2, 7, 5)
    want = torch.from_numpy(embeds).masked_scatter(mask, torch.from_numpy(tokens)).numpy()
    got = merge_image_tokens(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(got), want)
    jitted = jax.jit(merge_image_tokens)(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(jitted), want)
    with pytest.raises(ValueError, match=r"5 image placeholder token\(s\) \(id 163605\) in the ids but 4 image"):
        merge_image_tokens(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(tokens[:4]))


def test_blockwise_attention_matches_all_at_once_in_values_and_gradients():
    rng = np.random.default_rng(10)
    q, k, v = (jnp.asarray(rng.standard_normal((37, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray([0] * 20 + [1] * 12 + [-1] * 5, jnp.int32)
    whole = packed_attention(q, k, v, seg, scale=0.3, block_q=None)
    np.testing.assert_allclose(np.asarray(packed_attention(q, k, v, seg, scale=0.3, block_q=8)), np.asarray(whole),
                               rtol=1e-6, atol=1e-6)

    def loss(q_, block):
        return jnp.sum(jnp.square(packed_attention(q_, k, v, seg, scale=0.3, block_q=block)))

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(q, 8)), np.asarray(jax.grad(loss)(q, None)),
                               rtol=1e-5, atol=1e-5)
    cfg = VisionConfig(**K3_TINY)
    grids = [(1, 4, 6), (1, 2, 2)]
    pixels = _inputs(grids, seed=11)
    blocked = VisionModel(cfg, rngs=nnx.Rngs(6), attn_block_q=8)
    whole_model = VisionModel(cfg, rngs=nnx.Rngs(6), attn_block_q=None)
    np.testing.assert_allclose(np.asarray(blocked.encode(pixels, grids, pad_to=30)),
                               np.asarray(whole_model.encode(pixels, grids, pad_to=30)), rtol=1e-5, atol=1e-5)
