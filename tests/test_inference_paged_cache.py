"""Paged MLA latent cache: decoding through a scrambled page table equals the full forward pass (teacher-forced)
and the plain one-page-run-per-sequence layout; the scheduler's page allocator frees and reuses pages (more requests
than the pool holds at once all complete exactly), makes requests wait when pages run out, and a prefix-cache hit
maps the prefix's full pages by reference (refcount > 1, only the partial last page copied) with output identical
to a cold run."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.inference import prefix_admit
from k3jax.inference.prefix_cache import AUTO_FALLBACK_BYTES, DEFAULT_BLOCK, PrefixCache, PrefixEntry, entry_bytes
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.slot_steps import TRACE_COUNTS
from k3jax.layers.kda import KDAState
from k3jax.model import NO_PAGE, init_cache
from tests.test_inference_cache import tiny_model
from tests.test_inference_scheduler import PROMPTS, _full_forward, greedy_alone
from tests.test_server import post, serving

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
    assert s.page_copies - copies_before[1] == copies and (pc.hits, pc.tokens_saved) == (1, 16)
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


# Prefix checkpoints at two intervals, scaled down: every 16 tokens up to 32, every 64 past it. A 141-token prompt
# has chunk ends 16, 32, ..., 128: kept 16, 32 (fine), 64, 128 (coarse); 48, 80, 96, 112 are not kept.
INTERVALS = dict(prefix_block=16, prefix_long_threshold=32, prefix_long_block=64)
LONG_SHAPE = dict(num_slots=2, max_len=160, page_size=12, decode_steps=2)  # one set of compilations for these tests
LONG = [256] + [int(t) for t in np.random.RandomState(5).randint(0, 250, 140)]


def _capture_prefill(monkeypatch) -> list:
    """Records (per-sequence leaves, last-token logits) of every prefix-cache prefill as it is installed."""
    captured = []
    real = prefix_admit.install_slots

    def spy(cache, state, seq_n, logits_nv, *args, **kwargs):
        captured.append(jax.device_get((seq_n, logits_nv)))
        return real(cache, state, seq_n, logits_nv, *args, **kwargs)

    monkeypatch.setattr(prefix_admit, "install_slots", spy)
    return captured


def _states(s: Scheduler, seq) -> list[np.ndarray]:
    """Every KDA state, conv history and the length of a captured prefill (not the page table: pages differ)."""
    layout = s.layout.value
    cache = layout.join(seq, [np.zeros((0,), np.float32)] * len(layout.split(s.cache)[1]))
    kda = [st for group in cache.layers for st in group if isinstance(st, KDAState)]
    assert kda
    return [np.asarray(x) for x in jax.tree.leaves(kda)] + [np.asarray(cache.lengths)]


def test_hit_at_every_kept_boundary_equals_cold_run_kda_state_bit_equal(monkeypatch):
    """The long prompt's cold run keeps exactly the boundaries 16, 32, 64, 128. A prompt sharing its first b tokens
    (b = every kept boundary: fine, interior coarse, last; and 96, not kept, which resumes from 64) resumes there:
    its KDA states, conv histories and length after the prefill are bit-equal to a cold run of the same prompt, its
    last-token logits equal the cold run's (and for b = 16 the full forward's) to f32 tolerance, and the hit saved
    b tokens (96: 64).
    12-token pages: every boundary ends inside a page, so each hit also copies a partial page."""
    s = Scheduler(tiny_model(SCHED_NAME), **LONG_SHAPE, **INTERVALS)
    pc = s.prefix_cache
    captured = _capture_prefill(monkeypatch)
    queries = {b: LONG[:b] + [7, 8, 9] for b in (16, 32, 64, 128)}
    queries[96] = LONG[:96] + [7, 8, 9]
    queries[141] = LONG  # the whole prompt again: resumes from 128
    resumes = {16: 16, 32: 32, 64: 64, 128: 128, 96: 64, 141: 128}
    cold = {}
    for b, q in queries.items():
        pc.clear()
        s.generate([Request(f"cold-{b}", q, 1, eos_ids=[])])
        cold[b] = captured[-1]
    pc.clear()
    pc.reset_stats()
    s.generate([Request("long", LONG, 1, eos_ids=[])])
    assert [p for p in range(16, 141, 16) if pc.lookup(pc.block_keys(LONG[:p] + [0]))[0] == p] == [16, 32, 64, 128]
    assert len(pc) == 4 and (pc.hits, pc.misses) == (0, 1)
    state, full = _full_forward()
    for b, q in queries.items():
        saved = pc.tokens_saved
        s.generate([Request(f"warm-{b}", q, 1, eos_ids=[])])
        assert pc.tokens_saved - saved == resumes[b], b
        (seq, logits), (cold_seq, cold_logits) = captured[-1], cold[b]
        for got, want in zip(_states(s, seq), _states(s, cold_seq), strict=True):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(logits[0], cold_logits[0], rtol=1e-6, atol=1e-6)
        if len(q) <= 32:  # and the independent full forward (compiled for 32 tokens by the tests above)
            ids = np.zeros((1, 32), np.int32)
            ids[0, :len(q)] = q
            np.testing.assert_allclose(logits[0], np.asarray(full(state, jnp.asarray(ids)))[0, len(q) - 1], **TOL)
    assert (pc.hits, pc.misses, len(pc)) == (len(queries), 1, 4)


def test_default_intervals_keep_51_of_255_boundaries_of_a_128k_prompt():
    """With the release's intervals (512, and 6144 past 16384 tokens) a 131072-token prompt keeps 32 fine and 19
    coarse checkpoints; every chunk end is kept when the coarse interval is off. Bad intervals are refused."""
    pc = PrefixCache()
    assert (pc.block, pc.long_block, pc.threshold) == (512, 6144, 16384)
    kept = [p for p in range(512, pc.last_boundary(131072) + 1, 512) if pc.keeps(p)]
    assert len(kept) == 51 and kept[31:33] == [16384, 18432] and kept[-1] == 129024
    assert all(PrefixCache(long_block=0).keeps(p) for p in range(512, 131072, 512))
    keys = pc.block_keys(list(range(2000)))
    assert len(keys) == 3 and keys[:2] == pc.block_keys(list(range(1025))) and len(set(keys)) == 3
    assert pc.block_keys([1] + list(range(1, 1025)))[0] != keys[0]
    with pytest.raises(ValueError, match="multiple of the prefix block 512"):
        PrefixCache(long_block=1000)


def test_snapshots_are_bounded_in_bytes_least_recently_used_first():
    """A bound of 2.5 snapshots: a 3-block prompt keeps only its last 2 (the first is evicted, its pages released);
    a hit marks its entry recently used, so the next store evicts the other one; a bound below one snapshot keeps
    nothing and leaks no page. Every page the entries do not hold is free again once the requests finish."""
    s = Scheduler(tiny_model(SCHED_NAME), **LONG_SHAPE, prefix_block=16, prefix_long_block=0, prefix_bytes=1 << 30)
    pc, pages = s.prefix_cache, s.num_pages
    a, b = LONG[:49], [256] + list(range(100, 116))
    keys_a = pc.block_keys(a + [0])  # the keys of a[:16], a[:32], a[:48]
    s.generate([Request("b0", b, 1, eos_ids=[])])
    one = pc.bytes_used
    assert len(pc) == 1 and one > 0 and pc.max_bytes == 1 << 30
    pc.clear()
    pc.max_bytes = int(2.5 * one)
    s.generate([Request("a", a, 1, eos_ids=[])])
    assert len(pc) == 2 and pc.bytes_used == 2 * one and pc.lookup(keys_a[:1])[0] == 0
    s.generate([Request("a32", a[:32] + [7], 1, eos_ids=[])])  # hits a[:32]: now the most recently used
    assert pc.hits == 1 and len(pc) == 2
    s.generate([Request("b", b, 1, eos_ids=[])])  # stores b[:16], evicting a[:48]
    assert len(pc) == 2 and pc.bytes_used == 2 * one <= pc.max_bytes
    assert pc.lookup(keys_a)[0] == 32 and pc.lookup(pc.block_keys(b))[0] == 16
    held = [p for e in pc._entries.values() for p in e.pages]
    assert s.num_free_pages == pages - len(set(held)) and int(s.allocator.refcount.sum()) == len(held)
    pc.clear()
    pc.max_bytes = one - 1
    s.generate([Request("c", b, 1, eos_ids=[])])
    assert len(pc) == 0 and pc.bytes_used == 0 and s.num_free_pages == pages


def test_health_reports_the_prefix_cache_of_the_server_defaults_and_its_hits(tokenizer):
    """/health of a server whose scheduler has serve.py's default prefix cache (512-token blocks, 6144 past 16384
    tokens, the automatic byte bound: 1 GiB on a CPU), then of one with 16-token blocks after a miss and a hit:
    entries, bytes used, hits, misses and tokens saved."""
    model = tiny_model(SCHED_NAME)
    ids = LONG[:20]

    async def health(scheduler, prompts):
        async with serving(scheduler, tokenizer) as (_, client, _, _):
            for p in prompts:
                status, body = await post(client, "/v1/completions", {"prompt": p, "max_tokens": 1})
                assert status == 200, body
            async with client.get("/health") as r:
                return (await r.json())["prefix_cache"]

    default = Scheduler(model, **LONG_SHAPE, prefix_block=DEFAULT_BLOCK)
    assert asyncio.run(health(default, [ids[:9]])) == {
        "enabled": True, "block": 512, "long_block": 6144, "long_threshold": 16384, "entries": 0, "capacity": None,
        "bytes_used": 0, "bytes_limit": AUTO_FALLBACK_BYTES, "hits": 0, "misses": 0, "tokens_saved": 0}
    small = Scheduler(model, **LONG_SHAPE, **INTERVALS)
    got = asyncio.run(health(small, [ids, ids[:17] + [5], ids[:9]]))
    assert got["bytes_used"] == entry_bytes(PrefixEntry(small._fresh1, ())) > 0  # one batch-1 state
    assert {k: got[k] for k in ("block", "entries", "hits", "misses", "tokens_saved")} == {
        "block": 16, "entries": 1, "hits": 1, "misses": 1, "tokens_saved": 16}
