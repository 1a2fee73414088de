"""Bad input gives a clear error naming the tensor / file before anything is written, and no output directory
(nor a leftover temporary one) appears."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import configs
from k3jax.config import ConfigError
from k3jax.convert.checkpoint import AtomicDir, hf_to_orbax
from k3jax.convert.safetensors_io import CheckpointError
from tests.test_convert_fixtures import write_hf_dir

P = "language_model."


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "hf"
    write_hf_dir(d, configs.get_config("tiny"), k3=True, seed=6, a_log_len=128)
    return str(d)


@pytest.fixture
def hf(base, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(base, d)
    return str(d)


def _index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def _edit(d, name, fn):
    """Rewrites the shard holding `name` with fn(tensors dict) applied; keeps the index in step."""
    idx = _index(d)
    file = idx["weight_map"][name]
    tensors = load_file(os.path.join(d, file))
    fn(tensors)
    save_file(tensors, os.path.join(d, file))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != file}
    idx["weight_map"].update({k: file for k in tensors})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)
    return file


def _fails(hf, tmp_path, pattern, exc=CheckpointError, **kw):
    out = tmp_path / "out"
    with pytest.raises(exc, match=pattern):
        hf_to_orbax(hf, str(out), **kw)
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out.tmp")]


def test_missing_shard(hf, tmp_path):
    os.remove(os.path.join(hf, "model-00002-of-00002.safetensors"))
    _fails(hf, tmp_path, r"missing shard.*model-00002-of-00002\.safetensors")


def test_missing_tensor(hf, tmp_path):
    name = P + "model.layers.5.self_attn.q_proj.weight"
    file = _edit(hf, name, lambda t: t.pop(name))
    _fails(hf, tmp_path, r"missing tensor.*layers\.5\.self_attn\.q_proj\.weight")
    assert file


def test_unexpected_tensor(hf, tmp_path):
    name = P + "model.layers.2.self_attn.q_proj.weight"
    file = _edit(hf, name, lambda t: t.update({P + "model.layers.2.self_attn.mystery.weight": np.zeros(3, np.float32)}))
    _fails(hf, tmp_path, rf"unexpected tensor.*layers\.2\.self_attn\.mystery\.weight' in {file}")


def test_wrong_shape(hf, tmp_path):
    name = P + "model.layers.1.self_attn.k_proj.weight"
    file = _edit(hf, name, lambda t: t.update({name: np.zeros((64, 63), ml_dtypes.bfloat16)}))
    _fails(hf, tmp_path, rf"layers\.1\.self_attn\.k_proj\.weight' in {file} has shape \[64, 63\]; config\.json "
                         rf"implies \[64, 64\]")


def test_wrong_dtype(hf, tmp_path):
    name = P + "model.norm.weight"
    _edit(hf, name, lambda t: t.update({name: np.ones(64, np.int32)}))
    _fails(hf, tmp_path, r"model\.norm\.weight' in .* has dtype I32")
    name = P + "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    _edit(hf, name, lambda t: t.update({name: t[name].astype(np.float32)}))
    _fails(hf, tmp_path, r"experts\.3\.w2\.weight_packed.*must be U8")


def test_truncated_file(hf, tmp_path):
    path = os.path.join(hf, "model-00002-of-00002.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    _fails(hf, tmp_path, r"model-00002-of-00002\.safetensors: truncated file: tensor '.*' ends at byte")
    with open(path, "r+b") as f:
        f.truncate(5)
    _fails(hf, tmp_path, r"model-00002-of-00002\.safetensors: truncated safetensors file")


def test_config_tensor_disagreement(hf, tmp_path):
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["text_config"]["intermediate_size"] = 96
    with open(path, "w") as f:
        json.dump(cfg, f)
    _fails(hf, tmp_path, r"layers\.0\.mlp\.gate_proj\.weight' in .* has shape \[128, 64\]; config\.json implies "
                         r"\[96, 64\]")


def test_nonzero_a_log_tail(hf, tmp_path):
    name = P + "model.layers.0.self_attn.A_log"

    def poke(t):
        t[name] = t[name].copy()
        t[name][5] = 1.0
    _edit(hf, name, poke)
    _fails(hf, tmp_path, r"layers\.0\.self_attn\.A_log.*non-zero entries beyond kda_num_heads=2")


def test_config_mismatch_lists_every_field(hf, tmp_path):
    with pytest.raises(ConfigError) as err:
        hf_to_orbax(hf, str(tmp_path / "out"), config="tiny_kimi_linear")
    msg = str(err.value)
    for field in ("num_hidden_layers", "kda_gate", "kda_output_gate", "q_lora_rank", "attn_res_block_size",
                  "routed_expert_hidden_size", "hidden_act", "mla_use_output_gate"):
        assert f"{field}:" in msg, field
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        hf_to_orbax(hf, str(out))
    assert (out / "keep").exists()
    hf_to_orbax(hf, str(out), overwrite=True)
    assert not (out / "keep").exists() and (out / "manifest.json").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_crash_mid_write_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with AtomicDir(str(out)) as tmp:
            open(os.path.join(tmp, "manifest.json"), "w").close()
            raise RuntimeError("simulated crash")
    assert not out.exists() and not os.listdir(tmp_path)
