"""config.json <-> ModelConfig: both formats, aliases, round trips, and the one-error-lists-all check."""

from __future__ import annotations

import dataclasses
import json

import pytest

import configs
from k3jax.config import ConfigError, RuntimeConfig
from k3jax.convert.hf_config import ARCH_FIELDS, check_config, config_from_hf, config_to_hf
from tests.test_convert_fixtures import k3_hf_config, kimi_linear_hf_config


def _arch(cfg):
    return {name: getattr(cfg, name) for name in ARCH_FIELDS if name != "name"}


@pytest.mark.parametrize("name", ["k3", "kimi_linear", "tiny", "tiny_kimi_linear", "k3_gpu"])
def test_config_to_hf_round_trip(name):
    cfg = configs.get_config(name)
    assert _arch(config_from_hf(config_to_hf(cfg))) == _arch(cfg)
    check_config(config_from_hf(config_to_hf(cfg)), cfg)


def test_k3_nested_format():
    cfg = configs.get_config("tiny")
    check_config(config_from_hf(k3_hf_config(cfg, 128)), cfg)
    # linear_attn_config may also sit inside text_config
    hf = k3_hf_config(cfg, 128)
    hf["text_config"]["linear_attn_config"] = hf.pop("linear_attn_config")
    check_config(config_from_hf(hf), cfg)


def test_kimi_linear_flat_format_and_aliases():
    cfg = configs.get_config("tiny_kimi_linear")
    hf = kimi_linear_hf_config(cfg)
    check_config(config_from_hf(hf), cfg)
    hf["num_local_experts"] = hf.pop("num_experts")
    hf["num_experts_per_tok"] = hf.pop("num_experts_per_token")
    check_config(config_from_hf(hf), cfg)


def test_transformers_config_json():
    pytest.importorskip("torch")
    oracle = pytest.importorskip("tests.test_hf_kimi_linear_oracle")
    cfg = configs.get_config("tiny_kimi_linear")
    check_config(config_from_hf(oracle._hf_config(cfg).to_dict()), cfg)


def test_inconsistent_layer_lists():
    hf = kimi_linear_hf_config(configs.get_config("tiny_kimi_linear"))
    hf["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    with pytest.raises(ConfigError, match="partition"):
        config_from_hf(hf)
    hf = kimi_linear_hf_config(configs.get_config("tiny_kimi_linear"))
    hf["num_key_value_heads"] = 1
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        config_from_hf(hf)


def test_check_config_lists_every_field():
    cfg = configs.get_config("tiny")
    other = cfg.replace(hidden_size=32, num_experts=4, kda_gate="softplus")
    with pytest.raises(ConfigError, match="3 field") as err:
        check_config(cfg, other)
    for field in ("hidden_size", "num_experts", "kda_gate"):
        assert f"{field}: config.json has" in str(err.value)
    check_config(cfg, cfg.replace(kda_impl="recurrent", param_dtype="bfloat16"))  # runtime fields are not compared


def test_conversion_ignores_runtime_knobs_without_a_list():
    """Every ModelConfig field but `runtime` is architecture: config_to_hf writes no runtime knob, config_from_hf
    takes none from a config.json that carries some, and check_config lets every knob differ."""
    cfg = configs.get_config("tiny")
    knobs = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert set(ARCH_FIELDS) == {f.name for f in dataclasses.fields(cfg)} - {"runtime"}
    assert not knobs & set(ARCH_FIELDS)
    running = cfg.replace(kda_impl="recurrent", scan_layers=False, remat=False, moe_impl="dense", dtype="bfloat16",
                          param_dtype="bfloat16", kda_chunk_size=16, decode_loop_unroll=3, moe_expert_parallel="off",
                          record_routing_stats=True, routing_histogram_bins=8, mla_decode_impl="xla")
    hf = config_to_hf(running)
    assert hf == config_to_hf(cfg)
    assert not knobs & set(json.dumps(hf).replace('"', " ").split())  # no knob name anywhere in config.json
    check_config(config_from_hf(hf), running)
    hf["text_config"].update(kda_impl="recurrent", scan_layers=False, routing_histogram_bins=8, runtime={})
    assert config_from_hf(hf).runtime == RuntimeConfig()
