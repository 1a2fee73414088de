"""Conversion throughput and peak host memory on a multi-GB synthetic K3-format checkpoint.

    python -m benchmarks.convert_bench [--workdir /tmp/k3_convert_bench] [--keep]

Generates a K3-layout HF directory (`language_model.` prefix, MXFP4 routed experts, bf16/f32 as released, A_log
with a zero tail, nested config.json, one shard per layer) for a K3-shaped config scaled down in depth but with
large tensors (~3.8 GB on disk), then runs `python -m k3jax.convert` in a fresh subprocess for `--experts bf16`
(decode) and `--experts mxfp4` (keep packed), `k3jax.load_checkpoint(..., mesh=)` onto 8 emulated CPU devices,
and `--to_hf` back. Reports GB/s (input bytes / wall time) and
the subprocess's peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) next to the largest tensor group (one
layer's converted tensors) and the whole checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from configs import k3
from k3jax.convert.checkpoint import K3_PREFIX, hf_shape, make_plan
from k3jax.convert.hf_config import config_to_hf
from k3jax.convert.safetensors_io import plan_shards, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias",
                "routed_expert_norm.weight")


def bench_config():
    return k3.config().replace(
        name="convert_bench", hidden_size=2048, num_hidden_layers=6, full_attn_layers=(4, 6), intermediate_size=8192,
        kda_num_heads=16, kda_head_dim=128, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
        num_experts=128, num_experts_per_token=8, num_shared_experts=2, moe_intermediate_size=1536,
        routed_expert_hidden_size=1536, attn_res_block_size=4)


def generate(cfg, hf_dir: str) -> int:
    """Writes the synthetic HF directory one shard (one plan item) at a time; returns bytes written."""
    rng = np.random.default_rng(0)
    os.makedirs(hf_dir)
    plan = make_plan(cfg)
    weight_map, total = {}, 0
    items = list(plan.items.items())
    for i, (_, slots) in enumerate(items):
        entries = []
        for slot in slots:
            shape = hf_shape(slot)
            if slot.kind == "experts":
                out_f, in_f = shape
                for e in range(cfg.num_experts):
                    name = K3_PREFIX + slot.hf_name.format(e=e)
                    entries.append((name + "_packed", np.dtype(np.uint8), (out_f, in_f // 2)))
                    entries.append((name + "_scale", np.dtype(np.uint8), (out_f, in_f // 32)))
            elif slot.kind == "a_log":
                entries.append((K3_PREFIX + slot.hf_name, np.dtype(np.float32), (128,)))
            else:
                dt = np.float32 if slot.hf_name.endswith(F32_SUFFIXES) else ml_dtypes.bfloat16
                entries.append((K3_PREFIX + slot.hf_name, np.dtype(dt), shape))

        def arrays():
            for name, dt, shape in entries:
                if name.endswith("_packed"):
                    yield rng.integers(0, 256, shape, dtype=np.uint8)
                elif name.endswith("_scale"):
                    yield rng.integers(118, 124, shape, dtype=np.uint8)
                elif name.endswith("A_log"):
                    a = np.zeros(shape, np.float32)
                    a[:cfg.kda_num_heads] = rng.uniform(0, 2.7, cfg.kda_num_heads)
                    yield a
                else:
                    yield (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dt)

        file = f"model-{i + 1:05d}-of-{len(items):05d}.safetensors"
        (shard,) = plan_shards(entries, 1 << 62)
        write_shard(os.path.join(hf_dir, file), shard, arrays())
        for name, dt, shape in entries:
            weight_map[name] = file
            total += int(np.prod(shape)) * dt.itemsize
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    hf_cfg = config_to_hf(cfg, k3_format=True, quantization_config={"quant_method": "mxfp4", "group_size": 32})
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    return total


def run_convert(args: list[str]) -> tuple[float, float]:
    """Runs `python -m k3jax.convert ARGS` in a fresh process; returns (wall seconds, peak RSS GiB)."""
    code = ("import resource, runpy, sys\n"
            f"sys.argv = ['k3jax.convert'] + {args!r}\n"
            "try:\n    runpy.run_module('k3jax.convert', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    start = time.time()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    wall = time.time() - start
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    kb = int([ln for ln in res.stdout.splitlines() if ln.startswith("MAXRSS_KB")][0].split()[1])
    return wall, kb / (1 << 20)


def run_load(ckpt: str) -> tuple[float, float, float]:
    """`k3jax.load_checkpoint(ckpt, mesh=2x2x1x2)` on 8 emulated CPU devices in a fresh process; returns
    (wall seconds, peak RSS GiB, resident parameter GiB: every device's shards, replicas counted). On CPU the
    devices' shards live in host memory, so the loader's own overhead is peak RSS minus the resident parameters."""
    code = ("import resource, sys, jax\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "import k3jax\nfrom sharding.mesh import make_mesh\nfrom flax import nnx\n"
            f"cfg, model = k3jax.load_checkpoint({ckpt!r}, mesh=make_mesh(data=2, expert=2, model=2))\n"
            "n = sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model)) for s in x.addressable_shards)\n"
            "print('PARAM_BYTES', n)\n"
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    start = time.time()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - start
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    lines = res.stdout.splitlines()
    kb = int([ln for ln in lines if ln.startswith("MAXRSS_KB")][0].split()[1])
    nbytes = int([ln for ln in lines if ln.startswith("PARAM_BYTES")][0].split()[1])
    return wall, kb / (1 << 20), nbytes / 2**30


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/k3_convert_bench")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    cfg = bench_config()
    if os.path.exists(args.workdir):
        shutil.rmtree(args.workdir)
    hf_dir = os.path.join(args.workdir, "hf")
    start = time.time()
    total = generate(cfg, hf_dir)
    print(f"generated {total / 1e9:.2f} GB K3-format checkpoint in {time.time() - start:.0f}s ({hf_dir})")
    plan = make_plan(cfg)
    largest = max(sum(int(np.prod(s.shape)) * np.dtype(ml_dtypes.bfloat16 if s.dtype != np.float32 else s.dtype)
                      .itemsize for s in slots) for slots in plan.items.values())
    print(f"largest tensor group (one layer, decoded bf16): {largest / 2**30:.2f} GiB")
    for experts in ("bf16", "mxfp4"):
        out = os.path.join(args.workdir, f"orbax_{experts}")
        wall, rss = run_convert(["--hf_dir", hf_dir, "--out", out, "--dtype", "bf16", "--experts", experts])
        print(f"HF->Orbax --experts {experts}: {wall:.1f}s, {total / 1e9 / wall:.3f} GB/s of input, "
              f"output {dir_bytes(out) / 1e9:.2f} GB, peak RSS {rss:.2f} GiB")
    for experts in ("bf16", "mxfp4"):
        wall, rss, resident = run_load(os.path.join(args.workdir, f"orbax_{experts}"))
        print(f"load_checkpoint onto a 2x2x1x2 mesh (8 CPU devices), --experts {experts} checkpoint: {wall:.1f}s, "
              f"peak RSS {rss:.2f} GiB with {resident:.2f} GiB of parameters resident on the devices "
              f"(loader overhead {rss - resident:.2f} GiB)")
    back = os.path.join(args.workdir, "hf_back")
    wall, rss = run_convert(["--to_hf", "--checkpoint", os.path.join(args.workdir, "orbax_mxfp4"), "--out", back])
    print(f"Orbax->HF (packed experts): {wall:.1f}s, {dir_bytes(back) / 1e9 / wall:.3f} GB/s written, "
          f"peak RSS {rss:.2f} GiB")
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
