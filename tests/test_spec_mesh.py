"""Speculative decoding on a device mesh (8 emulated CPU devices): greedy tokens equal the one-device plain
scheduler's, token for token, with the draft's parameters placed like the target's, its per-slot state over the
slots' batch axes and its page pools replicated (`sharded.slot_axis_shardings`).

`tiny` with kda_impl=recurrent as in tests/test_inference_sharded.py (same layer kinds; faster prefill compiles).
"""

from __future__ import annotations

import functools

import jax
import pytest
from flax import nnx

from k3jax.eagle3 import Eagle3Layer
from k3jax.inference.drafts import CallbackDraft, MTPDraft
from k3jax.inference.eagle3_draft import Eagle3Draft
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.spec_scheduler import SpeculativeScheduler
from k3jax.inference.speculative import SpeculativeEngine
from k3jax.mtp import MTPLayer
from sharding.mesh import make_mesh
from tests.test_inference_sharded import PROMPTS, _axes, _serve, assert_cache_layout, tiny
from tests.test_spec_serving import oracle

SHAPE = dict(num_slots=4, max_len=32)
MAX_TOKENS = [6, 8, 4, 7, 5]
ARRIVALS = [0, 0, 1, 3, 6]  # 5 requests, 4 slots: one waits for a free slot


def _requests():
    return [Request(i, p, m, eos_ids=[]) for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]


@functools.lru_cache(maxsize=None)
def plain_one_device():
    return Scheduler(tiny(), **SHAPE).generate(_requests(), ARRIVALS)


@functools.lru_cache(maxsize=None)
def mesh_222():
    return make_mesh(2, 2, 1, 2)


def _check_layouts(sched, mesh, batch_axes):
    assert_cache_layout(sched.cache, mesh, batch_axes, ("model",))
    for x, a in zip(jax.tree.leaves(sched.draft_state), sched.draft.slot_axes()):
        want = tuple(() for _ in range(x.ndim)) if a < 0 else tuple(
            batch_axes if d == a else () for d in range(x.ndim))
        assert _axes(x.sharding.spec, mesh, x.ndim) == want, (x.shape, x.sharding.spec)


@pytest.mark.slow  # ~56 s; the default suite checks speculative decoding (test_speculative.py) and mesh decoding
def test_speculative_scheduler_on_mesh_equals_one_device_plain():  # (test_inference_sharded.py) apart
    """data=2 x expert=2 x model=2, staggered requests accepting different counts per step (an oracle draft wrong
    at a different index per request): the one-device plain greedy tokens."""
    want = plain_one_device()
    mesh = mesh_222()
    draft = CallbackDraft(oracle([want[i][0] for i in range(len(PROMPTS))], [None, 0, 1, 2, None]), 3)
    sched = SpeculativeScheduler(tiny(), draft, mesh=mesh, **SHAPE)
    assert sched.generate(_requests(), ARRIVALS) == want
    stats = sched.speculative_stats()
    assert 0 < stats["accepted"] < stats["drafted"] and stats["plain_steps"] == 0
    assert_cache_layout(sched.cache, mesh, ("data", "expert"), ("model",))
    assert sched.num_free_pages == sched.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_mtp_and_eagle3_drafts_on_mesh_equal_one_device_plain(kind):
    """Drafts with state (MTP / EAGLE-3 latent pages replicated, last hidden state over the slots' batch axes) and
    parameters sharded by the serving rules."""
    model, mesh = tiny(), mesh_222()
    layer = (MTPLayer if kind == "mtp" else Eagle3Layer)(model.cfg, rngs=nnx.Rngs(1))
    draft = (MTPDraft if kind == "mtp" else Eagle3Draft)(layer, 2)
    sched = SpeculativeScheduler(model, draft, mesh=mesh, **SHAPE)
    assert sched.generate(_requests(), ARRIVALS) == plain_one_device()
    assert sched.speculative_stats()["verify_steps"] > 0
    _check_layouts(sched, mesh, ("data", "expert"))
    params = jax.tree.leaves(sched.draft_params)
    assert all(x.sharding.mesh.shape == mesh.shape for x in params)


@pytest.mark.slow
def test_speculative_scheduler_with_prefix_cache_on_mesh_equals_one_device_plain():
    """An MTP draft observing prefix-cache chunks on the mesh (a hit: the boundary page copied in the target's and
    the draft's pools, the draft's row rewritten): the one-device plain tokens."""
    model = tiny()
    prefix = [256] + list(range(30, 45))  # one 16-token block
    reqs = [Request(i, prefix + tail, 6, eos_ids=[]) for i, tail in enumerate(([1, 2], [3]))]
    want = Scheduler(model, **SHAPE).generate(reqs, arrival_steps=[0, 1])
    draft = MTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), 2)
    sched = SpeculativeScheduler(model, draft, mesh=mesh_222(), prefix_block=16, page_size=8, **SHAPE)
    assert sched.generate(reqs, arrival_steps=[0, 1]) == want
    assert sched.prefix_cache.hits == 1 and sched.page_copies == 1
    _check_layouts(sched, mesh_222(), ("data", "expert"))


@pytest.mark.slow
def test_speculative_engine_on_mesh_equals_one_device_plain():
    """Batch mode (`serve.py --prompts_file --mesh --speculative`): `SpeculativeEngine(mesh=)`."""
    model = tiny()
    want = plain_one_device()
    draft = MTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), 2)
    out = SpeculativeEngine(model, draft, mesh=mesh_222()).generate(PROMPTS, MAX_TOKENS, eos_id=-1)
    assert [r.tokens for r in out] == [want[i][0] for i in range(len(PROMPTS))]


@pytest.mark.slow
def test_serve_cli_speculative_batch_mode_on_mesh_equals_one_device_plain(tmp_path):
    """`serve.py --prompts_file --mesh=2,2,1,2 --speculative=mtp` (default chunked KDA prefill) writes what the
    one-device plain run writes."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fib(n):\nimport os\nhello\n")
    outs = []
    for flags in ((), ("--mesh=2,2,1,2", "--speculative=mtp", "--num_draft_tokens=2")):
        path = tmp_path / f"o{len(outs)}.jsonl"
        r = _serve("--config=tiny", f"--prompts_file={prompts}", f"--out={path}", "--max_new_tokens=6",
                   "--max_len=64", *flags, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(path.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 3
