"""Expert parallelism (sharding/expert_parallel.py) on 8 emulated CPU devices.

- The EP routed-experts layer equals the all-experts reference (`k3jax.layers.moe.experts_dense`), outputs and
  gradients, in both modes, including experts that receive no token and one rank receiving every row.
- 'capacity' with a small factor drops exactly the rows an independent NumPy count says (per source device and
  destination rank, first come first served in row order), reports that count, and equals the reference with those
  rows' weights zeroed; the expert-rank load statistics equal a NumPy count.
- `tiny` loss and gradients under meshes (1,8,1,1) and (2,4,1,1) [data, expert, context, model] with the EP path
  (capacity large enough to drop nothing) equal the single-device run, and the EP path really ran (all-to-all in
  the lowered program).

XLA:CPU has no ragged-all-to-all: 'dropless' runs here through `ragged_all_to_all_emulated`; the native op is only
lowered (its program is checked to contain it), not executed.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.config import ConfigError
from k3jax.layers.moe import LatentMoE, experts_dense, route
from k3jax.layers.params import RouterBias
from k3jax.model import K3Model
from sharding import expert_parallel as ep
from sharding.mesh import make_mesh
from sharding.shard import mesh_context, shard_batch
from tests.helpers import make_sharded_loss_and_grad, shard_model

CFG = configs.get_config("tiny")  # E=8 experts, k=2, latent L=32, expert width M=32, f32
E, K, L, M = CFG.num_experts, CFG.num_experts_per_token, CFG.routed_expert_hidden_size, CFG.moe_intermediate_size
B, T = 8, 6


def _weights(seed=0):
    r = np.random.RandomState(seed)
    return (r.randn(E, L, M).astype(np.float32) / math.sqrt(L), r.randn(E, L, M).astype(np.float32) / math.sqrt(L),
            r.randn(E, M, L).astype(np.float32) / math.sqrt(M))


def _routing(kind, seed=1):
    """z [B,T,L], weights [B,T,K], experts [B,T,K] (distinct per token)."""
    r = np.random.RandomState(seed)
    z = r.randn(B, T, L).astype(np.float32)
    weights = r.rand(B, T, K).astype(np.float32) + 0.1
    if kind == "random":
        experts = np.stack([r.permutation(E)[:K] for _ in range(B * T)]).reshape(B, T, K)
        experts[:, :, :] = np.where(experts == 5, 4, experts)  # expert 5 receives nothing ...
        experts[..., 1] = np.where(experts[..., 0] == experts[..., 1], (experts[..., 1] + 2) % 5, experts[..., 1])
    elif kind == "one_rank":  # every row to experts 2 and 3, both on expert rank 1 of 4 (E/R = 2)
        experts = np.broadcast_to(np.array([3, 2]), (B, T, K)).copy()
    else:
        raise ValueError(kind)
    assert all(len(set(row)) == K for row in experts.reshape(-1, K))
    return z, weights, experts.astype(np.int32)


def _dense_reference(z, weights, experts, w1, w3, w2):
    u = experts_dense(jnp.asarray(z.reshape(-1, L)), jnp.asarray(weights.reshape(-1, K)),
                      jnp.asarray(experts.reshape(-1, K)), jnp.asarray(w1), jnp.asarray(w3), jnp.asarray(w2), CFG)
    return np.asarray(u).reshape(B, T, L)


def _run_ep(mesh, mode, factor, z, weights, experts, w, cotangent, cfg=CFG):
    """(u, stats, grads of <u, cotangent> w.r.t. z, weights, w1, w3, w2) of the EP layer, jitted under `mesh`."""

    def f(z, weights, w1, w3, w2):
        u, stats = ep.routed_experts(z, weights, jnp.asarray(experts), w1, w3, w2, cfg, mode=mode,
                                     capacity_factor=factor)
        return jnp.sum(u * cotangent), (u, stats)

    with mesh_context(mesh):
        grads, (u, stats) = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(z, weights, *w)
    return np.asarray(u), np.asarray(stats), [np.asarray(g) for g in grads]


def _dense_grads(z, weights, experts, w, cotangent):
    def f(z, weights, w1, w3, w2):
        u = experts_dense(z.reshape(-1, L), weights.reshape(-1, K), jnp.asarray(experts.reshape(-1, K)), w1, w3, w2,
                          CFG)
        return jnp.sum(u.reshape(B, T, L) * cotangent)

    return [np.asarray(g) for g in jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(z, weights, *w)]


def _numpy_rank_loads(experts, mesh_shape):
    """Global routed rows per expert rank (NumPy)."""
    r = mesh_shape[1]
    return np.bincount((experts.reshape(-1) // (E // r)), minlength=r).astype(np.float64)


# (data, expert, context, model); (1,4,1,2) splits the expert width over 'model', (1,2,2,2) the sequence over context
LAYER_CASES = [
    ("dropless", None, "random", (2, 4, 1, 1)),
    ("dropless", None, "one_rank", (2, 4, 1, 1)),
    ("capacity", 4.0, "one_rank", (1, 4, 1, 2)),
    ("dropless", None, "random", (1, 2, 2, 2)),
    ("local", None, "random", (2, 1, 2, 2)),  # expert axis 1: every expert on each device's own tokens
    ("local", None, "one_rank", (8, 1, 1, 1)),
]


@pytest.mark.parametrize("mode,factor,routing,mesh_shape", LAYER_CASES, ids=lambda v: str(v))
def test_ep_layer_matches_dense_reference(mode, factor, routing, mesh_shape):
    mesh = make_mesh(*mesh_shape)
    w = _weights()
    z, weights, experts = _routing(routing)
    cotangent = np.random.RandomState(7).randn(B, T, L).astype(np.float32)
    u, stats, grads = _run_ep(mesh, mode, factor, z, weights, experts, w, cotangent)
    want = _dense_reference(z, weights, experts, *w)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for name, got, ref in zip(("z", "weights", "w1", "w3", "w2"), grads, _dense_grads(z, weights, experts, w,
                                                                                      cotangent)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * (np.abs(ref).max() or 1.0), err_msg=name)
    loads = _numpy_rank_loads(experts, mesh_shape)
    np.testing.assert_allclose(stats, [loads.max(), loads.mean(), 0.0, B * T * K])
    if routing == "one_rank":
        assert stats[0] == B * T * K  # one rank received every row


def test_local_mode_in_token_pieces_matches_dense_reference():
    """'local' with moe_token_chunk: each device's 12 tokens in pieces of 5 (the last padded) equal the reference."""
    mesh = make_mesh(2, 1, 2, 2)
    w = _weights(3)
    z, weights, experts = _routing("random", seed=4)
    cotangent = np.random.RandomState(9).randn(B, T, L).astype(np.float32)
    cfg = CFG.with_overrides(["moe_token_chunk=5"])
    with mesh_context(mesh):
        lowered = jax.jit(lambda *a: ep.routed_experts(*a, cfg, mode="local")[0]).lower(
            z, weights, jnp.asarray(experts), *w).as_text()
    assert "stablehlo.while" in lowered  # the pieces' loop (the unchunked local program has none)
    u, _, grads = _run_ep(mesh, "local", None, z, weights, experts, w, cotangent, cfg=cfg)
    want = _dense_reference(z, weights, experts, *w)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for name, got, ref in zip(("z", "weights", "w1", "w3", "w2"), grads, _dense_grads(z, weights, experts, w,
                                                                                      cotangent)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * (np.abs(ref).max() or 1.0), err_msg=name)


def test_ep_layer_with_the_pallas_gmm_kernel_inside_shard_map(monkeypatch):
    """The grouped matmul inside the EP shard_map as the Pallas kernel (interpret mode here; the GPU/TPU default)."""
    import functools

    from k3jax.ops import gmm as gmm_ops

    monkeypatch.setattr(ep, "gmm", functools.partial(gmm_ops.gmm, impl="pallas"))
    w = _weights(5)
    z, weights, experts = _routing("random", seed=6)
    cotangent = np.random.RandomState(8).randn(B, T, L).astype(np.float32)
    u, _, grads = _run_ep(make_mesh(2, 4, 1, 1), "dropless", None, z, weights, experts, w, cotangent)
    want = _dense_reference(z, weights, experts, *w)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for name, got, ref in zip(("z", "weights", "w1", "w3", "w2"), grads, _dense_grads(z, weights, experts, w,
                                                                                      cotangent)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * (np.abs(ref).max() or 1.0), err_msg=name)


def _numpy_capacity_drops(experts, mesh_shape, factor):
    """Which rows 'capacity' drops: per source device (its token block) and destination expert rank, rows in row
    order (token-major, then routing slot) take the C = ceil(factor * tokens * k / R) slots (C at most
    tokens * min(k, E/R)); the rest are dropped."""
    data, r, context, _ = mesh_shape
    b_blocks, t_blocks = data * r, context
    bl, tl = B // b_blocks, T // t_blocks
    dropped = np.zeros(experts.shape, bool)
    for bi in range(b_blocks):
        for ti in range(t_blocks):
            block = experts[bi * bl:(bi + 1) * bl, ti * tl:(ti + 1) * tl]  # [bl, tl, K]
            tokens = block.size // K
            cap = max(1, min(tokens * min(K, E // r), math.ceil(factor * tokens * K / r)))
            taken = np.zeros(r, int)
            mask = np.zeros(block.shape, bool)
            for idx in np.ndindex(block.shape):  # row order: token (b, t) major, routing slot minor
                dest = block[idx] // (E // r)
                if taken[dest] < cap:
                    taken[dest] += 1
                else:
                    mask[idx] = True
            dropped[bi * bl:(bi + 1) * bl, ti * tl:(ti + 1) * tl] = mask
    return dropped


@pytest.mark.parametrize("mesh_shape", [(2, 4, 1, 1), (1, 4, 2, 1)], ids=lambda s: "x".join(map(str, s)))
def test_capacity_mode_drops_and_counts_rows_like_numpy(mesh_shape):
    mesh = make_mesh(*mesh_shape)
    w = _weights(3)
    z, weights, experts = _routing("random", seed=4)
    experts[:, :, 0] = np.where(np.arange(T)[None, :] % 2 == 0, 0, experts[:, :, 0])  # crowd rank 0
    experts[..., 1] = np.where(experts[..., 1] == experts[..., 0], 7, experts[..., 1])
    factor = 1.0
    dropped = _numpy_capacity_drops(experts, mesh_shape, factor)
    assert 0 < dropped.sum() < dropped.size / 2  # the case really drops some rows
    cotangent = np.ones((B, T, L), np.float32)
    u, stats, _ = _run_ep(mesh, "capacity", factor, z, weights, experts, w, cotangent)
    want = _dense_reference(z, np.where(dropped, 0.0, weights).astype(np.float32), experts, *w)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    loads = _numpy_rank_loads(experts, mesh_shape)
    np.testing.assert_allclose(stats, [loads.max(), loads.mean(), dropped.sum(), B * T * K])


def test_native_ragged_all_to_all_lowers_with_the_dropless_protocol():
    """The dropless path with the real `ragged_all_to_all` (not executable on XLA:CPU) lowers, forward and backward."""
    mesh = make_mesh(2, 4, 1, 1)
    w = _weights()
    z, weights, experts = _routing("random")

    def loss(z, w1):
        u, _ = ep.routed_experts(z, jnp.asarray(weights), jnp.asarray(experts), w1, w[1], w[2], CFG,
                                 mode="dropless", ragged="native")
        return u.sum()

    with mesh_context(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(z, w[0]).as_text()
    assert text.count("ragged_all_to_all") == 4  # dispatch + return, and their transposes
    assert "all_to_all" in text.replace("ragged_all_to_all", "")  # the counts exchanged first


def test_mode_parsing_and_config_validation():
    assert ep.parse_mode("capacity:2") == ("capacity", 2.0)
    assert ep.parse_mode("capacity") == ("capacity", ep.DEFAULT_CAPACITY_FACTOR)
    assert ep.parse_mode("auto") == ("auto", None)
    for bad in ("capacity:0", "dropless:2", "ragged"):
        with pytest.raises(ValueError, match="moe_expert_parallel"):
            ep.parse_mode(bad)
        with pytest.raises(ConfigError, match="moe_expert_parallel"):
            CFG.replace(moe_expert_parallel=bad)
    assert ep.capacity_per_rank(tokens=6, k=2, num_ranks=4, experts_per_rank=2, factor=1.0) == 3
    assert ep.capacity_per_rank(tokens=6, k=2, num_ranks=4, experts_per_rank=2, factor=100.0) == 12
    assert ep.capacity_per_rank(tokens=6, k=4, num_ranks=8, experts_per_rank=1, factor=100.0) == 6


def test_active_mode_follows_the_context_mesh():
    assert ep.active_mode(CFG, B, T) is None  # no mesh
    with mesh_context(make_mesh(devices=jax.devices()[:1])):
        assert ep.active_mode(CFG, B, T) is None  # one device: the single-program path as it is
    with mesh_context(make_mesh(8, 1, 1, 1)):
        assert ep.active_mode(CFG, B, T) == ("local", None)  # expert axis of 1: each device its own tokens
        assert ep.active_mode(CFG.replace(moe_expert_parallel="capacity:3"), B, T) == ("local", None)
        assert ep.active_mode(CFG.replace(moe_expert_parallel="off"), B, T) is None
        assert ep.active_mode(CFG.replace(moe_impl="dense"), B, T) is None  # per token: GSPMD splits it
        assert ep.active_mode(CFG, 4, T) is None  # batch 4 over data = 8: falls back (logged)
    with mesh_context(make_mesh(2, 4, 1, 1)):
        assert ep.active_mode(CFG, B, T) == ("dropless", None)
        assert ep.active_mode(CFG.replace(moe_expert_parallel="capacity:3"), B, T) == ("capacity", 3.0)
        assert ep.active_mode(CFG.replace(moe_expert_parallel="off"), B, T) is None
        assert ep.active_mode(CFG, 4, T) is None  # batch 4 not divisible by data*expert = 8: 'auto' falls back
        with pytest.raises(ep.ExpertParallelError, match="not divisible by data\\*expert = 8"):
            ep.active_mode(CFG.replace(moe_expert_parallel="dropless"), 4, T)


# ------------------------------------------------------------------------------------------------- whole model
MODEL_BATCH, MODEL_SEQ = 8, 16
# Whole-model EP loss + gradients: the default suite has them through test_sharding_equivalence.py's (2, 4, 1, 1)
# mesh (EP 'auto' = dropless); capacity mode is checked at the layer level above. These compile two tiny models
# each (~100 s on 2 CPU cores): slow suite.
# capacity:8 gives every (source, rank) pair as many slots as the source has rows: nothing can be dropped
MODEL_CASES = [
    pytest.param((2, 4, 1, 1), "capacity:8", marks=pytest.mark.slow),
    pytest.param((1, 8, 1, 1), "capacity:8", marks=pytest.mark.slow),  # ~25 s of compile each
    pytest.param((2, 4, 1, 1), "dropless", marks=pytest.mark.slow),
]


def _build_tiny(expert_parallel="auto"):
    """`tiny` (f32) with routing pinned by a well-separated selection bias (as in test_sharding_equivalence.py)."""
    overrides = ["kda_impl=recurrent", f"moe_expert_parallel={expert_parallel}"]
    model = K3Model(configs.get_config("tiny", overrides), rngs=nnx.Rngs(0))
    biases = nnx.state(model, RouterBias)
    nnx.update(model, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape), biases))
    return model


def _loss_and_grads(model, mesh, ids):
    """One compile of the sharded loss+grad program; returns (loss, grads, its StableHLO text)."""
    shard_model(model, mesh)
    fn = make_sharded_loss_and_grad(model, mesh)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    lowered = fn.jitted.lower(params, rest, shard_batch(ids, mesh))  # traced under the mesh (EP visible)
    loss, grads = lowered.compile()(params, rest, shard_batch(ids, mesh))
    return float(loss), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}, lowered.as_text()


@pytest.fixture(scope="module")
def model_ids():
    return np.random.RandomState(0).randint(0, CFG.vocab_size, (MODEL_BATCH, MODEL_SEQ + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def single_device(model_ids):
    loss, grads, text = _loss_and_grads(_build_tiny(), make_mesh(devices=jax.devices()[:1]), model_ids)
    assert "all_to_all" not in text
    return loss, grads


@pytest.mark.parametrize("shape,expert_parallel", MODEL_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_tiny_loss_and_grads_with_expert_parallel_match_single_device(shape, expert_parallel, model_ids,
                                                                      single_device):
    ref_loss, ref_grads = single_device
    loss, grads, text = _loss_and_grads(_build_tiny(expert_parallel), make_mesh(*shape), model_ids)
    assert "all_to_all" in text  # the EP path is in the program
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key, got in grads.items():
        want = ref_grads[key]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4 * (float(np.abs(want).max()) or 1.0),
                                   err_msg=".".join(map(str, key)))


def _sort_rows(hlo_text: str) -> list[int]:
    """Leading dimension of every sort in a compiled program's HLO."""
    return [int(m) for m in re.findall(r"= \(?[a-z0-9]+\[(\d+)[\],][^\n]*? sort\(", hlo_text)]


def test_data_parallel_moe_sorts_only_each_devices_own_rows():
    """Under a data-only mesh (expert axis 1) each device sorts and computes the expert rows of its own tokens:
    every sort in the compiled forward + backward has B*T*K / 8 rows, none the global B*T*K (GSPMD alone
    gathered the global rows on every device), and the layer equals the single-device layer."""
    cfg = CFG.replace(record_routing_stats=True)
    layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(2).randn(B, T, cfg.hidden_size).astype(np.float32))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    want_y = np.asarray(layer(x))
    want_g = nnx.grad(loss)(layer, x)
    mesh = make_mesh(8, 1, 1, 1)
    with mesh_context(mesh):
        step = nnx.jit(lambda m, x: (m(x), nnx.grad(loss)(m, x)))
        text = step.lower(layer, x).compile().as_text()
        y, g = step(layer, x)
    rows = _sort_rows(text)
    assert rows and max(rows) == B * T * K // 8, rows
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5 * np.abs(want_y).max())
    for (path, got), (_, ref) in zip(nnx.to_flat_state(g), nnx.to_flat_state(want_g)):
        ref = np.asarray(ref.get_value())
        np.testing.assert_allclose(np.asarray(got.get_value()), ref, rtol=1e-4,
                                   atol=1e-5 * (np.abs(ref).max() or 1.0), err_msg=str(path))
    np.testing.assert_allclose(np.asarray(layer.expert_parallel_stats[...]), [B * T * K, B * T * K, 0, B * T * K])


def test_moe_layer_records_expert_parallel_stats_and_metrics():
    """A `LatentMoE` with training statistics, jitted under a (2,4,1,1) mesh, records the EP stats its metrics
    report (capacity mode with a tight factor so rows are dropped)."""
    cfg = CFG.replace(record_routing_stats=True, moe_expert_parallel="capacity:0.5")
    layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(2).randn(B, T, cfg.hidden_size).astype(np.float32))
    mesh = make_mesh(2, 4, 1, 1)
    with mesh_context(mesh):
        nnx.jit(lambda m, x: m(x))(layer, x)
    _, experts_nk, _ = route(x.reshape(-1, cfg.hidden_size), layer.router[...], layer.router_bias[...], cfg)
    experts = np.asarray(experts_nk).reshape(B, T, K)
    dropped = _numpy_capacity_drops(experts, (2, 4, 1, 1), 0.5)
    loads = _numpy_rank_loads(experts, (2, 4, 1, 1))
    np.testing.assert_allclose(np.asarray(layer.expert_parallel_stats[...]),
                               [loads.max(), loads.mean(), dropped.sum(), B * T * K])
    metrics = ep.expert_parallel_metrics(layer)
    assert float(metrics["ep_dropped_rows"]) == dropped.sum() > 0
    np.testing.assert_allclose(float(metrics["ep_rank_load_max_over_mean"]), loads.max() / loads.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ep_dropped_fraction"]), dropped.sum() / (B * T * K), rtol=1e-6)


def test_the_device_ep_check_passes_here_and_fails_on_a_wrong_exchange(monkeypatch, capsys):
    """`benchmarks/ep_check.py` (run on GPUs with the native exchange) passes on the emulated devices, and reports
    a failure when the layer's output is off by 1%."""
    from benchmarks import ep_check

    argv = ["--config=tiny", "--tokens=64", "--mesh=1,2,1,1", "--dtypes=float32", "--modes=dropless"]
    assert ep_check.main(argv) == 0
    real = ep.routed_experts

    def off(*a, **kw):
        u, stats = real(*a, **kw)
        return u * 1.01, stats

    monkeypatch.setattr(ep, "routed_experts", off)
    assert ep_check.main(argv) == 1
    assert '"failed": ["random/dropless/float32", "one_rank/dropless/float32"]' in capsys.readouterr().out
