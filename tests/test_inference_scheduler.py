"""Continuous batching: requests arriving at different steps into a few reused slots produce exactly what each
request produces alone (greedy: an independent no-cache full-forward loop; sampling: the request alone);
per-request max_tokens / EOS / cancel; slot writes along the right batch axis for scanned groups."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.inference.cache import SHARED, cache_batch_axes, write_slots
from k3jax.inference.engine import SamplingParams
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.slot_steps import TRACE_COUNTS
from k3jax.model import init_cache
from tests.test_inference_cache import tiny_model

NAME = "tiny_kimi_linear"
MAX_LEN = 32
SLOTS = dict(num_slots=2, max_len=MAX_LEN, decode_steps=2)  # every scheduler here shares one set of compilations
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4], [256, 7, 7, 7, 9, 11],
           [256, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88]]


@functools.lru_cache(maxsize=None)
def _full_forward():
    gd, state = nnx.split(tiny_model(NAME))
    return state, jax.jit(lambda st, ids: nnx.merge(gd, st)(ids))


def greedy_alone(prompt: list[int], n: int) -> list[int]:
    """Independent reference: re-run the full (uncached) forward on the growing sequence and take the argmax."""
    state, full = _full_forward()
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, MAX_LEN), np.int32)  # causal: tokens after position len-1 do not change its logits
        ids[0, :len(seq)] = seq
        logits = np.asarray(full(state, jnp.asarray(ids)))[0, len(seq) - 1]
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def sched():
    return Scheduler(tiny_model(NAME), **SLOTS)


def test_staggered_greedy_requests_equal_each_alone_and_reuse_slots(sched):
    """5 requests into 2 slots (2 decode steps per device call), arriving at steps 0, 0, 1, 3, 6: some wait for a
    slot to free up; a second run in another scheduler of the same shapes compiles nothing."""
    max_tokens = [6, 9, 4, 7, 5]
    reqs = [Request(i, p, m, eos_ids=[]) for i, (p, m) in enumerate(zip(PROMPTS, max_tokens))]
    running = []
    orig_step = sched.step

    def step():  # record occupancy: never more than 3, and all 5 requests pass through the slots
        events = orig_step()
        running.append(sched.num_running)
        return events

    sched.step = step
    try:
        out = sched.generate(reqs, arrival_steps=[0, 0, 1, 3, 6])
    finally:
        del sched.step
    assert max(running) == 2 and not sched.has_work
    for i, (p, m) in enumerate(zip(PROMPTS, max_tokens)):
        assert out[i] == (greedy_alone(p, m), "length"), i
    traces = dict(TRACE_COUNTS)
    again = Scheduler(tiny_model(NAME), **SLOTS).generate(reqs[::-1], arrival_steps=[0, 1, 1, 2, 2])
    assert again == out and dict(TRACE_COUNTS) == traces


def test_events_eos_max_tokens_cancel_and_multi_step_decode():
    """Request 0 stops at an EOS id taken from its greedy output, request 1 has max_tokens 1 (its slot is reused in
    the same step), request 2 is cancelled after its 3rd token, request 3 runs to max_tokens."""
    s = Scheduler(tiny_model(NAME), **SLOTS)
    ref0 = greedy_alone(PROMPTS[0], 8)
    stop = ref0[3]
    cut = ref0.index(stop)
    s.add(Request("a", PROMPTS[0], 8, eos_ids=[stop, 383]))
    s.add(Request("b", PROMPTS[1], 1, eos_ids=[]))
    s.add(Request("c", PROMPTS[2], 8, eos_ids=[]))
    s.add(Request("d", PROMPTS[3], 5, eos_ids=[]))
    got: dict = {k: [] for k in "abcd"}
    finish: dict = {}
    for ev in s.events():
        assert ev.request_id not in finish, "no event after a request's final event"
        if ev.token is not None:
            assert ev.index == len(got[ev.request_id])
            got[ev.request_id].append(ev.token)
        if ev.request_id == "c" and len(got["c"]) == 3 and "c" not in finish:
            s.cancel("c")
        if ev.finish_reason:
            finish[ev.request_id] = ev.finish_reason
    assert finish == {"a": "stop", "b": "length", "c": "cancelled", "d": "length"}
    assert got["a"] == ref0[:cut]  # EOS itself is not emitted
    assert got["b"] == greedy_alone(PROMPTS[1], 1)
    assert 3 <= len(got["c"]) <= 4 and got["c"] == greedy_alone(PROMPTS[2], len(got["c"]))
    assert got["d"] == greedy_alone(PROMPTS[3], 5)
    assert s.num_running == 0 and s.num_waiting == 0


def test_mixed_sampling_is_independent_of_neighbours_and_arrival():
    """Sampled requests (own keys) next to a greedy one, staggered in 2 slots: each sampled request equals itself
    run alone, and the greedy one equals the reference (token i is drawn with fold_in(key, i), whatever the slot)."""
    s = Scheduler(tiny_model(NAME), **SLOTS)
    sp = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)]
    reqs = [Request(i, PROMPTS[i], 7, sp[i], jax.random.key(10 + i), eos_ids=[]) for i in range(3)]
    out = s.generate(reqs, arrival_steps=[0, 2, 3])
    assert out[1] == (greedy_alone(PROMPTS[1], 7), "length")
    for i in (0, 2):
        assert s.generate([reqs[i]]) == {i: out[i]}, i
        assert out[i][0] != greedy_alone(PROMPTS[i], 7)  # really sampled
    other = s.generate([dataclasses.replace(reqs[0], key=jax.random.key(99))])
    assert other[0] != out[0]


def test_prefix_cache_hit_equals_cold_run():
    """16-token boundaries: a cold run snapshots the 16-token prefix; two later prompts sharing it (one identical,
    one with another suffix) resume from the snapshot and produce the cold run's / the reference's tokens.
    8-token latent pages (a pool of 8): the entry's 2 full pages are shared, and the pool holds them next to both
    slots' requests (tests/test_inference_paged_cache.py checks the page sharing itself)."""
    s = Scheduler(tiny_model(NAME), **SLOTS, prefix_block=16, page_size=8)
    shared = [256] + list(range(1, 20))  # 20 tokens: one full block
    a, b, short = shared + [30, 31], shared + [40], shared[:15]
    cold = s.generate([Request("a", a, 6, eos_ids=[])])
    pc = s.prefix_cache
    assert (pc.hits, len(pc)) == (0, 1)
    warm = s.generate([Request("a", a, 6, eos_ids=[]), Request("b", b, 6, eos_ids=[]),
                       Request("s", short, 6, eos_ids=[])], arrival_steps=[0, 1, 1])
    assert (pc.hits, pc.tokens_saved, len(pc)) == (2, 32, 1)  # the 15-token prompt has no full block
    assert warm["a"] == cold["a"] and cold["a"] == (greedy_alone(a, 6), "length")
    assert warm["b"] == (greedy_alone(b, 6), "length") and warm["s"] == (greedy_alone(short, 6), "length")
    with pytest.raises(ValueError, match="prefix_block"):
        Scheduler(tiny_model(NAME), **SLOTS, prefix_block=8)


def test_request_validation(sched):
    for req, match in [(Request("x", [], 4), "at least one token"),
                       (Request("x", [1, 999], 4), r"\[0, 384\)"),
                       (Request("x", [1] * 30, 4), "maximum length of 32"),
                       (Request("x", [1], 0), "max_tokens"),
                       (Request("x", [1], 4, SamplingParams(temperature=1.0)), "PRNG key"),
                       (Request("x", [1], 4, SamplingParams(top_p=1.5)), "top_p"),
                       (Request("x", [1], 4, eos_ids=list(range(9))), "EOS ids")]:
        with pytest.raises(ValueError, match=match):
            sched.add(req)
    sched.add(Request("dup", [1], 1))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Request("dup", [1], 1))
    sched.cancel("dup")
    assert [tuple(e)[:4] for e in sched.step()] == [("dup", None, 0, "cancelled")] and not sched.has_work


def test_write_slots_uses_the_batch_axis_of_scanned_groups():
    """`tiny` stacks its scanned unit's states as [repeats, B, ...]: writing sequence i of a batch-2 cache into
    slots (3, 0) of a batch-4 cache changes exactly those rows along each leaf's batch axis; the MLA page pools
    (shared by all slots: no batch axis) are taken whole from the new cache."""
    cfg = configs.get_config("tiny")
    axes = cache_batch_axes(cfg, 8)
    leaves = jax.tree.leaves(axes)
    assert set(leaves) == {0, 1, SHARED} and 1 in leaves  # the scanned group's leaves have batch axis 1
    pools = [a == SHARED for a in leaves]
    assert sum(pools) == sum(attn == "mla" for g in cfg.layer_groups() for attn, _ in g.pattern)
    paged = lambda b: init_cache(cfg, b, 8, num_pages=3)  # noqa: E731
    shapes = jax.tree.leaves(jax.eval_shape(lambda: paged(4)))
    assert all(s.shape[a] == 4 for s, a in zip(shapes, leaves) if a != SHARED)
    cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), paged(4))
    new = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), paged(2))
    new = jax.tree.map(lambda x, a: x if a == SHARED else x * jnp.expand_dims(jnp.array([1, 2], x.dtype), tuple(
        i for i in range(x.ndim) if i != a)), new, axes)
    out = write_slots(cache, new, jnp.array([3, 0]), axes)
    for leaf, a in zip(jax.tree.leaves(out), leaves):
        if a == SHARED:
            assert np.all(np.asarray(leaf) == 1)
            continue
        rows = np.moveaxis(np.asarray(leaf), a, 0)
        for slot, value in [(0, 2), (1, 0), (2, 0), (3, 1)]:
            assert np.all(rows[slot] == value)
    dropped = write_slots(cache, new, jnp.array([4, 4]), axes)  # out-of-range slots: no write
    assert all(not np.any(np.asarray(x)) for x, a in zip(jax.tree.leaves(dropped), leaves) if a != SHARED)


def test_unrolled_decode_loop_gives_the_same_tokens(monkeypatch):
    """decode_loop_unroll=2 (two steps per loop iteration; the serving default on GPUs) with 3 decode steps per
    call (an odd remainder) decodes exactly the greedy reference."""
    from k3jax.inference import scheduler as sched_mod

    unrolls = []
    real_scan = jax.lax.scan
    monkeypatch.setattr(sched_mod.jax.lax, "scan",
                        lambda *a, **kw: unrolls.append(kw.get("unroll")) or real_scan(*a, **kw))
    model = tiny_model(NAME)  # shared with the other tests: its config is restored as it was
    original = model.cfg
    model.cfg = original.replace(decode_loop_unroll=2)
    try:
        s = Scheduler(model, num_slots=2, max_len=MAX_LEN, decode_steps=3)
        out = s.generate([Request(0, PROMPTS[0], 7, eos_ids=[]), Request(1, PROMPTS[4], 5, eos_ids=[])])
    finally:
        model.cfg = original
    assert 2 in unrolls  # the decode loop was traced unrolled
    assert out[0] == (greedy_alone(PROMPTS[0], 7), "length")
    assert out[1] == (greedy_alone(PROMPTS[4], 5), "length")
