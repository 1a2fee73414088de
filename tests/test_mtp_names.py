"""The MTP layer's DeepSeek-style HF names (`k3jax.convert.mtp_names`): export then load restores every variable,
eh_proj keeps DeepSeek's [embedding; hidden] input order, shared copies are exported, missing tensors are named."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.convert.hf_names import MissingTensorError
from k3jax.convert.mtp_names import export_mtp_hf_weights, load_mtp_hf_weights
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer

CFG = configs.get_config("tiny")


def _flat(module):
    state = nnx.state(module, nnx.Variable)
    return {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def test_export_then_load_restores_every_variable():
    src, dst = MTPLayer(CFG, rngs=nnx.Rngs(1)), MTPLayer(CFG, rngs=nnx.Rngs(2))
    weights = export_mtp_hf_weights(src)
    n = CFG.num_hidden_layers
    d = CFG.hidden_size
    assert weights[f"model.layers.{n}.eh_proj.weight"].shape == (d, 2 * d)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "self_attn.kv_b_proj.weight",
                 "block_sparse_moe.experts.0.w1.weight", "block_sparse_moe.gate.e_score_correction_bias"):
        assert f"model.layers.{n}.{name}" in weights, name
    assert all(k.startswith(f"model.layers.{n}.") for k in weights)
    load_mtp_hf_weights(dst, weights)
    want, got = _flat(src), _flat(dst)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=".".join(key))


def test_eh_proj_takes_the_embedding_first_like_deepseek():
    mtp = MTPLayer(CFG, rngs=nnx.Rngs(1))
    w = export_mtp_hf_weights(mtp)
    n = CFG.num_hidden_layers
    h_btd, e_btd = jax.random.normal(jax.random.key(0), (2, 1, 3, CFG.hidden_size))

    def rms(x, g):
        x = np.asarray(x, np.float64)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + CFG.rms_norm_eps) * g

    x = np.concatenate([rms(e_btd, w[f"model.layers.{n}.enorm.weight"]),
                        rms(h_btd, w[f"model.layers.{n}.hnorm.weight"])], -1)
    want = x @ w[f"model.layers.{n}.eh_proj.weight"].T
    np.testing.assert_allclose(np.asarray(mtp._fuse(h_btd, e_btd)), want, rtol=1e-4, atol=1e-4)


def test_shared_copies_exported_and_missing_tensor_named():
    model = K3Model(CFG, rngs=nnx.Rngs(0))
    mtp = MTPLayer(CFG, rngs=nnx.Rngs(1))
    weights = export_mtp_hf_weights(mtp, model)
    n = CFG.num_hidden_layers
    np.testing.assert_array_equal(weights[f"model.layers.{n}.embed_tokens.weight"], np.asarray(model.embed_tokens[...]))
    head = weights[f"model.layers.{n}.shared_head.head.weight"]
    assert head.shape == (CFG.vocab_size, CFG.hidden_size)
    assert not CFG.tie_word_embeddings
    np.testing.assert_array_equal(head, np.asarray(model.lm_head[...]).T)
    del weights[f"model.layers.{n}.hnorm.weight"]
    with pytest.raises(MissingTensorError, match=f"model.layers.{n}.hnorm.weight"):
        load_mtp_hf_weights(MTPLayer(CFG, rngs=nnx.Rngs(2)), weights)
