"""Context parallelism (sequence over the 'context' mesh axis, `sharding/context_parallel.py`) computes exactly what
the unsharded model computes, on 8 emulated CPU devices.

- KCP core (4 context shards, float64) == `kda_recurrent` (the token-loop reference) on the whole sequence: outputs,
  final state and gradients, with documents crossing shard edges, one starting exactly at a shard edge, a 1-token
  document, an initial state, and shard lengths that are not a multiple of the chunk size; its collectives have the
  same sizes for every T; also at T = 4000 (4 × 1000 tokens, not a multiple of the 64-token chunk).
- The state-only pre-pass (chunked and token forms) == the product of the token transitions (NumPy loop).
- KCP with the Pallas chunk kernel (interpret mode) on every shard == the single-device token recurrence (f32):
  outputs, final state and gradients (through the kernel's custom VJP, its initial-state gradient and the
  state-only pre-pass), with the same packed documents; the KDA layer under a context mesh with `kda_impl=pallas`
  traces the kernel and no value-width-(V+K) array.
- Short-conv halo == an independent NumPy loop (taps reaching into the left neighbour and across documents).
- KDA and MLA layers traced under a context mesh take the context-parallel path and equal the unsharded layer.
- `tiny` (packed documents) under meshes (2,1,4,1) and (1,2,2,2): loss and gradients equal one device; also with
  the KDA kernel on every context shard (slow suite).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.ops.kda import kda_recurrent
from sharding import context_parallel
from sharding.mesh import make_mesh


def _set_mesh(mesh):
    """The context mesh for tracing (what the sharded train step does)."""
    return (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh)


def _doc_index(ids_bt):
    starts = np.concatenate([np.zeros_like(ids_bt[:, :1]), (ids_bt[:, 1:] != ids_bt[:, :-1])], axis=1)
    return np.cumsum(starts, axis=1)


def _spy(monkeypatch, name):
    """Counts calls of `context_parallel.<name>` (the layers look it up at call time)."""
    calls = []
    real = getattr(context_parallel, name)
    monkeypatch.setattr(context_parallel, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# ------------------------------------------------------------------------------------------------------ KCP core
B, H, K, V = 2, 2, 8, 6
SHARDS, T_LOCAL, CHUNK = 4, 24, 16  # 96 tokens; each shard is 1.5 chunks


def _kda_inputs(t, seed=0):
    rng = np.random.RandomState(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    return dict(q=unit(rng.randn(B, t, H, K)), k=unit(rng.randn(B, t, H, K)), v=rng.randn(B, t, H, V),
                g=-0.3 * np.abs(rng.randn(B, t, H, K)), beta=1 / (1 + np.exp(-rng.randn(B, t, H))),
                s0=rng.randn(B, H, K, V))


def _segments(t):
    """Row 0: a document crossing shard edges 24 and 48 (tokens 10..49), 1-token document at 50, a document from 51
    to 71 and one starting exactly at shard edge 72. Row 1: one document (the initial state reaches every shard)."""
    ids = np.ones((B, t), np.int32)
    ids[0, 10:], ids[0, 50:], ids[0, 51:], ids[0, 72:] = 2, 3, 4, 5
    return ids


def test_kcp_core_matches_token_recurrence(x64):
    t = SHARDS * T_LOCAL
    x = _kda_inputs(t)
    ids = _segments(t)
    mesh = make_mesh(data=2, context=SHARDS)
    w_o, w_s = np.random.RandomState(1).randn(B, t, H, V), np.random.RandomState(2).randn(B, H, K, V)

    def objective(core):
        def f(q, k, v, g, beta, s0):
            o, s = core(q, k, v, g, beta, s0)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
        return jax.jit(jax.value_and_grad(f, argnums=range(6), has_aux=True))

    def ref_core(q, k, v, g, beta, s0):
        return kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state_bhkv=s0, segment_ids_bt=ids)

    def kcp_core(q, k, v, g, beta, s0):
        return context_parallel.kda_context_parallel(q, k, v, g, beta, scale=K ** -0.5, initial_state=s0,
                                                     chunk_size=CHUNK, segment_ids=ids, mesh=mesh)

    args = [x[n] for n in ("q", "k", "v", "g", "beta", "s0")]
    (_, (o_ref, s_ref)), g_ref = objective(ref_core)(*args)
    (_, (o, s)), g = objective(kcp_core)(*args)
    assert o.dtype == jnp.float64
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(s, s_ref, rtol=1e-10, atol=1e-12)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), g, g_ref):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=name)
    # The test can fail: without the incoming state (no state passing) shards 1..3 would be clearly wrong.
    o_alone, _ = jax.vmap(lambda *a: kda_recurrent(*a, scale=K ** -0.5), in_axes=1, out_axes=1)(
        *(a.reshape(B, SHARDS, T_LOCAL, *a.shape[2:]) for a in args[:5]))
    assert np.abs(np.asarray(o_alone).reshape(o.shape)[1] - np.asarray(o)[1]).max() > 1e-2


def test_kcp_core_long_sequence_uneven_chunks(x64):
    """T = 4000 over 4 shards of 1000 tokens (not a multiple of the 64-token chunk), documents crossing shard
    edges: KCP outputs, final state and gradients equal the whole-sequence token recurrence."""
    t, shards, chunk = 4000, 4, 64
    rng = np.random.RandomState(5)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    args = [unit(rng.randn(1, t, 1, K)), unit(rng.randn(1, t, 1, K)), rng.randn(1, t, 1, V),
            -0.05 * np.abs(rng.randn(1, t, 1, K)), 1 / (1 + np.exp(-rng.randn(1, t, 1))), rng.randn(1, 1, K, V)]
    ids = np.ones((1, t), np.int32)
    ids[0, 700:], ids[0, 2500:], ids[0, 3000:] = 2, 3, 4  # 700..2499 spans shard edges 1000 and 2000; 3000 = edge
    mesh = make_mesh(data=1, context=shards, devices=jax.devices()[:shards])
    w_o = rng.randn(1, t, 1, V)

    def run(core):
        def f(*a):
            o, s = core(*a)
            return jnp.sum(o * w_o) + jnp.sum(s), (o, s)
        return jax.jit(jax.value_and_grad(f, argnums=range(6), has_aux=True))(*args)

    (_, (o_ref, s_ref)), g_ref = run(lambda q, k, v, g, beta, s0: kda_recurrent(
        q, k, v, g, beta, scale=K ** -0.5, initial_state_bhkv=s0, segment_ids_bt=ids))
    (_, (o, s)), g = run(lambda q, k, v, g, beta, s0: context_parallel.kda_context_parallel(
        q, k, v, g, beta, scale=K ** -0.5, initial_state=s0, chunk_size=chunk, segment_ids=ids, mesh=mesh))
    np.testing.assert_allclose(o, o_ref, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(s, s_ref, rtol=1e-9, atol=1e-11)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), g, g_ref):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_shard_transition_is_product_of_token_steps(impl, x64):
    """The state-only pre-pass: m = A_T ··· A_1 with A_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) (zero from a document
    start on), s = the state from zero; a NumPy token loop. Row 0 has no document start, row 1 one at token 25 (inside
    a chunk), row 2 one at token 32 (a chunk edge)."""
    b, t, h, kd, vd = 3, 40, 1, 4, 3  # 2.5 chunks of 16
    x = {n: np.concatenate([a, a[:1]]) for n, a in _kda_inputs(t, seed=8).items()}  # rows 0 and 2 share inputs
    k, v = x["k"][:, :, :h, :kd], x["v"][:, :, :h, :vd]
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g, beta = 0.1 * x["g"][:, :, :h, :kd], x["beta"][:, :, :h]  # mild decay: m stays clearly nonzero
    ids = np.zeros((b, t), np.int32)
    ids[1, 25:], ids[2, 32:] = 1, 1
    m, s = jax.jit(lambda *a: context_parallel.kda_shard_transition(*a, impl=impl, chunk_size=CHUNK,
                                                                    segment_ids_bt=ids))(k, v, g, beta)
    for row in range(b):
        m_ref, s_ref = np.eye(kd), np.zeros((kd, vd))
        for i in range(t):
            a = (np.eye(kd) - beta[row, i, 0] * np.outer(k[row, i, 0], k[row, i, 0])) * np.exp(g[row, i, 0])[None]
            if i and ids[row, i] != ids[row, i - 1]:
                a = np.zeros_like(a)
            m_ref, s_ref = a @ m_ref, a @ s_ref + beta[row, i, 0] * np.outer(k[row, i, 0], v[row, i, 0])
        np.testing.assert_allclose(m[row, 0], m_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(s[row, 0], s_ref, rtol=1e-10, atol=1e-12)
    assert np.abs(np.asarray(m[0])).max() > 1e-3 and not np.asarray(m[1:]).any()


def _collective_types(t):
    """Result types of every collective in the lowered forward + backward of the KCP core at length t."""
    x = _kda_inputs(t)
    mesh = make_mesh(data=2, context=SHARDS)

    def loss(q, k, v, g, beta):
        o, s = context_parallel.kda_context_parallel(q, k, v, g, beta, scale=K ** -0.5, chunk_size=CHUNK,
                                                     segment_ids=jnp.ones((B, t), jnp.int32), mesh=mesh)
        return jnp.sum(o) + jnp.sum(s)

    args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")]
    text = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).as_text(dialect="hlo")
    return sorted(re.findall(r"= (\w+\[[\d,]*\])\S* (all-gather|reduce-scatter|all-reduce|collective-permute|"
                             r"all-to-all)\(", text))


def test_kcp_communication_does_not_grow_with_sequence_length_and_gathers_nothing():
    short, long_ = _collective_types(SHARDS * 16), _collective_types(SHARDS * 64)
    # log-depth state passing: ppermutes of one shard's pieces (forward and backward), no all-gather of n of them
    assert {op for _, op in short} == {"collective-permute"}, short
    assert short == long_


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_incoming_states_by_doubling_equal_the_sequential_composition(n, x64):
    """Random affine pieces on n ranks (powers of two and not), documents starting at some shard edges: the
    log-depth scan's S_in per rank equals the sequential chain S_in(i+1) = M_i S_in(i) + S_i (zeroed where a
    document starts at the edge), written here as a float64 NumPy loop."""
    rng = np.random.RandomState(n)
    m = rng.randn(n, B, H, K, K) * 0.5
    s = rng.randn(n, B, H, K, V)
    cont = rng.rand(n, B) < 0.6
    cont[0] = True
    init = rng.randn(B, H, K, V)
    want, state = np.zeros((n, B, H, K, V)), init
    for i in range(n):
        for b in range(B):
            want[i, b] = state[b] if cont[i, b] else 0.0
        state = np.einsum("bhkj,bhjv->bhkv", m[i], want[i]) + s[i]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("context",))
    spec = jax.sharding.PartitionSpec("context")

    def body(m_r, s_r, c_r, s0):
        return context_parallel.incoming_state_by_doubling(m_r[0], s_r[0], c_r[0], s0)[None]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()),
                                out_specs=spec))(m, s, cont, init)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(np.asarray(want)[1:], 0)  # states do pass between ranks


def test_kcp_with_pallas_kernel_matches_single_device():
    """Every shard runs the Pallas kernel (interpret mode on CPU) from its composed incoming state; 24-token shards
    (the kernel pads each to one 64-token chunk, the pre-pass sees 1.5 chunks of 16)."""
    t, kv = SHARDS * T_LOCAL, 16  # the kernel needs power-of-two head dims
    rng = np.random.RandomState(7)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    args = [unit(rng.randn(B, t, H, kv)), unit(rng.randn(B, t, H, kv)), rng.randn(B, t, H, kv),
            -0.3 * np.abs(rng.randn(B, t, H, kv)), 1 / (1 + np.exp(-rng.randn(B, t, H))), rng.randn(B, H, kv, kv)]
    args = [jnp.asarray(a, jnp.float32) for a in args]
    ids = _segments(t)
    w_o, w_s = (jnp.asarray(rng.randn(*shape), jnp.float32) for shape in ((B, t, H, kv), (B, H, kv, kv)))
    mesh = make_mesh(data=2, context=SHARDS)

    def run(core):
        def f(*a):
            o, s = core(*a)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
        fn = jax.jit(jax.value_and_grad(f, argnums=range(6), has_aux=True))
        return fn(*args)

    (_, (o_ref, s_ref)), g_ref = run(lambda q, k, v, g, beta, s0: kda_recurrent(
        q, k, v, g, beta, scale=kv ** -0.5, initial_state_bhkv=s0, segment_ids_bt=ids))
    (_, (o, s)), g = run(lambda q, k, v, g, beta, s0: context_parallel.kda_context_parallel(
        q, k, v, g, beta, scale=kv ** -0.5, initial_state=s0, impl="pallas", chunk_size=CHUNK, segment_ids=ids,
        mesh=mesh))
    assert o.shape == o_ref.shape and s.dtype == jnp.float32

    def close(got, want, name):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()), err_msg=name)

    close(o, o_ref, "o")
    close(s, s_ref, "final state")
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), g, g_ref):
        close(got, want, name)


def _avals(jaxpr):
    """Every variable's abstract value in `jaxpr` and the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval"))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _avals(sub)


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _primitives(sub)


def test_kda_layer_context_parallel_runs_kernel_at_value_width():
    """`kda_impl=pallas` under a context mesh: the layer's forward and backward trace the Pallas kernel (no fallback to
    the XLA core) and never widen the values: no [.., V+K] token or state array (the old [v | 0] trick)."""
    cfg = configs.get_config("tiny", ["kda_impl=pallas"])
    layer = KDA(cfg, rngs=nnx.Rngs(0))
    b, t, h, kd = 2, 32, cfg.kda_num_heads, cfg.kda_head_dim
    x = jnp.asarray(np.random.RandomState(4).randn(b, t, cfg.hidden_size), jnp.float32)
    ids = np.zeros((b, t), np.int32)
    ids[0, 5:], ids[0, 8:] = 1, 2

    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, ids))

    with _set_mesh(make_mesh(data=2, context=4)):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr
    assert "pallas_call" in set(_primitives(jaxpr)), "the context-parallel KDA did not call the Pallas kernel"
    widened = {(b // 2, t // 4, h, 2 * kd), (b, t, h, 2 * kd), (b // 2, h, kd, 2 * kd), (b, h, kd, 2 * kd)}
    shapes = {tuple(a.shape) for a in _avals(jaxpr) if hasattr(a, "shape")}
    assert not shapes & widened, f"value-width V+K arrays: {shapes & widened}"


# ------------------------------------------------------------------------------------------------------ short conv
def _conv_reference(x_btp, kernel_wp, ids_bt):
    """silu(Σ_w kernel[w] x[t-(W-1)+w]) over taps inside the sequence and in the same document: a plain loop."""
    w = kernel_wp.shape[0]
    doc = _doc_index(ids_bt)
    y = np.zeros(x_btp.shape)
    for b in range(x_btp.shape[0]):
        for t in range(x_btp.shape[1]):
            for i in range(w):
                s = t - (w - 1) + i
                if s >= 0 and doc[b, s] == doc[b, t]:
                    y[b, t] += kernel_wp[i] * x_btp[b, s]
    return y / (1 + np.exp(-y))


def test_short_conv_halo_matches_loop_reference():
    rng = np.random.RandomState(3)
    b, t, p, w = 2, 16, 6, 4  # 4 tokens per shard, halo of 3
    x = rng.randn(b, t, p).astype(np.float32)
    kernel = rng.randn(w, p).astype(np.float32)
    ids = np.zeros((b, t), np.int32)
    ids[0, 5:], ids[0, 8:], ids[1, 13:] = 1, 2, 3  # row 0: start inside a halo, start at shard edge 8
    mesh = make_mesh(data=2, context=4)
    conv = jax.jit(lambda x, k, i: context_parallel.short_conv_context_parallel(x, k, i, mesh=mesh))
    np.testing.assert_allclose(conv(x, kernel, ids), _conv_reference(x, kernel, ids), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv(x, kernel, None), _conv_reference(x, kernel, np.zeros_like(ids)),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(context_parallel.ContextParallelError, match="fewer than the 3"):
        context_parallel.short_conv_context_parallel(x[:, :8], kernel, None, mesh=mesh)


# ------------------------------------------------------------------------------------------------------ layers
@pytest.mark.parametrize("layer_cls, spied", [(KDA, "kda_context_parallel"), (MLA, "mla_attention_context_parallel")],
                         ids=["kda", "mla"])
def test_layer_under_context_mesh_matches_unsharded(layer_cls, spied, monkeypatch):
    # f32; the token-loop KDA core compiles ~3x faster than the chunked one (tested in the KCP core test above)
    cfg = configs.get_config("tiny", ["kda_impl=recurrent"])
    layer = layer_cls(cfg, rngs=nnx.Rngs(0))
    b, t = 2, 32
    x = jnp.asarray(np.random.RandomState(4).randn(b, t, cfg.hidden_size), jnp.float32)
    ids = np.zeros((b, t), np.int32)
    ids[0, 5:], ids[0, 8:], ids[0, 20:], ids[1, 17:] = 1, 2, 3, 4  # shard edges at 8, 16, 24
    w_y = jnp.asarray(np.random.RandomState(5).randn(b, t, cfg.hidden_size), jnp.float32)

    def run(layer, x):
        def loss(layer, x):
            y = layer(x, ids)
            return jnp.sum(y * w_y), y
        return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)

    (_, y_ref), (gp_ref, gx_ref) = nnx.jit(run)(layer, x)
    calls = _spy(monkeypatch, spied)
    with _set_mesh(make_mesh(data=2, context=4)):
        (_, y), (gp, gx) = nnx.jit(lambda l, x: run(l, x))(layer, x)
    assert calls, f"{layer_cls.__name__} did not take the context-parallel path"
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_ref).max()))
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(gx_ref).max()))
    ref = dict(nnx.to_flat_state(gp_ref))
    for key, var in nnx.to_flat_state(gp):
        want = np.asarray(ref[key].get_value())
        np.testing.assert_allclose(var.get_value(), want, rtol=1e-4, atol=1e-5 * (np.abs(want).max() or 1.0),
                                   err_msg=".".join(map(str, key)))


def test_no_context_parallel_without_context_axis():
    assert context_parallel.context_mesh(64) is None
    with _set_mesh(make_mesh(data=8)):
        assert context_parallel.context_mesh(64) is None
    with _set_mesh(make_mesh(data=2, context=4)):
        assert context_parallel.context_mesh(64) is not None
        assert context_parallel.context_mesh(30) is None  # 30 tokens do not split over 4: GSPMD fallback
        assert context_parallel.context_mesh(8, min_local_len=3) is None


# ------------------------------------------------------------------------------------------------------ model
MODEL_BATCH, MODEL_SEQ = 8, 32


def _build_tiny(kda_impl="recurrent"):
    """`tiny` with routing pinned by a well-separated selection bias (as in test_sharding_equivalence)."""
    from k3jax.layers.params import RouterBias
    from k3jax.model import K3Model

    model = K3Model(configs.get_config("tiny", [f"kda_impl={kda_impl}"]), rngs=nnx.Rngs(0))
    biases = nnx.state(model, RouterBias)
    nnx.update(model, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape), biases))
    return model


def _packed_loss(model, batch_b2t):
    """Next-token loss on packed rows: batch[:, 0] token ids, batch[:, 1] segment ids."""
    from k3jax.training.loss import next_token_loss

    ids, seg = batch_b2t[:, 0], batch_b2t[:, 1]
    return next_token_loss(model(ids[:, :-1], seg[:, :-1]), ids[:, 1:])


@pytest.fixture(scope="module")
def packed_batch():
    cfg = configs.get_config("tiny")
    rng = np.random.RandomState(6)
    ids = rng.randint(0, cfg.vocab_size, (MODEL_BATCH, MODEL_SEQ + 1))
    seg = np.zeros_like(ids)
    for row in range(MODEL_BATCH):  # 2-3 documents per row, boundaries anywhere (some on shard edges 8, 16, 24)
        for start in sorted(rng.choice(np.arange(1, MODEL_SEQ), 2, replace=False)):
            seg[row, start:] += 1
    seg[0, 8:] += 5
    return np.stack([ids, seg], axis=1).astype(np.int32)


def _loss_and_grads(mesh, batch, kda_impl="recurrent"):
    from sharding.shard import shard_batch
    from tests.helpers import make_sharded_loss_and_grad, shard_model

    model = _build_tiny(kda_impl)
    shard_model(model, mesh)
    fn = make_sharded_loss_and_grad(model, mesh, _packed_loss, batch_ndim=3)
    loss, grads = fn(model, shard_batch(batch, mesh))
    return float(loss), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}


@pytest.fixture(scope="module")
def packed_reference(packed_batch):
    return _loss_and_grads(make_mesh(devices=jax.devices()[:1]), packed_batch)


@pytest.mark.slow
@pytest.mark.parametrize("shape, kda_impl", [((2, 1, 4, 1), "recurrent"), ((1, 2, 2, 2), "recurrent"),
                                             ((2, 1, 4, 1), "pallas")], ids=["2x1x4x1", "1x2x2x2", "2x1x4x1-kernel"])
def test_tiny_packed_loss_and_grads_match_single_device(shape, kda_impl, packed_batch, packed_reference, monkeypatch):
    """The sharded model against one device running the token recurrence; "pallas": every context shard runs the
    KDA kernel (interpret mode)."""
    ref_loss, ref_grads = packed_reference
    kda_calls = _spy(monkeypatch, "kda_context_parallel")
    mla_calls = _spy(monkeypatch, "mla_attention_context_parallel")
    loss, grads = _loss_and_grads(make_mesh(*shape), packed_batch, kda_impl)
    assert kda_calls and mla_calls, "the model did not take the context-parallel paths"
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key, got in grads.items():
        want = ref_grads[key]
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4 * scale, err_msg=".".join(map(str, key)))
