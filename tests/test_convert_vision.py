"""Conversion of a multimodal HF directory: vision tensors are refused unless --text_only, which drops them, says
so, and makes --to_hf write a text-only config.json (no vision_config, no ConditionalGeneration architecture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import configs
from k3jax.convert.checkpoint import hf_to_orbax, orbax_to_hf
from k3jax.convert.hf_config import config_from_hf
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.convert.vision import text_only_hf_config
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def multimodal_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("mm") / "hf"
    write_hf_dir(d, configs.get_config("tiny"), k3=True, seed=2, a_log_len=128, vision=True)
    with open(d / "config.json") as f:
        hf = json.load(f)
    hf["architectures"] = ["KimiK3ForConditionalGeneration"]
    with open(d / "config.json", "w") as f:
        json.dump(hf, f)
    return str(d), hf


def test_vision_tensors_are_refused_without_text_only(multimodal_hf, tmp_path):
    hf_dir, _ = multimodal_hf
    with pytest.raises(CheckpointError, match=r"holds 1 mm_projector\.\* tensor\(s\), 1 vision_tower\.\* "
                                              r"tensor\(s\); .*pass --text_only to drop them"):
        hf_to_orbax(hf_dir, str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt") and os.listdir(tmp_path) == []


def test_text_only_drops_vision_says_so_and_exports_a_text_only_config(multimodal_hf, tmp_path):
    hf_dir, hf = multimodal_hf
    logs = []
    hf_to_orbax(hf_dir, str(tmp_path / "ckpt"), dtype="bf16", experts="mxfp4", text_only=True, log=logs.append)
    assert "text-only conversion: dropped 1 mm_projector.* tensor(s), 1 vision_tower.* tensor(s)" in logs
    with open(tmp_path / "ckpt" / "manifest.json") as f:
        assert json.load(f)["hf"]["dropped_vision_tensors"] == 2
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    with open(tmp_path / "back" / "config.json") as f:
        back = json.load(f)
    assert "vision_config" not in back and back["architectures"] == ["KimiK3ForCausalLM"]
    assert back == text_only_hf_config(hf)
    assert config_from_hf(back).to_dict() == config_from_hf(hf).to_dict()  # the text model is unchanged
    with open(tmp_path / "back" / "model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    assert not [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]


def test_cli_text_only_flag_converts_a_multimodal_directory(multimodal_hf, tmp_path):
    hf_dir, _ = multimodal_hf
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "k3jax.convert", "--hf_dir", hf_dir, "--out", str(tmp_path / "c"),
                          "--text_only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "text-only conversion: dropped 1 mm_projector.* tensor(s), 1 vision_tower.* tensor(s)" in out.stdout
