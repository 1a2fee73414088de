"""The continuous-batching scheduler's jitted device programs: prefill into slots, extend sequences by a chunk,
install prefilled sequences, copy a page, decode every slot (`k3jax.inference.scheduler` drives them).

Log-probabilities (`token_logprobs`): log-softmax of the model's raw f32 logits (before temperature, top-k, top-p:
the distribution OpenAI reports), the sampled token's value and the top MAX_TOP_LOGPROBS (ids, values) of each row.
Admission always returns them (one more pass over the vocabulary of a few rows, small next to the prefill); the
decode step computes them only in its `logprobs=True` variant, compiled separately and used only while a running
request asked for them, so the decode programs of requests without logprobs are unchanged.

They are module-level with the model's (graphdef, treedef) as a static argument held by an identity-hashed
`Static` (`intern_static`), so schedulers of the same model and shapes share compilations; `TRACE_COUNTS` counts
traces (= compilations) per program. Each pins its outputs to the mesh layouts of `k3jax.inference.sharded`
(identity without a mesh).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.inference import sampling as sampling_lib
from k3jax.inference import sharded
from k3jax.inference.cache import CacheLayout, write_slots
from k3jax.model import K3Model, init_cache

TRACE_COUNTS: collections.Counter = collections.Counter()  # traces (= compilations) of each program
MAX_EOS_IDS = 8  # EOS ids per request (static width of the per-slot EOS table)
MAX_TOP_LOGPROBS = 20  # alternatives per token returned with log-probabilities (static width)


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


class Static:
    """An identity-hashed holder for a static jit argument: hashing a GraphDef costs ~1 ms per call."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


_INTERNED: dict = {}


def intern_static(value) -> Static:
    """One holder per distinct value, so schedulers of the same model share compilations."""
    if value not in _INTERNED:
        _INTERNED[value] = Static(value)
    return _INTERNED[value]


def merge_model(spec: Static, params) -> K3Model:
    graphdef, treedef = spec.value
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))


def _sample(logits_bv, keys_b, index_b, temperature_b, top_k_b, top_p_b, greedy_only):
    if greedy_only:
        return sampling_lib.greedy(logits_bv)
    step_keys = jax.vmap(jax.random.fold_in)(keys_b, index_b)
    return sampling_lib.sample(logits_bv, step_keys, temperature_b, top_k_b, top_p_b)


def token_logprobs(logits_bv: jax.Array, tok_b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob of tok_b [B], top ids [B, K], top logprobs [B, K], descending) of log_softmax(f32 logits),
    K = min(MAX_TOP_LOGPROBS, vocab)."""
    lp_bv = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    top_bk, ids_bk = jax.lax.top_k(lp_bv, min(MAX_TOP_LOGPROBS, lp_bv.shape[-1]))
    chosen_b = jnp.take_along_axis(lp_bv, tok_b[:, None], axis=-1)[:, 0]
    return chosen_b, ids_bk.astype(jnp.int32), top_bk


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
    return cache, state, tok_n, done_n, token_logprobs(logits_nv, tok_n)


def _prefill_impl(model: K3Model, cache_n, ids_nt, lens_n):
    """Runs the prompts' tokens (right-padded, valid lengths lens_n) on cache_n; the logits of each last token."""
    h_ntd, cache_n = model.hidden_states_cached(ids_nt, cache_n, lens_n)
    last = jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1)
    return cache_n, model.logits(last)[:, 0]


def _pinned(cache, state, mesh: Static):
    """The slots' cache and fields pinned to their mesh layouts (`k3jax.inference.sharded`; identity without)."""
    return sharded.constrain_cache(cache, mesh.value), sharded.constrain_batch(state, mesh.value)


@functools.partial(jax.jit, static_argnames=("spec", "layout", "max_len", "page_size", "greedy_only", "mesh"),
                   donate_argnums=(1, 2))
def admit_slots(params, cache, state: SlotState, ids_nt, lens_n, slot_n, table_np, new: SlotState, *, spec, layout,
           max_len, page_size, greedy_only, mesh):
    """Prefills n prompts (fresh per-sequence states, page-table rows table_np, the shared page pools), samples
    their first tokens and writes both into their slots. Returns (cache, state, tokens, done, their logprobs)."""
    TRACE_COUNTS["admit"] += 1
    model = merge_model(spec, params)
    layout = layout.value
    fresh = init_cache(model.cfg, ids_nt.shape[0], max_len, page_size=page_size, num_pages=1)
    fresh = layout.join(layout.split(fresh._replace(page_table=table_np))[0], layout.split(cache)[1])
    fresh, logits_nv = _prefill_impl(model, fresh, ids_nt, lens_n)
    cache, state, tok_n, done_n, lps = _install_impl(cache, state, fresh, logits_nv, slot_n, new, layout,
                                                     greedy_only)
    return (*_pinned(cache, state, mesh), tok_n, done_n, lps)


@functools.partial(jax.jit, static_argnames=("spec", "layout", "mesh"), donate_argnums=(2,))
def extend_sequences(params, seq_n, pools, ids_nt, lens_n, *, spec, layout, mesh):
    """Continues sequences (per-sequence leaves seq_n, not donated: they may be a prefix-cache entry's) over the
    page pools (donated) with a chunk of prompt tokens. Returns (seq_n, pools, last-token logits)."""
    TRACE_COUNTS["extend"] += 1
    layout = layout.value
    cache_n, logits_nv = _prefill_impl(merge_model(spec, params), layout.join(seq_n, pools), ids_nt, lens_n)
    return (*layout.split(sharded.constrain_cache(cache_n, mesh.value)), logits_nv)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def copy_page(pools, src, dst, *, mesh):
    """Every pool ([..., num_pages, page_size, C]) with page dst overwritten by page src."""
    TRACE_COUNTS["copy_page"] += 1
    pools = tuple(p.at[..., dst, :, :].set(p[..., src, :, :]) for p in pools)
    if mesh.value is None:
        return pools
    return jax.lax.with_sharding_constraint(pools, (sharded.replicated(mesh.value),) * len(pools))


@functools.partial(jax.jit, static_argnames=("layout", "greedy_only", "mesh"), donate_argnums=(0, 1))
def install_slots(cache, state: SlotState, seq_n, logits_nv, slot_n, new: SlotState, *, layout, greedy_only, mesh):
    """Installs prefilled sequences (per-sequence leaves seq_n; their rows are already in cache's pools)."""
    TRACE_COUNTS["install"] += 1
    layout = layout.value
    cache_n = layout.join(seq_n, layout.split(cache)[1])
    cache, state, tok_n, done_n, lps = _install_impl(cache, state, cache_n, logits_nv, slot_n, new, layout,
                                                     greedy_only)
    return (*_pinned(cache, state, mesh), tok_n, done_n, lps)


@functools.partial(jax.jit, static_argnames=("spec", "greedy_only", "steps", "mesh", "logprobs"),
                   donate_argnums=(1, 2))
def decode_slots(params, cache, state: SlotState, *, spec, greedy_only, steps, mesh, logprobs=False):
    """`steps` decode steps of every slot; slots with done_s run with valid length 0 (caches frozen).
    Returns (cache, state, tokens [steps, S], ran [steps, S], done after each step [steps, S]) and, with
    `logprobs`, a sixth output: `token_logprobs` of every step ([steps, S], [steps, S, K], [steps, S, K])."""
    TRACE_COUNTS["decode"] += 1

    def one(carry, _):
        params, cache, st = carry  # params ride in the carry: nnx modules must live at the loop's trace level
        model = merge_model(spec, params)
        run = ~st.done_s
        logits, cache = model.forward_cached(st.last_s[:, None], cache, run.astype(jnp.int32))
        tok = _sample(logits[:, 0], st.keys_s, st.count_s, st.temperature_s, st.top_k_s, st.top_p_s, greedy_only)
        count = st.count_s + run.astype(jnp.int32)
        hit_eos = jnp.any(tok[:, None] == st.eos_se, axis=-1)
        done = st.done_s | (run & (hit_eos | (count >= st.max_new_s)))
        st = st._replace(last_s=jnp.where(run, tok, st.last_s), done_s=done, count_s=count)
        return (params, cache, st), (tok, run, done, token_logprobs(logits[:, 0], tok) if logprobs else None)

    unroll = min(merge_model(spec, params).cfg.runtime.decode_loop_unroll, steps)
    (_, cache, state), (tok_ks, ran_ks, done_ks, lps_ks) = jax.lax.scan(one, (params, cache, state), None,
                                                                        length=steps, unroll=unroll)
    return (*_pinned(cache, state, mesh), tok_ks, ran_ks, done_ks) + ((lps_ks,) if logprobs else ())
