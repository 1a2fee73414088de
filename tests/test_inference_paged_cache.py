"""Paged MLA latent cache: decoding through a scrambled page table equals the full forward pass (teacher-forced)
and the plain one-page-run-per-sequence layout; the scheduler's page allocator frees and reuses pages (more requests
than the pool holds at once all complete exactly), makes requests wait when pages run out, and a prefix-cache hit
maps the prefix's full pages by reference (refcount > 1, only the partial last page copied) with output identical
to a cold run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.slot_steps import TRACE_COUNTS
from k3jax.layers.kda import KDAState
from k3jax.model import NO_PAGE, init_cache
from tests.test_inference_cache import tiny_model
from tests.test_inference_scheduler import PROMPTS, _full_forward, greedy_alone

TOL = dict(rtol=1e-4, atol=1e-4)
SCHED_NAME = "tiny_kimi_linear"  # greedy_alone's config


@pytest.mark.slow
def test_scrambled_page_table_equals_full_forward_and_contiguous_layout():
    """2 sequences of 16 positions in 4-token pages scattered over an 11-page pool whose every row starts as large
    garbage (stale rows of earlier requests). (`tiny`'s scanned group, pools stacked [repeats, pages, ...], runs
    through the same page path in tests/test_inference_cache.py, in init_cache's default layout.) A 6/4-token
    right-padded prefill then token-by-token decode gives the full forward's logits, and exactly the logits of the
    same pool with each sequence on its own consecutive pages (init_cache's default layout)."""
    gd, state = nnx.split(tiny_model(SCHED_NAME))
    cached = jax.jit(lambda st, ids, cache, valid: nnx.merge(gd, st).forward_cached(ids, cache, valid))
    full_state, full = _full_forward()  # the scheduler tests' jitted [1, 32] full forward
    cfg = tiny_model(SCHED_NAME).cfg
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 256, (2, 16)).astype(np.int32)
    ref = [np.asarray(full(full_state, jnp.asarray(np.pad(ids[i:i + 1], ((0, 0), (0, 16))))))[0, :16]
           for i in range(2)]

    np.testing.assert_array_equal(np.asarray(init_cache(cfg, 2, 16, page_size=4).page_table),
                                  [[0, 1, 2, 3], [4, 5, 6, 7]])
    empty = init_cache(cfg, 2, 16, page_size=4, num_pages=11)
    assert (empty.max_len, empty.page_size, empty.num_pages) == (16, 4, 11)
    assert np.all(np.asarray(empty.page_table) == NO_PAGE)
    layers = tuple(tuple(st if isinstance(st, KDAState) else jnp.asarray(rng.uniform(-50, 50, st.shape), st.dtype)
                         for st in group) for group in empty.layers)
    pools = [st for group in layers for st in group if not isinstance(st, KDAState)]
    assert len(pools) == 2 and all(p.shape[-3:-1] == (11, 4) for p in pools)
    tables = {"plain": np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32),
              "scrambled": np.array([[7, 2, 9, 4], [0, 10, 5, 3]], np.int32)}

    prompt_lens = [6, 4]
    prompt = np.full((2, 8), 258, np.int32)
    for i, n in enumerate(prompt_lens):
        prompt[i, :n] = ids[i, :n]
    outs = {}
    for name, table in tables.items():
        cache = empty._replace(layers=layers, page_table=jnp.asarray(table))
        logits, cache = cached(state, jnp.asarray(prompt), cache, jnp.asarray(prompt_lens, jnp.int32))
        got = [[np.asarray(logits)[i, :n] for i, n in enumerate(prompt_lens)]]
        pos = list(prompt_lens)
        while min(pos) < 16:
            active = np.array([p < 16 for p in pos], np.int32)
            tok = np.array([[ids[i, min(p, 15)]] for i, p in enumerate(pos)], np.int32)
            logits, cache = cached(state, jnp.asarray(tok), cache, jnp.asarray(active))
            got.append([np.asarray(logits)[i, :a] for i, a in enumerate(active)])
            pos = [p + a for p, a in zip(pos, active)]
        outs[name] = [np.concatenate([g[i] for g in got]) for i in range(2)]
        np.testing.assert_array_equal(np.asarray(cache.lengths), [16, 16])
        np.testing.assert_array_equal(np.asarray(cache.page_table), table)
        for i in range(2):
            np.testing.assert_allclose(outs[name][i], ref[i], **TOL)
        # the pages the table does not map were never written: still the garbage they started with
        unmapped = sorted(set(range(11)) - set(table.ravel()))
        after = [st for group in cache.layers for st in group if not isinstance(st, KDAState)]
        for before_pool, after_pool in zip(pools, after):
            np.testing.assert_array_equal(np.asarray(after_pool)[..., unmapped, :, :],
                                          np.asarray(before_pool)[..., unmapped, :, :])
    for i in range(2):
        np.testing.assert_array_equal(outs["scrambled"][i], outs["plain"][i])


# One scheduler shape for the allocator tests: 3 slots of 32 tokens, 8-token pages, a pool of only 5 pages.
POOL = dict(num_slots=3, max_len=32, page_size=8, num_pages=5, decode_steps=2)


@pytest.fixture(scope="module")
def pool_sched():
    return Scheduler(tiny_model(SCHED_NAME), **POOL)


def _run_recording(s: Scheduler, reqs, arrival):
    """`generate`, recording after every step which request holds which pages and how many waited by a free slot."""
    history = []
    orig_step = s.step

    def step():
        events = orig_step()
        held = {s._slots[i].request.request_id: s.slot_pages(i) for i in range(s.num_slots) if s._slots[i]}
        history.append((held, s.num_waiting, s.num_slots - s.num_running, s.num_free_pages))
        return events

    s.step = step
    try:
        return s.generate(reqs, arrival_steps=arrival), history
    finally:
        del s.step


def test_more_requests_than_pages_complete_and_pages_are_reused(pool_sched):
    """7 requests needing 1-3 pages each (15 pages in all) through a 5-page pool: every output equals the request
    alone (an independent full-forward loop); no page is ever held by two requests at once; pages are reused by
    later requests; at the end every page is free again. A second run in another order (other pages) gives the same
    outputs without compiling anything."""
    s = pool_sched
    max_tokens = [6, 6, 9, 6, 6, 4, 12]
    prompts = PROMPTS + [[256, 33] * 3, [256] + list(range(60, 72))]
    reqs = [Request(i, p, m, eos_ids=[]) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    need = [s.pages_needed(r) for r in reqs]
    assert sum(need) == 3 * s.num_pages and max(need) == 3
    out, history = _run_recording(s, reqs, [0, 0, 0, 1, 1, 2, 2])
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert out[i] == (greedy_alone(p, m), "length"), i
    owners: dict[int, set] = {}
    for held, _, _, free_pages in history:
        in_use = [p for pages in held.values() for p in pages]
        assert len(in_use) == len(set(in_use)), "a page mapped by two running requests"
        assert free_pages == s.num_pages - len(in_use)
        for rid, pages in held.items():
            assert len(pages) == need[rid]
            for p in pages:
                owners.setdefault(p, set()).add(rid)
    assert max(len(o) for o in owners.values()) >= 2  # reused across requests
    assert s.num_free_pages == s.num_pages and not np.any(s.allocator.refcount)
    traces = dict(TRACE_COUNTS)
    again, history = _run_recording(s, reqs[::-1], [0, 0, 0, 0, 1, 1, 1])
    assert again == out and dict(TRACE_COUNTS) == traces  # other pages and slots: same compiled functions


def test_out_of_pages_requests_wait_instead_of_failing(pool_sched):
    """Two 3-page requests in a 5-page pool with 3 slots: the second waits by a free slot (no error) until the first
    finishes, then runs and equals its reference; a request needing more pages than the pool is rejected."""
    s = pool_sched
    a, b = [256] + list(range(1, 13)), [256] + list(range(40, 52))
    reqs = [Request("a", a, 10, eos_ids=[]), Request("b", b, 8, eos_ids=[])]
    assert [s.pages_needed(r) for r in reqs] == [3, 3]
    out, history = _run_recording(s, reqs, [0, 0])
    assert out == {"a": (greedy_alone(a, 10), "length"), "b": (greedy_alone(b, 8), "length")}
    held, waiting, free_slots, _ = history[0]
    assert list(held) == ["a"] and waiting == 1 and free_slots == 2  # b waits for pages, not for a slot
    assert any(list(h) == ["b"] for h, *_ in history) and not any(len(h) == 2 for h, *_ in history)
    small = Scheduler(tiny_model(SCHED_NAME), **{**POOL, "num_pages": 2})
    with pytest.raises(ValueError, match="needs 3 latent pages of 8 tokens but the page pool has only 2"):
        small.add(Request("big", a, 10))


@pytest.mark.parametrize("page_size, copies", [pytest.param(12, 1, marks=pytest.mark.slow), (8, 0)])
def test_prefix_hit_shares_full_pages_by_reference(page_size, copies):
    """Prefix blocks of 16 tokens. Cold run of A: the entry at 16 keeps A's first pages. B (same 20-token prefix,
    other suffix) hits it: its page table starts with the entry's full pages (refcount 2 while B runs), the partial
    page (12-token pages: rows 12..15) is copied into B's own page and 8-token pages need no copy; B's tokens equal
    a cold run of B and the independent reference. Then a request needing more than the free pages evicts the
    prefix entry (which holds pages) instead of waiting forever."""
    s = Scheduler(tiny_model(SCHED_NAME), num_slots=2, max_len=32, page_size=page_size, num_pages=4,
                  prefix_block=16)
    shared = [256] + list(range(1, 20))
    a, b = shared + [30, 31], shared + [40]
    cold_a = s.generate([Request("a", a, 6, eos_ids=[])])
    pc = s.prefix_cache
    assert (pc.hits, len(pc)) == (0, 1)
    entry_pages = next(iter(pc._entries.values())).pages
    assert len(entry_pages) == -(-16 // page_size)
    assert all(s.allocator.refcount[p] == 1 for p in entry_pages) and s.num_free_pages == 4 - len(entry_pages)
    full = entry_pages[:16 // page_size]

    s.add(Request("b", b, 6, eos_ids=[]))
    copies_before = TRACE_COUNTS["copy_page"], s.page_copies
    tokens = [ev.token for ev in s.step()]
    slot = next(i for i in range(s.num_slots) if s._slots[i] is not None)
    mapped = s.slot_pages(slot)
    assert mapped[:len(full)] == list(full) and all(s.allocator.refcount[p] == 2 for p in full)
    assert not set(mapped[len(full):]) & set(entry_pages)  # the partial page (if any) is B's own copy
    assert s.page_copies - copies_before[1] == copies and (pc.hits, pc.tokens_reused) == (1, 16)
    table_row = np.asarray(s.cache.page_table)[slot]
    np.testing.assert_array_equal(table_row[:len(mapped)], mapped)
    assert np.all(table_row[len(mapped):] == NO_PAGE)
    for ev in s.events():
        if ev.token is not None:
            tokens.append(ev.token)
    assert all(s.allocator.refcount[p] == 1 for p in entry_pages)  # B released its references
    assert tokens == greedy_alone(b, 6) and cold_a["a"] == (greedy_alone(a, 6), "length")
    pc.clear()
    assert s.num_free_pages == 4
    assert s.generate([Request("b", b, 6, eos_ids=[])])["b"] == (tokens, "length")  # cold run of B

    # B's cold run left an entry holding 2 pages; c (16 tokens: no boundary of its own) needs 3-4 of the 4 pages
    assert len(pc) == 1 and s.num_free_pages == 2
    c = [256] + list(range(100, 115))
    assert s.pages_needed(Request("c", c, 12)) > 2
    assert s.generate([Request("c", c, 12, eos_ids=[])])["c"] == (greedy_alone(c, 12), "length")
    assert len(pc) == 0 and s.num_free_pages == 4
