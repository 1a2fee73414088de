"""The speculative scheduler's jitted device programs: admission that also lets the draft observe the prompt, and
one draft-verify-commit step over every slot (`k3jax.inference.spec_scheduler` drives them).

A step per slot: the draft proposes k tokens; the target scores [last, d1..dk] in one cached forward with valid
length min(k + 1, max_new - count) (so the target cache is never written past the request's page reservation,
prompt + max_tokens - 1 positions); `speculative.accept` picks a accepted drafts (capped at valid - 1) and the
target's own token after them; `speculative.commit` rolls every cache back to exactly the a + 1 consumed tokens.
The emitted tokens are cut after an EOS (emitted, then the slot is done) and at max_tokens, as the plain step.

The draft's per-slot state rides beside the slots' cache: `Draft.slot_axes()` gives each state leaf's slot axis
(SHARED: a pool shared by every slot, e.g. the MTP draft's latent pages); admission gathers the admitted slots'
rows, observes the prompt and scatters them back. On a device mesh the slot axes sit over the 'batch' rule like the
slots' cache and SHARED leaves are replicated like the MLA page pools (`sharded.slot_axis_shardings`). The draft
sees the target's page table with free and finished slots' rows set to NO_PAGE, so a draft's own paged writes for
them are dropped (their pages may already belong to another request).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.inference import sharded
from k3jax.inference.cache import SHARED
from k3jax.inference.drafts import Draft, DraftContext
from k3jax.inference.slot_steps import TRACE_COUNTS, SlotState, _install_impl, _pinned, merge_model
from k3jax.inference.speculative import accept, commit
from k3jax.model import NO_PAGE, init_cache
from k3jax.vision import merge_image_tokens


def target_forward(model, draft: Draft, ids_bt, cache, valid_b, embeds_btd=None):
    """(hidden states, new cache, what the draft observes of them): the final hidden states, or for a draft with
    `uses_blocks` (EAGLE-3) its `target_features` of the AttnRes block outputs. `embeds_btd`: the input embeddings
    instead of ids_bt's (image tokens merged)."""
    embeds_btd = model.embed(ids_bt) if embeds_btd is None else embeds_btd
    if getattr(draft, "uses_blocks", False):
        h_btd, cache, blocks = model.hidden_states_cached_and_blocks_from_embeddings(embeds_btd, cache, valid_b)
        return h_btd, cache, draft.target_features(h_btd, blocks)
    h_btd, cache = model.hidden_states_cached_from_embeddings(embeds_btd, cache, valid_b)
    return h_btd, cache, h_btd


def gather_rows(state, axes: tuple[int, ...], rows_n: jax.Array, num_slots: int):
    """The draft state of slots rows_n (out-of-range rows read slot 0; their results are dropped on scatter)."""
    leaves, treedef = jax.tree.flatten(state)
    rows_n = jnp.where(rows_n < num_slots, rows_n, 0)
    return jax.tree.unflatten(treedef, [x if a == SHARED else jnp.take(x, rows_n, axis=a)
                                        for x, a in zip(leaves, axes)])


def scatter_rows(state, new, axes: tuple[int, ...], rows_n: jax.Array):
    """`state` with `new`'s rows written to slots rows_n (out of range: dropped) and `new`'s SHARED leaves."""
    leaves, treedef = jax.tree.flatten(state)
    out = []
    for x, y, a in zip(leaves, jax.tree.leaves(new), axes):
        out.append(y if a == SHARED else x.at[(slice(None),) * a + (rows_n,)].set(y.astype(x.dtype), mode="drop"))
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnames=("spec", "draft", "layout", "max_len", "page_size", "mesh"),
                   donate_argnums=(2, 3, 4))
def spec_admit_slots(params, draft_params, cache, state: SlotState, dstate, ids_nt, lens_n, slot_n, table_np,
                     new: SlotState, *, spec, draft: Draft, layout, max_len, page_size, mesh):
    """`slot_steps.admit_slots` plus the draft observing the prompts (their hidden states and next tokens, the
    first sampled token after the last). Returns (cache, state, draft state, tokens, done, logprobs)."""
    TRACE_COUNTS["spec_admit"] += 1
    model = merge_model(spec, params)
    layout = layout.value
    n = ids_nt.shape[0]
    fresh = init_cache(model.cfg, n, max_len, page_size=page_size, num_pages=1)
    fresh = layout.join(layout.split(fresh._replace(page_table=table_np))[0], layout.split(cache)[1])
    h_ntd, fresh, feats_nt = target_forward(model, draft, ids_nt, fresh, lens_n)
    last_n1d = jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1)
    logits_nv = model.logits(last_n1d)[:, 0]
    cache, state, tok_n, done_n, lps = _install_impl(cache, state, fresh, logits_nv, slot_n, new, layout, False)
    next_nt = jnp.concatenate([ids_nt[:, 1:], ids_nt[:, :1]], axis=1).at[jnp.arange(n), lens_n - 1].set(tok_n)
    axes = draft.slot_axes()
    num_slots = state.done_s.shape[0]
    rows = gather_rows(dstate, axes, slot_n, num_slots)
    rows = draft.observe(draft_params, rows, model, feats_nt, next_nt, jnp.zeros((n,), jnp.int32), lens_n, table_np)
    dstate = sharded.constrain_slot_axes(scatter_rows(dstate, rows, axes, slot_n), axes, mesh.value)
    return (*_pinned(cache, state, mesh), dstate, tok_n, done_n, lps)


@functools.partial(jax.jit, static_argnames=("spec", "draft", "layout", "placeholder_id", "mesh"),
                   donate_argnums=(2,))
def spec_extend(params, seq_n, pools, ids_nt, rows_md, lens_n, *, spec, draft: Draft, layout, placeholder_id, mesh):
    """`slot_steps.extend_sequences` (with image tokens when rows_md is not None: `image_slots.extend_with_images`)
    that also returns what the draft observes of the chunk. Returns (seq_n, pools, last-token logits, features)."""
    TRACE_COUNTS["spec_extend"] += 1
    model = merge_model(spec, params)
    layout = layout.value
    embeds_ntd = model.embed(ids_nt)
    if rows_md is not None:
        embeds_ntd = merge_image_tokens(embeds_ntd, ids_nt, rows_md, placeholder_id=placeholder_id)
    h_ntd, cache_n, feats_nt = target_forward(model, draft, ids_nt, layout.join(seq_n, pools), lens_n, embeds_ntd)
    logits_nv = model.logits(jnp.take_along_axis(h_ntd, (lens_n - 1)[:, None, None], axis=1))[:, 0]
    return (*layout.split(sharded.constrain_cache(cache_n, mesh.value)), logits_nv, feats_nt)


@functools.partial(jax.jit, static_argnames=("spec", "draft", "num_slots", "mesh"), donate_argnums=(2,))
def spec_observe(params, draft_params, dstate, feats_nt, next_nt, last_n, start_n, valid_n, slot_n, table_np, *,
                 spec, draft: Draft, num_slots, mesh):
    """The draft of slots slot_n observes positions start_n + t (t < valid_n) with the target's features feats_nt
    and the tokens after them next_nt, whose entry at valid_n - 1 is replaced by last_n where last_n >= 0 (the
    first token sampled after a prompt's end). Returns the draft state."""
    TRACE_COUNTS["spec_observe"] += 1
    model = merge_model(spec, params)
    rows_n = jnp.arange(next_nt.shape[0])
    end_n = jnp.maximum(valid_n - 1, 0)
    next_nt = next_nt.at[rows_n, end_n].set(jnp.where(last_n >= 0, last_n, next_nt[rows_n, end_n]))
    axes = draft.slot_axes()
    rows = gather_rows(dstate, axes, slot_n, num_slots)
    rows = draft.observe(draft_params, rows, model, feats_nt, next_nt, start_n, valid_n, table_np)
    return sharded.constrain_slot_axes(scatter_rows(dstate, rows, axes, slot_n), axes, mesh.value)


@functools.partial(jax.jit, static_argnames=("axes", "mesh"), donate_argnums=(0,))
def copy_draft_page(dstate, src, dst, *, axes, mesh):
    """The draft state with page dst of every SHARED leaf (a page pool [..., num_pages, page_size, C], like the
    target's MLA pools) overwritten by page src."""
    TRACE_COUNTS["copy_draft_page"] += 1
    leaves, treedef = jax.tree.flatten(dstate)
    leaves = [x.at[..., dst, :, :].set(x[..., src, :, :]) if a == SHARED else x for x, a in zip(leaves, axes)]
    return sharded.constrain_slot_axes(jax.tree.unflatten(treedef, leaves), axes, mesh.value)


@functools.partial(jax.jit, static_argnames=("spec", "draft", "greedy_only", "mesh"), donate_argnums=(2, 3, 4))
def spec_decode_slots(params, draft_params, cache, state: SlotState, dstate, *, spec, draft: Draft, greedy_only,
                      mesh):
    """One speculative step of every slot (module docstring). Returns (cache, state, draft state, tokens [S, k+1],
    emitted count [S] (the first that many tokens, in order; 0 for idle slots), done [S], accepted drafts [S])."""
    TRACE_COUNTS["spec_decode"] += 1
    model = merge_model(spec, params)
    s, k = state.done_s.shape[0], draft.num_tokens
    active_s = ~state.done_s
    sp = (state.temperature_s, state.top_k_s, state.top_p_s)
    step_keys = jax.vmap(jax.random.fold_in)(state.keys_s, state.count_s)
    key_d, key_v = jax.vmap(lambda key: jax.random.split(key), out_axes=1)(step_keys)
    table_sp = jnp.where(active_s[:, None], cache.page_table, NO_PAGE)
    ctx = DraftContext(model, state.last_s, cache.lengths, table_sp, state.count_s, jnp.zeros((s, 0), jnp.int32),
                       key_d, sp, greedy_only)
    proposal, dstate = draft.propose(draft_params, dstate, ctx)
    ids_sj = jnp.concatenate([state.last_s[:, None], proposal.tokens_bk], axis=1).astype(jnp.int32)
    valid_s = jnp.where(active_s, jnp.clip(state.max_new_s - state.count_s, 1, k + 1), 0).astype(jnp.int32)
    h_sjd, verified, feats_sj = target_forward(model, draft, ids_sj, cache, valid_s)
    tokens_sj, n_s = accept(model.logits(h_sjd), proposal, key_v, sp, greedy_only=greedy_only)
    n_s = jnp.minimum(n_s, jnp.maximum(valid_s - 1, 0))
    commit_s = jnp.where(active_s, n_s + 1, 0).astype(jnp.int32)
    cache = commit(model, cache, verified, ids_sj, commit_s, valid_s)
    dstate = draft.observe(draft_params, dstate, model, feats_sj, tokens_sj, ctx.lengths_b, commit_s, table_sp)
    pos_j = jnp.arange(k + 1)[None, :]
    is_eos_sj = jnp.any(tokens_sj[:, :, None] == state.eos_se[:, None, :], axis=-1)
    eos_before_sj = (jnp.cumsum(is_eos_sj, axis=1) - is_eos_sj) > 0
    keep_sj = (pos_j < commit_s[:, None]) & ~eos_before_sj & (state.count_s[:, None] + pos_j < state.max_new_s[:, None])
    n_emit_s = keep_sj.sum(1).astype(jnp.int32)
    count_s = state.count_s + n_emit_s
    last_emitted_s = jnp.take_along_axis(tokens_sj, jnp.maximum(n_emit_s - 1, 0)[:, None], axis=1)[:, 0]
    done_s = state.done_s | (active_s & (jnp.any(keep_sj & is_eos_sj, axis=1) | (count_s >= state.max_new_s)))
    state = state._replace(last_s=jnp.where(n_emit_s > 0, last_emitted_s, state.last_s), done_s=done_s,
                           count_s=count_s)
    cache, state = _pinned(cache, state, mesh)
    dstate = sharded.constrain_slot_axes(dstate, draft.slot_axes(), mesh.value)
    return cache, state, dstate, tokens_sj, n_emit_s, done_s, jnp.where(active_s, n_s, 0)
