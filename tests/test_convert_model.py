"""Converted models compute the right logits: K3 (MXFP4 experts, `language_model.` prefix, A_log tail) and
Kimi-Linear fixtures against the independent float64 reference, and transformers' own `save_pretrained` output
against transformers' logits.

Runtime choices `kda_impl=recurrent, moe_impl=dense` only shorten compilation on 2 CPU cores; both are pinned
equal to the defaults by tests/test_model_matches_numpy_reference.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import k3jax
from k3jax.convert.checkpoint import hf_to_orbax
from tests.reference import numpy_k3 as ref
from tests.test_convert_fixtures import write_hf_dir

FAST = ("kda_impl=recurrent", "moe_impl=dense")
_forward = nnx.jit(lambda m, x: m(x))


def _ids(cfg, seed=1):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (2, 37)).astype(np.int32)


def _params(model):
    return {tuple(str(p) for p in k): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Variable))}


def test_k3_mxfp4_checkpoint_matches_reference(tmp_path):
    cfg = configs.get_config("tiny")
    decoded, _ = write_hf_dir(tmp_path / "hf", cfg, k3=True, seed=1, a_log_len=128)
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), config="tiny", dtype="f32", experts="mxfp4")
    got_cfg, model = k3jax.load_checkpoint(str(tmp_path / "ckpt"), overrides=FAST)
    assert got_cfg.runtime.param_dtype == "float32" and got_cfg.runtime.kda_impl == "recurrent"
    ids = _ids(cfg)
    ours = np.asarray(_forward(model, jnp.asarray(ids)))
    want = ref.forward(decoded, cfg, ids)
    # tolerance as tests/test_model_matches_numpy_reference.py: the random tiny K3 amplifies f32 noise ~1e-3
    np.testing.assert_allclose(ours, want, rtol=0, atol=3e-3 * np.abs(want).max())
    # loading the HF directory directly gives the same parameters as the checkpoint (packed experts decoded)
    _, direct = k3jax.load_hf(str(tmp_path / "hf"), dtype="f32", config="tiny", overrides=FAST)
    a, b = _params(model), _params(direct)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=".".join(k))


def test_kimi_linear_checkpoint_matches_reference(tmp_path):
    cfg = configs.get_config("tiny_kimi_linear")
    decoded, _ = write_hf_dir(tmp_path / "hf", cfg, k3=False, seed=2, a_log_len=2 * cfg.kda_num_heads)
    got_cfg, model = k3jax.load_hf(str(tmp_path / "hf"), overrides=FAST)  # no --config: built from config.json
    assert got_cfg.runtime.param_dtype == "float32"  # from config.json "dtype"
    ids = _ids(cfg, seed=2)
    ours = np.asarray(_forward(model, jnp.asarray(ids)))
    want = ref.forward(decoded, cfg, ids)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_transformers_save_pretrained_converts_and_matches(tmp_path):
    pytest.importorskip("torch")
    oracle_mod = pytest.importorskip("tests.test_hf_kimi_linear_oracle")
    torch = pytest.importorskip("torch")
    kimi_linear = pytest.importorskip("transformers.models.kimi_linear")
    cfg = configs.get_config("tiny_kimi_linear")
    torch.manual_seed(oracle_mod.SEED)
    hf_model = kimi_linear.KimiLinearForCausalLM(oracle_mod._hf_config(cfg)).float().eval()
    gen = torch.Generator().manual_seed(oracle_mod.SEED)
    oracle_mod._randomise(hf_model, gen)
    ids = torch.randint(0, cfg.vocab_size, (oracle_mod.BATCH, oracle_mod.LENGTH), generator=gen)
    with torch.no_grad():
        want = hf_model(ids, use_cache=False).logits.float().numpy()
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), config="tiny_kimi_linear")
    _, model = k3jax.load_checkpoint(str(tmp_path / "ckpt"), overrides=FAST)
    got = np.asarray(_forward(model, jnp.asarray(ids.numpy().astype(np.int32))))
    # same seed, weights and tolerance as tests/test_hf_kimi_linear_oracle.py (routing margins checked there)
    assert np.abs(got - want).max() <= oracle_mod.ATOL, np.abs(got - want).max()


def test_loading_onto_a_mesh_places_each_parameter_in_its_sharding(tmp_path):
    """`load_checkpoint(..., mesh=)` / `load_hf(..., mesh=)` build every array straight into the sharding the
    rules give it (stacked layers filled row by row), with the same values as the single-device load."""
    import jax

    from sharding.mesh import make_mesh
    from sharding.shard import plan_shardings

    cfg = configs.get_config("tiny")
    write_hf_dir(tmp_path / "hf", cfg, k3=True, seed=3, a_log_len=128)
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), config="tiny", dtype="f32", experts="mxfp4")
    mesh = make_mesh(data=2, expert=2, model=2)
    _, plain = k3jax.load_checkpoint(str(tmp_path / "ckpt"))
    for load in (lambda: k3jax.load_checkpoint(str(tmp_path / "ckpt"), mesh=mesh),
                 lambda: k3jax.load_hf(str(tmp_path / "hf"), dtype="f32", config="tiny", mesh=mesh)):
        _, sharded = load()
        want_specs = plan_shardings(nnx.state(sharded), mesh, log_fallbacks=False).specs
        a, b = _params(plain), _params(sharded)
        assert a.keys() == b.keys()
        n_sharded = 0
        for path, var in nnx.to_flat_state(nnx.state(sharded, nnx.Variable)):
            key = tuple(str(p) for p in path)
            np.testing.assert_array_equal(a[key], b[key], err_msg=".".join(key))
            arr = var.get_value()
            assert isinstance(arr.sharding, jax.sharding.NamedSharding), key
            assert arr.sharding.spec == want_specs[".".join(key)], key
            n_sharded += any(s is not None for s in arr.sharding.spec)
        assert n_sharded > 10  # the rules really shard this model (not everything replicated)
