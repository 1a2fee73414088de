"""All opt-in decode fusions at once (AttnRes read + norm, MoE routing plan with the expert group walk, KDA decode
with its prologue, split-K projections; kernels through the Pallas interpreter) decode a tiny unrolled model to the
logits and caches of the plain XLA decode, over several steps with a padded slot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import gmm as gmm_ops
from k3jax.ops import kda as kda_ops

@pytest.mark.slow  # ~60 s on 2 cores; these fusions are off by default and each has its own test in the default suite
def test_all_decode_fusions_together_equal_the_xla_decode(monkeypatch):
    import configs

    import pallas_kernels.kda.decode_fused as kda_fused
    import pallas_kernels.moe as moe_kernels
    from k3jax.layers import attn_res
    from k3jax.ops import linear
    from tests.conftest import DecodeHarness, max_rel_err

    base = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32", "scan_layers=False", "kda_impl=pallas"])
    fused = dict(attn_res_impl="pallas", moe_route_impl="pallas", kda_decode_fusion="prologue",
                 decode_matmul_impl="pallas")
    monkeypatch.setattr(kda_ops, "decode_kernel_backend", lambda: "interpret")  # the decode kernels, interpreted
    model = DecodeHarness(base, seed=21)
    ids = model.ids(3, 3)
    valid = jnp.asarray([1, 0, 1], jnp.int32)  # slot 1 is idle: its caches must not move

    def decode(**overrides):
        step, cache, logits = model.step(**overrides), model.cache(3, 16), []
        for t in range(ids.shape[1]):
            out, cache = step(model.params, ids[:, t:t + 1], cache, valid)
            logits.append(out)
        return jnp.concatenate(logits, axis=1), cache

    want, want_cache = decode()  # experts on ragged_dot
    calls = {}

    def spy(module, name):
        real = getattr(module, name)
        patch.setattr(module, name, lambda *a, **kw: calls.__setitem__(name, calls.get(name, 0) + 1) or
                      real(*a, **kw))

    with monkeypatch.context() as patch:  # the expert kernels too (the interpreter standing in for the GPU)
        patch.setattr(gmm_ops, "_kernel_backend_here", lambda: "interpret")
        for module, name in ((attn_res, "_fused_read_norm"), (moe_kernels, "route_plan"),
                             (kda_fused, "kda_decode_fused"), (linear, "_kernel_matmul")):
            spy(module, name)
        got, got_cache = decode(**fused)
    layers, kda_layers = base.num_hidden_layers, base.num_hidden_layers - len(base.full_attn_layers)
    moe_layers = layers - base.first_k_dense_replace
    assert calls["_fused_read_norm"] == 2 * layers + 1 and calls["route_plan"] == moe_layers
    assert calls["kda_decode_fused"] == kda_layers and calls["_kernel_matmul"] > layers, calls
    rows = np.asarray(valid) == 1
    assert max_rel_err(got[rows], want[rows]) < 2e-5
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
        else:
            np.testing.assert_array_equal(a, b)
