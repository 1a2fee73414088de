"""The 4-axis mesh: construction over the 8 emulated CPU devices, clear errors, the CLI spec parser, multi-host
detection."""

import jax
import pytest
from jax.sharding import AxisType

from sharding.mesh import (
    MeshShapeError,
    describe,
    initialize_distributed,
    is_multi_host_launch,
    make_mesh,
    parse_mesh,
)
from sharding.rules import MESH_AXES


def test_eight_emulated_devices():
    assert jax.device_count() == 8, "tests/conftest.py should force 8 host-platform devices"


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 4, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2), (1, 1, 1, 8)])
def test_make_mesh_shapes(shape):
    mesh = make_mesh(*shape)
    assert mesh.axis_names == MESH_AXES
    assert tuple(mesh.shape[a] for a in MESH_AXES) == shape
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert describe(mesh).startswith(" ".join(f"{a}={n}" for a, n in zip(MESH_AXES, shape)))


def test_make_mesh_on_a_device_subset():
    mesh = make_mesh(data=2, devices=jax.devices()[:2])
    assert mesh.size == 2 and mesh.shape["data"] == 2 and mesh.shape["model"] == 1
    assert make_mesh(devices=jax.devices()[:1]).size == 1


def test_make_mesh_wrong_product_names_the_sizes():
    with pytest.raises(MeshShapeError, match=r"data=2 x expert=2 x context=1 x model=1 needs 4 devices but 8 are"):
        make_mesh(data=2, expert=2)
    with pytest.raises(MeshShapeError, match="needs 8 devices but 2 were given"):
        make_mesh(model=8, devices=jax.devices()[:2])
    with pytest.raises(MeshShapeError, match="positive int"):
        make_mesh(data=0, model=8)


def test_parse_mesh():
    assert parse_mesh("2,1,1,4") == {"data": 2, "expert": 1, "context": 1, "model": 4}
    assert parse_mesh(" 1, 2,2 ,2 ") == {"data": 1, "expert": 2, "context": 2, "model": 2}
    assert parse_mesh("data=2,model=4") == {"data": 2, "expert": 1, "context": 1, "model": 4}
    assert make_mesh(**parse_mesh("2,4,1,1")).shape["expert"] == 4
    for bad, msg in [("2,4", "has 2 sizes"), ("2,x,1,1", "not an integer"), ("0,8,1,1", ">= 1"),
                     ("dat=8", "unknown mesh axis 'dat'"), ("data=2,1,1,4", "mixes"), ("", "empty")]:
        with pytest.raises(ValueError, match=msg):
            parse_mesh(bad)


@pytest.mark.parametrize("env,multi", [
    ({}, False),
    ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}, False),  # compile-only runs
    ({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"}, True),
    ({"MEGASCALE_NUM_SLICES": "2"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "0"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "1"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, True),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, False),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
])
def test_multi_host_detection(env, multi):
    assert is_multi_host_launch(env) is multi


def test_initialize_distributed_is_a_no_op_single_host():
    assert initialize_distributed({}) is False
    assert not jax.distributed.is_initialized()
