"""Speculative decoding for the `Engine` path: a draft proposes k tokens, the target verifies them in one cached
forward, and every cache rolls back to exactly the state after the last accepted token.

One step, per sequence (cache positioned after the last consumed token, `last` pending):
  1. the draft proposes d1..dk (`k3jax.inference.drafts`);
  2. `verify`: the target scores [last, d1..dk] in ONE `hidden_states_cached` call (the chunked-prefill form);
     `accept` picks the accepted count a (0..k) and the target's own token at index a (the correction on a
     rejection, the bonus after full acceptance), so a+1 tokens come out of every step;
  3. rollback (`commit`): the cache must hold [last, d1..da] only. KDA's recurrent state and short-conv history
     and the MLA lengths are restored by re-running the cached forward over the same k+1 tokens from the saved
     pre-verify cache with valid length a+1: padded tokens are exact no-ops there (β = g = 0, conv history taken
     at the true end, MLA rows not written), so the result IS the cached forward over the accepted tokens, with no
     second code path to get wrong. Keeping per-position KDA states instead would need the chunked core to emit
     them (a [B, k+1, H, K, V] output per layer) and new per-layer plumbing; the recompute costs a second forward
     of k+1 tokens, skipped (`lax.cond`) when every sequence accepted all its drafts. The MLA page pools are not
     copied: the re-run writes into the verify's pools, whose rows past each sequence's new length may hold
     rejected tokens' latents; those are never read (queries attend to positions <= their own, and each position
     is written before it is read), so the attended cache is identical.

Sampling: greedy rows accept the longest prefix where the draft equals the target's argmax, so the output is the
plain greedy output. Sampled rows use speculative rejection sampling: accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)) (p: the target's filtered distribution, the same temperature / top-k / top-p as
`sampling.sample`; q: the draft's), on the first rejection draw from norm(max(0, p_i − q_i)), after k acceptances
draw the bonus from p_k: every emitted token is distributed exactly as the target's.

    engine = SpeculativeEngine(model, RandomDraft(3, cfg.vocab_size))  # or MTPDraft(mtp, 3), Eagle3Draft(layer, 3)
    results = engine.generate(prompts, 32, eos_id=257)
    engine.last_stats    # {"steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", ...}

The continuous-batching form is `k3jax.inference.spec_scheduler.SpeculativeScheduler`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.inference import sampling as sampling_lib
from k3jax.inference import sharded
from k3jax.inference.drafts import Draft, DraftContext, Proposal
from k3jax.inference.engine import DecodeState, Engine, GenerationResult, SamplingParams
from k3jax.layers.kda import KDAState
from k3jax.model import AttnResBlocks, DecodeCache, K3Model


class Verified(NamedTuple):
    """One verification: tokens_bj[b, :num_accepted_b[b] + 1] are the step's output (accepted drafts, then the
    target's token); `cache` holds exactly commit_b = num_accepted + 1 more tokens (0 for inactive rows)."""

    tokens_bj: jax.Array  # int32 [B, k+1]
    num_accepted_b: jax.Array  # int32 [B]
    commit_b: jax.Array  # int32 [B]
    cache: DecodeCache
    hidden_btd: jax.Array  # the target's final hidden states at the k+1 verified positions
    start_b: jax.Array  # int32 [B]: the position of the first verified token (the pre-verify cache length)
    blocks: AttnResBlocks | None = None  # the target's AttnRes block outputs there (`verify(with_blocks=True)`)


def residual_probs(p_bv: jax.Array, q_bv: jax.Array) -> jax.Array:
    """norm(max(0, p − q)): what a rejection draws from (p itself where p == q everywhere: then nothing is ever
    rejected, the row is never used)."""
    r = jnp.maximum(p_bv - q_bv, 0.0)
    total = r.sum(-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_bv)


def accept(logits_bjv: jax.Array, proposal: Proposal, keys_b: jax.Array, sp: tuple, *, greedy_only: bool
           ) -> tuple[jax.Array, jax.Array]:
    """(tokens_bj [B, k+1], num_accepted_b [B]) from the target's logits at [last, d1..dk] (row j predicts the token
    after d_j; d_0 = last). Greedy rows (temperature 0): the longest prefix with d_{j+1} == argmax_j, then argmax.
    Sampled rows: speculative rejection sampling (module docstring)."""
    draft_bk = proposal.tokens_bk
    b, j1, v = logits_bjv.shape
    k = j1 - 1
    target_bj = sampling_lib.greedy(logits_bjv.reshape(b * j1, v)).reshape(b, j1)
    greedy_n_b = jnp.sum(jnp.cumprod(draft_bk == target_bj[:, :k], axis=1), axis=1).astype(jnp.int32)
    if greedy_only:
        return target_bj, greedy_n_b
    temperature_b, top_k_b, top_p_b = sp
    filtered = sampling_lib.filter_logits(logits_bjv.reshape(b * j1, v), *(jnp.repeat(x, j1, axis=0) for x in sp))
    p_bjv = jax.nn.softmax(filtered, axis=-1).reshape(b, j1, v)
    q_bkv = (jax.nn.one_hot(draft_bk, v, dtype=jnp.float32) if proposal.probs_bkv is None
             else proposal.probs_bkv.astype(jnp.float32))
    p_d_bk = jnp.take_along_axis(p_bjv[:, :k], draft_bk[..., None], axis=2)[..., 0]
    q_d_bk = jnp.take_along_axis(q_bkv, draft_bk[..., None], axis=2)[..., 0]
    key_u, key_r = (jax.vmap(lambda key: jax.random.split(key), out_axes=1)(keys_b))
    u_bk = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(key_u)
    accepted_bk = u_bk * q_d_bk < p_d_bk  # u < p/q without dividing (p = 0: never; p >= q: always)
    n_b = jnp.sum(jnp.cumprod(accepted_bk, axis=1), axis=1).astype(jnp.int32)
    q_pad_bjv = jnp.concatenate([q_bkv, jnp.zeros((b, 1, v), jnp.float32)], axis=1)  # bonus row: residual(p, 0) = p

    def at_n(x_bjv):
        return jnp.take_along_axis(x_bjv, n_b[:, None, None], axis=1)[:, 0]

    final_bv = residual_probs(at_n(p_bjv), at_n(q_pad_bjv))
    new_b = jax.vmap(jax.random.categorical)(key_r, jnp.log(final_bv)).astype(jnp.int32)
    pos_j = jnp.arange(j1)[None, :]
    draft_pad_bj = jnp.concatenate([draft_bk, jnp.zeros((b, 1), jnp.int32)], axis=1)
    sampled_bj = jnp.where(pos_j < n_b[:, None], draft_pad_bj, jnp.where(pos_j == n_b[:, None], new_b[:, None], 0))
    sampled_b = temperature_b > 0
    return (jnp.where(sampled_b[:, None], sampled_bj, target_bj).astype(jnp.int32),
            jnp.where(sampled_b, n_b, greedy_n_b))


def commit(target: K3Model, pre_cache: DecodeCache, verified_cache: DecodeCache, ids_bj: jax.Array,
           commit_b: jax.Array, valid_b: jax.Array) -> DecodeCache:
    """The cache after only the first commit_b[b] of ids_bj (module docstring: a re-run from the pre-verify
    per-sequence state over the verify's page pools; the verify's cache itself where commit == valid for all)."""
    graphdef, state = nnx.split(target)

    def rerun(operands):
        state, pre, ver = operands
        layers = tuple(tuple(p if isinstance(p, KDAState) else v for p, v in zip(pg, vg))
                       for pg, vg in zip(pre.layers, ver.layers))
        cache = DecodeCache(layers, pre.page_table, pre.lengths)
        return nnx.merge(graphdef, state).hidden_states_cached(ids_bj, cache, commit_b)[1]

    return jax.lax.cond(jnp.all(commit_b == valid_b), lambda operands: operands[2], rerun,
                        (state, pre_cache, verified_cache))


def verify(target: K3Model, cache: DecodeCache, last_b: jax.Array, proposal: Proposal, active_b: jax.Array,
           keys_b: jax.Array, sp: tuple, *, greedy_only: bool, with_blocks: bool = False) -> Verified:
    """Scores [last, d1..dk] in one cached forward, accepts (`accept`) and rolls back (`commit`). Inactive rows
    consume nothing (valid length 0: their caches stay as they are). `with_blocks` (static): also return the
    target's AttnRes block outputs at the verified positions (an EAGLE-3 draft's features)."""
    ids_bj = jnp.concatenate([last_b[:, None], proposal.tokens_bk], axis=1).astype(jnp.int32)
    j1 = ids_bj.shape[1]
    valid_b = jnp.where(active_b, j1, 0).astype(jnp.int32)
    blocks = None
    if with_blocks:
        h_btd, verified_cache, blocks = target.hidden_states_cached_and_blocks(ids_bj, cache, valid_b)
    else:
        h_btd, verified_cache = target.hidden_states_cached(ids_bj, cache, valid_b)
    tokens_bj, n_b = accept(target.logits(h_btd), proposal, keys_b, sp, greedy_only=greedy_only)
    commit_b = jnp.where(active_b, n_b + 1, 0).astype(jnp.int32)
    new_cache = commit(target, cache, verified_cache, ids_bj, commit_b, valid_b)
    return Verified(tokens_bj, n_b, commit_b, new_cache, h_btd, cache.lengths, blocks)


class SpecState(NamedTuple):
    decode: DecodeState
    draft: Any  # the draft's carried state
    steps_b: jax.Array  # int32 [B]: verify steps run while active
    accepted_b: jax.Array  # int32 [B]: drafted tokens accepted in those steps


class SpeculativeEngine(Engine):
    """`Engine` whose `generate` decodes speculatively with `draft` (k = draft.num_tokens per step): one jitted
    prefill (+ the draft's `observe` over the prompt) and one jitted draft-verify-commit step (`trace_counts`
    "spec_prefill" / "spec_step"). Greedy output equals `Engine.generate`'s; sampled output has the same
    distribution (not the same draws). `mesh`: as `Engine`'s; the draft's parameters are placed like the target's
    (`sharded.place_draft_params`) and its state pinned by its slot axes (`sharded.slot_axis_shardings`)."""

    def __init__(self, model: K3Model, draft: Draft, *, max_len: int | None = None, steps_per_sync: int = 4,
                 mesh=None):
        super().__init__(model, max_len=max_len, steps_per_sync=steps_per_sync, mesh=mesh)
        self.draft = draft
        self.draft_params = sharded.place_draft_params(draft.params, self.mesh)
        self.last_stats: dict = {}
        self._spec_prefill = jax.jit(self._spec_prefill_impl, static_argnames=("greedy_only", "out_len"))
        self._spec_step = jax.jit(self._spec_step_impl, static_argnames=("greedy_only",), donate_argnums=(2, 3))

    def _spec_prefill_impl(self, params, draft_params, ids_bt, lengths_b, cache, keys_b, sp, max_new_b, eos_e, *,
                           greedy_only, out_len):
        self.trace_counts["spec_prefill"] += 1
        model = self._model(params)
        blocks = None
        if self.draft.uses_blocks:
            h_btd, cache, blocks = model.hidden_states_cached_and_blocks(ids_bt, cache, lengths_b)
        else:
            h_btd, cache = model.hidden_states_cached(ids_bt, cache, lengths_b)
        last_b1d = jnp.take_along_axis(h_btd, jnp.maximum(lengths_b - 1, 0)[:, None, None], axis=1)
        b = ids_bt.shape[0]
        tok = self._sample(model.logits(last_b1d)[:, 0], keys_b, jnp.zeros((b,), jnp.int32), sp, greedy_only)
        out = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(tok)
        done = jnp.isin(tok, eos_e) | (max_new_b <= 1)
        # the token after position t: the prompt's next token, and the sampled one after the prompt's last
        next_bt = jnp.concatenate([ids_bt[:, 1:], ids_bt[:, :1]], axis=1)
        next_bt = next_bt.at[jnp.arange(b), jnp.maximum(lengths_b - 1, 0)].set(tok)
        dstate = self.draft.init_state(cache)
        dstate = self.draft.observe(draft_params, dstate, model, self.draft.target_features(h_btd, blocks), next_bt,
                                    jnp.zeros((b,), jnp.int32), lengths_b, cache.page_table)
        zeros = jnp.zeros((b,), jnp.int32)
        return self._pin(SpecState(DecodeState(tok, done, jnp.ones((b,), jnp.int32), out), dstate, zeros, zeros),
                         cache)

    def _pin(self, state: SpecState, cache: DecodeCache) -> tuple[SpecState, DecodeCache]:
        """On a mesh: the step's outputs in their layouts (`k3jax.inference.sharded`), so the next step gets them."""
        dstate = sharded.constrain_slot_axes(state.draft, self.draft.slot_axes(), self.mesh)
        batch = sharded.constrain_batch((state.decode, state.steps_b, state.accepted_b), self.mesh)
        return SpecState(batch[0], dstate, *batch[1:]), sharded.constrain_cache(cache, self.mesh)

    def _spec_step_impl(self, params, draft_params, cache: DecodeCache, state: SpecState, keys_b, sp, max_new_b,
                        eos_e, *, greedy_only):
        self.trace_counts["spec_step"] += 1
        model = self._model(params)
        dec = state.decode
        active = ~dec.done_b
        step_keys = jax.vmap(jax.random.fold_in)(keys_b, dec.num_generated_b)
        key_d, key_v = jax.vmap(lambda key: jax.random.split(key), out_axes=1)(step_keys)
        ctx = DraftContext(model, dec.last_b, cache.lengths, cache.page_table, dec.num_generated_b, dec.out_bn,
                           key_d, sp, greedy_only)
        proposal, dstate = self.draft.propose(draft_params, state.draft, ctx)
        v = verify(model, cache, dec.last_b, proposal, active, key_v, sp, greedy_only=greedy_only,
                   with_blocks=self.draft.uses_blocks)
        dstate = self.draft.observe(draft_params, dstate, model, self.draft.target_features(v.hidden_btd, v.blocks),
                                    v.tokens_bj, v.start_b, v.commit_b, cache.page_table)
        # emit tokens_bj[:a+1], cut after an EOS and at max_new
        b, j1 = v.tokens_bj.shape
        pos_j = jnp.arange(j1)[None, :]
        is_eos_bj = jnp.isin(v.tokens_bj, eos_e)
        eos_before_bj = (jnp.cumsum(is_eos_bj, axis=1) - is_eos_bj) > 0
        keep_bj = ((pos_j < v.commit_b[:, None]) & ~eos_before_bj
                   & (dec.num_generated_b[:, None] + pos_j < max_new_b[:, None]))
        n_out = dec.out_bn.shape[1]
        col_bj = jnp.where(keep_bj, dec.num_generated_b[:, None] + pos_j, n_out)  # out of bounds: dropped
        out = dec.out_bn.at[jnp.arange(b)[:, None], col_bj].set(v.tokens_bj, mode="drop")
        n_emit_b = keep_bj.sum(1).astype(jnp.int32)
        count = dec.num_generated_b + n_emit_b
        last_emitted_b = jnp.take_along_axis(v.tokens_bj, jnp.maximum(n_emit_b - 1, 0)[:, None], axis=1)[:, 0]
        last = jnp.where(n_emit_b > 0, last_emitted_b, dec.last_b)
        done = dec.done_b | jnp.any(keep_bj & is_eos_bj, axis=1) | (count >= max_new_b)
        act = active.astype(jnp.int32)
        new = SpecState(DecodeState(last, done, count, out), dstate, state.steps_b + act,
                        state.accepted_b + act * v.num_accepted_b)
        new, cache = self._pin(new, v.cache)
        return cache, new

    def generate(self, prompts, max_new_tokens, sampling=SamplingParams(), eos_id=None, key=None,
                 pad_id=None) -> list[GenerationResult]:
        """`Engine.generate` decoded speculatively; `last_stats` then holds the acceptance statistics."""
        if not prompts:
            return []
        k = self.draft.num_tokens
        p = self._prepare(prompts, max_new_tokens, sampling, eos_id, key, pad_id, extra_positions=k)
        cache = self.init_cache(p.batch_size, p.max_len)
        dparams = self.draft_params
        with sharded.context(self.mesh):
            state, cache = self._spec_prefill(self.params, dparams, p.ids_bt, p.lens_b, cache, p.keys_b, p.sp,
                                              p.max_new_b, p.eos_e, greedy_only=p.greedy_only, out_len=p.out_len)
            for i in range(max(p.max_new) - 1):  # at least one token per step
                cache, state = self._spec_step(self.params, dparams, cache, state, p.keys_b, p.sp, p.max_new_b,
                                               p.eos_e, greedy_only=p.greedy_only)
                if (i + 1) % self.steps_per_sync == 0 and bool(jnp.all(state.decode.done_b)):
                    break
        steps_b = np.asarray(state.steps_b)[:p.num_prompts].tolist()
        accepted_b = np.asarray(state.accepted_b)[:p.num_prompts].tolist()
        steps, accepted = sum(steps_b), sum(accepted_b)
        self.last_stats = {"steps": steps, "drafted": steps * k, "accepted": accepted,
                           "acceptance_rate": accepted / max(steps * k, 1),
                           "mean_accepted_length": (accepted + steps) / max(steps, 1),  # tokens per verify step
                           "steps_per_sequence": steps_b, "accepted_per_sequence": accepted_b}
        return p.results(state.decode)
