"""Distributed Newton–Schulz (`k3jax/training/optimizer.py`: `ns_plan`, `distributed_orthogonalize`) on the 8-device
CPU mesh: the sharded optimizer update equals the single-device one, and the compiled HLO shows each rank
orthogonalising only its own blocks (experts never gathered, replicated matrices split and all-gathered)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.model import K3Model
from k3jax.training import optimizer as opt_lib
from sharding.mesh import make_mesh
from sharding.rules import MESH_AXES
from sharding.shard import plan_shardings, resolve_spec

TINY_MESHES = [pytest.param((2, 2, 1, 2), marks=pytest.mark.slow), pytest.param((1, 4, 1, 2), marks=pytest.mark.slow),
               (8, 1, 1, 1)]


def _tiny_pair(module_fn):
    """(model, optimizer) built as `k3jax.training.trainer.make_trainable` builds them (Muon + AdamW, f32 moments,
    global-norm clipping), with a constant learning rate so the first step's update is not zero."""
    model = module_fn()
    tx = opt_lib.make_optimizer(model, learning_rate=1.0, weight_decay=0.1, max_grad_norm=1.0, mu_dtype=jnp.float32)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


class _UpdateHarness:
    """One random (model, optimizer) state and gradients; `update(mesh)` runs the jitted optimizer update (as
    `nnx.Optimizer.update`, returning the updates) unsharded (mesh None) or with every Variable placed by
    `plan_shardings` and traced under the mesh, and returns (updates as numpy, compiled HLO text)."""

    def __init__(self, module_fn):
        self.graphdef, self.state = nnx.split(_tiny_pair(module_fn))
        params = nnx.state(nnx.merge(self.graphdef, self.state)[0], nnx.Param)
        rng = np.random.default_rng(0)
        self.grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        self.cache = {}

    def _update(self, state, grads):
        model, optimizer = nnx.merge(self.graphdef, state)
        return optimizer.update(model, grads)

    def update(self, mesh_sizes=None):
        if mesh_sizes in self.cache:
            return self.cache[mesh_sizes]
        if mesh_sizes is None:
            compiled = jax.jit(self._update).lower(self.state, self.grads).compile()
            out = compiled(self.state, self.grads)
        else:
            mesh = make_mesh(*mesh_sizes)
            state = jax.device_put(self.state, plan_shardings(self.state, mesh, log_fallbacks=False).shardings)
            grads = jax.device_put(self.grads, plan_shardings(self.grads, mesh, log_fallbacks=False).shardings)
            with jax.set_mesh(mesh):
                compiled = jax.jit(self._update).lower(state, grads).compile()
                out = compiled(state, grads)
        result = (jax.tree.map(np.asarray, nnx.to_pure_dict(out)), compiled.as_text())
        self.cache[mesh_sizes] = result
        return result


# `tiny` cut to one scanned (KDA, MLA) x 2 group: stacked KDA / MLA projections, routed experts [layers, E, L, M],
# dense and shared-expert weights, in a compile the 2-core test budget allows (unstacked leaves: DATA_MESH_SPECS).
TINY = ["num_hidden_layers=4", "full_attn_layers=(2,4)", "first_k_dense_replace=0"]


@pytest.fixture(scope="module")
def tiny_harness():
    cfg = configs.get_config("tiny", TINY)
    return _UpdateHarness(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))


def _flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.State(tree))}


def _collectives(hlo: str, op: str) -> list[tuple[int, ...]]:
    """Result shapes of every `op` (all-gather, all-to-all, all-reduce) instruction; tuple results give one entry
    per element."""
    shapes = []
    for line in hlo.splitlines():
        m = re.search(rf"= (\(.*?\)|\S+) {op}\(", line)
        if m:
            shapes += [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", m[1])]
    return shapes


def _dot_shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"= \w+\[([\d,]*)\]\S* dot\(", hlo)]


@pytest.mark.parametrize("mesh_sizes", TINY_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_distributed_newton_schulz_update_equals_single_device(tiny_harness, mesh_sizes):
    want, _ = tiny_harness.update(None)
    got, hlo = tiny_harness.update(mesh_sizes)
    want, got = _flat(want), _flat(got)
    assert want.keys() == got.keys()
    for key, w in want.items():
        err = np.abs(got[key] - w).max() / max(np.abs(w).max(), 1e-30)
        assert err < 2e-5, (key, err)
    assert "shard_map" in hlo or _collectives(hlo, "all-to-all")  # the distributed path was taken


def test_expert_sharded_mesh_never_gathers_a_whole_expert_tensor(tiny_harness):
    """Under (data 1, expert 4, context 1, model 2) every rank orthogonalises only its own experts: no all-gather
    result has the shape (in any axis order, or with layers and experts merged) of a stacked expert tensor, and no
    all-reduce other than the scalar gradient norm (the NS iterations themselves communicate nothing; GSPMD's
    partitioned NS all-reduces partial matmuls inside every iteration)."""
    _, hlo = tiny_harness.update((1, 4, 1, 2))
    model = nnx.eval_shape(lambda: K3Model(configs.get_config("tiny", TINY), rngs=nnx.Rngs(0)))
    experts = [r for r in opt_lib.label_table(model) if "experts" in r.axes]
    assert experts
    forbidden = set()
    for r in experts:
        e = r.axes.index("experts")
        forbidden.add(tuple(sorted(r.shape)))
        if e > 0:  # layers and experts merged into one blocks axis
            merged = (math.prod(r.shape[:e + 1]),) + r.shape[e + 1:]
            forbidden.add(tuple(sorted(merged)))
    gathers = _collectives(hlo, "all-gather")
    assert gathers, "the replicated per-head matrices are split over 'expert' and all-gathered"
    assert not [s for s in gathers if tuple(sorted(s)) in forbidden], gathers
    assert all(math.prod(s) == 1 for s in _collectives(hlo, "all-reduce"))
    assert _collectives(hlo, "all-to-all")  # the tensor-parallel 'model' halves of each expert matrix
    # Each rank's expert NS is batched over its own blocks: 2 experts x 2 layers of the 8 x 2, halved again by the
    # all_to_all over 'model', never all 8 experts.
    block_dots = [s for s in _dot_shapes(hlo) if s[-2:] == (32, 32)]
    assert block_dots and max(math.prod(s[:-2]) for s in block_dots) <= 2


class _Params(nnx.Module):
    def __init__(self, specs):
        rng = np.random.default_rng(0)
        for name, (shape, axes) in specs.items():
            setattr(self, name, nnx.Param(jnp.asarray(rng.standard_normal(shape), jnp.float32), out_sharding=axes,
                                                 eager_sharding=False))


# A replicated stacked per-head projection (kv_b_proj-shaped [layers, rows, heads, head_dim]: 4 x 8 = 32 blocks of
# [40, 24]; its rows on a replicated logical axis, 'heads' on 'model' (size 1), nothing on 'data'; k3's own
# kv_b_proj rows are FSDP'd now), a stacked FSDP dense weight ('embed' over 'data') and an unstacked one (a single
# block: gathered, orthogonalised on every rank).
DATA_MESH_SPECS = {
    "kv_b_proj": ((4, 40, 8, 24), ("layers", "kv_a_out", "heads", "head_dim")),
    "up_proj": ((8, 64, 48), ("layers", "embed", "mlp")),
    "router": ((64, 8), ("embed", "experts_router")),
}


def test_pure_data_mesh_splits_replicated_blocks_over_ranks_and_all_gathers_them():
    """Under (8, 1, 1, 1) the replicated kv_b_proj's 4 stacked layers of 8 blocks go one layer per step, its 8
    blocks split 1 per rank (NS matmuls batched over 1 block, never 8 or 32) and all-gathered ([8, 40, 24]) before
    the next layer; the FSDP weight's 8 layers (one block each) go in one step, exchanged by an all_to_all so each
    rank orthogonalises one whole [64, 48] layer; the single-block router is all-gathered. The update equals the
    single-device one."""
    harness = _UpdateHarness(lambda: _Params(DATA_MESH_SPECS))
    want, _ = harness.update(None)
    got, hlo = harness.update((8, 1, 1, 1))
    for key in DATA_MESH_SPECS:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6 * np.abs(want[key]).max())
    assert (8, 40, 24) in _collectives(hlo, "all-gather")
    assert (32, 40, 24) not in _collectives(hlo, "all-gather")  # never the whole leaf at once
    kv_dots = [s for s in _dot_shapes(hlo) if s[-2:] in ((24, 24), (24, 40))]  # NS on the wide [24, 40] side
    assert kv_dots and {math.prod(s[:-2]) for s in kv_dots} == {1}
    # all_to_all pieces: one layer's [64 / 8 embed rows, 48] to each of the 8 ranks (there and back)
    assert set(_collectives(hlo, "all-to-all")) == {(1, 8, 48)}
    up_dots = [s for s in _dot_shapes(hlo) if s[-2:] in ((48, 48), (48, 64))]
    assert up_dots and {math.prod(s[:-2]) for s in up_dots} == {1}
    assert (1, 64, 8) in _collectives(hlo, "all-gather")  # the router (one block): its 8 row shards gathered


def test_k3_expert_plan_keeps_experts_local_and_balances_blocks():
    """On K3's (1, 64, 1, 8) mesh the stacked expert weight [22, 896, 3584, 3072] (experts over 'expert', the
    expert width over 'model') is never moved over 'expert': one all_to_all over 'model' leaves each rank
    ceil(22 * 14 / 8) = 39 of the 19712 blocks; q_b_proj (its q_lora rows FSDP'd over 'expert', heads over
    'model') is exchanged by one all_to_all over 'expert' so each rank orthogonalises whole [1536, 192] blocks."""
    mesh_shape = dict(zip(MESH_AXES, (1, 64, 1, 8)))
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), MESH_AXES)
    w1 = ((22, 896, 3584, 3072), ("layers", "experts", "expert_latent", "expert_mlp"))
    dn = opt_lib.muon_dimension_numbers("w1", w1[1], w1[0])
    spec, _ = resolve_spec(w1[1], w1[0], mesh)
    moves = opt_lib.ns_plan(w1[0], dn, spec, mesh_shape)
    assert [(m.kind, m.axis, m.blocks, m.padded) for m in moves] == [("a2a", "model", 22 * 14, 312)]
    q_b = ((22, 1536, 96, 192), ("layers", "q_lora", "heads", "head_dim"))
    dn = opt_lib.muon_dimension_numbers("q_b_proj", q_b[1], q_b[0])
    spec, _ = resolve_spec(q_b[1], q_b[0], mesh)
    assert [(m.kind, m.axis, m.blocks) for m in opt_lib.ns_plan(q_b[0], dn, spec, mesh_shape)] == \
        [("a2a", "expert", 22 * 12)]


def test_no_mesh_or_distributed_off_is_the_single_device_computation():
    """Without a context mesh the update's jaxpr has no shard_map (today's computation), and
    `ns_distributed=False` keeps it so under a mesh too."""
    module = _Params(DATA_MESH_SPECS)
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    for distributed, mesh in ((True, None), (False, make_mesh(8))):
        tx = opt_lib.make_optimizer(module, learning_rate=1.0, ns_distributed=distributed)
        state = tx.init(params)
        if mesh is None:
            text = str(jax.make_jaxpr(tx.update)(params, state, params))
        else:
            with jax.set_mesh(mesh):
                text = str(jax.make_jaxpr(tx.update)(params, state, params))
        assert "shard_map" not in text
