"""Config validation names the bad field; the layer map, dense/MoE map, AttnRes snapshots and scan groups derive
from the released fields exactly as the spec says; parameter counts match the spec and the reference."""

import math

import pytest

import configs
from k3jax.config import ConfigError, ModelConfig, RuntimeConfig
from k3jax.param_count import count_params
from tests.reference import numpy_k3 as ref


@pytest.mark.parametrize("overrides,message", [
    (dict(hidden_size=0), "hidden_size must be > 0"),
    (dict(hidden_size=64.0), "hidden_size must be an int"),
    (dict(kda_gate="relu"), "kda_gate must be one of"),
    (dict(full_attn_layers=(4, 94)), "out of range: [94]"),
    (dict(num_experts_per_token=1000), "num_experts_per_token=1000 exceeds num_experts=896"),
    (dict(kda_gate_lower_bound=1.0), "kda_gate_lower_bound must be < 0"),
    (dict(dtype="fp8"), "dtype must be one of"),
    (dict(routed_expert_hidden_size=None), "latent_moe_use_norm=True needs routed_expert_hidden_size"),
    (dict(num_expert_group=3), "not divisible by num_expert_group=3"),
    (dict(kda_decode_block_v=24), "kda_decode_block_v must be a power of two >= 16"),
    (dict(kda_decode_warps=3), "kda_decode_warps must be a power of two >= 1"),
    (dict(decode_loop_unroll=0), "decode_loop_unroll must be >= 1"),
    (dict(mla_decode_splits=-1), "mla_decode_splits must be >= 0"),
    (dict(moe_decode_row_tile=8), "moe_decode_row_tile must be a power of two >= 16"),
    (dict(moe_assigned_down_tiling="64-100-4-4"), "moe_assigned_down_tiling: tk and tn must be powers of two"),
    (dict(moe_assigned_glu_tiling="64-128"), "moe_assigned_glu_tiling must be 'tk-tn-warps-stages'"),
    (dict(moe_assigned_order="row"), "moe_assigned_order must be one of"),
])
def test_invalid_fields_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        configs.get_config("k3").replace(**overrides)
    assert message in str(err.value)


def test_unknown_keys_suggest_the_closest_field():
    with pytest.raises(ConfigError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\)"):
        ModelConfig.from_dict({"hiden_size": 3})
    with pytest.raises(ConfigError, match="unknown config 'k4'"):
        configs.get_config("k4")


def test_runtime_knobs_route_through_replace_set_and_from_dict():
    """A key naming a runtime knob (`knob` or `runtime.knob`) lands in `cfg.runtime`; architecture keys stay on the
    config; to_dict nests the knobs and from_dict reads that back, or the flat form older files hold."""
    cfg = configs.get_config("tiny")
    got = cfg.replace(kda_impl="recurrent", hidden_size=96, **{"runtime.remat": False})
    assert (got.runtime.kda_impl, got.runtime.remat, got.hidden_size) == ("recurrent", False, 96)
    assert got.runtime == cfg.runtime.replace(kda_impl="recurrent", remat=False)
    assert cfg.replace(runtime={"scan_layers": False}).runtime == cfg.runtime.replace(scan_layers=False)
    assert cfg.replace(runtime=RuntimeConfig()).runtime == RuntimeConfig()
    set_ = configs.get_config("tiny", ["runtime.kda_chunk_size=16", "moe_decode_row_tile=32", "kda_impl=chunked"])
    assert (set_.runtime.kda_chunk_size, set_.runtime.moe_decode_row_tile, set_.runtime.kda_impl) == (
        16, 32, "chunked")
    assert set_.runtime.param_dtype == "float32"  # the named config's other knobs are kept
    d = got.to_dict()
    assert d["runtime"]["kda_impl"] == "recurrent" and "kda_impl" not in d and d["hidden_size"] == 96
    assert ModelConfig.from_dict(d) == got
    flat = {k: v for k, v in d.items() if k != "runtime"} | d["runtime"]
    assert ModelConfig.from_dict(flat) == got
    with pytest.raises(ConfigError, match="kda_chunk_size must be > 0"):
        cfg.replace(kda_chunk_size=0)
    with pytest.raises(ConfigError, match="runtime must be a RuntimeConfig"):
        ModelConfig(runtime="fast")
    with pytest.raises(ConfigError, match="one by one"):
        cfg.with_overrides(["runtime=x"])


def test_unknown_keys_suggest_across_architecture_and_runtime():
    cfg = configs.get_config("tiny")
    with pytest.raises(ConfigError, match=r"'kda_imp' \(did you mean 'kda_impl'\?\)"):
        cfg.replace(kda_imp="chunked")
    with pytest.raises(ConfigError, match=r"'runtime.scan_layer' \(did you mean 'scan_layers'\?\)"):
        configs.get_config("tiny", ["runtime.scan_layer=false"])
    with pytest.raises(ConfigError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\)"):
        configs.get_config("tiny", ["hiden_size=3"])
    with pytest.raises(ConfigError, match=r"'runtime.hidden_size' \(did you mean 'hidden_size'\?\)"):
        cfg.replace(**{"runtime.hidden_size": 3})  # architecture is not reachable under runtime.
    with pytest.raises(ConfigError, match=r"'record_routing_stat' \(did you mean 'record_routing_stats'\?\)"):
        ModelConfig.from_dict({"record_routing_stat": True})


def test_cross_validation_sees_architecture_and_runtime():
    """Checks that need both halves run on the whole config; runtime-only checks on RuntimeConfig alone."""
    with pytest.raises(ConfigError, match="kda_impl='pallas' needs kda_gate='lower_bound'"):
        configs.get_config("tiny_kimi_linear").replace(kda_impl="pallas")
    with pytest.raises(ConfigError, match="MXFP4 group of 32"):
        configs.get_config("tiny").replace(expert_weights="mxfp4", moe_intermediate_size=48)
    with pytest.raises(ConfigError, match="expert_weights='mxfp4' is inference-only"):
        RuntimeConfig(expert_weights="mxfp4", record_routing_stats=True)
    assert all(g.num_repeats == 1 for g in configs.get_config("tiny", ["scan_layers=false"]).layer_groups())


def test_string_overrides_are_parsed_by_field_type():
    cfg = configs.get_config("tiny", ["hidden_size=96", "kda_impl=recurrent", "q_lora_rank=None",
                                      "full_attn_layers=4,8,12,13", "remat=false", "rms_norm_eps=1e-6"])
    assert (cfg.hidden_size, cfg.runtime.kda_impl, cfg.q_lora_rank, cfg.runtime.remat, cfg.rms_norm_eps) == (
        96, "recurrent", None, False, 1e-6)
    with pytest.raises(ConfigError, match="hidden_size needs a int"):
        configs.get_config("tiny", ["hidden_size=big"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        configs.get_config("tiny", ["hidden_size"])


def test_k3_layer_map_from_released_fields():
    cfg = configs.get_config("k3")
    specs = cfg.layer_specs()
    mla = [s.index for s in specs if s.attn == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]  # 0-based 3, 7, ..., 91 and 92
    assert len(mla) == 24 and sum(s.attn == "kda" for s in specs) == 69
    assert [s.index for s in specs if s.ffn == "dense"] == [0]
    assert cfg.num_attn_res_snapshots == 8  # snapshots at layers 0, 12, ..., 84
    groups = [(g.start, len(g.pattern), g.num_repeats) for g in cfg.layer_groups()]
    assert groups == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 4, 22), (92, 1, 1)]
    assert cfg.layer_groups()[4].pattern == (("kda", "moe"),) * 3 + (("mla", "moe"),)


def test_tiny_has_every_layer_kind():
    cfg = configs.get_config("tiny")
    kinds = {(s.attn, s.ffn) for s in cfg.layer_specs()}
    assert kinds == {("kda", "dense"), ("kda", "moe"), ("mla", "moe")}
    assert cfg.num_attn_res_snapshots >= 2
    assert any(g.num_repeats > 1 for g in cfg.layer_groups())


def test_k3_param_counts_match_the_spec():
    counts = count_params(configs.get_config("k3"))
    assert abs(counts["total_params"] / 2.7795e12 - 1) < 1e-3
    assert abs(counts["active_params"] / 104.2e9 - 1) < 1e-3


@pytest.mark.parametrize("name", ["k3", "kimi_linear", "tiny", "k3_gpu"])
def test_param_count_equals_checkpoint_tensor_sizes(name):
    """Our parameter total equals the sum of the released tensor shapes (the reference's independent table),
    less the router biases, which are state rather than parameters."""
    cfg = configs.get_config(name)
    hf_total = sum(math.prod(shape) for shape in ref.weight_shapes(cfg).values())
    moe_layers = sum(s.ffn == "moe" for s in cfg.layer_specs())
    assert count_params(cfg)["total_params"] == hf_total - moe_layers * cfg.num_experts


def test_k3_gpu_fits_the_brief():
    counts = count_params(configs.get_config("k3_gpu"))
    assert 1e9 <= counts["total_params"] <= 3e9
