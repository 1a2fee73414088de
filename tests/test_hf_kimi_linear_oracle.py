"""External oracle: HF transformers' `KimiLinearForCausalLM` (pure-torch fallback on CPU) and our K3Model built
from `configs.get_config("tiny_kimi_linear")` give the same logits on the same random weights.

The weights travel through `k3jax.convert.transformers_names.release_weights_from_transformers` (transformers'
naming -> release naming) and `load_hf_weights` (release naming -> our layout), once from the in-memory
`state_dict()` and once from what `save_pretrained` writes to disk, so both spellings are pinned.

Every tensor (router bias, norm gains, A_log, dt_bias, conv kernels included) is randomised away from its trivial
init, at scales that keep activations O(1) (logits have std ~1). Measured in float32: max |Δlogits| ~1e-5.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kimi_linear = pytest.importorskip("transformers.models.kimi_linear")

import configs
from k3jax.convert.transformers_names import kimi_linear_config_kwargs, release_weights_from_transformers

BATCH, LENGTH = 2, 37  # 37 > our kda_chunk_size 32: the chunked path crosses a chunk boundary
# Seed of the weights and ids. Chosen (among 0..39) for the largest top-k routing margin, see `_ROUTING_MARGIN`.
SEED = 33
# Max |Δlogits| allowed; logits are O(1) (std ~1, max ~4). Measured 1.2e-5 (f32 rounding, different op orders:
# HF's KDA uses chunk 64 with a sequential triangular solve, ours chunk 32).
ATOL = 1e-4
# Top-k routing is discontinuous: a token whose k-th and (k+1)-th biased scores differ by less than the
# implementations' f32 disagreement can pick different experts, giving an isolated O(1) logit error that says
# nothing about semantics. The disagreement of the router inputs is ~1e-5 at most (the final logits agree to
# ~1e-5), so a score moves by <= sigmoid' * |Δx| * |w_e| ~ 1e-5. We require every routing decision (7 MoE layers x
# 74 tokens) to have margin >= 1e-4 in the HF run, so a flip cannot happen and the tight tolerance holds; the seed
# above gives a minimum margin of ~7e-4. If this precondition fails (e.g. a changed init order), pick another seed:
# do not loosen ATOL.
_ROUTING_MARGIN = 1e-4


def _hf_config(cfg):
    """A transformers KimiLinearConfig with exactly our config's dimensions."""
    mla = [s.index + 1 for s in cfg.layer_specs() if s.attn == "mla"]
    assert tuple(mla) == tuple(sorted(cfg.full_attn_layers)) == (4, 8)
    assert cfg.routed_expert_hidden_size is None and cfg.attn_res_block_size is None  # plain Kimi-Linear
    return kimi_linear.KimiLinearConfig(**kimi_linear_config_kwargs(cfg), dtype="float32",
                                        attn_implementation="eager")


def _randomise(model, gen):
    """Overwrites every parameter and buffer with seeded random values at O(1)-activation scales."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            def normal(std=1.0, mean=0.0, shape=t.shape):
                return mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)

            if name.endswith("A_log"):
                v = normal(0.5)  # decay rate exp(A_log) around 1
            elif name.endswith("dt_bias"):
                v = normal(0.5, -1.0)  # softplus(z + dt_bias) ~ 0.1..1: per-step decays spread over (0, 1)
            elif name.endswith("e_score_correction_bias"):
                v = normal(0.1)
            elif "norm" in name:  # input/post_attention/final/kv_a_layernorm and the KDA o_norm gains
                v = normal(0.1, 1.0)
            elif name.endswith("embed_tokens.weight"):
                v = normal()
            elif t.ndim in (2, 3):  # [out, in] linears, [E, out, in] experts, [C, 1, W] conv: 1/sqrt(fan-in)
                v = normal(1.0 / math.sqrt(t.shape[-1]))
            else:
                raise AssertionError(f"no randomisation rule for {name} {tuple(t.shape)}")
            t.copy_(v)


@pytest.fixture(scope="module")
def oracle():
    """(HF model, ids int64 [B,T], HF logits, min routing margin) for the seeded random weights."""
    cfg = configs.get_config("tiny_kimi_linear")
    hf_cfg = _hf_config(cfg)
    assert [t == "full_attention" for t in hf_cfg.layer_types] == [s.attn == "mla" for s in cfg.layer_specs()]
    assert [t == "dense" for t in hf_cfg.mlp_layer_types] == [s.ffn == "dense" for s in cfg.layer_specs()]
    torch.manual_seed(SEED)  # construction-time init; every value is overwritten below anyway
    model = kimi_linear.KimiLinearForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    _randomise(model, gen)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, LENGTH), generator=gen)

    margins = []

    def record_margin(router, args, _out):
        x = args[0].reshape(-1, router.hidden_dim).float()
        biased = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias
        top = biased.sort(dim=-1, descending=True).values
        margins.append((top[:, router.top_k - 1] - top[:, router.top_k]).min().item())

    hooks = [m.register_forward_hook(record_margin) for m in model.modules()
             if isinstance(m, kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter)]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float().numpy()
    for h in hooks:
        h.remove()
    assert len(margins) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    return model, ids.numpy().astype(np.int32), logits, min(margins)


@pytest.fixture(scope="module")
def ours():
    """Runs our model on release-named weights: `run(weights, ids) -> logits` (one model, compiled once)."""
    from flax import nnx

    from k3jax.convert.hf_names import load_hf_weights
    from k3jax.model import K3Model

    cfg = configs.get_config("tiny_kimi_linear")
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x: m(x))

    def run(weights, ids):
        load_hf_weights(model, weights)
        return np.asarray(forward(model, ids))

    return cfg, run


def _assert_close(got, want):
    err = np.abs(got - want)
    assert err.max() <= ATOL, (
        f"max |Δlogits| {err.max():.3g} (mean {err.mean():.3g}) > {ATOL}; worst positions (b, t): "
        f"{[tuple(int(i) for i in ix) for ix in np.argwhere(err.max(-1) > ATOL)[:8]]}")


def test_logits_match_transformers_state_dict(oracle, ours):
    hf_model, ids, hf_logits, min_margin = oracle
    cfg, run = ours
    assert np.abs(hf_logits).max() > 1.0 and 0.3 < hf_logits.std() < 3.0  # O(1) logits: ATOL is meaningful
    assert min_margin >= _ROUTING_MARGIN, (
        f"routing near-tie in the HF run (min top-k margin {min_margin:.3g} < {_ROUTING_MARGIN}); choose another "
        f"SEED rather than loosening ATOL")
    weights = release_weights_from_transformers(hf_model.state_dict(), cfg)
    _assert_close(run(weights, ids), hf_logits)


def test_logits_match_transformers_save_pretrained(oracle, ours, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    hf_model, ids, hf_logits, _ = oracle
    cfg, run = ours
    hf_model.save_pretrained(tmp_path)
    on_disk = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        on_disk.update(safetensors_numpy.load_file(str(path)))
    assert on_disk, f"save_pretrained wrote no safetensors files: {sorted(p.name for p in tmp_path.iterdir())}"
    # the on-disk spelling differs from the in-memory one (fused experts and conv, forget_gate.*, mlp.*) ...
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in on_disk
    weights = release_weights_from_transformers(on_disk, cfg)
    # ... but both translate to the same release-named tensors
    from_memory = release_weights_from_transformers(hf_model.state_dict(), cfg)
    assert sorted(weights) == sorted(from_memory)
    for name, arr in from_memory.items():
        np.testing.assert_array_equal(weights[name], arr, err_msg=name)
    _assert_close(run(weights, ids), hf_logits)


def test_unmapped_keys_are_named(oracle):
    hf_model, *_ = oracle
    cfg = configs.get_config("tiny_kimi_linear")
    state = dict(hf_model.state_dict())
    state["model.layers.1.self_attn.mystery.weight"] = state["model.norm.weight"]
    state["model.layers.3.self_attn.conv1d.weight"] = state["model.layers.0.self_attn.conv1d.weight"]  # MLA layer
    with pytest.raises(ValueError, match=r"mystery.*layers\.3\.self_attn\.conv1d|layers\.3.*mystery"):
        release_weights_from_transformers(state, cfg)
    state = dict(hf_model.state_dict())
    state["model.layers.1.block_sparse_moe.gate.weight"] = state["model.layers.1.mlp.gate.weight"]
    with pytest.raises(ValueError, match=r"more than once.*layers\.1\.block_sparse_moe\.gate\.weight"):
        release_weights_from_transformers(state, cfg)
