"""HF -> Orbax -> HF is bit-exact (K3 with packed MXFP4 experts kept packed; Kimi-Linear f32), bf16 expert
decoding writes the exact decoded values, the CLI works end to end, and the written files are readable by the
reference `safetensors` library."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import configs
import k3jax
from k3jax.convert.checkpoint import hf_to_orbax
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.convert.vision import text_only_hf_config
from tests.conftest import jit_call
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_all(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(os.path.join(d, file), "numpy") as g:
            for k in g.keys():
                assert weight_map[k] == file
                out[k] = g.get_tensor(k)
    return out


def _assert_bit_exact(got, want):
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:10]
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (k, got[k].dtype, want[k].dtype)
        assert got[k].tobytes() == want[k].tobytes(), k


@pytest.fixture(scope="module")
def k3_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3") / "hf"
    decoded, stored = write_hf_dir(d, configs.get_config("tiny"), k3=True, seed=3, a_log_len=128, n_shards=3)
    return str(d), decoded, stored


def test_k3_roundtrip_bit_exact_with_packed_experts(k3_hf, tmp_path):
    hf_dir, _, stored = k3_hf
    hf_to_orbax(hf_dir, str(tmp_path / "ckpt"), dtype="bf16", experts="mxfp4")
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), max_shard_bytes=40_000)
    assert len([f for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors")]) >= 2
    want = {k: v for k, v in stored.items() if not k.startswith("vision_tower.")}  # vision is not converted
    _assert_bit_exact(_read_all(str(tmp_path / "back")), want)
    with open(os.path.join(hf_dir, "config.json")) as f, open(tmp_path / "back" / "config.json") as g:
        assert json.load(g) == text_only_hf_config(json.load(f))  # the checkpoint holds no vision tower


def test_k3_bf16_experts_are_exact_decodes(k3_hf, tmp_path):
    hf_dir, decoded, stored = k3_hf
    hf_to_orbax(hf_dir, str(tmp_path / "ckpt"), dtype="bf16", experts="bf16")
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    got = _read_all(str(tmp_path / "back"))
    for k, v in stored.items():
        if k.endswith("_packed"):
            name = k[:-len("_packed")]
            assert got[name].dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got[name].astype(np.float32), decoded[name[len("language_model."):]])
        elif not k.endswith("_scale") and not k.startswith("vision_tower."):
            assert got[k].tobytes() == v.tobytes() and got[k].dtype == v.dtype, k
    with open(tmp_path / "back" / "config.json") as f:
        assert "quantization_config" not in json.load(f)  # experts are no longer quantized
    # the two checkpoints load to the same model (kept-packed experts are decoded on load)
    a = nnx.state(k3jax.load_checkpoint(str(tmp_path / "ckpt"))[1], nnx.Variable)
    hf_to_orbax(hf_dir, str(tmp_path / "packed"), dtype="bf16", experts="mxfp4")
    b = nnx.state(k3jax.load_checkpoint(str(tmp_path / "packed"))[1], nnx.Variable)
    for (ka, va), (kb, vb) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b)):
        assert ka == kb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))


def test_kimi_linear_roundtrip_bit_exact_via_cli(tmp_path):
    cfg = configs.get_config("tiny_kimi_linear")
    _, stored = write_hf_dir(tmp_path / "hf", cfg, k3=False, seed=4)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for args in (["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--config", "tiny_kimi_linear"],
                 ["--to_hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]):
        res = subprocess.run([sys.executable, "-m", "k3jax.convert", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        # its own progress lines only: no library INFO line (Orbax logs one per array saved or loaded)
        info = [line for line in res.stderr.splitlines() if re.match(r"I\d{4} ", line)]
        assert not info, info[:3]
        assert res.stdout.splitlines()[-1].startswith("wrote "), res.stdout[-1000:]
    _assert_bit_exact(_read_all(str(tmp_path / "back")), stored)
    # the written directory converts again (HF -> Orbax -> HF -> Orbax)
    cfg2, _ = k3jax.load_hf(str(tmp_path / "back"))
    assert cfg2.hidden_size == cfg.hidden_size and cfg2.kda_gate == "softplus"


def test_save_checkpoint_then_to_hf_then_load_hf(k3_hf, tmp_path):
    _, model = k3jax.load_hf(k3_hf[0], dtype="f32", config="tiny")  # a live model (no HF config recorded)
    k3jax.save_checkpoint(model, str(tmp_path / "ckpt"))
    orbax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))  # no source config: config.json generated
    cfg2, back = k3jax.load_hf(str(tmp_path / "hf"), config="tiny")
    for (ka, va), (kb, vb) in zip(nnx.to_flat_state(nnx.state(model, nnx.Variable)),
                                  nnx.to_flat_state(nnx.state(back, nnx.Variable))):
        assert ka == kb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()), err_msg=str(ka))


@pytest.mark.slow
def test_checkpoint_saved_with_a_layer_scan_loads_unrolled_with_the_same_logits(k3_hf, tmp_path):
    """serve.py loads unrolled (scan_layers=False) by default: a checkpoint written from a scanned model must load
    into the unrolled layout and compute the same function."""
    import jax.numpy as jnp

    cfg, model = k3jax.load_hf(k3_hf[0], dtype="f32", config="tiny")
    assert cfg.runtime.scan_layers
    k3jax.save_checkpoint(model, str(tmp_path / "ckpt"))
    cfg2, unrolled = k3jax.load_checkpoint(str(tmp_path / "ckpt"), overrides=["scan_layers=False"])
    assert not cfg2.runtime.scan_layers
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    np.testing.assert_allclose(np.asarray(jit_call(unrolled, ids)), np.asarray(jit_call(model, ids)), rtol=1e-3,
                               atol=1e-3)  # f32 op order


def test_checkpoint_config_nests_runtime_and_loads_with_other_knobs_or_older_flat_configs(k3_hf, tmp_path):
    """A checkpoint's config.json nests the runtime knobs; one written flat (older checkpoints) loads the same;
    a load may change any runtime knob (`knob=` or `runtime.knob=`), never an architecture field."""
    ckpt = str(tmp_path / "ckpt")
    hf_to_orbax(k3_hf[0], ckpt, config="tiny", dtype="f32", experts="mxfp4")
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        saved = json.load(f)
    assert saved["runtime"]["param_dtype"] == "float32" and "kda_impl" not in saved
    with open(path, "w") as f:
        json.dump({k: v for k, v in saved.items() if k != "runtime"} | saved["runtime"], f)
    cfg, _ = k3jax.load_checkpoint(ckpt, overrides=["runtime.kda_impl=recurrent", "decode_loop_unroll=3"])
    assert (cfg.runtime.kda_impl, cfg.runtime.decode_loop_unroll) == ("recurrent", 3)
    assert cfg.replace(runtime=saved["runtime"]) == configs.get_config("tiny").replace(name=cfg.name)
    with pytest.raises(ValueError, match="only runtime fields can be overridden"):
        k3jax.load_checkpoint(ckpt, overrides=["hidden_size=32"])
