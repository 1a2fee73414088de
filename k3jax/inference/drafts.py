"""Draft proposers for speculative decoding (`k3jax.inference.speculative`).

A draft proposes `num_tokens` (k) tokens per sequence and step, and the probabilities it drew them from (None: drawn
deterministically, i.e. one-hot). Its methods run inside the engine's jitted steps, so they are pure JAX; `params`
(a pytree, e.g. weights) is passed to them as a jitted argument and `state` is carried from step to step:

    init_state(cache)                                 -> state     (after the target's cache is created)
    observe(params, state, target, h_btd, next_ids_bt, start_b, valid_b, page_table_bp) -> state
        the target consumed tokens at positions start_b + t (t < valid_b) with final hidden states h_btd, and
        next_ids_bt[b, t] is the token that followed position start_b + t (after prefill and after every verify)
    propose(params, state, ctx: DraftContext)         -> (Proposal, state)
    slot_axes()                                       -> per-leaf batch axis of the state (SHARED = -1: one
        buffer for every sequence: a page pool [..., num_pages, page_size, C] addressed through the target's page
        table), in `jax.tree.leaves` order; the continuous-batching scheduler (`k3jax.inference.spec_scheduler`)
        uses it to admit sequences into slots and to copy a prefix-cache hit's partial page

A draft with `uses_blocks = True` (`k3jax.inference.eagle3_draft.Eagle3Draft`) reads the target's AttnRes block
outputs: the engine runs the target through `hidden_states_cached_and_blocks` and passes
`target_features(h_btd, blocks)` to `observe` as its h_btd (the final hidden states for every other draft).

`RandomDraft` (uniform tokens) and `CallbackDraft` (any host callable, through `jax.pure_callback`) are for tests and
experiments; `MTPDraft` is the model's own MTP layer (`k3jax.mtp.MTPLayer`) served incrementally.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.inference import sampling as sampling_lib
from k3jax.layers.mla import init_latent_pages
from k3jax.model import AttnResBlocks, DecodeCache, K3Model
from k3jax.mtp import MTPLayer


class Proposal(NamedTuple):
    tokens_bk: jax.Array  # int32 [B, k]
    probs_bkv: jax.Array | None  # f32 [B, k, V]: the distributions the tokens were drawn from; None: one-hot


class DraftContext(NamedTuple):
    """What a draft may look at when proposing (inside the jitted step)."""

    target: K3Model  # the target model (shared embedding / head)
    last_b: jax.Array  # int32 [B]: the last token, not yet in the target's cache
    lengths_b: jax.Array  # int32 [B]: the target cache's length = the position of last_b
    page_table_bp: jax.Array  # the target cache's page table (a draft's own MLA pages use it too)
    num_generated_b: jax.Array  # int32 [B]
    out_bn: jax.Array  # int32 [B, N]: the tokens generated so far (first num_generated_b valid)
    keys_b: jax.Array  # per-sequence PRNG keys for this step's draws
    sp: tuple  # (temperature_b, top_k_b, top_p_b)
    greedy_only: bool  # static: every sequence is greedy


class Draft:
    """The interface (and a no-state default); subclasses set `num_tokens` and override `propose`."""

    num_tokens: int = 1
    params: Any = ()
    uses_blocks: bool = False  # static: `observe` wants the target's AttnRes block outputs (`target_features`)

    def init_state(self, cache: DecodeCache) -> Any:
        return ()

    def observe(self, params, state, target: K3Model, h_btd, next_ids_bt, start_b, valid_b, page_table_bp):
        return state

    def target_features(self, h_btd: jax.Array, blocks: AttnResBlocks | None) -> jax.Array:
        """What `observe` receives of the target's forward: its final hidden states unless `uses_blocks`."""
        return h_btd

    def propose(self, params, state, ctx: DraftContext) -> tuple[Proposal, Any]:
        raise NotImplementedError

    def slot_axes(self) -> tuple[int, ...]:
        return ()  # no state


class RandomDraft(Draft):
    """k tokens drawn uniformly from the vocabulary (acceptance near zero: exercises rejection and rollback)."""

    def __init__(self, num_tokens: int, vocab_size: int):
        self.num_tokens, self.vocab_size = _check_k(num_tokens), vocab_size

    def propose(self, params, state, ctx: DraftContext) -> tuple[Proposal, Any]:
        k, v = self.num_tokens, self.vocab_size
        tokens_bk = jax.vmap(lambda key: jax.random.randint(key, (k,), 0, v, jnp.int32))(ctx.keys_b)
        probs = None if ctx.greedy_only else jnp.full(tokens_bk.shape + (v,), 1.0 / v, jnp.float32)
        return Proposal(tokens_bk, probs), state


class CallbackDraft(Draft):
    """Any host function `fn(last_b, out_bn, num_generated_b) -> int [B, k]` (NumPy in, NumPy out), deterministic
    (one-hot proposals), called once per step through `jax.pure_callback`."""

    def __init__(self, fn: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray], num_tokens: int):
        self.fn, self.num_tokens = fn, _check_k(num_tokens)

    def propose(self, params, state, ctx: DraftContext) -> tuple[Proposal, Any]:
        b, k = ctx.last_b.shape[0], self.num_tokens

        def host(last_b, out_bn, num_generated_b):
            tokens = np.asarray(self.fn(np.asarray(last_b), np.asarray(out_bn), np.asarray(num_generated_b)))
            if tokens.shape != (b, k):
                raise ValueError(f"draft callback returned shape {tokens.shape}, expected {(b, k)}")
            return tokens.astype(np.int32)

        tokens_bk = jax.pure_callback(host, jax.ShapeDtypeStruct((b, k), jnp.int32), ctx.last_b, ctx.out_bn,
                                      ctx.num_generated_b)
        return Proposal(jnp.clip(tokens_bk, 0, ctx.target.cfg.vocab_size - 1), None), state


class MTPState(NamedTuple):
    pages_npc: jax.Array  # the MTP block's MLA latent pages (same page table as the target's cache)
    hidden_bd: jax.Array  # MTP output at the last consumed position: predicts the first draft token


class MTPDraft(Draft):
    """The MTP layer as a draft, with its own MLA latent cache.

    MTP position i combines the target's hidden state h_i with Emb(t_{i+1}) and predicts t_{i+2}. `observe` runs the
    layer over the positions the target just consumed (the prompt after prefill, the accepted tokens after each
    verify), with the target's real h_i, writing their latent rows into the MTP pages at the target's positions:
    the MTP cache then holds exactly what the training forward would attend to. Its output at the last consumed
    position (h of that position, Emb of the pending token) gives the first draft. Drafts 2..k chain: the MTP
    output stands in for the target's (not yet computed) hidden state, one position per step; those rows are
    rewritten by the next `observe` before anything reads them (every query attends to positions <= its own).
    A cache rather than recomputing a window: exact w.r.t. training, and each step costs k MTP tokens, not a window.
    Drafts are greedy for greedy rows and drawn from the filtered MTP distribution (same temperature / top-k /
    top-p) for sampled rows.
    """

    def __init__(self, mtp: MTPLayer, num_tokens: int):
        self.num_tokens = _check_k(num_tokens)
        self.cfg = mtp.cfg
        self.graphdef, self.params = nnx.split(mtp)

    def init_state(self, cache: DecodeCache) -> MTPState:
        pages = init_latent_pages(self.cfg, cache.num_pages, cache.page_size)
        return MTPState(pages, jnp.zeros((cache.lengths.shape[0], self.cfg.hidden_size), self.cfg.runtime.jnp_dtype))

    def slot_axes(self) -> tuple[int, ...]:
        return (-1, 0)  # MTPState leaves: pages_npc shared (the target's page table), hidden_bd per sequence

    def observe(self, params, state: MTPState, target: K3Model, h_btd, next_ids_bt, start_b, valid_b, page_table_bp):
        mtp = nnx.merge(self.graphdef, params)
        o_btd, pages = mtp.forward_cached(h_btd, target.embed(next_ids_bt), state.pages_npc, page_table_bp,
                                          start_b, valid_b)
        last_bd = jnp.take_along_axis(o_btd, jnp.maximum(valid_b - 1, 0)[:, None, None], axis=1)[:, 0]
        return MTPState(pages, jnp.where((valid_b > 0)[:, None], last_bd.astype(state.hidden_bd.dtype),
                                         state.hidden_bd))

    def propose(self, params, state: MTPState, ctx: DraftContext) -> tuple[Proposal, MTPState]:
        mtp = nnx.merge(self.graphdef, params)
        target, b = ctx.target, ctx.last_b.shape[0]
        keys_kb = jax.vmap(lambda key: jax.random.split(key, self.num_tokens), out_axes=1)(ctx.keys_b)
        h_bd, pages = state.hidden_bd, state.pages_npc
        tokens, probs = [], []
        for j in range(self.num_tokens):
            if j > 0:  # chain: MTP at position lengths + j - 1 from its own previous output and the last draft
                o_b1d, pages = mtp.forward_cached(h_bd[:, None], target.embed(tokens[-1][:, None]), pages,
                                                  ctx.page_table_bp, ctx.lengths_b + j - 1, jnp.ones((b,), jnp.int32))
                h_bd = o_b1d[:, 0]
            logits_bv = target.logits(h_bd[:, None])[:, 0]
            tok, p = _draw(logits_bv, keys_kb[j], ctx)
            tokens.append(tok)
            probs.append(p)
        proposal = Proposal(jnp.stack(tokens, 1), None if ctx.greedy_only else jnp.stack(probs, 1))
        return proposal, MTPState(pages, state.hidden_bd)


def _draw(logits_bv, keys_b, ctx: DraftContext):
    """A token per row from the filtered distribution (greedy rows: argmax, one-hot) and that distribution."""
    greedy_b = sampling_lib.greedy(logits_bv)
    if ctx.greedy_only:
        return greedy_b, None
    temperature_b = ctx.sp[0]
    filtered = sampling_lib.filter_logits(logits_bv, *ctx.sp)
    drawn = jax.vmap(jax.random.categorical)(keys_b, filtered).astype(jnp.int32)
    tok = jnp.where(temperature_b > 0, drawn, greedy_b)
    probs = jnp.where((temperature_b > 0)[:, None], jax.nn.softmax(filtered, axis=-1),
                      jax.nn.one_hot(greedy_b, logits_bv.shape[-1], dtype=jnp.float32))
    return tok, probs


def _check_k(k: int) -> int:
    if int(k) != k or k < 1:
        raise ValueError(f"num_tokens (drafted tokens per step) must be an integer >= 1, got {k}")
    return int(k)
