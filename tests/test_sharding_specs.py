"""Logical axes -> PartitionSpecs: every variable of the tiny configs (odd toy sizes) gets a valid spec on every test
mesh, fallbacks are recorded, and the full `k3` config shards its big weights without falling back."""

import math

import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import configs
from k3jax.model import K3Model
from sharding.mesh import make_mesh
from sharding.rules import MESH_AXES, UnknownLogicalAxisError
from sharding.shard import plan_shardings, resolve_spec

MESHES = [(8, 1, 1, 1), (2, 4, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2), (1, 1, 1, 8)]


def _axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def assert_valid(spec, shape, mesh, path=""):
    assert len(spec) <= len(shape), path
    used = [a for e in spec for a in _axes(e)]
    assert len(used) == len(set(used)), f"{path}: mesh axis used twice in {spec}"
    assert set(used) <= set(MESH_AXES), f"{path}: {spec}"
    for size, entry in zip(shape, spec):
        ways = math.prod(mesh.shape[a] for a in _axes(entry))
        assert size % ways == 0, f"{path}: dim {size} not divisible by {entry} ({ways}) in {spec}"


@pytest.fixture(scope="module")
def abstract_states():
    return {name: abstract_state(configs.get_config(name)) for name in ("tiny", "tiny_kimi_linear")}


def abstract_state(cfg):
    return nnx.state(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_every_variable_gets_a_valid_spec(abstract_states, name, shape):
    mesh = make_mesh(*shape)
    state = abstract_states[name]
    plan = plan_shardings(state, mesh)
    flat = dict(nnx.to_flat_state(state))
    shardings = dict(nnx.to_flat_state(plan.shardings))
    assert shardings.keys() == flat.keys()
    for key, var in flat.items():
        path = ".".join(map(str, key))
        shape_ = var.get_value().shape
        sharding = shardings[key].get_value()
        assert sharding.mesh is mesh and sharding.spec == plan.specs[path]
        assert_valid(sharding.spec, shape_, mesh, path)
        sharding.shard_shape(shape_)  # raises if the spec does not fit the shape
    # The fallbacks are exactly the mesh axes of size > 1 the rules asked for but the spec does not use.
    for f in plan.fallbacks:
        assert all(a not in _axes(plan.specs[f.path][f.dim]) for a in f.dropped), f
    assert plan.summary().startswith(f"{sum(any(e is not None for e in s) for s in plan.specs.values())}/")


def test_tiny_fallbacks_are_recorded(abstract_states):
    state = abstract_states["tiny"]
    tp = plan_shardings(state, make_mesh(model=8))  # tiny has 2 heads: heads cannot split 8 ways
    kda_q = tp.specs["groups.0.layers.0.self_attn.q_proj"]
    assert kda_q == P(("data", "context", "expert"), None, None)
    assert any(f.path == "groups.0.layers.0.self_attn.q_proj" and f.dropped == ("model",) and
               f.reason == "indivisible" for f in tp.fallbacks)
    assert tp.specs["embed_tokens"] == P("model", ("data", "context", "expert"))  # vocab 384 = 8 x 48
    assert tp.specs["groups.1.layers.0.mlp.w1"] == P("expert", ("data", "context"), "model")  # [E=8, L=32, M=32]
    # 'expert_latent' wants 'data' x 'context', already taken by 'embed' in the latent down-projection [D, L]:
    # replicated.
    fsdp = plan_shardings(state, make_mesh(data=2, expert=4))
    assert fsdp.specs["groups.1.layers.0.mlp.routed_expert_down_proj"] == P(("data", "context", "expert"), None)
    assert any(f.path == "groups.1.layers.0.mlp.routed_expert_down_proj" and f.reason == "reused"
               and f.dropped == ("data", "context") for f in fsdp.fallbacks)
    # Scanned stacks keep their leading 'layers' axis replicated.
    assert fsdp.specs["groups.4.units.layers.0.self_attn.q_proj"][0] is None


def test_resolve_spec_rules():
    mesh = make_mesh(data=2, expert=4)
    # greedy per dim: data x context (2) divides 4, with expert (8) it does not -> keep data x context
    spec, fb = resolve_spec(("embed", "mlp"), (4, 16), mesh, path="w")
    assert spec == P(("data", "context"), "model") and [(f.dim, f.dropped, f.reason) for f in fb] == [(0, ("expert",),
                                                                                       "indivisible")]
    # a size-1 mesh axis never counts as a fallback
    spec, fb = resolve_spec(("embed", "heads", "head_dim"), (8, 3, 5), mesh)
    assert spec == P(("data", "context", "expert"), "model", None) and fb == []
    # unknown logical names are an error, not silently replicated
    with pytest.raises(UnknownLogicalAxisError):
        resolve_spec(("embed", "not_an_axis"), (8, 8), mesh)
    with pytest.raises(ValueError, match="do not match shape"):
        resolve_spec(("embed",), (8, 8), mesh)


def test_k3_shards_its_big_weights_on_a_pod_mesh():
    """The released config on an abstract 2048-chip mesh: experts over 'expert', FSDP over data x context x expert,
    tensor parallel over 'model'; the only fallbacks are small tensors (never a routed-expert or attention weight dim
    that the table asks to shard, apart from the documented latent reuse)."""
    state = abstract_state(configs.get_config("k3"))
    mesh = AbstractMesh((16, 16, 1, 8), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    plan = plan_shardings(state, mesh)
    flat = dict(nnx.to_flat_state(state))
    for key, var in flat.items():
        path = ".".join(map(str, key))
        assert_valid(plan.specs[path], var.get_value().shape, mesh, path)
    w1 = next(p for p in plan.specs if p.endswith("mlp.w1"))
    assert tuple(plan.specs[w1])[-3:] == ("expert", ("data", "context"), "model")
    assert not [f for f in plan.fallbacks if f.reason == "indivisible" and math.prod(flat_shape(flat, f.path)) > 1e7]
    # the latent reuse of the routed experts, and the low-rank dims (FSDP'd in q_b / kv_b / f_b / g_b) where the
    # embed dim of the same weight already takes the FSDP axes
    assert {f.path.rsplit(".", 1)[-1] for f in plan.fallbacks if f.reason == "reused"} <= {
        "routed_expert_down_proj", "routed_expert_up_proj", "q_a_proj", "kv_a_proj_with_mqa", "f_a_proj", "g_a_proj"}


def flat_shape(flat, path):
    return next(v.get_value().shape for k, v in flat.items() if ".".join(map(str, k)) == path)
