"""Several local JAX processes on CPU, as a pod's hosts are: the launcher (`launch`, used by the tests) and the worker
(`python tests/multiprocess_worker.py TASK ...`, one per process).

Each worker gets `--xla_force_host_platform_device_count` CPU devices, joins `jax.distributed` at a local
coordinator (cross-process collectives through gloo, `jax_cpu_collectives_implementation`), runs one task from
`TASKS` and writes its result to `<out>/process_<i>.npz` (or .json). A worker whose peers do not all join within
`--init_timeout` seconds ends (jax's coordination client aborts the process; a Python-level failure exits with
code 3); `launch` kills every worker when one fails or the wall-clock timeout passes and returns each one's exit
code, output and a one-line `error` (e.g. "did not join: not all 2 processes joined ... within 5 s"), so a missing
or stuck process fails the test clearly instead of hanging it. Tasks (`TASKS`): `data` (global batches on several
meshes), `train` (`k3jax.training.trainer.train` on `train_config()`: losses, checkpoints in --workdir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

import configs
from k3jax.data.global_batch import make_global_dataset
from k3jax.training.trainer import TrainOptions, train
from sharding.rules import MESH_AXES
from tests.helpers import use_compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INIT_FAILED = 3
JOINED = "joined jax.distributed:"  # printed by a worker once every process has joined


# ------------------------------------------------------------------------------------------------ launcher side


@dataclasses.dataclass
class WorkerResult:
    process_id: int
    returncode: int | None  # None: killed at the timeout
    output: str
    error: str | None  # None when the worker succeeded


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(task: str, args: list[str], *, num_processes: int = 2, devices_per_process: int = 4,
           process_ids: list[int] | None = None, timeout: float = 240, init_timeout: int = 60,
           grace: float = 15) -> list[WorkerResult]:
    """Starts `process_ids` (default all) of `num_processes` workers running `task`, waits for them (at most
    `timeout` s; once one fails, the others get `grace` s before they are killed) and returns their results."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    procs = {}
    for i in (range(num_processes) if process_ids is None else process_ids):
        cmd = [sys.executable, os.path.abspath(__file__), task, "--process_id", str(i), "--num_processes",
               str(num_processes), "--coordinator", f"127.0.0.1:{port}", "--init_timeout", str(init_timeout), *args]
        procs[i] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs.values()):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    results = []
    for i, p in procs.items():
        killed = p.poll() is None
        if killed:
            p.kill()
        out, _ = p.communicate()
        rc = None if killed else p.returncode
        error = None
        if rc != 0:
            how = "killed at the timeout" if killed else f"exit {rc}"
            error = (f"process {i} failed after joining ({how})" if JOINED in out else
                     f"process {i} did not join: not all {num_processes} processes joined the coordinator within "
                     f"{init_timeout} s ({how})")
        results.append(WorkerResult(i, rc, out, error))
    return results


def describe(results: list[WorkerResult]) -> str:
    """Every worker's exit code and the tail of its output (for assertion messages)."""
    return "\n".join(f"--- process {r.process_id}: {r.error or 'ok'}\n{r.output[-3000:]}" for r in results)


# ------------------------------------------------------------------------------------------------ worker side

# Meshes of the data task over 2 processes x 4 devices: (name, data,expert,context,model sizes, device order).
# Orders index the global devices process-major (process p's local device d is p * 4 + d); "interleaved" orders
# put devices of both processes into one data-parallel shard, so both must build its rows identically.
DATA_MESHES = (
    ("2,2,1,2", (2, 2, 1, 2), (0, 1, 2, 3, 4, 5, 6, 7)),
    ("1,2,1,4", (1, 2, 1, 4), (0, 1, 2, 3, 4, 5, 6, 7)),
    ("1,1,1,8 shared", (1, 1, 1, 8), (0, 1, 2, 3, 4, 5, 6, 7)),
    ("4,1,1,2 interleaved", (4, 1, 1, 2), (0, 4, 1, 5, 2, 6, 3, 7)),
    ("2,2,1,1 on 4 devices", (2, 2, 1, 1), (0, 1, 4, 5)),
    ("1,2,1,2 on 4 devices interleaved", (1, 2, 1, 2), (0, 4, 1, 5)),
)
DATA_BATCH, DATA_SEQ, DATA_STEPS = 8, 16, 2


def data_task(args) -> dict:
    """For every mesh of DATA_MESHES: DATA_STEPS global batches from `make_global_dataset`; records each global
    array as gathered to every process (a gloo all-gather) and this process's own shards (index, rows)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    out = {}
    for name, sizes, order in DATA_MESHES:
        grid = np.array([devices[i] for i in order]).reshape(sizes)
        mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        it = make_global_dataset(args.data_dir, mesh, batch_size=DATA_BATCH, seq_len=DATA_SEQ, seed=5)
        for step in range(DATA_STEPS):
            batch = next(it)
            for key, arr in batch.items():
                prefix = f"{name}|{step}|{key}"
                out[f"{prefix}|gathered"] = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
                for n, shard in enumerate(arr.addressable_shards):
                    start = shard.index[0].start or 0
                    out[f"{prefix}|local|{n}|{start}"] = np.asarray(shard.data)
        it.close()
    return out


# `tiny` cut to 5 layers (every layer kind) and the options of the multi-process training runs.
TRAIN_CONFIG = ("tiny", ("num_hidden_layers=5", "full_attn_layers=(4,5)"))
TRAIN_OPTIONS = dict(batch_size=8, seq_len=32, log_every=1, checkpoint_every=2, seed=0)


def train_config():
    return configs.get_config(TRAIN_CONFIG[0], list(TRAIN_CONFIG[1]))


def train_options(**kw) -> TrainOptions:
    return TrainOptions(**{**TRAIN_OPTIONS, **kw})


def train_task(args) -> dict:
    """`train` with --mesh / --steps / --halt_at_step / --workdir / --data_dir: this process's losses and log."""
    logs = []
    opts = train_options(mesh=args.mesh, steps=args.steps, halt_at_step=args.halt_at_step, workdir=args.workdir,
                         data=args.data_dir)
    losses = train(train_config(), opts, log_fn=logs.append)
    return {"losses": losses, "log": logs}


TASKS = {"data": data_task, "train": train_task}


def _worker_main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--process_id", type=int, required=True)
    p.add_argument("--num_processes", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--init_timeout", type=int, default=60)
    p.add_argument("--out", required=True)
    p.add_argument("--data_dir")
    p.add_argument("--mesh")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--halt_at_step", type=int)
    p.add_argument("--workdir")
    p.add_argument("--compile_cache", help="persistent XLA compilation cache (runs of one test compile once)")
    args = p.parse_args(argv)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.compile_cache:
        use_compile_cache(args.compile_cache)
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.init_timeout, heartbeat_timeout_seconds=30)
    except Exception as e:  # noqa: BLE001 - any start-up failure is reported the same way
        print(f"process {args.process_id}: jax.distributed.initialize failed: not all {args.num_processes} "
              f"processes joined the coordinator {args.coordinator} within {args.init_timeout} s "
              f"({type(e).__name__}: {str(e)[:300]})", file=sys.stderr, flush=True)
        return INIT_FAILED
    print(f"{JOINED} process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} local / "
          f"{jax.device_count()} global devices", flush=True)
    result = TASKS[args.task](args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"process_{args.process_id}")
    if all(hasattr(v, "shape") for v in result.values()):
        np.savez(path + ".npz", **result)
    else:
        with open(path + ".json", "w") as f:
            json.dump(result, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
