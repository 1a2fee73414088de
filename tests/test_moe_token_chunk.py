"""`moe_token_chunk`: the single-program dropless experts over pieces of tokens give the unchunked layer's output,
gradients and routing statistics (k3jax/ops/moe.py::_experts_in_pieces)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.config import ConfigError
from k3jax.layers.moe import LatentMoE
from tests.helpers import layer_output_and_grads

B, T = 2, 24  # 48 tokens: pieces of 20 leave a partly padded third piece


def _layer(chunk: int, dtype: str) -> LatentMoE:
    overrides = [f"param_dtype={dtype}", f"dtype={dtype}", f"moe_token_chunk={chunk}", "record_routing_stats=true"]
    cfg = configs.get_config("tiny", overrides)
    return LatentMoE(cfg, rngs=nnx.Rngs(5))


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_chunked_routed_experts_equal_the_unchunked_layer_with_gradients_and_statistics(dtype, rtol):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, _layer(0, dtype).cfg.hidden_size)), dtype)
    whole, pieces = _layer(0, dtype), _layer(20, dtype)
    y0, g0 = layer_output_and_grads(whole, x)
    y1, g1 = layer_output_and_grads(pieces, x)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    # each token's rows are computed as in the unchunked call: the output is identical
    np.testing.assert_array_equal(f(y1), f(y0))
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):  # the weights' gradients sum over pieces: f32 summation order
        np.testing.assert_allclose(f(b), f(a), rtol=rtol, atol=rtol * max(np.abs(f(a)).max(), 1e-30))
    for name in ("margin_counts", "expert_loads", "expert_parallel_stats"):
        np.testing.assert_array_equal(getattr(pieces, name)[...], getattr(whole, name)[...])


def test_chunked_layer_runs_three_pieces_and_short_inputs_stay_unchunked():
    layer = _layer(20, "float32")
    x = jnp.zeros((B, T, layer.cfg.hidden_size), jnp.float32)
    graphdef, state = nnx.split(layer)
    jaxpr = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
    assert "length=3" in jaxpr  # ceil(48 / 20) pieces in one map
    short = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x[:, :8]))  # 16 tokens <= 20
    assert "length=" not in short


def test_negative_token_chunk_is_refused():
    with pytest.raises(ConfigError, match="moe_token_chunk"):
        configs.get_config("tiny", ["moe_token_chunk=-1"])
