"""Every parameter's logical axes resolve through the one rules table (no silently unknown names)."""

import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import configs
from k3jax.model import K3Model
from k3jax.training.memory import _variable_table
from sharding.rules import MESH_AXES, UnknownLogicalAxisError, mesh_axes_for
from sharding.shard import resolve_spec


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_every_parameter_axis_has_a_rule(name):
    cfg = configs.get_config(name)
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Variable)):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None, f"{'.'.join(map(str, path))} has no logical axes"
        assert len(axes) == len(var.get_value().shape), f"{'.'.join(map(str, path))}: {axes} vs shape"
        for mesh_axis in mesh_axes_for(axes):
            for a in (mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)):
                assert a is None or a in MESH_AXES


def test_unknown_axis_is_an_error():
    with pytest.raises(UnknownLogicalAxisError, match="no rule"):
        mesh_axes_for(("embed", "not_an_axis"))


def test_every_activation_layout_has_a_rule_and_is_applied_under_a_mesh():
    """The activation layouts the model annotates resolve through the rules; traced under a mesh the constraints
    appear in the program (without a mesh they are the identity)."""
    import jax
    import jax.numpy as jnp

    from sharding import constraints
    from sharding.mesh import make_mesh
    from sharding.shard import mesh_context

    for layout in (constraints.ACT_BTD, constraints.ACT_NBTD, constraints.ACT_BTV):
        mesh_axes_for(layout)
    cfg = configs.get_config("tiny")
    model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((4, 16), jnp.int32)

    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    plain = jax.jit(forward).trace(state, ids).lower().as_text()
    assert "sharding_constraint" not in plain and "Sharding" not in plain
    with mesh_context(make_mesh(data=2, expert=2, model=2)):
        text = jax.jit(forward).trace(state, ids).lower().as_text()
    assert text.count("sharding_constraint") + text.count("@Sharding") >= cfg.num_hidden_layers, text[:2000]


def test_serving_rules_drop_fsdp_and_keep_tensor_and_expert_parallelism():
    from sharding.rules import LOGICAL_AXIS_RULES, SERVING_AXIS_RULES

    assert set(SERVING_AXIS_RULES) == set(LOGICAL_AXIS_RULES)
    for name, axes in SERVING_AXIS_RULES.items():
        if name in ("batch", "seq"):  # activations keep training's layout
            continue
        assert "data" not in ((axes,) if isinstance(axes, str) else (axes or ())), name
    assert SERVING_AXIS_RULES["experts"] == "expert" and SERVING_AXIS_RULES["mlp"] == "model"
    assert mesh_axes_for(("embed", "mlp"), SERVING_AXIS_RULES) == (None, "model")


def test_k3_weights_of_a_pod_mesh_are_fsdp_sharded_unless_small():
    """On the k3 pod mesh (data 16, expert 64, model 1) every parameter over 8 MB per chip in f32 is split over
    'data' or 'expert': no matrix is replicated because its head axis cannot split (q_b / kv_b / f_b / g_b were,
    8 GB of parameters + momentum per chip)."""
    cfg = configs.get_config("k3")
    mesh = AbstractMesh((16, 64, 1, 1), ("data", "expert", "context", "model"))
    big = []
    for path, shape, logical, *_ in _variable_table(cfg, True):
        spec, _ = resolve_spec(logical, shape, mesh, path=path)
        split = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
        if not split & {"data", "expert"} and np.prod(shape) * 4 > 8 * 2 ** 20:
            big.append((path, shape))
    assert not big, big
