"""Generation on a device mesh (8 emulated CPU devices) equals generation on one device.

References are single-device and independent of the cached path: greedy tokens come from re-running the full
(uncached) forward on the growing sequences, teacher-forced logits from one full forward. The mesh runs go through
`Engine(mesh=)` / `Scheduler(mesh=)`: parameters sharded by the rules, caches in `k3jax.inference.sharded`'s layouts
(checked leaf by leaf against the intended specs written out here), the MoE expert-parallel (checked in the lowered
decode program). Compilation dominates the cost: the default suite compiles each mesh program once ((2,2,1,2):
Engine.generate and teacher forcing; (1,4,1,2): the Scheduler); the other combinations are marked slow.

`tiny` with kda_impl=recurrent: the same layer kinds, and its prefill compiles in about half the time of the chunked
core (decode uses the recurrent step either way; the chunked prefill under a mesh is covered by the slow CLI test).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.inference import sharded
from k3jax.inference.engine import Engine, SamplingParams
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.layers.kda import KDAState
from k3jax.model import K3Model
from sharding.mesh import MeshShapeError, make_mesh
from tests.test_inference_cache import fixed_routing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME, OVERRIDES = "tiny", ("kda_impl=recurrent",)
MAX_LEN = 32
N_NEW = 8
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4], [256, 7, 7, 7, 9, 11],
           [256, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88]]
REF_ROWS = len(PROMPTS)  # every reference forward has shape [REF_ROWS, MAX_LEN]: one compile
TOL = dict(rtol=1e-4, atol=1e-4)


@functools.lru_cache(maxsize=None)
def tiny():
    return fixed_routing(K3Model(configs.get_config(NAME, list(OVERRIDES)), rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=None)
def _full_forward():
    gd, state = nnx.split(tiny())
    full = jax.jit(lambda st, ids: nnx.merge(gd, st)(ids))
    return lambda ids: np.asarray(full(state, jnp.asarray(ids)))


def full_logits(rows: list[list[int]]) -> np.ndarray:
    """Single-device full-forward logits [len(rows), MAX_LEN, V] (rows right-padded with 0; causal, so padding
    does not change earlier positions)."""
    ids = np.zeros((REF_ROWS, MAX_LEN), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return _full_forward()(ids)[:len(rows)]


def greedy_reference(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Independent reference: argmax of the full forward on the growing sequences, n times."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = full_logits(seqs)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(PROMPTS, N_NEW)


def _axes(spec, mesh, ndim: int) -> tuple:
    """A PartitionSpec as, per dimension, the mesh axes of size > 1 splitting it (size-1 axes are no split)."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    out = []
    for e in entries:
        names = () if e is None else (e if isinstance(e, tuple) else (e,))
        out.append(tuple(a for a in names if mesh.shape[a] > 1))
    return tuple(out)


def assert_cache_layout(cache, mesh, batch_axes: tuple, head_axes: tuple):
    """Every leaf carries the intended layout: KDA states [(R,) B, H, K, V] on B and H, conv histories
    [(R,) B, W-1, 3, H*K] on B and H*K, page pools replicated, page table and lengths on B."""
    for group in cache.layers:
        for state in group:
            if isinstance(state, KDAState):
                lead = ((),) * (state.state_bhkv.ndim - 4)
                want = {"state_bhkv": lead + (batch_axes, head_axes, (), ()),
                        "conv_bwcp": lead + (batch_axes, (), (), head_axes)}
                for field, axes in want.items():
                    x = getattr(state, field)
                    assert _axes(x.sharding.spec, mesh, x.ndim) == axes, (field, x.sharding.spec)
            else:
                assert _axes(state.sharding.spec, mesh, state.ndim) == ((),) * state.ndim, state.sharding.spec
    assert _axes(cache.page_table.sharding.spec, mesh, 2) == (batch_axes, ())
    assert _axes(cache.lengths.sharding.spec, mesh, 1) == (batch_axes,)
    assert all(x.sharding.mesh.shape == mesh.shape for x in jax.tree.leaves(cache))


@pytest.fixture(scope="module")
def mesh_a():
    return make_mesh(2, 2, 1, 2)


@pytest.fixture(scope="module")
def engine_a(mesh_a):
    return Engine(tiny(), mesh=mesh_a)


def test_engine_generate_on_mesh_equals_one_device(engine_a, reference):
    """5 prompts on data=2 x expert=2 x model=2 (padded to 8 rows): the greedy tokens of the one-device full
    forward; prefill and decode compile once."""
    out = engine_a.generate(PROMPTS, N_NEW, eos_id=-1)
    assert [r.tokens for r in out] == reference
    assert [r.prompt_length for r in out] == [len(p) for p in PROMPTS]
    assert engine_a.trace_counts["prefill"] == 1 and engine_a.trace_counts["decode"] == 1
    # parameters are distributed by the serving rules: tensor ('model') and expert parallel, no FSDP over 'data'
    # (a decode step would otherwise gather the weights every token)
    leaves = jax.tree.leaves(engine_a.params)
    assert all(x.sharding.mesh.shape == engine_a.mesh.shape for x in leaves)
    used = [set(_axes(x.sharding.spec, engine_a.mesh, x.ndim)[d]) for x in leaves for d in range(x.ndim)]
    assert not any("data" in axes for axes in used)
    assert any("expert" in axes for axes in used) and any("model" in axes for axes in used)


@pytest.mark.slow
def test_teacher_forced_logits_on_mesh_equal_one_device_and_cache_keeps_its_layout(engine_a, mesh_a):
    """Prefill a chunk of 8 then decode 8 tokens one at a time on the mesh: every logit equals the one-device full
    forward; the cache carries its layout before, during and after; the decode program exchanges tokens between
    expert ranks (expert parallelism at decode shapes: 1 token per device)."""
    seqs = np.random.RandomState(1).randint(0, 256, (4, 16)).astype(np.int32)
    want = full_logits(seqs.tolist())[:, :16]
    batch_axes, heads = ("data", "expert"), ("model",)
    cache = engine_a.init_cache(4, MAX_LEN)
    assert_cache_layout(cache, mesh_a, batch_axes, heads)
    logits, cache = engine_a.forward_cached(seqs[:, :8], cache)
    np.testing.assert_allclose(np.asarray(logits), want[:, :8], **TOL)
    assert_cache_layout(cache, mesh_a, batch_axes, heads)
    assert _axes(logits.sharding.spec, mesh_a, 3) == (batch_axes, (), ("model",))  # vocab over model
    for t in range(8, 16):
        logits, cache = engine_a.forward_cached(seqs[:, t:t + 1], cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], want[:, t], **TOL)
    assert_cache_layout(cache, mesh_a, batch_axes, heads)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [16] * 4)
    with sharded.context(mesh_a):
        hlo = engine_a._forward.lower(engine_a.params, jnp.asarray(seqs[:, :1]), cache,
                                      jnp.ones((4,), jnp.int32)).as_text()
    assert "all_to_all" in hlo


def _scheduler_matches_reference(mesh, reference, batch_axes, **kw):
    sched = Scheduler(tiny(), num_slots=4, max_len=MAX_LEN, decode_steps=2, mesh=mesh, **kw)
    assert_cache_layout(sched.cache, mesh, batch_axes, ("model",))
    max_tokens = [6, 8, 4, 7, 5]
    reqs = [Request(i, p, m, eos_ids=[]) for i, (p, m) in enumerate(zip(PROMPTS, max_tokens))]
    out = sched.generate(reqs, arrival_steps=[0, 0, 1, 3, 6])  # 5 requests, 4 slots: one waits for a free slot
    assert out == {i: (reference[i][:m], "length") for i, m in enumerate(max_tokens)}
    assert_cache_layout(sched.cache, mesh, batch_axes, ("model",))
    for x in jax.tree.leaves(sched.state):
        assert _axes(x.sharding.spec, mesh, x.ndim)[0] == batch_axes
    assert sched.num_free_pages == sched.num_pages
    return sched


@pytest.mark.slow
def test_scheduler_on_expert_mesh_equals_one_device(reference):
    """Continuous batching on data=1 x expert=4 x model=2: staggered requests in 4 slots give the one-device greedy
    tokens; the slots' cache and fields keep their layouts (slots over 'expert', KDA heads over 'model')."""
    _scheduler_matches_reference(make_mesh(1, 4, 1, 2), reference, ("expert",))


@pytest.mark.slow
def test_engine_on_expert_mesh_equals_one_device(reference):
    out = Engine(tiny(), mesh=make_mesh(1, 4, 1, 2)).generate(PROMPTS, N_NEW, eos_id=-1)
    assert [r.tokens for r in out] == reference


@pytest.mark.slow
def test_sampled_generation_on_mesh_equals_one_device():
    """Temperature / top-k / top-p sampling with per-sequence keys (sharded over the batch with the sequences) draws
    the one-device tokens."""
    sps = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, top_p=0.9)] * 2 + \
        [SamplingParams()]
    key = jax.random.key(7)
    want = Engine(tiny()).generate(PROMPTS, N_NEW, sps, eos_id=-1, key=key)
    got = Engine(tiny(), mesh=make_mesh(2, 2, 1, 2)).generate(PROMPTS, N_NEW, sps, eos_id=-1, key=key)
    assert [r.tokens for r in got] == [r.tokens for r in want]


@pytest.mark.slow
def test_scheduler_with_prefix_cache_on_mesh_equals_one_device(reference):
    """data=2 x expert=2 x model=2, with the prefix cache: a hit (shared pages, restored KDA states) on the mesh
    gives the one-device tokens."""
    sched = _scheduler_matches_reference(make_mesh(2, 2, 1, 2), reference, ("data", "expert"))
    prefix = [256] + list(range(30, 49))  # 20 tokens: one 16-token block cached
    prompts = [prefix + [1, 2], prefix + [3]]
    want = greedy_reference(prompts, 6)
    sched = Scheduler(tiny(), num_slots=4, max_len=MAX_LEN, mesh=sched.mesh, prefix_block=16)
    out = sched.generate([Request(i, p, 6, eos_ids=[]) for i, p in enumerate(prompts)], arrival_steps=[0, 1])
    assert out == {0: (want[0], "length"), 1: (want[1], "length")}
    assert sched.prefix_cache.hits == 1


def test_context_axis_refused_and_mesh_specs_checked():
    model = tiny()
    mesh = make_mesh(1, 1, 2, 4)
    with pytest.raises(sharded.InferenceMeshError, match="context axis to be 1"):
        Engine(model, mesh=mesh)
    with pytest.raises(sharded.InferenceMeshError, match="context axis to be 1"):
        Scheduler(model, num_slots=4, max_len=MAX_LEN, mesh=mesh)
    with pytest.raises(sharded.InferenceMeshError, match="context = 1"):
        sharded.mesh_from_spec("1,1,2,4")
    got = sharded.mesh_from_spec("2,2,1,2")
    assert dict(got.shape) == {"data": 2, "expert": 2, "context": 1, "model": 2}
    assert dict(sharded.mesh_from_spec("model=2", devices=jax.devices()[:2]).shape)["model"] == 2
    assert sharded.mesh_from_spec(None) is None and sharded.mesh_from_spec("") is None
    for bad, msg in (("2,2", "has 2 sizes"), ("2,x,1,4", "not an integer"), ("0,1,1,8", "must be >= 1"),
                     ("batch=8", "unknown mesh axis")):
        with pytest.raises(ValueError, match=msg):
            sharded.mesh_from_spec(bad)
    with pytest.raises(MeshShapeError, match="needs 3 devices"):
        sharded.mesh_from_spec("3,1,1,1")


def _serve(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "serve.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_serve_cli_rejects_bad_mesh(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    out = f"--out={tmp_path / 'o.jsonl'}"
    r = _serve("--config=tiny", "--mesh=1,1,2,4", f"--prompts_file={prompts}", out)
    assert r.returncode == 2 and "context = 1" in r.stderr, r.stderr[-2000:]
    r = _serve("--config=tiny", "--mesh=2,2", "--port=8000")
    assert r.returncode == 2 and "has 2 sizes" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_serve_cli_batch_mode_on_mesh_equals_one_device(tmp_path):
    """`serve.py --mesh=2,2,1,2` batch mode (default chunked KDA prefill) writes what the one-device run writes."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fib(n):\nimport os\nhello\n")
    outs = []
    for mesh in ((), ("--mesh=2,2,1,2",)):
        path = tmp_path / f"o{len(outs)}.jsonl"
        r = _serve("--config=tiny", f"--prompts_file={prompts}", f"--out={path}", "--max_new_tokens=6",
                   "--max_len=64", *mesh, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(path.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 3


def test_the_sharded_decode_benchmark_names_the_first_differing_position():
    from benchmarks.sharded_decode import compare

    assert compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) == {
        "identical_sequences": 2, "sequences": 2, "first_difference_at": None}
    assert compare([[1, 2, 3], [4, 9, 6]], [[1, 2, 3], [4, 5, 7]]) == {
        "identical_sequences": 1, "sequences": 2, "first_difference_at": 1}
