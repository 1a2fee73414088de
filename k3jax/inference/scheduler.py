"""Continuous batching: a fixed number of decode slots; requests join free slots while the others keep decoding.

Every slot is one row of a `DecodeCache` with batch = `num_slots` (its KDA states, MLA page-table row and length)
plus per-slot decode fields (last token, token count, limits, sampling parameters, PRNG key, EOS ids). All shapes are
static, so the decode step compiles once (per greedy/sampling variant) and admission once per (prefill batch
bucket, prompt length bucket).

MLA latents are paged: each MLA layer has one pool of `num_pages` pages of `page_size` tokens shared by all slots,
and the cache's page table maps each slot's positions to pages (the same page ids in every layer). A host-side
`PageAllocator` (free list + reference counts) RESERVES a request's pages on admission for its whole budget,
prompt + max_tokens - 1 positions (so decode never runs out mid-request and needs no preemption), and releases them
when it finishes or is cancelled. When the free pages do not cover the next waiting request, it waits (first come,
first served: later requests do not overtake it) until running requests free theirs; prefix-cache entries, which
also hold page references, are evicted (least recently used first) before a request is made to wait. A request that
needs more pages than the whole pool is rejected by `validate`.

Admission prefills the new prompts (right-padded) with fresh per-sequence states (KDA, length) and the slots' page
tables, writing their latent rows straight into the shared pools, then scatters the per-sequence states into the
slots along each leaf's batch axis (axis 0, or 1 for scanned groups whose states carry a leading [repeats] axis;
found from the cache's shapes, not assumed). Pages are not cleared between requests: rows past a sequence's length
are masked (queries see positions <= their own) until overwritten.

Token i of a request is drawn with `fold_in(request.key, i)` exactly as `Engine.generate` does with one key per
sequence, so a request's tokens do not depend on which slot or pages it gets, on its neighbours or arrival times.

On a device mesh (`Scheduler(model, ..., mesh=make_mesh(data, expert, 1, model))`) the parameters, the slots'
cache and fields sit in the layouts of `k3jax.inference.sharded` (slots over ('data', 'expert') when num_slots
divides, KDA heads over 'model', page pools replicated); every jitted function runs under the mesh (the MoE
expert-parallel when 'expert' > 1) and pins its outputs to those layouts. Admission prefills a multiple of
data * expert rows (padding rows write nothing), so the expert-parallel MoE can split them too.

    sched = Scheduler(model, num_slots=8, max_len=1024)            # page_size=64, num_pages: 8 * 1024 / 64
    sched.add(Request("a", prompt_ids, max_tokens=32))
    for event in sched.events():           # runs until every request has finished
        print(event.request_id, event.token, event.finish_reason)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
from typing import Any, Hashable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.inference import sampling as sampling_lib
from k3jax.inference import sharded
from k3jax.inference.engine import MIN_PROMPT_BUCKET, SamplingParams, bucket
from k3jax.inference.prefix_cache import PrefixCache, PrefixEntry
from k3jax.layers.mla import DEFAULT_PAGE_SIZE, pages_per_sequence
from k3jax.model import NO_PAGE, DecodeCache, K3Model, init_cache

log = logging.getLogger(__name__)

TRACE_COUNTS: collections.Counter = collections.Counter()  # traces (= compilations) of _admit / _decode
MAX_EOS_IDS = 8  # EOS ids per request (static width of the per-slot EOS table)
SHARED = -1  # "batch axis" of a cache leaf shared by every slot (an MLA page pool)

FINISH_STOP = "stop"  # an EOS id was sampled (not emitted as a token)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CANCELLED = "cancelled"  # `cancel` was called


@dataclasses.dataclass
class Request:
    """One generation request. `key` is required when sampling (temperature > 0); `eos_ids` None means the config's
    eos_token_id; `max_tokens` counts generated tokens (an EOS ends the request early and is not emitted)."""

    request_id: Hashable
    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    key: jax.Array | None = None
    eos_ids: Sequence[int] | None = None


class TokenEvent(NamedTuple):
    """One step of one request. `token` is None only on a final event that carries no token (EOS sampled, or
    cancelled); `index` is the token's position in the completion; `finish_reason` is None while it runs."""

    request_id: Hashable
    token: int | None
    index: int
    finish_reason: str | None


class SlotState(NamedTuple):
    """Per-slot decode fields on device (S = num_slots). Free and finished slots have done_s True."""

    last_s: jax.Array  # int32: token to feed next
    done_s: jax.Array  # bool
    count_s: jax.Array  # int32: tokens generated so far
    max_new_s: jax.Array  # int32
    temperature_s: jax.Array  # f32
    top_k_s: jax.Array  # int32
    top_p_s: jax.Array  # f32
    keys_s: jax.Array  # PRNG keys
    eos_se: jax.Array  # int32 [S, MAX_EOS_IDS], padded with -1


@dataclasses.dataclass
class _Running:
    request: Request
    num_emitted: int = 0


class PageAllocator:
    """Host-side bookkeeping of the MLA page pool: a free list and a reference count per page.

    A page is free at count 0. `allocate` hands out pages at count 1 (most recently freed first); `ref` adds a
    holder to pages in use (a prefix-cache entry, a request sharing a prefix); `release` drops one holder per page
    and returns pages reaching 0 to the free list. Misuse (releasing a free page) raises: it would mean two
    requests writing one page.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros((num_pages,), np.int64)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free pages (count 1), or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def ref(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise AssertionError(f"page {p} is free: cannot share it")
            self.refcount[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise AssertionError(f"page {p} released more often than it was taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


def cache_batch_axes(cfg, max_len: int, page_size: int | None = None) -> DecodeCache:
    """The batch axis of every leaf of a `DecodeCache` (a DecodeCache of ints), found by comparing the shapes of
    caches for batch 1 and 2 over the same page pool: exactly one axis differs, or none (SHARED: a page pool)."""
    one = jax.eval_shape(lambda: init_cache(cfg, 1, max_len, page_size=page_size, num_pages=1))
    two = jax.eval_shape(lambda: init_cache(cfg, 2, max_len, page_size=page_size, num_pages=1))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) > 1:
            raise ValueError(f"cannot find the batch axis of a cache leaf {a.shape} / {b.shape}")
        return diff[0] if diff else SHARED

    return jax.tree.map(axis, one, two)


def write_slots(cache: DecodeCache, new: DecodeCache, slots_n: jax.Array, axes: DecodeCache) -> DecodeCache:
    """`cache` with sequence i of `new` (batch n) written into slot slots_n[i] (out-of-range slots are dropped),
    and the SHARED leaves (page pools) of `new`, which already hold the new sequences' latent rows."""

    def put(c, x, axis):
        if axis == SHARED:
            return x
        index = (slice(None),) * axis + (slots_n,)
        return c.at[index].set(x.astype(c.dtype), mode="drop")

    return jax.tree.map(put, cache, new, axes)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """A `DecodeCache`'s flattened structure and per-leaf batch axes: splits a cache into its per-sequence leaves
    and its shared page pools (so jitted functions can donate the pools alone) and joins them back."""

    treedef: Any
    axes: tuple[int, ...]

    @classmethod
    def of(cls, cfg, max_len: int, page_size: int) -> "CacheLayout":
        leaves, treedef = jax.tree.flatten(cache_batch_axes(cfg, max_len, page_size))
        return cls(treedef, tuple(leaves))

    def axes_tree(self) -> DecodeCache:
        return jax.tree.unflatten(self.treedef, self.axes)

    def split(self, cache: DecodeCache) -> tuple[tuple, tuple]:
        """(per-sequence leaves, page pools) in leaf order."""
        leaves = self.treedef.flatten_up_to(cache)
        seq = tuple(x for x, a in zip(leaves, self.axes) if a != SHARED)
        pools = tuple(x for x, a in zip(leaves, self.axes) if a == SHARED)
        return seq, pools

    def join(self, seq: Sequence, pools: Sequence) -> DecodeCache:
        seq, pools = iter(seq), iter(pools)
        return jax.tree.unflatten(self.treedef, [next(pools) if a == SHARED else next(seq) for a in self.axes])

    def without_pools(self, cache: DecodeCache) -> DecodeCache:
        """The per-sequence part alone (pools replaced by empty placeholders): what a prefix entry keeps."""
        seq, pools = self.split(cache)
        return self.join(seq, [np.zeros((0,), np.float32)] * len(pools))


class Scheduler:
    """Continuous batching over `num_slots` decode slots of `max_len` tokens (prompt + generated) each.

    Single-threaded: `add`, `cancel` and `step` are called from one thread (the server's engine thread).
    `max_prefill_batch`: most requests prefilled in one call (a power of two; more compiles, fewer calls).
    `decode_steps`: decode steps per device call (> 1 syncs less often; a request finishing mid-call idles its slot
    for the rest of the call). The jitted functions are module-level with the model's graphdef as a static
    argument, so schedulers of the same model and shapes share compilations (`TRACE_COUNTS` counts traces).
    `prefix_block`: enables the prefix cache (`prefix_cache.PrefixCache`, at most `prefix_capacity` snapshots):
    prompts are then admitted one at a time, prefilled in `prefix_block`-token chunks (a power of two >= 16); a hit
    shares the prefix's full latent pages.
    `page_size`: tokens per MLA latent page (default 64, capped at max_len; a multiple of the 64-token prefill chunk
    suits real models). `num_pages`: pages per MLA layer pool (default num_slots * ceil(max_len / page_size): every
    slot at full length; fewer pages hold less memory and make requests wait when their reservations do not fit).
    `mesh`: a `sharding.mesh.make_mesh` mesh with context == 1 (see the module docstring and
    `k3jax.inference.sharded`); the parameters are placed on it by the rules (no copy when the model was loaded
    onto it, `k3jax.load_hf(..., mesh=mesh)`). num_slots should be a multiple of data * expert.
    """

    def __init__(self, model: K3Model, *, num_slots: int = 8, max_len: int = 1024, max_prefill_batch: int = 1,
                 decode_steps: int = 1, pad_id: int | None = None, prefix_block: int | None = None,
                 prefix_capacity: int = 64, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 mesh=None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        if max_prefill_batch < 1 or max_prefill_batch & (max_prefill_batch - 1):
            raise ValueError(f"max_prefill_batch must be a power of two >= 1, got {max_prefill_batch}")
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.cfg = model.cfg
        self.mesh = None if mesh is None else sharded.check_mesh(mesh)
        self._mesh = _intern(self.mesh)
        if num_slots % sharded.batch_ways(self.mesh):
            log.warning("num_slots=%d is not a multiple of data * expert = %d: the slot axis is replicated over the "
                        "mesh and the MoE runs without expert parallelism in decode", num_slots,
                        sharded.batch_ways(self.mesh))
        self.num_slots, self.max_len = num_slots, max_len
        self.max_prefill_batch = min(max_prefill_batch, bucket(num_slots, 1))
        self.decode_steps = decode_steps
        pad = self.cfg.pad_token_id if pad_id is None else pad_id
        self.pad_id = 0 if pad is None else int(pad)
        graphdef, params = nnx.split(model)
        if self.mesh is not None:
            params = sharded.place_params(params, self.mesh)
        leaves, treedef = jax.tree.flatten(params)
        self.params = tuple(leaves)  # flat: cheap to pass per call (an nnx State flattens in ~0.5 ms)
        self.model_spec = _intern((graphdef, treedef))
        self.page_size = min(page_size, max_len)
        self.pages_per_seq = pages_per_sequence(max_len, self.page_size)
        self.num_pages = num_pages or num_slots * self.pages_per_seq
        self.layout = _intern(CacheLayout.of(self.cfg, max_len, self.page_size))
        self.allocator = PageAllocator(self.num_pages)
        self.page_copies = 0  # partial prefix pages copied on prefix-cache hits (full pages are shared, not copied)
        self.prefix_cache = None
        if prefix_block is not None:
            if prefix_block < MIN_PROMPT_BUCKET:
                raise ValueError(f"prefix_block must be >= {MIN_PROMPT_BUCKET}, got {prefix_block}")
            self.prefix_cache = PrefixCache(prefix_block, prefix_capacity,
                                            release=lambda pages: self.allocator.release(pages))
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[_Running | None] = [None] * num_slots
        self._slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._cancelled: set = set()
        self._ids: set = set()  # ids of waiting and running requests
        self._auto_id = itertools.count()
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> list[TokenEvent]:
        """Drops every request (returns their "cancelled" events) and starts from empty slots."""
        events = [TokenEvent(r.request_id, None, 0, FINISH_CANCELLED) for r in self._waiting]
        events += [TokenEvent(s.request.request_id, None, s.num_emitted, FINISH_CANCELLED)
                   for s in self._slots if s is not None]
        self._waiting.clear()
        self._slots = [None] * self.num_slots
        self._cancelled.clear()
        self._ids.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.allocator = PageAllocator(self.num_pages)
        self._slot_pages = [[] for _ in range(self.num_slots)]
        s = self.num_slots
        self.cache = self.state = None  # release the old buffers before allocating new ones
        # distinct buffers per leaf (init_cache shares zeros between leaves; donation needs each leaf its own)
        if self.mesh is None:
            self.cache = jax.tree.map(lambda x: jnp.array(x, copy=True), init_cache(
                self.cfg, s, self.max_len, page_size=self.page_size, num_pages=self.num_pages))
        else:  # created in place, sharded (jit outputs are distinct buffers)
            self.cache = sharded.init_cache_on(self.cfg, self.mesh, s, self.max_len, page_size=self.page_size,
                                               num_pages=self.num_pages)
        self._fresh1 = self.layout.value.without_pools(
            init_cache(self.cfg, 1, self.max_len, page_size=self.page_size, num_pages=1))
        self.state = SlotState(
            last_s=jnp.zeros((s,), jnp.int32), done_s=jnp.ones((s,), bool), count_s=jnp.zeros((s,), jnp.int32),
            max_new_s=jnp.zeros((s,), jnp.int32), temperature_s=jnp.zeros((s,), jnp.float32),
            top_k_s=jnp.zeros((s,), jnp.int32), top_p_s=jnp.ones((s,), jnp.float32),
            keys_s=jax.random.split(jax.random.key(0), s), eos_se=jnp.full((s, MAX_EOS_IDS), -1, jnp.int32))
        self.state = sharded.put_batch(self.state, self.mesh)
        return events

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self.num_running > 0

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def slot_pages(self, slot: int) -> list[int]:
        """The pool pages mapped by `slot`'s page table (empty for a free slot)."""
        return list(self._slot_pages[slot]) if self._slots[slot] is not None else []

    def pages_needed(self, request: Request) -> int:
        """Pages reserved for a request: its prompt + max_tokens - 1 positions (the last token is not fed back)."""
        return self._pages_for(len(request.prompt_ids) + int(request.max_tokens) - 1)

    def _pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    # ------------------------------------------------------------------ API

    def validate(self, request: Request) -> Request:
        """Checks a request against the model and the slot size; raises ValueError naming the problem."""
        ids = [int(i) for i in request.prompt_ids]
        if not ids:
            raise ValueError("the prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if isinstance(request.max_tokens, bool) or int(request.max_tokens) != request.max_tokens \
                or request.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
        if len(ids) + int(request.max_tokens) - 1 > self.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} exceeds the maximum "
                             f"length of {self.max_len} tokens")
        need = self._pages_for(len(ids) + int(request.max_tokens) - 1)
        if need > self.num_pages:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} needs {need} latent "
                             f"pages of {self.page_size} tokens but the page pool has only {self.num_pages}")
        request.sampling.validate()
        if request.sampling.temperature > 0 and request.key is None:
            raise ValueError("sampling with temperature > 0 needs an explicit PRNG key")
        eos = self._eos(request)
        if len(eos) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids per request, got {len(eos)}")
        return dataclasses.replace(request, prompt_ids=ids, max_tokens=int(request.max_tokens))

    def add(self, request: Request) -> Hashable:
        """Queues a request (validated now); it enters a slot at a later `step`. Returns its id (request_id None:
        a fresh integer)."""
        if request.request_id is None:
            request = dataclasses.replace(request, request_id=next(self._auto_id))
        if request.request_id in self._ids:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request = self.validate(request)
        self._waiting.append(request)
        self._ids.add(request.request_id)
        return request.request_id

    def cancel(self, request_id: Hashable) -> None:
        """Ends a waiting or running request at the next `step` (a final "cancelled" event); unknown ids: no-op."""
        if request_id in self._ids:
            self._cancelled.add(request_id)

    def step(self) -> list[TokenEvent]:
        """Handles cancellations, admits waiting requests into free slots (their first token) while their pages
        fit, then runs `decode_steps` decode steps for every running slot. Returns the events in order."""
        events = self.drop_cancelled()
        free = [i for i, s in enumerate(self._slots) if s is None]
        while self._waiting and free:
            if self.prefix_cache is not None:
                admitted = self._admit_with_prefix(self._waiting[0], free[0])
                if admitted is None:
                    break
                self._waiting.popleft()
                events += admitted
            else:
                batch, pages = [], []
                for r in itertools.islice(self._waiting, min(len(free), self.max_prefill_batch)):
                    got = self._allocate(self.pages_needed(r))
                    if got is None:
                        break
                    batch.append(r)
                    pages.append(got)
                if not batch:
                    break
                for _ in batch:
                    self._waiting.popleft()
                events += self._admit_batch(batch, free[:len(batch)], pages)
            free = [i for i, s in enumerate(self._slots) if s is None]
        if self._waiting and free and not self.num_running:  # nothing will free pages: cannot happen (validate)
            raise RuntimeError(f"request {self._waiting[0].request_id!r} cannot get its pages from an idle pool")
        if self.num_running:
            events += self._decode_running()
        return events

    def events(self) -> Iterator[TokenEvent]:
        """Steps until no request is waiting or running, yielding every event (requests may be added meanwhile)."""
        while self.has_work:
            yield from self.step()

    def generate(self, requests: Sequence[Request], arrival_steps: Sequence[int] | None = None
                 ) -> dict[Hashable, tuple[list[int], str]]:
        """Runs `requests` to completion, request i added before step arrival_steps[i] (default: all at once).
        Returns {request_id: (tokens, finish_reason)}."""
        arrival = list(arrival_steps) if arrival_steps is not None else [0] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: arrival[i])
        out: dict[Hashable, tuple[list[int], str]] = {}
        pending = collections.deque(order)
        step = 0
        while pending or self.has_work:
            while pending and arrival[pending[0]] <= step:
                rid = self.add(requests[pending.popleft()])
                out[rid] = ([], "")
            for ev in self.step():
                toks, _ = out[ev.request_id]
                if ev.token is not None:
                    toks.append(ev.token)
                if ev.finish_reason:
                    out[ev.request_id] = (toks, ev.finish_reason)
            step += 1
        return out

    # ------------------------------------------------------------------ host side

    def _eos(self, request: Request) -> list[int]:
        if request.eos_ids is None:
            return [] if self.cfg.eos_token_id is None else [int(self.cfg.eos_token_id)]
        return [int(e) for e in request.eos_ids]

    def _finish(self, rid: Hashable) -> None:
        self._ids.discard(rid)
        self._cancelled.discard(rid)

    def _free_slot(self, slot: int) -> None:
        """Empties `slot` and releases its pages (its device row is left stale: a done slot never writes)."""
        self._slots[slot] = None
        self.allocator.release(self._slot_pages[slot])
        self._slot_pages[slot] = []

    def _allocate(self, n: int) -> list[int] | None:
        """n pages, evicting prefix-cache entries (least recently used first) while the free ones do not suffice;
        None (nothing taken) if they still do not."""
        while self.allocator.num_free < n and self.prefix_cache is not None and self.prefix_cache.evict_lru():
            pass
        return self.allocator.allocate(n)

    def _table_rows(self, pages: list[list[int]], n: int) -> np.ndarray:
        """int32 [n, pages_per_seq] page-table rows (NO_PAGE past each list; rows past the lists: all NO_PAGE)."""
        table = np.full((n, self.pages_per_seq), NO_PAGE, np.int32)
        for i, p in enumerate(pages):
            table[i, :len(p)] = p
        return table

    def _set_pools(self, pools) -> None:
        layout = self.layout.value
        self.cache = layout.join(layout.split(self.cache)[0], pools)

    def drop_cancelled(self) -> list[TokenEvent]:
        """Ends the requests `cancel` marked now (their "cancelled" events); `step` also does this first."""
        if not self._cancelled:
            return []
        events = []
        kept = collections.deque()
        for r in self._waiting:
            if r.request_id in self._cancelled:
                events.append(TokenEvent(r.request_id, None, 0, FINISH_CANCELLED))
                self._finish(r.request_id)
            else:
                kept.append(r)
        self._waiting = kept
        stop = np.zeros((self.num_slots,), bool)
        for i, s in enumerate(self._slots):
            if s is not None and s.request.request_id in self._cancelled:
                events.append(TokenEvent(s.request.request_id, None, s.num_emitted, FINISH_CANCELLED))
                self._finish(s.request.request_id)
                self._free_slot(i)
                stop[i] = True
        if stop.any():
            done = self.state.done_s | sharded.put_batch(jnp.asarray(stop), self.mesh)
            self.state = self.state._replace(done_s=sharded.put_batch(done, self.mesh))
        return events

    def _emit(self, slot: int, token: int, done: bool) -> TokenEvent:
        """The event for `token` sampled by `slot` (its request still running before this token)."""
        run = self._slots[slot]
        req = run.request
        index = run.num_emitted
        if token in self._eos(req):
            ev = TokenEvent(req.request_id, None, index, FINISH_STOP)
        else:
            run.num_emitted += 1
            finished = run.num_emitted >= req.max_tokens
            ev = TokenEvent(req.request_id, token, index, FINISH_LENGTH if finished else None)
        if (ev.finish_reason is not None) != bool(done):
            raise AssertionError(f"slot {slot}: host and device disagree on whether request {req.request_id!r} "
                                 "finished")
        if ev.finish_reason:
            self._finish(req.request_id)
            self._free_slot(slot)
        return ev

    def _new_fields(self, batch: list[Request], slots: list[int], n: int) -> tuple[SlotState, np.ndarray]:
        """Per-slot fields of the admitted requests (n rows; rows past the batch go to an out-of-range slot)."""
        slot_n = np.full((n,), self.num_slots, np.int32)  # padding rows go out of range: dropped
        temp, top_k, top_p = np.zeros((n,), np.float32), np.zeros((n,), np.int32), np.ones((n,), np.float32)
        max_new = np.ones((n,), np.int32)
        eos = np.full((n, MAX_EOS_IDS), -1, np.int32)
        keys = []
        for i, (r, slot) in enumerate(zip(batch, slots)):
            slot_n[i], max_new[i] = slot, r.max_tokens
            temp[i], top_k[i], top_p[i] = r.sampling.temperature, r.sampling.top_k, r.sampling.top_p
            e = self._eos(r)
            eos[i, :len(e)] = e
            keys.append(_typed_key(r.key) if r.key is not None else jax.random.key(0))
        keys += [jax.random.key(0)] * (n - len(batch))
        new = SlotState(last_s=None, done_s=None, count_s=None, max_new_s=jnp.asarray(max_new),
                        temperature_s=jnp.asarray(temp), top_k_s=jnp.asarray(top_k), top_p_s=jnp.asarray(top_p),
                        keys_s=jnp.stack(keys), eos_se=jnp.asarray(eos))
        return new, slot_n

    def _started(self, batch: list[Request], slots: list[int], pages: list[list[int]], tok_n, done_n
                 ) -> list[TokenEvent]:
        tok_n, done_n = jax.device_get((tok_n, done_n))
        events = []
        for i, (r, slot) in enumerate(zip(batch, slots)):
            self._slots[slot] = _Running(r)
            self._slot_pages[slot] = pages[i]
            events.append(self._emit(slot, int(tok_n[i]), bool(done_n[i])))
        return events

    def _admit_batch(self, batch: list[Request], slots: list[int], pages: list[list[int]]) -> list[TokenEvent]:
        """Prefills `batch` (its pages already allocated) into `slots` in one call."""
        n = sharded.round_up_batch(bucket(len(batch), 1), self.mesh)  # padding rows go to no slot, write nothing
        t = min(bucket(max(len(r.prompt_ids) for r in batch), MIN_PROMPT_BUCKET), self.max_len)
        ids = np.full((n, t), self.pad_id, np.int32)
        lens = np.ones((n,), np.int32)
        for i, r in enumerate(batch):
            ids[i, :len(r.prompt_ids)] = r.prompt_ids
            lens[i] = len(r.prompt_ids)
        new, slot_n = self._new_fields(batch, slots, n)
        greedy_only = all(r.sampling.temperature == 0 for r in batch)
        with sharded.context(self.mesh):
            self.cache, self.state, tok_n, done_n = _admit(
                self.params, self.cache, self.state, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(slot_n),
                jnp.asarray(self._table_rows(pages, n)), new, spec=self.model_spec, layout=self.layout,
                max_len=self.max_len, page_size=self.page_size, greedy_only=greedy_only, mesh=self._mesh)
        return self._started(batch, slots, pages, tok_n, done_n)

    def _admit_with_prefix(self, r: Request, slot: int) -> list[TokenEvent] | None:
        """Prefill through the prefix cache: resume from the longest cached boundary (KDA states restored, full
        latent pages shared, a partial last page copied), snapshot every new boundary. None: not enough free pages
        (nothing changed; the request keeps waiting)."""
        pc, ps, layout = self.prefix_cache, self.page_size, self.layout.value
        ids = list(r.prompt_ids)
        pos, entry = pc.lookup(ids)
        shared = list(entry.pages[:pos // ps]) if entry is not None else []
        partial = entry.pages[pos // ps] if entry is not None and pos % ps else None
        held = shared + ([partial] if partial is not None else [])
        self.allocator.ref(held)  # before _allocate, which may evict the entry itself
        own = self._allocate(self.pages_needed(r) - len(shared))
        if own is None:
            self.allocator.release(held)
            return None
        pages = shared + own
        if partial is not None:  # the sharer writes the rest of this page: it gets its own copy
            with sharded.context(self.mesh):
                self._set_pools(_copy_page(layout.split(self.cache)[1], jnp.int32(partial), jnp.int32(own[0]),
                                           mesh=self._mesh))
            self.page_copies += 1
            self.allocator.release([partial])
        if entry is not None:
            pc.record_hit(pos)
        start = entry.state if entry is not None else self._fresh1
        seq1 = layout.split(start._replace(page_table=jnp.asarray(self._table_rows([pages], 1))))[0]
        end = pc.last_boundary(len(ids))
        while pos < end:
            chunk = np.asarray([ids[pos:pos + pc.block]], np.int32)
            with sharded.context(self.mesh):
                seq1, pools, _ = _extend(self.params, seq1, layout.split(self.cache)[1], jnp.asarray(chunk),
                                         jnp.asarray([pc.block], jnp.int32), spec=self.model_spec,
                                         layout=self.layout, mesh=self._mesh)
            self._set_pools(pools)
            pos += pc.block
            entry_pages = tuple(pages[:-(-pos // ps)])
            self.allocator.ref(entry_pages)
            pc.store(ids[:pos], PrefixEntry(layout.without_pools(layout.join(seq1, pools)), entry_pages))
        rest = ids[pos:]
        chunk = np.full((1, bucket(len(rest), MIN_PROMPT_BUCKET)), self.pad_id, np.int32)
        chunk[0, :len(rest)] = rest
        new, slot_n = self._new_fields([r], [slot], 1)
        with sharded.context(self.mesh):
            seq1, pools, logits_nv = _extend(self.params, seq1, layout.split(self.cache)[1], jnp.asarray(chunk),
                                             jnp.asarray([len(rest)], jnp.int32), spec=self.model_spec,
                                             layout=self.layout, mesh=self._mesh)
            self._set_pools(pools)
            self.cache, self.state, tok_n, done_n = _install(
                self.cache, self.state, seq1, logits_nv, jnp.asarray(slot_n), new, layout=self.layout,
                greedy_only=r.sampling.temperature == 0, mesh=self._mesh)
        return self._started([r], [slot], [pages], tok_n, done_n)

    def _decode_running(self) -> list[TokenEvent]:
        greedy_only = all(s.request.sampling.temperature == 0 for s in self._slots if s is not None)
        with sharded.context(self.mesh):
            self.cache, self.state, tok_ks, ran_ks, done_ks = _decode(
                self.params, self.cache, self.state, spec=self.model_spec, greedy_only=greedy_only,
                steps=self.decode_steps, mesh=self._mesh)
        tok_ks, ran_ks, done_ks = jax.device_get((tok_ks, ran_ks, done_ks))
        events = []
        for k in range(self.decode_steps):
            for slot in np.flatnonzero(ran_ks[k]):
                if self._slots[slot] is not None:
                    events.append(self._emit(int(slot), int(tok_ks[k, slot]), bool(done_ks[k, slot])))
        return events

def _typed_key(key) -> jax.Array:
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))


# ---------------------------------------------------------------------- jitted (shared by all schedulers)


class _Static:
    """An identity-hashed holder for a static jit argument: hashing a GraphDef costs ~1 ms per call."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


_INTERNED: dict = {}


def _intern(value) -> _Static:
    """One holder per distinct value, so schedulers of the same model share compilations."""
    if value not in _INTERNED:
        _INTERNED[value] = _Static(value)
    return _INTERNED[value]


def _merge(spec: _Static, params) -> K3Model:
    graphdef, treedef = spec.value
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))


def _sample(logits_bv, keys_b, index_b, temperature_b, top_k_b, top_p_b, greedy_only):
    if greedy_only:
        return sampling_lib.greedy(logits_bv)
    step_keys = jax.vmap(jax.random.fold_in)(keys_b, index_b)
    return sampling_lib.sample(logits_bv, step_keys, temperature_b, top_k_b, top_p_b)


def _install_impl(cache, state: SlotState, cache_n, logits_nv, slot_n, new: SlotState, layout: CacheLayout,
                  greedy_only):
    """Samples the first tokens from the prompts' last logits and writes caches and slot fields into the slots
    (cache_n: the prefilled sequences over the updated page pools)."""
    n = logits_nv.shape[0]
    tok_n = _sample(logits_nv, new.keys_s, jnp.zeros((n,), jnp.int32), new.temperature_s, new.top_k_s,
                    new.top_p_s, greedy_only)
    done_n = jnp.any(tok_n[:, None] == new.eos_se, axis=-1) | (new.max_new_s <= 1)
    cache = write_slots(cache, cache_n, slot_n, layout.axes_tree())
    new = new._replace(last_s=tok_n, done_s=done_n, count_s=jnp.ones((n,), jnp.int32))
    state = jax.tree.map(lambda s, x: s.at[slot_n].set(x, mode="drop"), state, new)
    return cache, state, tok_n, done_n


def _prefill_impl(model: K3Model, cache_n, ids_nt, lens_n):
    """Runs the prompts' tokens (right-padded, valid lengths lens_n) on cache_n; the logits of each last token."""
    h_ntd, cache_n = model.hidden_states_cached(ids_nt, cache_n, lens_n)
    last = jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1)
    return cache_n, model.logits(last)[:, 0]


def _pinned(cache, state, mesh: _Static):
    """The slots' cache and fields pinned to their mesh layouts (`k3jax.inference.sharded`; identity without)."""
    return sharded.constrain_cache(cache, mesh.value), sharded.constrain_batch(state, mesh.value)


@functools.partial(jax.jit, static_argnames=("spec", "layout", "max_len", "page_size", "greedy_only", "mesh"),
                   donate_argnums=(1, 2))
def _admit(params, cache, state: SlotState, ids_nt, lens_n, slot_n, table_np, new: SlotState, *, spec, layout,
           max_len, page_size, greedy_only, mesh):
    """Prefills n prompts (fresh per-sequence states, page-table rows table_np, the shared page pools), samples
    their first tokens and writes both into their slots."""
    TRACE_COUNTS["admit"] += 1
    model = _merge(spec, params)
    layout = layout.value
    fresh = init_cache(model.cfg, ids_nt.shape[0], max_len, page_size=page_size, num_pages=1)
    fresh = layout.join(layout.split(fresh._replace(page_table=table_np))[0], layout.split(cache)[1])
    fresh, logits_nv = _prefill_impl(model, fresh, ids_nt, lens_n)
    cache, state, tok_n, done_n = _install_impl(cache, state, fresh, logits_nv, slot_n, new, layout, greedy_only)
    return (*_pinned(cache, state, mesh), tok_n, done_n)


@functools.partial(jax.jit, static_argnames=("spec", "layout", "mesh"), donate_argnums=(2,))
def _extend(params, seq_n, pools, ids_nt, lens_n, *, spec, layout, mesh):
    """Continues sequences (per-sequence leaves seq_n, not donated: they may be a prefix-cache entry's) over the
    page pools (donated) with a chunk of prompt tokens. Returns (seq_n, pools, last-token logits)."""
    TRACE_COUNTS["extend"] += 1
    layout = layout.value
    cache_n, logits_nv = _prefill_impl(_merge(spec, params), layout.join(seq_n, pools), ids_nt, lens_n)
    return (*layout.split(sharded.constrain_cache(cache_n, mesh.value)), logits_nv)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def _copy_page(pools, src, dst, *, mesh):
    """Every pool ([..., num_pages, page_size, C]) with page dst overwritten by page src."""
    TRACE_COUNTS["copy_page"] += 1
    pools = tuple(p.at[..., dst, :, :].set(p[..., src, :, :]) for p in pools)
    if mesh.value is None:
        return pools
    return jax.lax.with_sharding_constraint(pools, (sharded.replicated(mesh.value),) * len(pools))


@functools.partial(jax.jit, static_argnames=("layout", "greedy_only", "mesh"), donate_argnums=(0, 1))
def _install(cache, state: SlotState, seq_n, logits_nv, slot_n, new: SlotState, *, layout, greedy_only, mesh):
    """Installs prefilled sequences (per-sequence leaves seq_n; their rows are already in cache's pools)."""
    TRACE_COUNTS["install"] += 1
    layout = layout.value
    cache_n = layout.join(seq_n, layout.split(cache)[1])
    cache, state, tok_n, done_n = _install_impl(cache, state, cache_n, logits_nv, slot_n, new, layout, greedy_only)
    return (*_pinned(cache, state, mesh), tok_n, done_n)


@functools.partial(jax.jit, static_argnames=("spec", "greedy_only", "steps", "mesh"), donate_argnums=(1, 2))
def _decode(params, cache, state: SlotState, *, spec, greedy_only, steps, mesh):
    """`steps` decode steps of every slot; slots with done_s run with valid length 0 (caches frozen).
    Returns (cache, state, tokens [steps, S], ran [steps, S], done after each step [steps, S])."""
    TRACE_COUNTS["decode"] += 1

    def one(carry, _):
        params, cache, st = carry  # params ride in the carry: nnx modules must live at the loop's trace level
        model = _merge(spec, params)
        run = ~st.done_s
        logits, cache = model.forward_cached(st.last_s[:, None], cache, run.astype(jnp.int32))
        tok = _sample(logits[:, 0], st.keys_s, st.count_s, st.temperature_s, st.top_k_s, st.top_p_s, greedy_only)
        count = st.count_s + run.astype(jnp.int32)
        hit_eos = jnp.any(tok[:, None] == st.eos_se, axis=-1)
        done = st.done_s | (run & (hit_eos | (count >= st.max_new_s)))
        st = st._replace(last_s=jnp.where(run, tok, st.last_s), done_s=done, count_s=count)
        return (params, cache, st), (tok, run, done)

    unroll = min(_merge(spec, params).cfg.decode_loop_unroll, steps)
    (_, cache, state), (tok_ks, ran_ks, done_ks) = jax.lax.scan(one, (params, cache, state), None, length=steps,
                                                                unroll=unroll)
    return (*_pinned(cache, state, mesh), tok_ks, ran_ks, done_ks)
