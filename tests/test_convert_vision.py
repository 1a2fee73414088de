"""Conversion of a multimodal HF directory: the vision tower and projector go HF -> Orbax -> HF bit-exactly and load
as a VisionModel; vision tensors that disagree with `vision_config` (or come without one) are refused before
anything is written; --text_only drops them, says so, and makes --to_hf write a text-only config.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import configs
from k3jax.convert.checkpoint import hf_to_orbax
from k3jax.convert.hf_config import config_from_hf
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.convert.vision import export_vision_weights, load_vision_weights, text_only_hf_config
from k3jax.convert.vision_load import load_vision_checkpoint
from k3jax.vision import VisionConfig, VisionModel
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = configs.get_config("tiny")
VISION = VisionConfig(vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=48, vt_num_attention_heads=2,
                      qkv_hidden_size=48, mm_hidden_size=32, text_hidden_size=TEXT.hidden_size,
                      init_pos_emb_height=6, init_pos_emb_width=6)


def _read_all(d) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _set_config(d, **changes):
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del hf[k]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    return hf


@pytest.fixture(scope="module")
def multimodal_hf(tmp_path_factory):
    """A tiny K3 directory with a real tiny vision tower (bf16, its own shard) and its vision_config."""
    d = tmp_path_factory.mktemp("mm") / "hf"
    _, stored = write_hf_dir(d, TEXT, k3=True, seed=2, a_log_len=128)
    vision = {k: v.astype(ml_dtypes.bfloat16) for k, v in
              export_vision_weights(VisionModel(VISION, rngs=nnx.Rngs(5))).items()}
    save_file(vision, os.path.join(d, "model-vision.safetensors"), metadata={"format": "pt"})
    with open(d / "model.safetensors.index.json") as f:
        index = json.load(f)
    index["weight_map"].update({k: "model-vision.safetensors" for k in vision})
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    hf = _set_config(d, vision_config=VISION.to_dict(), architectures=["KimiK3ForConditionalGeneration"])
    return str(d), hf, {**stored, **vision}


@pytest.fixture(scope="module")
def converted(multimodal_hf, tmp_path_factory):
    hf_dir = multimodal_hf[0]
    ckpt = str(tmp_path_factory.mktemp("mm_ckpt") / "ckpt")
    logs = []
    hf_to_orbax(hf_dir, ckpt, dtype="bf16", experts="mxfp4", log=logs.append)
    return ckpt, logs


def test_multimodal_round_trip_is_bit_exact_with_the_vision_tower(multimodal_hf, converted, tmp_path):
    _, hf, stored = multimodal_hf
    ckpt, logs = converted
    assert "vision: 18 tensors" in logs  # 2 blocks x 6 + patch, pos grid, final norm + 3 projector tensors
    orbax_to_hf(ckpt, str(tmp_path / "back"), max_shard_bytes=40_000)
    got = _read_all(tmp_path / "back")
    assert sorted(got) == sorted(stored)
    for k, v in stored.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f) == hf


def test_the_vision_tower_loads_from_the_checkpoint(multimodal_hf, converted):
    _, _, stored = multimodal_hf
    from_ckpt = load_vision_checkpoint(converted[0])
    direct = VisionModel(VISION, rngs=nnx.Rngs(0))
    load_vision_weights(direct, {k: v.astype(np.float32) for k, v in stored.items() if k.startswith(("vision_",
                                                                                                     "mm_"))})
    pixels = np.random.default_rng(0).standard_normal((12, 3, 14, 14)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(from_ckpt.encode(pixels, [(1, 2, 6)])),
                                  np.asarray(direct.encode(pixels, [(1, 2, 6)])))


def test_vision_tensors_that_disagree_with_vision_config_are_refused_before_writing(tmp_path):
    d = tmp_path / "hf"
    write_hf_dir(d, TEXT, k3=True, seed=2, a_log_len=128, vision=True)  # two placeholder vision tensors
    with pytest.raises(CheckpointError, match=r"vision tensors disagree with vision_config \(168 problem\(s\)\): "
                                              r"missing 'mm_projector.post_norm.weight'; 'mm_projector.proj.0.weight' "
                                              r"has shape \[16, 16\], expected \[4096, 4096\]"):
        hf_to_orbax(str(d), str(tmp_path / "ckpt"))
    _set_config(d, vision_config=None)
    with pytest.raises(CheckpointError, match=r"holds 1 mm_projector\.\* tensor\(s\), 1 vision_tower\.\* "
                                              r"tensor\(s\) but config.json has no vision_config; pass --text_only"):
        hf_to_orbax(str(d), str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_text_only_drops_vision_says_so_and_exports_a_text_only_config(multimodal_hf, tmp_path):
    hf_dir, hf, stored = multimodal_hf
    logs = []
    hf_to_orbax(hf_dir, str(tmp_path / "ckpt"), dtype="bf16", experts="mxfp4", text_only=True, log=logs.append)
    assert "text-only conversion: dropped 3 mm_projector.* tensor(s), 15 vision_tower.* tensor(s)" in logs
    with open(tmp_path / "ckpt" / "manifest.json") as f:
        hf_meta = json.load(f)["hf"]
    assert hf_meta["dropped_vision_tensors"] == 18 and hf_meta["vision"] is None
    assert load_vision_checkpoint(str(tmp_path / "ckpt")) is None
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    with open(tmp_path / "back" / "config.json") as f:
        back = json.load(f)
    assert "vision_config" not in back and back["architectures"] == ["KimiK3ForCausalLM"]
    assert back == text_only_hf_config(hf)
    assert config_from_hf(back).to_dict() == config_from_hf(hf).to_dict()  # the text model is unchanged
    assert sorted(_read_all(tmp_path / "back")) == sorted(k for k in stored if k.startswith("language_model."))


def test_cli_text_only_flag_converts_a_multimodal_directory(multimodal_hf, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "k3jax.convert", "--hf_dir", multimodal_hf[0], "--out",
                          str(tmp_path / "c"), "--text_only"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "text-only conversion: dropped 3 mm_projector.* tensor(s), 15 vision_tower.* tensor(s)" in out.stdout
