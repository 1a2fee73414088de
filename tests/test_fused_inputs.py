"""Fused input projections (k3jax/layers/fused.py, `fuse_input_projections=True`): every attention and FFN module
fuses (K3 and Kimi-Linear layer kinds); one matmul on the weights concatenated once gives the logits of the
per-weight matmuls in prefill and decode (scanned and unrolled groups), checked with the fused copy's original
projections zeroed, so it can only pass by reading the fused weights; a scheduler with the option generates the
unfused scheduler's tokens."""

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
        for name in m.input_projection_names():
            *path, last = name.split(".")
            owner = functools.reduce(getattr, path, m)
            w = getattr(owner, last)
            setattr(owner, last, nnx.Param(jnp.zeros_like(w.get_value()), **w.get_metadata()))
            zeroed += 1
    return zeroed


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_every_attention_and_ffn_module_fuses_and_the_source_model_is_untouched(name):
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


def test_fused_copy_reads_only_its_fused_weights_and_decodes_like_the_model():
    """`tiny` (K3 layer kinds, scanned and unrolled groups): a 7-token prefill (one row padded to 5) and a one-token
    decode step through the cached forward, fused copy (originals zeroed) vs the model."""
    model = tiny_model("tiny")
    fused, count = fused_copy(model)
    assert _zero_fused_originals(fused) >= 2 * count
    assert all(float(jnp.max(jnp.abs(m.q_proj[...]))) > 0 for m in _modules(model, KDA))  # the source is intact
    cfg = model.cfg
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    step = jax.jit(lambda m, ids, cache, valid: m.forward_cached(ids, cache, valid))
    caches = [init_cache(cfg, 2, 16), init_cache(cfg, 2, 16)]
    for chunk, valid in ((ids[:, :7], jnp.asarray([7, 5], jnp.int32)), (ids[:, 7:8], jnp.ones(2, jnp.int32))):
        (want, caches[0]), (got, caches[1]) = (step(m, chunk, c, valid) for m, c in zip((model, fused), caches))
        for b in range(2):  # positions past a row's valid length are meaningless
            n = int(valid[b])
            assert max_rel_err(got[b, :n], want[b, :n]) < 1e-5


def test_schedulers_fuse_when_configured_and_generate_the_same_tokens(caplog):
    name = "tiny_kimi_linear"
    cfg = configs.get_config(name, ["fuse_input_projections=True"])
    on = fixed_routing(K3Model(cfg, rngs=nnx.Rngs(0)))  # the weights of tiny_model(name): same seed
    off = tiny_model(name)
    slots = dict(num_slots=2, max_len=32, decode_steps=2)  # tests/test_inference_scheduler.py's: shared compiles
    sched_on, sched_off = Scheduler(on, **slots), Scheduler(off, **slots)
    assert len(sched_on.params) > len(sched_off.params)  # the FusedInputs ride along with the originals
    assert not any(hasattr(m, "fused_inputs") for _, m in nnx.iter_graph(on) if isinstance(m, nnx.Module))
    requests = [Request(0, [256, 10, 20, 30, 40], 6, eos_ids=[]), Request(1, [256, 5], 6, eos_ids=[])]
    assert sched_on.generate(requests) == sched_off.generate(requests)

    with caplog.at_level(logging.WARNING, logger="k3jax.layers.fused"):
        assert serving_model(on, mesh=object()) is on
    assert "skipped on a device mesh" in caplog.text


def test_fused_inputs_that_do_not_match_the_module_are_an_error():
    from k3jax.layers.fused import project_inputs

    fused, _ = fused_copy(tiny_model("tiny_kimi_linear"))
    layer = _modules(fused, KDA)[0]
    x = jnp.zeros((1, 2, layer.cfg.hidden_size), layer.cfg.jnp_dtype)
    assert set(project_inputs(layer, x, layer.cfg)) == set(layer.input_projection_names())
    layer.fused_inputs = FusedInputs(layer.fused_inputs[...][:, 1:])  # a column short of the weights it fuses
    with pytest.raises(ValueError, match="fused inputs have .* columns, the weights of"):
        project_inputs(layer, x, layer.cfg)
