"""Compile-only for a small TPU topology (v5p:2x2x1, 4 chips) with libtpu: one sharded `tiny` training step
lowers and compiles with the real TPU compiler on this CPU machine. Skipped where libtpu is not installed (it is not
a default dependency); run in a subprocess so the TPU plugin never touches the test process's 8 CPU devices."""

import json
import os
import subprocess
import sys

import pytest

from sharding.aot import libtpu_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_tiny_train_step_compiles_for_v5p_2x2x1():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "k3jax.training.aot", "--config=tiny", "--set=kda_impl=recurrent",
           "--topology=v5p:2x2x1", "--mesh=2,1,1,2", "--batch_size=4", "--seq_len=32"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["num_chips"] == 4 and result["device_kind"].startswith("TPU v5")
    assert result["mesh"].startswith("data=2 expert=1 context=1 model=2")
    mem = result["per_chip_bytes"]
    assert 0 < mem["argument_size_in_bytes"] < 64 * 2**20 and mem["temp_size_in_bytes"] > 0


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_tiny_train_step_with_the_mosaic_kernels_compiles_for_v5p_2x2x1():
    """The kernels' "auto" choices resolve for the TPU topology (even compiled on a CPU host): the whole step on an
    expert x model mesh, with the Mosaic KDA forward/backward inside shard_map and the Mosaic grouped matmuls inside
    the expert-parallel shard_map, compiles."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "k3jax.training.aot", "--config=tiny", "--topology=v5p:2x2x1", "--mesh=1,2,1,2",
           "--batch_size=4", "--seq_len=128"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    want = {"kda_chunk_tpu", "kda_chunk_bwd_tpu", "k3_gmm_tpu", "k3_tgmm_tpu"}
    assert want <= set(result["pallas_kernels"]), result["pallas_kernels"]


def _train_compile_only(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "TPU_SKIP_MDS_QUERY": "1"}
    cmd = [sys.executable, "train.py", "--config=tiny", "--compile_only", "--topology=v5p:2x2x1", "--mesh=4,1,1,1",
           "--batch_size=4", "--set=kda_impl=recurrent", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.tpu_compile
@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]==<jax version>')")
def test_train_compile_only_says_whether_the_step_fits_the_chip():
    """`train.py --compile_only` ends with a verdict line against the chip's memory and exits 0 when the step fits;
    a step the TPU compiler refuses for memory exits 2 with one 'does not fit' line and the knobs to try, no
    traceback (tiny at T = 65,536 with the XLA attention core: f32 T x T scores)."""
    fits = _train_compile_only("--seq_len=64")
    assert fits.returncode == 0, fits.stderr[-4000:]
    assert "GiB per chip of 95.00 GiB" in fits.stdout and fits.stdout.rstrip().endswith(": fits")
    big = _train_compile_only("--seq_len=65536", "--set=mla_attention_impl=xla")
    assert big.returncode == 2, big.stderr[-4000:]
    assert "does not fit on v5p:2x2x1: RESOURCE_EXHAUSTED" in big.stderr and "Traceback" not in big.stderr
    assert "--set remat_policy=layer" in big.stderr
