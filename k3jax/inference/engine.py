"""Batched generation: jitted prefill (bucketed prompt lengths) + a jitted decode step that never recompiles.

Caches (`k3jax.model.DecodeCache`): each KDA layer keeps its fixed-size state (conv history + f32 recurrent state),
each MLA layer a pool of latent pages [pages, page_size, kv_lora_rank + rope] (the 576-wide row for K3) read and
written through the cache's page table, plus per-sequence lengths. A one-shot batch needs no allocator: each
sequence owns its own consecutive pages (`init_cache`'s default layout); the continuous-batching `Scheduler`
allocates and shares pages. Prefill uses the chunked KDA core and the expanded MLA form; decode the recurrent KDA
step and the absorbed (MQA-over-latent) MLA form.

Padding: prompts are RIGHT-padded to a power-of-two bucket and prefilled in one call with per-sequence valid
lengths. Padded tokens are exact no-ops for KDA (β = 0 and g = 0 there, conv history taken at each prompt's true end);
their MLA latent rows are not written (and valid queries only look at positions <= their own); AttnRes and the MoE
are per token. So each sequence's state after prefill is the state of that prompt alone.
During decode, finished sequences run with valid length 0: their caches freeze.

On a device mesh (`Engine(model, mesh=make_mesh(data, expert, 1, model))`): parameters by the sharding rules, the
cache and per-sequence fields in the layouts of `k3jax.inference.sharded` (sequences over ('data', 'expert'), KDA
heads over 'model', page pools replicated), the MoE expert-parallel when 'expert' > 1. The batch is padded to a
multiple of data * expert with one-token dummy prompts, so every device gets an equal share.

    engine = Engine(model)
    results = engine.generate([[256, 72, 105], [256, 65]], max_new_tokens=32,
                              sampling=SamplingParams(temperature=0.8, top_p=0.95), eos_id=257,
                              key=jax.random.key(0))
    results[0].tokens, results[0].finish_reason     # generated ids (EOS excluded), "stop" | "length"
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.inference import sampling as sampling_lib
from k3jax.inference import sharded
from k3jax.model import DecodeCache, K3Model, init_cache

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k <= 0 and top_p >= 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> "SamplingParams":
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be an integer, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated ids, EOS excluded
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached)
    prompt_length: int


class DecodeState(NamedTuple):
    """Per-sequence decode bookkeeping, all on device."""

    last_b: jax.Array  # int32[B]: the token to feed next
    done_b: jax.Array  # bool[B]
    num_generated_b: jax.Array  # int32[B]
    out_bn: jax.Array  # int32[B, N]: generated tokens (pad after the end)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


class Engine:
    """Holds the model's split state and the jitted prefill / decode functions (one compile per shape bucket).

    `trace_counts["prefill"|"decode"|"forward_cached"]` counts traces (= compilations) of each function (tests, logs).
    `max_len`: fixed cache capacity (tokens per sequence, prompt + generated); None sizes it per call to a power of
    two >= the longest prompt + max_new_tokens.
    `mesh`: a `sharding.mesh.make_mesh` mesh with context == 1 (see `k3jax.inference.sharded`): the parameters are
    placed on it by the rules (a copy unless the model was loaded onto it, `k3jax.load_hf(..., mesh=mesh)`), caches
    are created sharded, and prefill / decode run under it with their outputs pinned to the same layouts.
    """

    def __init__(self, model: K3Model, *, max_len: int | None = None, steps_per_sync: int = 8, mesh=None):
        self.cfg = model.cfg
        self.mesh = None if mesh is None else sharded.check_mesh(mesh)
        self.graphdef, self.params = nnx.split(model)
        if self.mesh is not None:
            self.params = sharded.place_params(self.params, self.mesh)
        self.max_len = max_len
        self.steps_per_sync = steps_per_sync
        self.trace_counts: collections.Counter = collections.Counter()
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("greedy_only", "out_len"))
        self._decode = jax.jit(self._decode_impl, static_argnames=("greedy_only",), donate_argnums=(1, 2))
        self._forward = jax.jit(self._forward_impl)

    # ------------------------------------------------------------------ jitted pieces

    def _model(self, params) -> K3Model:
        return nnx.merge(self.graphdef, params)

    def _sample(self, logits_bv, keys_b, count_b, sp, greedy_only):
        if greedy_only:
            return sampling_lib.greedy(logits_bv)
        step_keys = jax.vmap(jax.random.fold_in)(keys_b, count_b)
        return sampling_lib.sample(logits_bv, step_keys, *sp)

    def _prefill_impl(self, params, ids_bt, lengths_b, cache, keys_b, sp, max_new_b, eos_e, *, greedy_only, out_len):
        self.trace_counts["prefill"] += 1
        model = self._model(params)
        h_btd, cache = model.hidden_states_cached(ids_bt, cache, lengths_b)
        last = jnp.take_along_axis(h_btd, jnp.maximum(lengths_b - 1, 0)[:, None, None], axis=1)  # [B,1,D]
        logits_bv = model.logits(last)[:, 0]
        b = ids_bt.shape[0]
        tok = self._sample(logits_bv, keys_b, jnp.zeros((b,), jnp.int32), sp, greedy_only)
        out = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(tok)
        done = jnp.isin(tok, eos_e) | (max_new_b <= 1)
        state = DecodeState(tok, done, jnp.ones((b,), jnp.int32), out)
        return (sharded.constrain_batch(state, self.mesh), sharded.constrain_cache(cache, self.mesh),
                sharded.constrain_logits(logits_bv, self.mesh))

    def _decode_impl(self, params, cache: DecodeCache, state: DecodeState, keys_b, sp, max_new_b, eos_e, *,
                     greedy_only):
        self.trace_counts["decode"] += 1
        model = self._model(params)
        active = ~state.done_b
        logits, cache = model.forward_cached(state.last_b[:, None], cache, active.astype(jnp.int32))
        tok = self._sample(logits[:, 0], keys_b, state.num_generated_b, sp, greedy_only)
        n = state.out_bn.shape[1]
        b = tok.shape[0]
        col = jnp.where(active, state.num_generated_b, n)  # inactive rows write out of bounds: dropped
        out = state.out_bn.at[jnp.arange(b), col].set(tok, mode="drop")
        count = state.num_generated_b + active.astype(jnp.int32)
        done = state.done_b | (active & jnp.isin(tok, eos_e)) | (count >= max_new_b)
        last = jnp.where(active, tok, state.last_b)
        return (sharded.constrain_cache(cache, self.mesh),
                sharded.constrain_batch(DecodeState(last, done, count, out), self.mesh))

    def _forward_impl(self, params, ids_bt, cache, valid_len_b):
        self.trace_counts["forward_cached"] += 1
        logits_btv, cache = self._model(params).forward_cached(ids_bt, cache, valid_len_b)
        return sharded.constrain_logits(logits_btv, self.mesh), sharded.constrain_cache(cache, self.mesh)

    # ------------------------------------------------------------------ API

    def init_cache(self, batch_size: int, max_len: int, **paging) -> DecodeCache:
        """An empty cache (`k3jax.model.init_cache`), created in its mesh layout when the engine has a mesh."""
        if self.mesh is None:
            return init_cache(self.cfg, batch_size, max_len, **paging)
        return sharded.init_cache_on(self.cfg, self.mesh, batch_size, max_len, **paging)

    def forward_cached(self, ids_bt, cache: DecodeCache, valid_len_b=None) -> tuple[jax.Array, DecodeCache]:
        """`K3Model.forward_cached` jitted (on the engine's mesh when it has one): (logits [B, T, V], new cache).
        For scoring and teacher forcing; `cache` from `init_cache` (not donated)."""
        ids_bt = jnp.asarray(ids_bt, jnp.int32)
        b, t = ids_bt.shape
        valid = jnp.full((b,), t, jnp.int32) if valid_len_b is None else jnp.asarray(valid_len_b, jnp.int32)
        ids_bt, valid = sharded.put_batch((ids_bt, valid), self.mesh)
        with sharded.context(self.mesh):
            return self._forward(self.params, ids_bt, cache, valid)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 eos_id: int | Sequence[int] | None = None, key: jax.Array | None = None,
                 pad_id: int | None = None) -> list[GenerationResult]:
        """Generates for a batch of token-id prompts (different lengths allowed).

        `max_new_tokens` and `sampling`: one for all or one per prompt. `eos_id`: id(s) that end a sequence (None:
        the config's eos_token_id). `key`: PRNG key (required unless every sequence is greedy); sequence i draws
        from fold_in(fold_in(key, i), token_index), so its samples do not depend on the rest of the batch.
        """
        if not prompts:
            return []
        p = self._prepare(prompts, max_new_tokens, sampling, eos_id, key, pad_id)
        cache = self.init_cache(p.batch_size, p.max_len)
        with sharded.context(self.mesh):
            state, cache, _ = self._prefill(self.params, p.ids_bt, p.lens_b, cache, p.keys_b, p.sp, p.max_new_b,
                                            p.eos_e, greedy_only=p.greedy_only, out_len=p.out_len)
            for i in range(max(p.max_new) - 1):
                cache, state = self._decode(self.params, cache, state, p.keys_b, p.sp, p.max_new_b, p.eos_e,
                                            greedy_only=p.greedy_only)
                if (i + 1) % self.steps_per_sync == 0 and bool(jnp.all(state.done_b)):
                    break
        return p.results(state)

    def _prepare(self, prompts, max_new_tokens, sampling, eos_id, key, pad_id, extra_positions: int = 0
                 ) -> "PreparedBatch":
        """Checks `generate`'s arguments and builds its device inputs. `extra_positions`: cache positions needed
        past the last generated token (speculative verification writes that many drafted tokens beyond it)."""
        cfg = self.cfg
        prompts = [list(map(int, p)) for p in prompts]
        b = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for p in prompts:
            if min(p) < 0 or max(p) >= cfg.vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        max_new = _per_seq(max_new_tokens, b, "max_new_tokens")
        if any(int(m) < 1 for m in max_new):
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sps = [s.validate() for s in _per_seq(sampling, b, "sampling")]
        greedy_only = all(s.temperature == 0 for s in sps)
        if key is None:
            if not greedy_only:
                raise ValueError("sampling with temperature > 0 needs an explicit PRNG key")
            key = jax.random.key(0)
        if isinstance(key, (list, tuple)):  # one key per sequence
            if len(key) != b:
                raise ValueError(f"key: got {len(key)} keys for {b} prompts")
            keys = jnp.stack([_typed_key(k) for k in key])
        else:
            key = _typed_key(key)
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b, dtype=jnp.uint32))
        eos = [cfg.eos_token_id] if eos_id is None else ([eos_id] if np.isscalar(eos_id) else list(eos_id))
        pad = cfg.pad_token_id if pad_id is None else pad_id
        pad = 0 if pad is None else int(pad)

        extra = sharded.round_up_batch(b, self.mesh) - b
        if extra:  # on a mesh: a batch every device gets an equal share of, padded with one-token greedy dummies
            keys = keys[np.concatenate([np.arange(b), np.zeros(extra, np.int64)])]
            prompts, max_new, sps = prompts + [[pad]] * extra, max_new + [1] * extra, sps + [SamplingParams()] * extra
        lens = np.array([len(p) for p in prompts], np.int32)
        need = int(max(lens + np.asarray(max_new))) + extra_positions  # last position written + 1
        max_len = self.max_len or bucket(need, MIN_CACHE_BUCKET)
        if need - 1 > max_len:
            what = "prompt + max_new_tokens" + (f" + {extra_positions} drafted" if extra_positions else "")
            raise ValueError(f"{what} ({need}) exceeds the cache capacity max_len={max_len}")
        t = min(bucket(int(lens.max()), MIN_PROMPT_BUCKET), max(max_len, int(lens.max())))
        ids = np.full((len(prompts), t), pad, np.int32)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p

        sp = (jnp.asarray([s.temperature for s in sps], jnp.float32), jnp.asarray([s.top_k for s in sps], jnp.int32),
              jnp.asarray([s.top_p for s in sps], jnp.float32))
        max_new_b = jnp.asarray(max_new, jnp.int32)
        eos_e = jnp.asarray(eos, jnp.int32)
        ids_b, lens_b, keys, sp, max_new_b = sharded.put_batch(
            (jnp.asarray(ids), jnp.asarray(lens), keys, sp, max_new_b), self.mesh)
        if self.mesh is not None:
            eos_e = jax.device_put(eos_e, sharded.replicated(self.mesh))
        return PreparedBatch(b, len(prompts), lens, max_new, eos, max_len, greedy_only, bucket(max(max_new), 16),
                             ids_b, lens_b, keys, sp, max_new_b, eos_e)


class PreparedBatch(NamedTuple):
    """`Engine.generate`'s checked inputs: host values, then the device arrays its jitted steps take."""

    num_prompts: int  # the caller's prompts (the batch may carry mesh padding after them)
    batch_size: int
    lens: np.ndarray
    max_new: list
    eos: list
    max_len: int
    greedy_only: bool
    out_len: int
    ids_bt: jax.Array
    lens_b: jax.Array
    keys_b: jax.Array
    sp: tuple
    max_new_b: jax.Array
    eos_e: jax.Array

    def results(self, state: DecodeState) -> list[GenerationResult]:
        """One `GenerationResult` per prompt from the final decode state (EOS stripped)."""
        out = np.asarray(state.out_bn)
        counts = np.asarray(state.num_generated_b)
        results = []
        for i in range(self.num_prompts):
            toks = out[i, :counts[i]].tolist()
            if toks and toks[-1] in self.eos:
                results.append(GenerationResult(toks[:-1], "stop", int(self.lens[i])))
            else:
                results.append(GenerationResult(toks, "length", int(self.lens[i])))
        return results


def _typed_key(key) -> jax.Array:
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))


def _per_seq(value, b: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(f"{name}: got {len(value)} values for {b} prompts")
        return list(value)
    return [value] * b


def generate(model: K3Model, prompts: Sequence[Sequence[int]], max_new_tokens, sampling=SamplingParams(),
             eos_id=None, key=None, *, max_len: int | None = None) -> list[GenerationResult]:
    """One-shot `Engine(model).generate(...)` (builds and compiles a fresh engine; keep an Engine to reuse)."""
    return Engine(model, max_len=max_len).generate(prompts, max_new_tokens, sampling, eos_id, key)
