"""Compiling for GPUs without one, and the cuDNN attention workspace it must add back.

The figures these tests pin were read from GPU-compiled programs (RESULTS.md 2026-12-05 "cudnn-workspace"): the
packed-layout attention backward of a `k3_gpu` step at one 131,072-token row with 64 document slots asked for
u8[77712090112]. The compile-only GPU run itself needs jax's CUDA plugin (not a default dependency): that test is
marked `gpu_compile` and runs in a subprocess."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from k3jax.ops import attention
from k3jax.training import memory
from k3jax.training.aot import cudnn_workspace_bytes, roofline
from sharding.aot import GPU_TARGETS, cuda_plugin_available, gpu_target_config, missing_compiler, parse_gpu_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_topology_names_parse_and_tpu_names_do_not():
    assert parse_gpu_target("h200") == ("h200", 1)
    assert parse_gpu_target("H100:8") == ("h100", 8)
    assert parse_gpu_target("v5p:2x2x1") is None and parse_gpu_target("a100") is None
    with pytest.raises(ValueError, match="GPU count must be >= 1"):
        parse_gpu_target("h200:0")


def test_gpu_target_config_carries_the_chip_figures():
    text = gpu_target_config("h200")
    assert f"device_memory_size: {143771 * 2**20}" in text and "core_count: 132" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert 'device_description_str: "NVIDIA H200 141GB HBM3e"' in text
    assert set(GPU_TARGETS) == {"h100", "h200"}


def test_packed_backward_workspace_formula_matches_the_compiled_gpu_program():
    # the device asked for 77,712,090,112 bytes: the formula's f32 [64, 12, 131072, 193] plus 25,600 bytes
    assert attention.cudnn_packed_bwd_workspace_bytes(1, 64, 12, 131072, 192) == 77712090112 - 25600


@pytest.mark.parametrize("batch, seq_len, want", [(1, 4096, 64), (4, 4096, 32), (8, 4096, 16), (1, 32768, 16),
                                                 (1, 131072, 4), (1, 1048576, 4)])
def test_auto_document_slots_keep_the_workspace_within_budget(batch, seq_len, want):
    m = attention.cudnn_max_segments(0, batch, 12, seq_len, 192)
    assert m == want
    ws = attention.cudnn_packed_bwd_workspace_bytes(batch, m, 12, seq_len, 192)
    assert ws <= attention.CUDNN_WORKSPACE_BUDGET or m == attention.CUDNN_MIN_SEGMENTS
    assert attention.cudnn_max_segments(7, batch, 12, seq_len, 192) == 7  # an explicit count is kept


def test_cudnn_attention_takes_the_auto_slot_count(monkeypatch):
    """causal_attention(impl="cudnn") hands cuDNN's packed layout the slot count `cudnn_max_segments` picks for the
    call's own shapes when asked for 0 (the `mla_cudnn_max_segments` default)."""
    seen = {}

    def fake_packed_or(q, k, v, seg, scale, max_segments, causal, fallback, layout=None):
        seen["m"] = max_segments
        return jnp.zeros(q.shape[:3] + v.shape[-1:], jnp.float32)

    monkeypatch.setattr(attention, "_cudnn_packed_or", fake_packed_or)
    b, t, h = 2, 65536, 12
    q = jax.ShapeDtypeStruct((b, t, h, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((b, t, h, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    jax.eval_shape(lambda q, k, v, s: attention.causal_attention(q, k, v, scale=0.1, impl="cudnn", segment_ids_bt=s,
                                                                 max_segments=0), q, q, v, seg)
    assert seen["m"] == attention.cudnn_max_segments(0, b, h, t, 192) == 4


def test_cudnn_operands_all_take_the_callers_layout(monkeypatch):
    """Under a GSPMD mesh cuDNN's partitioner needs q, k and v in one layout: the caller's `operand_layout` reaches
    all three as cuDNN receives them, the zero-padded values included (they came out replicated otherwise in a
    data-parallel step compiled for two GPUs)."""
    laid, got = [], {}

    def layout(a):
        laid.append(a.shape)
        return a

    def fake_dpa(q, k, v, **kw):
        got["shapes"] = (q.shape, k.shape, v.shape)
        return jnp.zeros(q.shape, q.dtype)

    monkeypatch.setattr(attention.cudnn_attention, "dot_product_attention", fake_dpa)
    b, t, h = 1, 64, 2
    q = jnp.zeros((b, t, h, 192), jnp.bfloat16)
    v = jnp.zeros((b, t, h, 128), jnp.bfloat16)
    seg = jnp.zeros((b, t), jnp.int32)
    out = attention.causal_attention(q, q, v, scale=0.1, impl="cudnn", segment_ids_bt=seg, max_segments=4,
                                      operand_layout=layout)
    assert out.shape == (b, t, h, 128)
    assert got["shapes"] == ((b, t, h, 192),) * 3 and laid.count((b, t, h, 192)) >= 3
    laid.clear()
    attention.causal_attention(q, q, v, scale=0.1, impl="cudnn", operand_layout=layout)  # unpacked rows
    assert laid == [(b, t, h, 192), (b, t, h, 192), (b, t, h, 128)]


_BWD_LINE = ('  %dot_product_attention_bwd.8 = (bf16[1,12,8192,192]{{3,1,2,0}}, bf16[1,12,8192,192]{{3,1,2,0}}, '
             'bf16[1,12,8192,192]{{3,1,2,0}}, u8[{ws}]{{0}}) custom-call(%a, %b), '
             'custom_call_target="__cudnn$fmhaSoftmaxBackward", operand_layout_constraints={{bf16[1,8192,12,192]'
             '{{3,2,1,0}}, bf16[1,8192,12,192]{{3,2,1,0}}, bf16[1,8192,12,192]{{3,2,1,0}}, f32[{rows},12,8192]'
             '{{2,1,0}}, s32[1,64]{{1,0}}}}, api_version=API_VERSION_STATUS_RETURNING')


def test_workspace_is_added_for_a_deviceless_compile_only():
    deviceless = "\n".join([_BWD_LINE.format(ws=0, rows=16), _BWD_LINE.format(ws=0, rows=64)])
    assert cudnn_workspace_bytes(deviceless) == attention.cudnn_packed_bwd_workspace_bytes(1, 64, 12, 8192, 192)
    assert cudnn_workspace_bytes(_BWD_LINE.format(ws=123456, rows=64)) == 0  # sized on the device already
    assert cudnn_workspace_bytes("%x = f32[4] add(%a, %b)") == 0


class _CompileOnlyGpu(SimpleNamespace):
    def memory_stats(self):
        raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")


@pytest.mark.parametrize("env, frac", [({}, 0.75), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, 0.95),
                                       ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 1.0)])
def test_compile_only_gpu_memory_is_the_allocators_share(monkeypatch, env, frac):
    for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    dev = _CompileOnlyGpu(platform="gpu", device_kind="NVIDIA H200 141GB HBM3e")
    got, source = memory.device_memory_bytes(dev)
    assert got == int(140.4 * memory.GIB * frac) and "allocator" in source  # 143,771 MiB, as the H200 reports


def test_roofline_is_withheld_without_compiler_counts():
    assert roofline({"flops": 0.0, "bytes_accessed": 0.0}, 1e12, "v5p") is None  # as a GPU compiled without one
    assert roofline({"flops": 1e12, "bytes_accessed": 1e9}, 1e12, "v5p")["step_s"] > 0
    assert roofline({"flops": 1e12, "bytes_accessed": 1e9}, 1e12, "h200") is None  # no GPU peaks kept


def test_compile_only_for_a_gpu_without_the_plugin_names_the_install(monkeypatch):
    if cuda_plugin_available():
        pytest.skip("the CUDA plugin is installed here: the message is for machines without it")
    assert missing_compiler("h200")
    run = subprocess.run([sys.executable, "train.py", "--config=tiny", "--compile_only", "--topology=h200"],
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "needs jax's CUDA plugin (pip install 'jax[cuda12]" in run.stderr, run.stderr


@pytest.mark.gpu_compile
@pytest.mark.skipif(not cuda_plugin_available(), reason="jax's CUDA plugin not installed (pip install "
                    "'jax[cuda12]==<jax version>')")
def test_data_parallel_bf16_step_with_cudnn_attention_compiles_for_two_h200s():
    """The data-parallel step on two GPUs with bf16 compute (cuDNN attention under GSPMD): its partitioner refused
    the step when the padded values' layout differed from the queries' (`operand_layout`)."""
    env = {**os.environ, "XLA_FLAGS": ""}
    env.pop("JAX_PLATFORMS", None)
    cmd = [sys.executable, "train.py", "--config=tiny", "--compile_only", "--topology=h200:2", "--mesh=2,1,1,1",
           "--batch_size=4", "--seq_len=256", "--set=dtype=bfloat16"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "compiled step:" in run.stdout and "fits" in run.stdout


@pytest.mark.gpu_compile
@pytest.mark.skipif(not cuda_plugin_available(), reason="jax's CUDA plugin not installed (pip install "
                    "'jax[cuda12]==<jax version>')")
def test_tiny_train_step_compiles_for_an_h200_without_a_gpu():
    """train.py --compile_only --topology=h200 compiles the tiny step with XLA's GPU compiler on this CPU host (the
    Triton KDA kernel and cuDNN attention included) and gives the verdict against the allocator's share."""
    env = {**os.environ, "XLA_FLAGS": "", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    env.pop("JAX_PLATFORMS", None)
    cmd = [sys.executable, "train.py", "--config=tiny", "--compile_only", "--topology=h200", "--batch_size=2",
           "--seq_len=256"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    body = run.stdout[run.stdout.index("\n{\n") + 1:run.stdout.rindex("\n}") + 2]
    out = json.loads(body)
    assert out["device_kind"] == "NVIDIA H200 141GB HBM3e" and out["fits"]
    assert out["per_chip_bytes"]["temp_size_in_bytes"] > 0
    assert "kda_chunk" in " ".join(out["pallas_kernels"]), out["pallas_kernels"]
    assert "compiled step:" in run.stdout and "x 0.95, the allocator's share" in run.stdout
