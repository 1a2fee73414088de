"""Continuous batching: a fixed number of decode slots; requests join free slots while the others keep decoding.

Every slot is one row of a `DecodeCache` with batch = `num_slots` (its KDA states, MLA page-table row and length)
plus per-slot decode fields (last token, token count, limits, sampling parameters, PRNG key, EOS ids). All shapes are
static, so the decode step compiles once (per greedy/sampling variant) and admission once per (prefill batch
bucket, prompt length bucket): admission always runs the sampling program (greedy rows take the argmax; the one
sort of the vocabulary per admitted row costs little next to the prefill), which halves the programs a server
compiles at start-up (`k3jax.inference.warmup`).

MLA latents are paged: each MLA layer has one pool of `num_pages` pages of `page_size` tokens shared by all slots, and
the cache's page table maps each slot's positions to pages (the same page ids in every layer). A host-side
`PageAllocator` (`k3jax.inference.cache`: free list + reference counts) RESERVES a request's pages on admission for its
whole budget, prompt + max_tokens - 1 positions (so decode never runs out mid-request and needs no preemption), and
releases them when it finishes or is cancelled. When the free pages do not cover the next waiting request, it waits
(first come, first served: later requests do not overtake it) until running requests free theirs; prefix-cache entries,
which also hold page references, are evicted (least recently used first) before a request is made to wait. A request
that needs more pages than the whole pool is rejected by `validate`.

Admission prefills the new prompts (right-padded) with fresh per-sequence states (KDA, length) and the slots' page
tables, writing their latent rows straight into the shared pools, then scatters the per-sequence states into the
slots along each leaf's batch axis (axis 0, or 1 for scanned groups whose states carry a leading [repeats] axis;
found from the cache's shapes, `k3jax.inference.cache.CacheLayout`; the jitted programs are in
`k3jax.inference.slot_steps`). Pages are not cleared between requests: rows past a sequence's length
are masked (queries see positions <= their own) until overwritten.

A request with `logprobs` set (k alternatives, 0..MAX_TOP_LOGPROBS) gets each token's log-probability and the top k
(id, log-probability) pairs in its events: log-softmax of the raw logits, before temperature / top-k / top-p
(`slot_steps.token_logprobs`); while such a request runs, decode uses the sampling program's logprobs variant
(greedy rows still take the argmax), otherwise the programs are the ones without.

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
import itertools
import logging
from typing import Hashable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.inference import sharded
from k3jax.inference.cache import CacheLayout, PageAllocator, page_table_rows, pages_for
from k3jax.inference.engine import MIN_PROMPT_BUCKET, SamplingParams, bucket
from k3jax.inference.image_slots import ImageEncoder, admit_with_images, count_placeholders
from k3jax.inference.images import ImageInput
from k3jax.inference.prefix_admit import ChunkedAdmission
from k3jax.inference.prefix_cache import DEFAULT_LONG_BLOCK, DEFAULT_THRESHOLD, PrefixCache, auto_max_bytes
from k3jax.inference.slot_steps import (
    MAX_EOS_IDS,
    MAX_TOP_LOGPROBS,
    SlotState,
    admit_slots,
    decode_slots,
    intern_static,
)
from k3jax.layers.mla import DEFAULT_PAGE_SIZE, pages_per_sequence
from k3jax.model import K3Model, init_cache

log = logging.getLogger(__name__)

FINISH_STOP = "stop"  # an EOS id was sampled (not emitted as a token)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CANCELLED = "cancelled"  # `cancel` was called


@dataclasses.dataclass
class Request:
    """One generation request. `key` is required when sampling (temperature > 0); `eos_ids` None means the config's
    eos_token_id; `max_tokens` counts generated tokens (an EOS ends the request early and is not emitted);
    `logprobs` None: no log-probabilities, k: each token's and its top k alternatives' (k <= MAX_TOP_LOGPROBS).
    `images`: `images.ImageInput`s filling the prompt's placeholder ids in order (`Scheduler.attach_vision`)."""

    request_id: Hashable
    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    key: jax.Array | None = None
    eos_ids: Sequence[int] | None = None
    logprobs: int | None = None
    images: tuple[ImageInput, ...] = ()


class TokenEvent(NamedTuple):
    """One step of one request. `token` is None only on a final event that carries no token (EOS sampled, or
    cancelled); `index` is the token's position in the completion; `finish_reason` is None while it runs.
    For a request with `logprobs`: the token's `logprob` and `top_logprobs`, ((id, logprob), ...) descending."""

    request_id: Hashable
    token: int | None
    index: int
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass
class _Running:
    request: Request
    num_emitted: int = 0


class Scheduler(ChunkedAdmission):
    images: ImageEncoder | None = None  # the vision tower of image requests (`attach_vision`)
    """Continuous batching over `num_slots` decode slots of `max_len` tokens (prompt + generated) each.

    Single-threaded: `add`, `cancel` and `step` are called from one thread (the server's engine thread).
    `max_prefill_batch`: most requests prefilled in one call (a power of two; more compiles, fewer calls).
    `decode_steps`: decode steps per device call (> 1 syncs less often; a request finishing mid-call idles its slot
    for the rest of the call). The jitted functions are module-level with the model's graphdef as a static
    argument, so schedulers of the same model and shapes share compilations (`slot_steps.TRACE_COUNTS` counts
    traces).
    `prefix_block`: enables the prefix cache (`prefix_cache.PrefixCache`; `prefix_admit.ChunkedAdmission`): prompts
    are then admitted one at a time, prefilled in `prefix_block`-token chunks (a power of two >= 16); a snapshot is
    kept at every chunk end up to `prefix_long_threshold` tokens and at multiples of `prefix_long_block` past it
    (None or 0: at every chunk end); a hit shares the prefix's full latent pages. Snapshots take at most
    `prefix_bytes` bytes of device memory (None: `prefix_cache.auto_max_bytes`, a share of the memory free once the
    decode cache is allocated) and, if set, at most `prefix_capacity` entries; least recently used ones go first.
    `page_size`: tokens per MLA latent page (default 64, capped at max_len; a multiple of the 64-token prefill chunk
    suits real models). `num_pages`: pages per MLA layer pool (default num_slots * ceil(max_len / page_size): every
    slot at full length; fewer pages hold less memory and make requests wait when their reservations do not fit).
    `mesh`: a `sharding.mesh.make_mesh` mesh with context == 1 (see the module docstring and
    `k3jax.inference.sharded`); the parameters are placed on it by the rules (no copy when the model was loaded
    onto it, `k3jax.load_hf(..., mesh=mesh)`). num_slots should be a multiple of data * expert.
    """

    def __init__(self, model: K3Model, *, num_slots: int = 8, max_len: int = 1024, max_prefill_batch: int = 1,
                 decode_steps: int = 1, pad_id: int | None = None, prefix_block: int | None = None,
                 prefix_capacity: int | None = None, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 mesh=None, prefix_long_block: int | None = DEFAULT_LONG_BLOCK,
                 prefix_long_threshold: int = DEFAULT_THRESHOLD, prefix_bytes: int | None = None):
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
        self._mesh = intern_static(self.mesh)
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
        self.model_spec = intern_static((graphdef, treedef))
        self.page_size = min(page_size, max_len)
        self.pages_per_seq = pages_per_sequence(max_len, self.page_size)
        self.num_pages = num_pages or num_slots * self.pages_per_seq
        self.layout = intern_static(CacheLayout.of(self.cfg, max_len, self.page_size))
        self.allocator = PageAllocator(self.num_pages)
        self.page_copies = 0  # partial prefix pages copied on prefix-cache hits (full pages are shared, not copied)
        self.prefix_cache = None
        if prefix_block is not None:
            if prefix_block < MIN_PROMPT_BUCKET:
                raise ValueError(f"prefix_block must be >= {MIN_PROMPT_BUCKET}, got {prefix_block}")
            self.prefix_cache = PrefixCache(prefix_block, prefix_capacity,
                                            release=lambda pages: self.allocator.release(pages),
                                            long_block=prefix_long_block, threshold=prefix_long_threshold,
                                            max_bytes=prefix_bytes)
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[_Running | None] = [None] * num_slots
        self._slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._cancelled: set = set()
        self._ids: set = set()  # ids of waiting and running requests
        self._auto_id = itertools.count()
        self.reset()
        if self.prefix_cache is not None and prefix_bytes is None:  # measured after the decode cache exists
            self.prefix_cache.max_bytes = auto_max_bytes(
                list(self.mesh.devices.flat) if self.mesh is not None else jax.local_devices()[:1])

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

    def speculative_stats(self) -> dict | None:
        """Speculative-decoding counters (`spec_scheduler.SpeculativeScheduler`); None: plain decoding."""
        return None

    def slot_pages(self, slot: int) -> list[int]:
        """The pool pages mapped by `slot`'s page table (empty for a free slot)."""
        return list(self._slot_pages[slot]) if self._slots[slot] is not None else []

    def pages_needed(self, request: Request) -> int:
        """Pages reserved for a request: its prompt + max_tokens - 1 positions (the last token is not fed back)."""
        return pages_for(len(request.prompt_ids) + int(request.max_tokens) - 1, self.page_size)

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
        need = pages_for(len(ids) + int(request.max_tokens) - 1, self.page_size)
        if need > self.num_pages:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} needs {need} latent "
                             f"pages of {self.page_size} tokens but the page pool has only {self.num_pages}")
        request.sampling.validate()
        if request.sampling.temperature > 0 and request.key is None:
            raise ValueError("sampling with temperature > 0 needs an explicit PRNG key")
        if request.logprobs is not None and not (
                isinstance(request.logprobs, int) and 0 <= request.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs!r}")
        eos = self._eos(request)
        if len(eos) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids per request, got {len(eos)}")
        if request.images:
            if self.images is None:
                raise ValueError("this model has no vision tower")
            want, have = sum(im.num_tokens for im in request.images), count_placeholders(
                ids, self.images.placeholder_id)
            if want != have:
                raise ValueError(f"{len(request.images)} image(s) of {want} tokens but {have} placeholder ids "
                                 f"({self.images.placeholder_id}) in the prompt")
        return dataclasses.replace(request, prompt_ids=ids, max_tokens=int(request.max_tokens),
                                   images=tuple(request.images))

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
            if self._waiting[0].images and self.prefix_cache is None:  # one at a time
                admitted = self._admit_images(self._waiting[0], free[0])
                if admitted is None:
                    break
                self._waiting.popleft()
                events += admitted
            elif self.prefix_cache is not None:
                admitted = self._admit_with_prefix(self._waiting[0], free[0])
                if admitted is None:
                    break
                self._waiting.popleft()
                events += admitted
            else:
                batch, pages = [], []
                for r in itertools.islice(self._waiting, min(len(free), self.max_prefill_batch)):
                    if r.images:
                        break
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

    def _emit(self, slot: int, token: int, done: bool, lps=None) -> TokenEvent:
        """The event for `token` sampled by `slot` (its request still running before this token); `lps`: this row
        of `token_logprobs` (chosen, top ids, top logprobs) as host arrays, or None."""
        run = self._slots[slot]
        req = run.request
        index = run.num_emitted
        if token in self._eos(req):
            ev = TokenEvent(req.request_id, None, index, FINISH_STOP)
        else:
            run.num_emitted += 1
            finished = run.num_emitted >= req.max_tokens
            lp = top = None
            if req.logprobs is not None and lps is not None:
                lp = float(lps[0])
                top = tuple((int(i), float(v)) for i, v in zip(lps[1][:req.logprobs], lps[2][:req.logprobs]))
            ev = TokenEvent(req.request_id, token, index, FINISH_LENGTH if finished else None, lp, top)
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

    def _started(self, batch: list[Request], slots: list[int], pages: list[list[int]], tok_n, done_n, lps
                 ) -> list[TokenEvent]:
        want = any(r.logprobs is not None for r in batch)
        tok_n, done_n, lps = jax.device_get((tok_n, done_n, lps if want else None))
        events = []
        for i, (r, slot) in enumerate(zip(batch, slots)):
            self._slots[slot] = _Running(r)
            self._slot_pages[slot] = pages[i]
            row = None if lps is None else tuple(x[i] for x in lps)
            events.append(self._emit(slot, int(tok_n[i]), bool(done_n[i]), row))
        return events

    def _padded_prompts(self, batch: list[Request], n: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompts as int32 [n, T] ids (T a bucket, padded with pad_id) and their lengths [n] (1 for padding
        rows)."""
        t = min(bucket(max(len(r.prompt_ids) for r in batch), MIN_PROMPT_BUCKET), self.max_len)
        ids = np.full((n, t), self.pad_id, np.int32)
        lens = np.ones((n,), np.int32)
        for i, r in enumerate(batch):
            ids[i, :len(r.prompt_ids)] = r.prompt_ids
            lens[i] = len(r.prompt_ids)
        return ids, lens

    def _admit_batch(self, batch: list[Request], slots: list[int], pages: list[list[int]]) -> list[TokenEvent]:
        """Prefills `batch` (its pages already allocated) into `slots` in one call."""
        n = sharded.round_up_batch(bucket(len(batch), 1), self.mesh)  # padding rows go to no slot, write nothing
        ids, lens = self._padded_prompts(batch, n)
        new, slot_n = self._new_fields(batch, slots, n)
        with sharded.context(self.mesh):
            self.cache, self.state, tok_n, done_n, lps = admit_slots(
                self.params, self.cache, self.state, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(slot_n),
                jnp.asarray(page_table_rows(pages, n, self.pages_per_seq)), new, spec=self.model_spec,
                layout=self.layout, max_len=self.max_len, page_size=self.page_size, greedy_only=False,
                mesh=self._mesh)
        return self._started(batch, slots, pages, tok_n, done_n, lps)

    def attach_vision(self, vision, placeholder_id: int) -> None:
        """Serve image requests with the tower + projector `vision` (a `k3jax.vision.VisionModel` whose
        text_hidden_size is the model's hidden size); their prompts hold `placeholder_id` once per image token."""
        if self.mesh is not None:
            raise ValueError("image input on a device mesh is not supported yet")
        self.images = ImageEncoder(vision, placeholder_id, self.cfg)

    def _admit_images(self, r: Request, slot: int) -> list[TokenEvent] | None:
        """Admits an image request alone without the prefix cache (`image_slots.admit_with_images`): its images are
        encoded now and fill its placeholders. None: not enough free pages (it keeps waiting)."""
        pages = self._allocate(self.pages_needed(r))
        if pages is None:
            return None
        ids = np.full((1, min(bucket(len(r.prompt_ids), MIN_PROMPT_BUCKET), self.max_len)), self.pad_id, np.int32)
        ids[0, :len(r.prompt_ids)] = r.prompt_ids
        new, slot_n = self._new_fields([r], [slot], 1)
        self.cache, self.state, tok_n, done_n, lps = admit_with_images(
            self.params, self.cache, self.state, jnp.asarray(ids), self.images.encode(r.images),
            jnp.asarray([len(r.prompt_ids)], jnp.int32), jnp.asarray(slot_n),
            jnp.asarray(page_table_rows([pages], 1, self.pages_per_seq)), new, spec=self.model_spec,
            layout=self.layout, max_len=self.max_len, page_size=self.page_size,
            placeholder_id=self.images.placeholder_id, mesh=self._mesh)
        return self._started([r], [slot], [pages], tok_n, done_n, lps)

    def _decode_running(self) -> list[TokenEvent]:
        running = [s.request for s in self._slots if s is not None]
        logprobs = any(r.logprobs is not None for r in running)  # one program with logprobs, sampling or not
        greedy_only = all(r.sampling.temperature == 0 for r in running) and not logprobs
        with sharded.context(self.mesh):
            self.cache, self.state, tok_ks, ran_ks, done_ks, *lps = decode_slots(
                self.params, self.cache, self.state, spec=self.model_spec, greedy_only=greedy_only,
                steps=self.decode_steps, mesh=self._mesh, logprobs=logprobs)
        tok_ks, ran_ks, done_ks, lps = jax.device_get((tok_ks, ran_ks, done_ks, lps[0] if lps else None))
        events = []
        for k in range(self.decode_steps):
            for slot in np.flatnonzero(ran_ks[k]):
                if self._slots[slot] is not None:
                    row = None if lps is None else tuple(x[k, slot] for x in lps)
                    events.append(self._emit(int(slot), int(tok_ks[k, slot]), bool(done_ks[k, slot]), row))
        return events

def _typed_key(key) -> jax.Array:
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
