"""K3Model: embedding → decoder layers (repeating units scanned) → final AttnRes → norm → lm_head.

The residual stream is a carry `(h_btd, bank_nbtd)`: with Block AttnRes (K3) the bank holds the block snapshots
(fixed size, rows filled as layers run); with plain residuals (Kimi-Linear) the bank is an empty [0, B, T, D] array.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import LayerGroup, ModelConfig
from k3jax.layers import params
from k3jax.layers.attn_res import AttnResRead, push_snapshot, read_normed, snapshots_before
from k3jax.layers.grad_order import tie_gradients
from k3jax.layers.kda import KDA, KDAState, init_kda_state
from k3jax.layers.mla import DEFAULT_PAGE_SIZE, MLA, contiguous_page_table, init_latent_pages, pages_per_sequence
from k3jax.layers.mlp import GatedMLP
from k3jax.layers.moe import LatentMoE
from k3jax.layers.norms import RMSNorm
from k3jax.ops.head_loss import chunked_head_cross_entropy, head_cross_entropy
from k3jax.ops.linear import project_wide, unless_single_row
from sharding.constraints import ACT_BTD, ACT_BTV, ACT_NBTD, constrain

Carry = tuple[jax.Array, jax.Array]  # (h_btd, bank_nbtd)


NO_PAGE = -1  # page-table entry of a page not allocated


class DecodeCache(NamedTuple):
    """Every layer's incremental state, the MLA page table and the number of tokens each sequence has consumed.

    `layers[g][j]` is the state of layer j of group g's unit: a `KDAState` (per sequence, batch axis 0) for KDA
    layers, the latent page pool [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] for MLA layers (shared
    by all sequences). Scanned groups hold their states stacked with a leading [num_repeats] axis, like their
    parameters. `page_table` int32[B, P]: page j of sequence b (positions j*page_size ..) is pool page
    page_table[b, j] in EVERY MLA layer's pool (NO_PAGE: none). `lengths` int32[B]: tokens already in the cache
    (the position of each sequence's next token). AttnRes needs no entry: it mixes depth per token.
    """

    layers: tuple
    page_table: jax.Array
    lengths: jax.Array

    def _pool(self):
        for group in self.layers:
            for state in group:
                if not isinstance(state, KDAState):
                    return state
        return None

    @property
    def page_size(self) -> int:
        pool = self._pool()
        return -1 if pool is None else pool.shape[-2]

    @property
    def num_pages(self) -> int:
        pool = self._pool()
        return -1 if pool is None else pool.shape[-3]

    @property
    def max_len(self) -> int:
        """Positions the page table can address; -1: no MLA layer (the cache has no length limit)."""
        pool = self._pool()
        return -1 if pool is None else self.page_table.shape[1] * pool.shape[-2]


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, *, page_size: int | None = None,
               num_pages: int | None = None) -> DecodeCache:
    """An empty `DecodeCache` for `batch_size` sequences of up to `max_len` tokens (prompt + generated).

    MLA latents live in pages of `page_size` tokens (default min(64, max_len)); the page table has
    ceil(max_len / page_size) entries per sequence. `num_pages` None: batch_size * that many pages with sequence b
    owning its own consecutive pages (a plain batch: `Engine`, tests); an int: a pool of that many pages and every
    table entry NO_PAGE, for a scheduler to allocate (`k3jax.inference.scheduler`).
    """
    page_size = page_size or min(DEFAULT_PAGE_SIZE, max_len)
    per_seq = pages_per_sequence(max_len, page_size)
    if num_pages is None:
        num_pages, table = batch_size * per_seq, contiguous_page_table(batch_size, per_seq)
    else:
        table = jnp.full((batch_size, per_seq), NO_PAGE, jnp.int32)
    layers = []
    for group in cfg.layer_groups():
        unit = tuple(init_kda_state(cfg, batch_size) if attn == "kda" else init_latent_pages(cfg, num_pages, page_size)
                     for attn, _ in group.pattern)
        if group.num_repeats > 1:
            unit = jax.tree.map(lambda x: jnp.broadcast_to(x, (group.num_repeats,) + x.shape), unit)
        layers.append(unit)
    return DecodeCache(tuple(layers), table, jnp.zeros((batch_size,), jnp.int32))


class AttnResBlocks(NamedTuple):
    """The AttnRes block outputs of a forward: block n (1-based) is the sum of the outputs of its layers
    ((n-1)*block .. n*block - 1). Blocks 1 .. N-1 are bank rows 1 .. N-1 (row 0 holds the embedding), the last
    block N = `num_attn_res_snapshots` is the live partial sum after the last layer (before the output read)."""

    bank_nbtd: jax.Array
    last_btd: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.bank_nbtd.shape[0]

    def block(self, n: int) -> jax.Array:
        """Block n's output [B, T, D] (1 <= n <= num_blocks; -1: the last)."""
        n = self.num_blocks if n == -1 else n
        if not 1 <= n <= self.num_blocks:
            raise ValueError(f"AttnRes block {n} does not exist: blocks are 1..{self.num_blocks} (-1: the last)")
        return self.last_btd if n == self.num_blocks else self.bank_nbtd[n]


class DecoderLayer(nnx.Module):
    """One layer: attention (KDA or MLA) and FFN (dense or MoE), with AttnRes reads or plain residuals."""

    def __init__(self, cfg: ModelConfig, attn: str, ffn: str, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.runtime.jnp_param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.self_attn = KDA(cfg, rngs=rngs) if attn == "kda" else MLA(cfg, rngs=rngs)
        self.mlp = GatedMLP(cfg, cfg.intermediate_size, rngs=rngs) if ffn == "dense" else LatentMoE(cfg, rngs=rngs)
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResRead(cfg)
            self.mlp_res = AttnResRead(cfg)

    def __call__(self, carry: Carry, layer_index, segment_ids_bt: jax.Array | None = None, *,
                 snapshot: bool | None = None) -> Carry:
        """Training forward; `segment_ids_bt` (packed documents) only matters to the attention (KDA/MLA).
        `snapshot`: whether this layer starts an AttnRes block, when known statically for a traced `layer_index`
        (a scanned unit whose length the block size divides): the bank is then written only where it changes."""
        if segment_ids_bt is None:
            return self._run(carry, layer_index, self.self_attn, snapshot)
        return self._run(carry, layer_index, lambda x: self.self_attn(x, segment_ids_bt), snapshot)

    def forward_cached(self, carry: Carry, layer_index, state, start_b, valid_b, page_table_bp):
        """The layer over new tokens with its attention state (see `K3Model.forward_cached`)."""
        out = {}

        def attn(x):
            if isinstance(self.self_attn, KDA):
                y, out["state"] = self.self_attn.forward_cached(x, state, valid_b)
            else:
                y, out["state"] = self.self_attn.forward_cached(x, state, page_table_bp, start_b, valid_b)
            return y

        carry = self._run(carry, layer_index, attn)
        return carry, out["state"]

    def _run(self, carry: Carry, layer_index, attn, snapshot: bool | None = None) -> Carry:
        h, bank = carry
        if not self.cfg.uses_attn_res:
            h = h + attn(self.input_layernorm(h)).astype(h.dtype)
            h = h + self.mlp(self.post_attention_layernorm(h)).astype(h.dtype)
            return constrain(h, ACT_BTD), bank
        block = self.cfg.attn_res_block_size
        filled = snapshots_before(layer_index, block)
        x = read_normed(self.self_attention_res, h, bank, filled, self.input_layernorm, self.cfg)
        is_snapshot = layer_index % block == 0 if snapshot is None else snapshot
        bank = push_snapshot(bank, filled, h, is_snapshot)  # snapshot BEFORE this layer's attention
        partial = jnp.where(is_snapshot, jnp.zeros_like(h), h)
        partial = partial + attn(x).astype(h.dtype)
        x = read_normed(self.mlp_res, partial, bank, filled + is_snapshot, self.post_attention_layernorm, self.cfg)
        partial = partial + self.mlp(x).astype(h.dtype)
        return constrain(partial, ACT_BTD), constrain(bank, ACT_NBTD)


class DecoderUnit(nnx.Module):
    """The repeating unit (e.g. KDA, KDA, KDA, MLA) that a LayerGroup scans over."""

    def __init__(self, cfg: ModelConfig, pattern, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, attn, ffn, rngs=rngs) for attn, ffn in pattern])
        self.remat_layers = cfg.runtime.remat and cfg.runtime.remat_policy == "layer"
        self.tie_layer_gradients = cfg.runtime.tie_layer_gradients

    def __call__(self, carry: Carry, first_layer_index, segment_ids_bt: jax.Array | None = None,
                 phase: int | None = None) -> Carry:
        """`phase`: `first_layer_index % attn_res_block_size` when static although the index is traced."""
        block = self.layers[0].cfg.attn_res_block_size
        for j, layer in enumerate(self.layers):
            snapshot = None if phase is None or not block else (phase + j) % block == 0

            def run(layer, carry, segment_ids_bt, index=first_layer_index + j, snapshot=snapshot):
                if not self.tie_layer_gradients:
                    return layer(carry, index, segment_ids_bt, snapshot=snapshot)
                # this layer's weight gradients before its input gradient (k3jax/layers/grad_order.py)
                graphdef, weights, rest = nnx.split(layer, nnx.Param, ...)
                carry, weights = tie_gradients((carry, weights))
                tied = nnx.merge(graphdef, weights, rest, copy=True)
                carry = tied(carry, index, segment_ids_bt, snapshot=snapshot)
                nnx.update(layer, nnx.state(tied, params.RoutingStats))
                return carry

            carry = (nnx.remat(run) if self.remat_layers else run)(layer, carry, segment_ids_bt)
        return carry

    def forward_cached(self, carry: Carry, first_layer_index, states, start_b, valid_b, page_table_bp):
        new_states = []
        for j, layer in enumerate(self.layers):
            carry, st = layer.forward_cached(carry, first_layer_index + j, states[j], start_b, valid_b,
                                             page_table_bp)
            new_states.append(st)
        return carry, tuple(new_states)


class ScannedUnits(nnx.Module):
    """`group.num_repeats` stacked copies of a DecoderUnit (parameters get a leading 'layers' axis), run by scan."""

    def __init__(self, cfg: ModelConfig, group: LayerGroup, *, rngs: nnx.Rngs):
        self.group = group
        self.block_size = cfg.attn_res_block_size
        self.remat = cfg.runtime.remat
        # "dots": the unit's backward reuses the forward's matmul outputs instead of recomputing them
        self.remat_policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                             if cfg.runtime.remat_policy == "dots" else None)

        @nnx.split_rngs(splits=group.num_repeats)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return DecoderUnit(cfg, group.pattern, rngs=rngs)

        self.units = make(rngs)

    def __call__(self, carry: Carry, segment_ids_bt: jax.Array | None = None) -> Carry:
        """Scans the units; `segment_ids_bt` (or None) is broadcast to every unit, not carried."""
        unit_len = len(self.group.pattern)
        starts = self.group.start + unit_len * jnp.arange(self.group.num_repeats, dtype=jnp.int32)
        # every unit starts at the same offset into an AttnRes block when the block size divides the unit length
        phase = (self.group.start % self.block_size if self.block_size and unit_len % self.block_size == 0
                 else None)

        # A plain scan over the split state, returning only what the forward writes (the routing statistics).
        # `nnx.scan` returns the module's whole stacked state, so every parameter was copied out of the loop per
        # forward: ~13.6 GB per chip for k3 on v5p-1024, a third of the scan's temporaries (benchmarks/RESULTS.md,
        # 2026-12-04).
        graphdef, weights, stats = nnx.split(self.units, nnx.Not(params.RoutingStats), params.RoutingStats)

        def run_unit(unit_weights, unit_stats, start, carry, segment_ids_bt):
            # a copy: the bank rebuild's backward merges the unit inside jax.vjp, where the layers' own remat
            # regions write routing statistics (without a copy flax raises TraceContextError)
            unit = nnx.merge(graphdef, unit_weights, unit_stats, copy=True)
            carry = unit(carry, start, segment_ids_bt, phase)
            return carry, nnx.state(unit, params.RoutingStats)

        if self.remat and self.remat_policy is None and carry[1].shape[0] > 0:
            carry, new_stats = scan_units_rebuilding_bank(run_unit, self.block_size, weights, stats, starts, carry,
                                                          segment_ids_bt)
        else:
            def body(carry, xs):
                unit_weights, unit_stats, start = xs
                return run_unit(unit_weights, unit_stats, start, carry, segment_ids_bt)

            if self.remat:
                body = jax.checkpoint(body, policy=self.remat_policy)
            carry, new_stats = jax.lax.scan(body, carry, (weights, stats, starts))
        nnx.update(self.units, new_stats)
        return carry

    def forward_cached(self, carry: Carry, states, start_b, valid_b, page_table_bp):
        """Scans the units with their stacked states as scanned input and the updated states as scanned output."""
        unit_len = len(self.group.pattern)
        starts = self.group.start + unit_len * jnp.arange(self.group.num_repeats, dtype=jnp.int32)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(carry, unit, start, unit_states):
            return unit.forward_cached(carry, start, unit_states, start_b, valid_b, page_table_bp)

        return run(carry, self.units, starts, states)


def scan_units_rebuilding_bank(run_unit, block_size: int, weights, stats, starts_u: jax.Array, carry: Carry,
                               segment_ids_bt: jax.Array | None) -> tuple[Carry, object]:
    """The scan of `ScannedUnits` under full rematerialisation, differentiated without saving the AttnRes bank
    per unit.

    `run_unit(unit_weights, unit_stats, start, carry, segment_ids_bt) -> (carry, new_stats)` is one unit. A
    rematerialised scan saves each unit's input carry for its backward: the residual stream h [B, T, D] and the
    bank [N, B, T, D], N times larger, although a unit adds at most one bank row (K3: [22, 8, 1, 4096, 7168] bf16,
    10.3 GB per chip at 4,096 tokens per chip). A bank row is written once, at its block's first layer, and never
    changed, so the bank a unit started from is the scan's output bank with the rows it had not yet filled taken
    from the scan's input bank. This custom VJP saves h per unit and the two banks once, rebuilds each unit's input
    bank in the backward scan, and recomputes the unit there (its own layer checkpoints apply): the gradients are
    those of the rematerialised scan."""

    def forward(weights, stats, starts_u, carry, segment_ids_bt):
        def body(carry, xs):
            unit_weights, unit_stats, start = xs
            new_carry, new_stats = run_unit(unit_weights, unit_stats, start, carry, segment_ids_bt)
            return new_carry, (new_stats, carry[0])

        carry_out, (new_stats, h_in_ubtd) = jax.lax.scan(body, carry, (weights, stats, starts_u))
        return carry_out, new_stats, h_in_ubtd

    @jax.custom_vjp
    def scan(weights, stats, starts_u, carry, segment_ids_bt):
        carry_out, new_stats, _ = forward(weights, stats, starts_u, carry, segment_ids_bt)
        return carry_out, new_stats

    def scan_fwd(weights, stats, starts_u, carry, segment_ids_bt):
        carry_out, new_stats, h_in_ubtd = forward(weights, stats, starts_u, carry, segment_ids_bt)
        saved = (weights, stats, starts_u, h_in_ubtd, carry[1], carry_out[1], segment_ids_bt)
        return (carry_out, new_stats), saved

    def scan_bwd(saved, cotangents):
        weights, stats, starts_u, h_in_ubtd, bank_in_nbtd, bank_out_nbtd, segment_ids_bt = saved
        (dh_btd, dbank_nbtd), _ = cotangents
        rows_n = jnp.arange(bank_in_nbtd.shape[0], dtype=jnp.int32)

        def body(dcarry, xs):
            unit_weights, unit_stats, start, h_btd = xs
            filled = rows_n[:, None, None, None] < snapshots_before(start, block_size)
            bank_nbtd = constrain(jnp.where(filled, bank_out_nbtd, bank_in_nbtd), ACT_NBTD)
            _, vjp = jax.vjp(lambda w, c: run_unit(w, unit_stats, start, c, segment_ids_bt)[0], unit_weights,
                             (h_btd, bank_nbtd))
            dweights, dcarry_in = vjp(dcarry)
            return dcarry_in, dweights

        dcarry, dweights = jax.lax.scan(body, (dh_btd, dbank_nbtd), (weights, stats, starts_u, h_in_ubtd),
                                        reverse=True)
        none = lambda tree: jax.tree.map(lambda _: None, tree)  # noqa: E731
        return dweights, none(stats), None, dcarry, none(segment_ids_bt)

    scan.defvjp(scan_fwd, scan_bwd)
    return scan(weights, stats, starts_u, carry, segment_ids_bt)


class K3Model(nnx.Module):
    """The K3 text backbone: `model(input_ids int32[B, T], segment_ids int32[B, T] | None) -> logits f32[B, T, V]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.runtime.jnp_param_dtype
        self.embed_tokens = params.normal(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd, std=1.0)
        groups = []
        for group in cfg.layer_groups():
            if group.num_repeats == 1:
                groups.append(DecoderUnit(cfg, group.pattern, rngs=rngs))
            else:
                groups.append(ScannedUnits(cfg, group, rngs=rngs))
        self.groups = nnx.List(groups)
        self.group_starts = tuple(g.start for g in cfg.layer_groups())
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResRead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = params.normal(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)

    def embed(self, input_ids_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], input_ids_bt, axis=0).astype(self.cfg.runtime.jnp_dtype)

    def hidden_states(self, input_ids_bt: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Final normed hidden states [B, T, D] (before the head).

        `segment_ids_bt` int [B, T] (optional) packs several documents into each row: equal ids form one document
        and must be contiguous (e.g. non-decreasing; a padding run of 0s is its own document). Each document is
        then computed as if alone: KDA state and short conv restart and MLA attends within the document only
        (AttnRes and the FFNs are per token). None: one document per row, at no extra cost.
        """
        return self.hidden_states_from_embeddings(self.embed(input_ids_bt), segment_ids_bt)

    def hidden_states_from_embeddings(self, embeds_btd: jax.Array,
                                      segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """`hidden_states` from input embeddings [B, T, D] instead of ids (multimodal: image tokens merged in)."""
        return self._final(*self._stack(embeds_btd, segment_ids_bt))

    def _stack(self, embeds_btd: jax.Array, segment_ids_bt: jax.Array | None) -> Carry:
        """The decoder stack over input embeddings: the final carry (h_btd, bank_nbtd)."""
        cfg = self.cfg
        h = jnp.asarray(embeds_btd).astype(cfg.runtime.jnp_dtype)
        b, t, d = h.shape
        if segment_ids_bt is not None:
            segment_ids_bt = jnp.asarray(segment_ids_bt)
            if segment_ids_bt.shape != (b, t) or not jnp.issubdtype(segment_ids_bt.dtype, jnp.integer):
                raise ValueError(f"segment_ids must be an integer array of shape [B, T] = {(b, t)} like input_ids, "
                                 f"got {segment_ids_bt.dtype}{list(segment_ids_bt.shape)}")
        h = constrain(h, ACT_BTD)
        bank = constrain(jnp.zeros((cfg.num_attn_res_snapshots, b, t, d), h.dtype), ACT_NBTD)
        carry = (h, bank)
        for start, group in zip(self.group_starts, self.groups):
            if isinstance(group, ScannedUnits):
                carry = group(carry, segment_ids_bt)
            else:
                carry = group(carry, start, segment_ids_bt)
        return carry

    def _final(self, h_btd: jax.Array, bank_nbtd: jax.Array) -> jax.Array:
        """The final AttnRes read (K3) and norm of the stack's output carry."""
        cfg = self.cfg
        if cfg.uses_attn_res:
            return read_normed(self.output_attn_res, h_btd, bank_nbtd, cfg.num_attn_res_snapshots, self.norm, cfg)
        return self.norm(h_btd)

    def hidden_states_and_blocks(self, input_ids_bt: jax.Array, segment_ids_bt: jax.Array | None = None
                                 ) -> tuple[jax.Array, AttnResBlocks]:
        """`hidden_states` and the AttnRes block outputs it computed on the way (the EAGLE-3 draft's features);
        the same arrays, nothing recomputed."""
        h, bank = self._stack(self.embed(input_ids_bt), segment_ids_bt)
        return self._final(h, bank), AttnResBlocks(bank, h)

    def init_cache(self, batch_size: int, max_len: int, **paging) -> DecodeCache:
        return init_cache(self.cfg, batch_size, max_len, **paging)

    def hidden_states_cached(self, input_ids_bt: jax.Array, cache: DecodeCache,
                             valid_len_b: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
        """`hidden_states` for T new tokens per sequence continuing `cache` (see `forward_cached`)."""
        return self.hidden_states_cached_from_embeddings(self.embed(input_ids_bt), cache, valid_len_b)

    def hidden_states_cached_from_embeddings(self, embeds_btd: jax.Array, cache: DecodeCache,
                                             valid_len_b: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
        """`hidden_states_cached` from input embeddings [B, T, D] instead of ids."""
        (h, bank), cache = self._stack_cached(embeds_btd, cache, valid_len_b)
        return self._final(h, bank), cache

    def hidden_states_cached_and_blocks(self, input_ids_bt: jax.Array, cache: DecodeCache,
                                        valid_len_b: jax.Array | None = None
                                        ) -> tuple[jax.Array, DecodeCache, AttnResBlocks]:
        """`hidden_states_cached` and the AttnRes block outputs of the new tokens (see `hidden_states_and_blocks`)."""
        return self.hidden_states_cached_and_blocks_from_embeddings(self.embed(input_ids_bt), cache, valid_len_b)

    def hidden_states_cached_and_blocks_from_embeddings(self, embeds_btd: jax.Array, cache: DecodeCache,
                                                        valid_len_b: jax.Array | None = None
                                                        ) -> tuple[jax.Array, DecodeCache, AttnResBlocks]:
        """`hidden_states_cached_and_blocks` from input embeddings [B, T, D] instead of ids."""
        (h, bank), cache = self._stack_cached(embeds_btd, cache, valid_len_b)
        return self._final(h, bank), cache, AttnResBlocks(bank, h)

    def _stack_cached(self, embeds_btd: jax.Array, cache: DecodeCache,
                      valid_len_b: jax.Array | None) -> tuple[Carry, DecodeCache]:
        """The decoder stack over new tokens continuing `cache`: (final carry, new cache)."""
        cfg = self.cfg
        h = jnp.asarray(embeds_btd).astype(cfg.runtime.jnp_dtype)
        b, t, d = h.shape
        if valid_len_b is None:
            valid_len_b = jnp.full((b,), t, jnp.int32)
        valid_len_b = jnp.clip(jnp.asarray(valid_len_b, jnp.int32), 0, t)
        start_b = cache.lengths
        bank = jnp.zeros((cfg.num_attn_res_snapshots, b, t, d), h.dtype)
        carry = (h, bank)
        new_layers = []
        for start, group, states in zip(self.group_starts, self.groups, cache.layers):
            if isinstance(group, ScannedUnits):
                carry, states = group.forward_cached(carry, states, start_b, valid_len_b, cache.page_table)
            else:
                carry, states = group.forward_cached(carry, start, states, start_b, valid_len_b, cache.page_table)
            new_layers.append(states)
        return carry, DecodeCache(tuple(new_layers), cache.page_table, start_b + valid_len_b)

    def forward_cached(self, input_ids_bt: jax.Array, cache: DecodeCache,
                       valid_len_b: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
        """Incremental forward: `(logits [B, T, V], new_cache)` for T new tokens per sequence.

        Token t of sequence b is at position `cache.lengths[b] + t`. Only its first `valid_len_b[b]` tokens are
        real (right padding; default all T): padded tokens leave every cache untouched (KDA: β = g = 0 and conv
        history at the true end; MLA: their latent rows are not written), and `lengths` advances by `valid_len_b`.
        Logits at padded positions are meaningless. MLA rows are written and read through `cache.page_table`
        (unchanged here: allocating pages is the caller's job); the caller keeps `lengths + T <= max_len` and the
        pages of those positions mapped for valid tokens. Jittable: shapes are static given (B, T, the cache's).
        """
        h, cache = self.hidden_states_cached(input_ids_bt, cache, valid_len_b)
        return self.logits(h), cache

    def head_weight(self) -> jax.Array:
        """The LM head [D, V] in the compute dtype (the embedding transposed when tied)."""
        w_dv = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return w_dv.astype(self.cfg.runtime.jnp_dtype)

    def logits(self, h_btd: jax.Array) -> jax.Array:
        # f32 logits; the backward's matmuls in the compute dtype (`project_wide`)
        w_dv = self.head_weight()
        return constrain(unless_single_row(lambda h: project_wide(h, w_dv), h_btd.astype(w_dv.dtype), 2), ACT_BTV)

    def token_losses(self, h_btd: jax.Array, targets_bt: jax.Array) -> jax.Array:
        """Next-token cross-entropy f32 [B, T] of the head on hidden states `h_btd` (training): the head and the
        loss fused over f32 logits kept for the backward, or in `runtime.loss_vocab_chunks` vocabulary slices without
        a [B, T, V] array (ops/head_loss.py)."""
        chunks = self.cfg.runtime.loss_vocab_chunks
        w_dv = self.head_weight()
        if not chunks:
            return head_cross_entropy(h_btd.astype(w_dv.dtype), w_dv, targets_bt,
                                      constrain=lambda x: constrain(x, ACT_BTV))
        b, t, d = h_btd.shape
        losses_n = chunked_head_cross_entropy(h_btd.astype(w_dv.dtype).reshape(b * t, d), w_dv,
                                              targets_bt.reshape(b * t), chunks=chunks)
        return losses_n.reshape(b, t)

    def __call__(self, input_ids_bt: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Logits f32 [B, T, V]; `segment_ids_bt`: packed documents (see `hidden_states`)."""
        return self.logits(self.hidden_states(input_ids_bt, segment_ids_bt))
