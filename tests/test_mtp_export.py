"""The MTP layer through checkpoints and `--to_hf`: `save_checkpoint(..., mtp=)` keeps it as the `mtp` item,
`--to_hf` writes it under the DeepSeek-style names (bit-exact with --dtype f32, the release's dtypes by default),
conversion back from HF keeps it, and the serving draft (`make_draft("mtp", ...)`, what `serve.py
--speculative=mtp` calls) loads it from the HF directory and from either checkpoint."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import configs
import k3jax
from k3jax.convert.checkpoint import K3_PREFIX, hf_to_orbax
from k3jax.convert.mtp_names import export_mtp_hf_weights, mtp_prefix
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.inference.spec_scheduler import make_draft
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer


def _tensors(hf_dir) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(os.listdir(hf_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, file), "numpy") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _flat(module) -> dict:
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(module, nnx.Variable))}


def _draft_weights(model, path) -> dict:
    logs = []
    draft = make_draft("mtp", 2, model, path, logs.append)
    assert logs == [f"MTP draft loaded from {path}"]
    return _flat(nnx.merge(draft.graphdef, draft.params))


def test_to_hf_writes_the_mtp_layer_and_the_serving_draft_loads_it_back(tmp_path):
    cfg = configs.get_config("tiny").replace(param_dtype="float32", dtype="float32")
    model, mtp = K3Model(cfg, rngs=nnx.Rngs(0)), MTPLayer(cfg, rngs=nnx.Rngs(1))
    want = _flat(mtp)
    ckpt = k3jax.save_checkpoint(model, str(tmp_path / "ckpt"), mtp=mtp)
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["hf"]["mtp"]["hash"]

    orbax_to_hf(ckpt, str(tmp_path / "hf"), dtype="f32")
    tensors = _tensors(tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config.get("text_config", hf_config)["num_nextn_predict_layers"] == 1
    prefix = K3_PREFIX if cfg.uses_attn_res else ""
    layer = prefix + mtp_prefix(cfg)
    exported = export_mtp_hf_weights(mtp)
    assert {k for k in tensors if k.startswith(layer)} == {prefix + k for k in exported}
    for k, v in exported.items():
        np.testing.assert_array_equal(tensors[prefix + k], v, err_msg=k)

    for path in (ckpt, str(tmp_path / "hf"), hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "back"))):
        got = _draft_weights(model, path)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{path}: {k}")
    for _, loaded in (k3jax.load_hf(str(tmp_path / "hf")), k3jax.load_checkpoint(ckpt)):  # the text model loads
        np.testing.assert_array_equal(np.asarray(loaded.embed_tokens[...]), np.asarray(model.embed_tokens[...]))

    orbax_to_hf(ckpt, str(tmp_path / "hf_bf16"))  # the default: the release's dtypes
    bf16 = _tensors(tmp_path / "hf_bf16")
    for k, v in exported.items():  # bf16 but for the few tensors a bf16 model keeps in f32
        assert str(bf16[prefix + k].dtype) in ("bfloat16", "float32"), k
        np.testing.assert_array_equal(bf16[prefix + k], v.astype(bf16[prefix + k].dtype), err_msg=k)
    assert sum(str(bf16[prefix + k].dtype) == "bfloat16" for k in exported) > 0.8 * len(exported)


def test_a_checkpoint_without_an_mtp_layer_is_a_clear_draft_error(tmp_path):
    cfg = configs.get_config("tiny")
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    ckpt = k3jax.save_checkpoint(model, str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["hf"]["mtp"] is None
    with pytest.raises(ValueError, match="holds no MTP layer"):
        make_draft("mtp", 2, model, ckpt, print)
    orbax_to_hf(ckpt, str(tmp_path / "hf"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config.get("text_config", hf_config)["num_nextn_predict_layers"] == 0
    assert not any(k.startswith(mtp_prefix(cfg)) or ".layers.%d." % cfg.num_hidden_layers in k
                   for k in _tensors(tmp_path / "hf"))
    with pytest.raises(ValueError, match="no MTP tensor"):
        make_draft("mtp", 2, model, str(tmp_path / "hf"), print)


@pytest.mark.slow  # three conversions (~20 s on 2 cores); the dense export is checked in the default suite
def test_to_hf_with_mxfp4_experts_packs_the_mtp_experts_and_the_draft_decodes_them(tmp_path):
    """`--experts mxfp4` writes the MTP layer's routed experts as the model's are (codes + scales); the draft loads
    them as the MXFP4 fake-quantisation of the trained weights (`fake_quant_mxfp4` along the input axis), and
    `--experts bf16` of a checkpoint converted back writes those values dense again."""
    import jax.numpy as jnp

    from k3jax.convert.mtp_names import PACKED, SCALE, mtp_entries, mtp_expert_names
    from k3jax.ops.mx_quant import fake_quant_mxfp4

    cfg = configs.get_config("tiny").replace(param_dtype="float32", dtype="float32")
    model, mtp = K3Model(cfg, rngs=nnx.Rngs(0)), MTPLayer(cfg, rngs=nnx.Rngs(1))
    expert_paths = {".".join(p) for p, _, kind, _ in mtp_entries(mtp) if kind == "experts"}
    want = {k: np.asarray(fake_quant_mxfp4(jnp.asarray(v), axis=1)) if k in expert_paths else v
            for k, v in _flat(mtp).items()}
    ckpt = k3jax.save_checkpoint(model, str(tmp_path / "ckpt"), mtp=mtp)
    orbax_to_hf(ckpt, str(tmp_path / "hf"), dtype="f32", experts="mxfp4")
    tensors = _tensors(tmp_path / "hf")
    prefix = K3_PREFIX if cfg.uses_attn_res else ""
    names = mtp_expert_names(cfg)
    assert expert_paths and len(names) == 3 * cfg.num_experts
    assert not {prefix + n for n in names} & tensors.keys()
    assert all(tensors[prefix + n + PACKED].dtype == np.uint8 and prefix + n + SCALE in tensors for n in names)

    got = _draft_weights(model, str(tmp_path / "hf"))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    back = hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "back"))
    orbax_to_hf(back, str(tmp_path / "dense"), dtype="f32", experts="bf16")
    dense = _tensors(tmp_path / "dense")
    assert not any(k.endswith((PACKED, SCALE)) for k in dense)
    got = _draft_weights(model, str(tmp_path / "dense"))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
