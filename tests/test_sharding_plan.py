"""Per-config parallelism plans: the mesh `auto_mesh` derives for any device count, its errors, `--mesh=auto`."""

import jax
import pytest

import configs
from k3jax.training.trainer import make_mesh_from_option
from sharding.mesh import MeshShapeError
from sharding.plan import MeshPlan, auto_mesh, mesh_sizes_for, plan_for, plan_problems


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear", "k3_gpu"])
def test_small_configs_put_every_device_on_data(name):
    for n in (1, 3, 8, 64):
        assert auto_mesh(name, n) == (n, 1, 1, 1)


@pytest.mark.parametrize("chips, mesh", [
    (1, (1, 1, 1, 1)), (8, (1, 1, 1, 8)), (16, (1, 2, 1, 8)), (512, (1, 64, 1, 8)), (1024, (2, 64, 1, 8)),
    (2048, (4, 64, 1, 8)), (6144, (12, 64, 1, 8)), (12, (3, 1, 1, 4)),
])
def test_k3_plan_fills_model_then_expert_then_data(chips, mesh):
    assert auto_mesh("k3", chips) == mesh


def test_every_named_plan_divides_its_config():
    for name in configs.names():
        assert plan_problems(plan_for(name), configs.get_config(name)) == [], name


def test_plan_for_accepts_names_configs_mappings_and_plans():
    assert plan_for("k3") == MeshPlan(model=8, expert=64)
    assert plan_for(configs.get_config("k3")) == MeshPlan(model=8, expert=64)
    assert plan_for(configs.get_config("k3").replace(name="custom")) == MeshPlan()
    assert plan_for({"expert": 4}) == MeshPlan(expert=4)
    plan = MeshPlan(context=2)
    assert plan_for(plan) is plan


def test_exact_axis_that_cannot_be_met_is_a_clear_error():
    plan = MeshPlan(model=8, exact=("model",))
    assert auto_mesh(plan, 16) == (2, 1, 1, 8)
    with pytest.raises(MeshShapeError, match="needs model=8 exactly, but 12 devices"):
        auto_mesh(plan, 12)
    with pytest.raises(MeshShapeError, match="positive device count"):
        auto_mesh("k3", 0)


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="unknown axes"):
        MeshPlan.from_dict({"data": 2})
    with pytest.raises(ValueError, match="positive int"):
        MeshPlan(model=0)
    with pytest.raises(ValueError, match="exact axes"):
        MeshPlan(exact=("data",))
    with pytest.raises(Exception, match="unknown config"):
        plan_for("nope")


def test_mesh_option_auto_or_absent_uses_the_plan_else_parses():
    assert mesh_sizes_for(None, "k3", 16) == {"data": 1, "expert": 2, "context": 1, "model": 8}
    assert mesh_sizes_for("auto", "tiny", 8) == {"data": 8, "expert": 1, "context": 1, "model": 1}
    assert mesh_sizes_for("2,1,1,4", "k3", 8) == {"data": 2, "expert": 1, "context": 1, "model": 4}


def test_the_trainer_mesh_comes_from_the_plan_when_mesh_is_absent_or_auto():
    """`train.py` without --mesh (or --mesh=auto) on this process's 8 devices: k3's plan puts them on 'model';
    an explicit smaller mesh takes the first devices."""
    k3 = configs.get_config("k3")
    for option in (None, "auto"):
        assert dict(make_mesh_from_option(option, k3).shape) == {"data": 1, "expert": 1, "context": 1, "model": 8}
        assert dict(make_mesh_from_option(option, configs.get_config("tiny")).shape)["data"] == 8
    small = make_mesh_from_option("2,1,1,1", k3)
    assert list(small.devices.flat) == jax.devices()[:2]
