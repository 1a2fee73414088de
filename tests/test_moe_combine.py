"""The dropless MoE combine (`k3jax.layers.moe.experts_dropless`) equals every expert on every token weighted by the
routing (`experts_dense`), and gathers its output rows instead of scatter-adding them: a GPU scatter-add adds with
atomics in a run-dependent order, which made greedy decoding of identical k3_gpu runs differ (RESULTS.md)."""

import jax
import jax.numpy as jnp
import numpy as np

import configs
from k3jax.layers import moe
from tests.conftest import moe_problem


def _inputs(n=7, seed=0):
    p = moe_problem(n, seed)
    return p.cfg, p.z, p.weights, p.experts, p.w1, p.w3, p.w2


def _float_scatter_adds(jaxpr) -> list:
    """The floating-point scatter-adds of a jaxpr and its sub-jaxprs (an integer one, bincount's, is exact)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
            found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                found += _float_scatter_adds(getattr(inner, "jaxpr", inner))
    return found


def test_dropless_combine_equals_every_expert_on_every_token():
    cfg, z, weights, experts, w1, w3, w2 = _inputs()
    got = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg)
    want = moe.experts_dense(z, weights, experts, w1, w3, w2, cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_dropless_combine_gathers_instead_of_scatter_adding():
    cfg, z, weights, experts, w1, w3, w2 = _inputs()
    jaxpr = jax.make_jaxpr(lambda *a: moe.experts_dropless(*a, cfg))(z, weights, experts, w1, w3, w2)
    assert not _float_scatter_adds(jaxpr.jaxpr)
    # the test can fail: the previous combine, a weighted scatter-add of the expert-sorted rows, is caught
    rows = jnp.ones((14, 32), jnp.float32)
    old = jax.make_jaxpr(lambda r, t: jnp.zeros((7, 32), r.dtype).at[t].add(r))(rows, jnp.arange(14) // 2)
    assert len(_float_scatter_adds(old.jaxpr)) == 1


def test_group_walk_with_xla_routing_equals_the_tile_walk_and_every_expert(monkeypatch):
    """`moe_gmm_walk="groups"` on the XLA routing: the GPU kernels (the interpreter here) walk expert groups for the
    fused GLU and the down gmm, and give the tile walk's result and every-expert-on-every-token's."""
    from k3jax.ops import gmm as gmm_ops
    from pallas_kernels.gmm import gpu as gmm_gpu

    cfg, z, weights, experts, w1, w3, w2 = _inputs(n=6, seed=3)
    monkeypatch.setattr(gmm_ops, "_kernel_backend_here", lambda: "interpret")
    walks = []
    real = gmm_gpu._group_walk_call
    monkeypatch.setattr(gmm_gpu, "_group_walk_call", lambda *a, **kw: walks.append(kw["name"]) or real(*a, **kw))
    tiles = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg)
    assert not walks
    groups = moe.experts_dropless(z, weights, experts, w1, w3, w2, cfg, group_walk=True)
    assert len(walks) == 2, walks  # the fused GLU and the down projection
    want = moe.experts_dense(z, weights, experts, w1, w3, w2, cfg)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(groups), np.asarray(tiles), rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(groups), np.asarray(want), rtol=2e-5, atol=2e-5 * scale)


def test_latent_moe_walks_groups_only_when_configured_in_decode_steps_on_the_gpu_kernel_family(monkeypatch):
    import flax.nnx as nnx

    from k3jax.ops import gmm as gmm_ops

    for walk, backend, want in (("tiles", "gpu", False), ("groups", "gpu", True), ("groups", "interpret", True),
                                ("groups", "tpu", False), ("groups", None, False)):
        cfg = configs.get_config("tiny", [f"moe_gmm_walk={walk}"])
        layer = nnx.eval_shape(lambda cfg=cfg: moe.LatentMoE(cfg, rngs=nnx.Rngs(0)))
        monkeypatch.setattr(gmm_ops, "_kernel_backend_here", lambda b=backend: b)
        assert layer._group_walk(1) is want, (walk, backend)
        assert layer._group_walk(7) is False  # prefill / training: the tile walk
