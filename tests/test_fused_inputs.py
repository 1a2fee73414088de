"""Fused input projections (k3jax/layers/fused.py, `fuse_input_projections=True`): one matmul on weights
concatenated once gives the logits of the per-weight matmuls, in the full forward and in cached decoding, for the
K3 and Kimi-Linear layer kinds (scanned and unrolled). The fused copy is checked to read only its fused weights:
its original projections are zeroed and its outputs still equal the unfused model's."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.layers.fused import FusedInputs, fused_copy, serving_model
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import GatedMLP
from k3jax.layers.moe import LatentMoE
from k3jax.model import K3Model, init_cache
from tests.conftest import max_rel_err
from tests.test_inference_cache import fixed_routing, tiny_model


def _modules(model, kind):
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, kind)]


def _zero_fused_originals(model) -> int:
    """Rebinds every weight that a FusedInputs replaces to zeros of its shape (new variables: the fused copy
    shares its variables with the source model); returns how many."""
    owners = [m for _, m in nnx.iter_graph(model)
              if isinstance(m, nnx.Module) and getattr(m, "fused_inputs", None) is not None]
    zeroed = 0
    for m in owners:
        for name in m.fused_input_names:
            *path, last = name.split(".")
            owner = functools.reduce(getattr, path, m)
            w = getattr(owner, last)
            setattr(owner, last, nnx.Param(jnp.zeros_like(w.get_value()), **w.get_metadata()))
            zeroed += 1
    return zeroed


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_fused_copy_reads_only_its_fused_weights_and_equals_the_model(name):
    model = tiny_model(name)
    fused, count = fused_copy(model)
    # every attention module and every FFN fuses; the shared experts fuse inside their MoE, not on their own
    attn = _modules(fused, KDA) + _modules(fused, MLA)
    moes, mlps = _modules(fused, LatentMoE), _modules(fused, GatedMLP)
    shared = {id(m.shared_experts) for m in moes if hasattr(m, "shared_experts")}
    assert shared and attn and moes
    for m in attn + moes:
        assert isinstance(m.fused_inputs, FusedInputs), type(m).__name__
    for m in mlps:
        assert (getattr(m, "fused_inputs", None) is None) == (id(m) in shared)
    assert count == len(attn) + len(moes) + len(mlps) - len(shared)
    assert not any(hasattr(m, "fused_inputs") for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module))
    assert _zero_fused_originals(fused) >= 2 * count
    assert all(float(jnp.max(jnp.abs(m.q_proj[...]))) > 0 for m in _modules(model, KDA))  # the source is intact

    cfg = model.cfg
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    full = jax.jit(lambda m, ids: m(ids))
    want, got = full(model, ids), full(fused, ids)
    assert max_rel_err(got, want) < 1e-5

    # cached: a 7-token prefill (one sequence padded to 5), then two one-token decode steps
    step = jax.jit(lambda m, ids, cache, valid: m.forward_cached(ids, cache, valid))
    caches = [init_cache(cfg, 2, 16), init_cache(cfg, 2, 16)]
    valid = jnp.asarray([7, 5], jnp.int32)
    chunks = [(ids[:, :7], valid), (ids[:, 7:8], jnp.ones(2, jnp.int32)), (ids[:, 8:9], jnp.ones(2, jnp.int32))]
    for chunk, v in chunks:
        outs = [step(m, chunk, c, v) for m, c in zip((model, fused), caches)]
        (want, caches[0]), (got, caches[1]) = outs
        for b in range(2):  # positions past a row's valid length are meaningless
            n = int(v[b])
            assert max_rel_err(got[b, :n], want[b, :n]) < 1e-5


def test_schedulers_fuse_when_configured_and_generate_the_same_tokens(caplog):
    name = "tiny_kimi_linear"
    cfg = configs.get_config(name, ["fuse_input_projections=True"])
    on = fixed_routing(K3Model(cfg, rngs=nnx.Rngs(0)))  # the weights of tiny_model(name): same seed
    off = tiny_model(name)
    slots = dict(num_slots=2, max_len=24, decode_steps=2)
    sched_on, sched_off = Scheduler(on, **slots), Scheduler(off, **slots)
    assert len(sched_on.params) > len(sched_off.params)  # the FusedInputs ride along with the originals
    assert not any(hasattr(m, "fused_inputs") for _, m in nnx.iter_graph(on) if isinstance(m, nnx.Module))
    requests = [Request(0, [256, 10, 20, 30, 40], 6, eos_ids=[]), Request(1, [256, 5], 6, eos_ids=[])]
    assert sched_on.generate(requests) == sched_off.generate(requests)

    with caplog.at_level(logging.WARNING, logger="k3jax.layers.fused"):
        assert serving_model(on, mesh=object()) is on
    assert "skipped on a device mesh" in caplog.text


def test_mismatched_fused_names_are_an_error():
    from k3jax.layers.fused import project_inputs

    fused, _ = fused_copy(tiny_model("tiny_kimi_linear"))
    layer = _modules(fused, KDA)[0]
    x = jnp.zeros((1, 2, layer.cfg.hidden_size), layer.cfg.jnp_dtype)
    with pytest.raises(ValueError, match="fused inputs hold"):
        project_inputs(layer, x, ("q_proj", "k_proj"), layer.cfg)
