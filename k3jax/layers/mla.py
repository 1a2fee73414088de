"""Gated Multi-head Latent Attention with NoPE (docs/spec.md#mla).

q from a LoRA (or a plain projection for Kimi-Linear); keys/values from a 512-wide normalised latent plus one
64-wide key part `k_r` shared by all heads and never rotated; scale (nope + rope)^-0.5; sigmoid output gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.numerics import upcast, wide
from k3jax.ops.attention import causal_attention, mla_decode_backend, paged_latent_decode, training_attention_impl
from k3jax.ops.linear import project as dense
from k3jax.ops.linear import unless_single_row
from sharding import context_parallel
from sharding.constraints import ACT_BTHK, constrain


def _attention_operand_layout(a_bthk: jax.Array) -> jax.Array:
    """One layout for cuDNN's q, k and v under a GSPMD mesh: its partitioner refuses operands whose shardings differ
    (the padded values came out replicated in a data-parallel step compiled for two GPUs, RESULTS.md 2026-12-05)."""
    return constrain(a_bthk, ACT_BTHK)


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, pd = cfg.hidden_size, cfg.num_attention_heads, cfg.runtime.jnp_param_dtype
        qk, nope, vd = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = params.normal(rngs, (d, h, qk), ("embed", "heads", "head_dim"), pd)
        else:
            self.q_a_proj = params.normal(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), pd)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.mla_lora_norm_eps, param_dtype=pd)
            self.q_b_proj = params.normal(rngs, (cfg.q_lora_rank, h, qk), ("q_lora", "heads", "head_dim"), pd)
        self.kv_a_proj_with_mqa = params.normal(
            rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_a_out"), pd)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.mla_lora_norm_eps, param_dtype=pd)
        self.kv_b_proj = params.normal(rngs, (cfg.kv_lora_rank, h, nope + vd), ("kv_lora", "heads", "head_dim"), pd)
        if cfg.mla_use_output_gate:
            self.g_proj = params.normal(rngs, (d, h, vd), ("embed", "heads", "head_dim"), pd)
        self.o_proj = params.normal(rngs, (h, vd, d), ("heads", "head_dim", "embed"), pd, fan_in=h * vd)

    def _project_inputs(self, x_btd: jax.Array) -> dict[str, jax.Array]:
        """Every projection of the layer input by weight name, in the compute dtype: the query (q_proj, or q_a_proj
        with the q LoRA), the latent (kv_a_proj_with_mqa) and the output gate (g_proj, when K3's)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        names = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj",)
        names += ("kv_a_proj_with_mqa",) + (("g_proj",) if cfg.mla_use_output_gate else ())
        x = x_btd.astype(dt)
        return {n: dense(x, getattr(self, n)[...].astype(dt), cfg) for n in names}

    def latent(self, x_btd: jax.Array) -> jax.Array:
        """The per-token cache row: [kv_a_layernorm(latent) | k_r], width kv_lora_rank + qk_rope_head_dim."""
        dt = self.cfg.runtime.jnp_dtype
        return self._latent_rows(dense(x_btd.astype(dt), self.kv_a_proj_with_mqa[...].astype(dt), self.cfg))

    def _latent_rows(self, c_btc: jax.Array) -> jax.Array:
        """[kv_a_layernorm(latent) | k_r] from the latent projection's output."""
        lat, k_r = c_btc[..., :self.cfg.kv_lora_rank], c_btc[..., self.cfg.kv_lora_rank:]
        # rows in the projection's dtype: an f32 master gain would promote them (f32 kv_b_proj matmuls in training)
        return jnp.concatenate([self.kv_a_layernorm(lat).astype(c_btc.dtype), k_r], axis=-1)

    def _queries(self, proj: dict[str, jax.Array]) -> jax.Array:
        """Per-head queries [B,T,H,qk_head_dim] from the input projections (through the q LoRA when K3's)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        if cfg.q_lora_rank is None:
            return proj["q_proj"]
        # the norm's output in the compute dtype (an f32 master gain would promote it: an f32 (TF32) q_b matmul)
        return dense(self.q_a_layernorm(proj["q_a_proj"]).astype(dt), self.q_b_proj[...].astype(dt), cfg)

    def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Training forward. `segment_ids_bt` int [B, T] (optional, packed documents): causal AND same-id mask.
        Traced under a mesh whose 'context' axis is > 1, attention runs context-parallel
        (`sharding.context_parallel`: the latent rows are all-gathered over 'context' and attended blockwise in
        `mla_flash_block` tiles, zig-zag balanced, whatever `mla_attention_impl` says)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        proj = self._project_inputs(x_btd)
        q_bthk = self._queries(proj)
        cache_btc = self._latent_rows(proj["kv_a_proj_with_mqa"])
        cp_mesh = context_parallel.context_mesh(x_btd.shape[1])
        if cp_mesh is not None:
            o_bthv = context_parallel.mla_attention_context_parallel(
                q_bthk, cache_btc, self.kv_b_proj[...].astype(dt), segment_ids_bt, nope=nope,
                scale=cfg.qk_head_dim ** -0.5, mesh=cp_mesh, block=cfg.runtime.mla_flash_block)  # f32
            return self._output(proj, o_bthv)
        lat, k_r = cache_btc[..., :cfg.kv_lora_rank], cache_btc[..., cfg.kv_lora_rank:]
        kv_bthe = jnp.einsum("btr,rhe->bthe", lat, self.kv_b_proj[...].astype(dt))
        k_nope, v_bthv = kv_bthe[..., :nope], kv_bthe[..., nope:]
        k_rope = jnp.broadcast_to(k_r[:, :, None, :], k_r.shape[:2] + (h, cfg.qk_rope_head_dim))
        k_bthk = jnp.concatenate([k_nope, k_rope], axis=-1)
        o_bthv = causal_attention(q_bthk, k_bthk, v_bthv, scale=cfg.qk_head_dim ** -0.5,
                                  impl=training_attention_impl(cfg.runtime.mla_attention_impl, dt),
                                  segment_ids_bt=segment_ids_bt,
                                  block_q=cfg.runtime.mla_flash_block, block_k=cfg.runtime.mla_flash_block,
                                  max_segments=cfg.runtime.mla_cudnn_max_segments,
                                  operand_layout=_attention_operand_layout)  # f32
        return self._output(proj, o_bthv)

    def _output(self, proj: dict[str, jax.Array], o_bthv: jax.Array) -> jax.Array:
        """Sigmoid output gate (K3; its logits among the input projections) and o_proj on the f32 attention
        output."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        if cfg.mla_use_output_gate:
            o_bthv = o_bthv * jax.nn.sigmoid(upcast(proj["g_proj"]))
        return dense(o_bthv.astype(dt), self.o_proj[...].astype(dt), cfg, contract=2)

    def attention_parts(self, x_btd: jax.Array) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
        """(input projections, queries [B,T,H,qk_head_dim], latent cache rows [B,T,C]) of the layer input: what
        an attention pattern built outside this layer needs (the EAGLE-3 draft's unrolled training,
        `k3jax.eagle3`); `expand_rows` gives keys and values, `gated_output` finishes."""
        proj = self._project_inputs(x_btd)
        return proj, self._queries(proj), self._latent_rows(proj["kv_a_proj_with_mqa"])

    def expand_rows(self, rows_bsc: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head keys [B,S,H,qk_head_dim] and values [B,S,H,v_head_dim] of latent rows (kv_b_proj; the rope
        part k_r shared by every head, never rotated)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        h, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        lat, k_r = rows_bsc[..., :r].astype(dt), rows_bsc[..., r:].astype(dt)
        kv_bshe = jnp.einsum("bsr,rhe->bshe", lat, self.kv_b_proj[...].astype(dt))
        k_rope = jnp.broadcast_to(k_r[:, :, None, :], k_r.shape[:2] + (h, cfg.qk_rope_head_dim))
        return jnp.concatenate([kv_bshe[..., :nope], k_rope], axis=-1), kv_bshe[..., nope:]

    def gated_output(self, proj: dict[str, jax.Array], o_bthv: jax.Array) -> jax.Array:
        """The output gate and o_proj on an attention output [B,T,H,v_head_dim] (see `attention_parts`)."""
        return self._output(proj, o_bthv)

    # ---------------------------------------------------------------------------------------------
    # Incremental decoding over a paged latent cache
    # ---------------------------------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_len: int, page_size: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
        """(pages [B * P, page_size, C], page_table int32 [B, P]): sequence b owning pages b*P .. b*P + P - 1."""
        page_size = page_size or min(DEFAULT_PAGE_SIZE, max_len)
        per_seq = pages_per_sequence(max_len, page_size)
        return (init_latent_pages(self.cfg, batch_size * per_seq, page_size),
                contiguous_page_table(batch_size, per_seq))

    def forward_cached(self, x_btd: jax.Array, pages_npc: jax.Array, page_table_bp: jax.Array, start_b: jax.Array,
                       valid_len_b: jax.Array | None = None, *,
                       absorb: bool | None = None) -> tuple[jax.Array, jax.Array]:
        """Runs T new tokens per sequence against the paged latent cache.

        `pages_npc` [N, page_size, C] is the layer's page pool; `page_table_bp` int32 [B, P] maps page j of
        sequence b (its positions j*page_size ..) to a pool page, -1 (or any id outside [0, N)) = none. Token t of
        sequence b sits at position `start_b[b] + t`: its latent row is written through the table (rows with no
        page are dropped) and its query attends causally to positions <= its own, read through the table (pages
        with no id read as zeros, and only ever sit past the sequence's length, so they are masked). With
        `valid_len_b` only the first valid_len_b[b] tokens are written (right padding: padded tokens leave the
        cache untouched; their outputs are meaningless). Several sequences may map the same page (a shared
        prefix) as long as none of them writes it.
        `absorb` (static): attend in the MQA-over-latent form (kv_b_proj folded into q and the output);
        None picks it for decode (T == 1) and the expanded form otherwise. The absorbed decode step reads the pages
        through the table with the Pallas kernel (pallas_kernels/mla) when `mla_decode_backend` picks it (the
        `mla_decode_impl` config field; on GPU by default), else gathers them into a dense [B, P * page_size, C]
        array. Returns (y [B,T,D], new pages).
        """
        t = x_btd.shape[1]
        proj = self._project_inputs(x_btd)
        rows_btc = self._latent_rows(proj["kv_a_proj_with_mqa"])
        pages_npc = write_latent_rows(pages_npc, page_table_bp, start_b, rows_btc, valid_len_b)
        q_bthk = self._queries(proj)
        if absorb is None:
            absorb = t == 1
        backend = mla_decode_backend(self.cfg, *pages_npc.shape[:2]) if absorb and t == 1 else None
        if backend is not None:
            o_bthv = self._attend_paged(q_bthk, pages_npc, page_table_bp, start_b, backend)
            return self._output(proj, o_bthv), pages_npc
        cache_bsc = gather_latent_rows(pages_npc, page_table_bp)
        pos_bt = start_b.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        mask_bts = jnp.arange(cache_bsc.shape[1], dtype=jnp.int32)[None, None, :] <= pos_bt[:, :, None]
        attend = self._attend_absorbed if absorb else self._attend_expanded
        o_bthv = attend(q_bthk, cache_bsc, mask_bts)
        return self._output(proj, o_bthv), pages_npc

    def _attend_expanded(self, q_bthk, cache_bsc, mask_bts):
        """Standard MLA over cached latents: expand every cached row to per-head k_nope / v with kv_b_proj."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        h, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        lat, k_r = cache_bsc[..., :r].astype(dt), cache_bsc[..., r:].astype(dt)
        kv_bshe = jnp.einsum("bsr,rhe->bshe", lat, self.kv_b_proj[...].astype(dt))
        k_nope, v_bshv = kv_bshe[..., :nope], kv_bshe[..., nope:]
        k_rope = jnp.broadcast_to(k_r[:, :, None, :], k_r.shape[:2] + (h, cfg.qk_rope_head_dim))
        k_bshk = jnp.concatenate([k_nope, k_rope], axis=-1)
        logits = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk, preferred_element_type=wide(q_bthk.dtype))
        probs = _masked_softmax(logits * cfg.qk_head_dim ** -0.5, mask_bts)
        return jnp.einsum("bhts,bshv->bthv", probs, v_bshv.astype(probs.dtype))

    def _attend_absorbed(self, q_bthk, cache_bsc, mask_bts):
        """MQA over the latent: q_nope·W_k gives a kv_lora-wide query per head, attention reads the cached rows
        directly (one shared 'head' of width kv_lora + rope), and W_v maps the attended latent to each head."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        q_abs = self._absorbed_queries(q_bthk)  # [B,T,H,r+rope]
        logits = jnp.einsum("bthc,bsc->bhts", q_abs, cache_bsc.astype(dt), preferred_element_type=wide(dt))
        probs = _masked_softmax(logits * cfg.qk_head_dim ** -0.5, mask_bts)
        o_lat = jnp.einsum("bhts,bsr->bthr", probs, cache_bsc[..., :cfg.kv_lora_rank].astype(probs.dtype))
        return self._latent_values(o_lat)

    def _attend_paged(self, q_bthk, pages_npc, page_table_bp, start_b, backend):
        """The absorbed decode step (T == 1) by the paged kernel (`k3jax.ops.attention.paged_latent_decode`): every
        sequence's pages read once through its table row, positions 0 .. start_b (its own row already written)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        q_bhc = self._absorbed_queries(q_bthk)[:, 0]
        o_bhr = paged_latent_decode(q_bhc, pages_npc.astype(dt), page_table_bp, start_b.astype(jnp.int32) + 1,
                                    scale=cfg.qk_head_dim ** -0.5, latent_dim=cfg.kv_lora_rank, backend=backend,
                                    num_splits=cfg.runtime.mla_decode_splits)
        return self._latent_values(o_bhr[:, None])  # f32, like the XLA path

    def _absorbed_queries(self, q_bthk):
        """[q_nope · W_k | q_rope] per head: [B, T, H, kv_lora + rope] in the compute dtype."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        nope = cfg.qk_nope_head_dim
        # q_nope · W_k over the whole kv_b row with q zero-padded over the value columns: the same sums (the
        # padding adds exact zeros) without slicing the weight, which XLA would copy every decode step.
        q_pad = jnp.pad(q_bthk[..., :nope].astype(dt), [(0, 0)] * (q_bthk.ndim - 1) + [(0, cfg.v_head_dim)])
        w_rhe = self.kv_b_proj[...].astype(dt)
        q_lat = unless_single_row(lambda q: jnp.einsum("bthe,rhe->bthr", q, w_rhe, preferred_element_type=wide(
            q_bthk.dtype)), q_pad, 2).astype(dt)
        return jnp.concatenate([q_lat, q_bthk[..., nope:].astype(dt)], axis=-1)

    def _latent_values(self, o_bthr):
        """W_v maps each head's attended latent [B, T, H, kv_lora] to its value width (in o's dtype)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        # the whole kv_b row, then the value columns of the (small) result: no per-step copy of a weight slice
        w_rhe = self.kv_b_proj[...].astype(dt).astype(o_bthr.dtype)
        kv = unless_single_row(lambda o: jnp.einsum("bthr,rhe->bthe", o, w_rhe), o_bthr, 2)
        return kv[..., cfg.qk_nope_head_dim:]


DEFAULT_PAGE_SIZE = 64  # tokens per latent page: one 64-token prefill chunk


def pages_per_sequence(max_len: int, page_size: int) -> int:
    """Page-table width: pages needed for `max_len` positions."""
    if page_size < 1 or max_len < 1:
        raise ValueError(f"page_size and max_len must be >= 1, got page_size={page_size}, max_len={max_len}")
    return -(-max_len // page_size)


def init_latent_pages(cfg: ModelConfig, num_pages: int, page_size: int) -> jax.Array:
    """A zeroed page pool [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] in the compute dtype."""
    return jnp.zeros((num_pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim), cfg.runtime.jnp_dtype)


def contiguous_page_table(batch_size: int, pages_per_seq: int) -> jax.Array:
    """int32 [B, P] with sequence b owning pages b*P .. b*P + P - 1 (the layout of a plain, unshared batch)."""
    return jnp.arange(batch_size * pages_per_seq, dtype=jnp.int32).reshape(batch_size, pages_per_seq)


def _page_ids(page_table_bp: jax.Array, num_pages: int) -> jax.Array:
    """The table with every id outside [0, num_pages) (-1: no page) mapped to num_pages (out of bounds)."""
    table = page_table_bp.astype(jnp.int32)
    return jnp.where((table >= 0) & (table < num_pages), table, num_pages)


def write_latent_rows(pages_npc: jax.Array, page_table_bp: jax.Array, start_b: jax.Array, rows_btc: jax.Array,
                      valid_len_b: jax.Array | None = None) -> jax.Array:
    """Scatters rows_btc[b, t] to position start_b[b] + t of sequence b through the page table. Rows at t >=
    valid_len_b[b], past the table, or on a page with no id are dropped (static shapes: one scatter)."""
    n, page_size, _ = pages_npc.shape
    t, width = rows_btc.shape[1], page_table_bp.shape[1]
    pos_bt = start_b.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    slot_bt = pos_bt // page_size
    page_bt = jnp.take_along_axis(_page_ids(page_table_bp, n), jnp.clip(slot_bt, 0, width - 1), axis=1)
    keep_bt = (slot_bt < width) & (pos_bt >= 0)
    if valid_len_b is not None:
        keep_bt &= jnp.arange(t, dtype=jnp.int32)[None, :] < valid_len_b.astype(jnp.int32)[:, None]
    page_bt = jnp.where(keep_bt, page_bt, n)  # n: out of bounds, dropped
    return pages_npc.at[page_bt, pos_bt % page_size].set(rows_btc.astype(pages_npc.dtype), mode="drop")


def gather_latent_rows(pages_npc: jax.Array, page_table_bp: jax.Array) -> jax.Array:
    """Every sequence's rows [B, P * page_size, C] in position order; pages with no id read as zeros."""
    n, page_size, c = pages_npc.shape
    b, width = page_table_bp.shape
    rows = jnp.take(pages_npc, _page_ids(page_table_bp, n), axis=0, mode="fill", fill_value=0)
    return rows.reshape(b, width * page_size, c)


def _masked_softmax(logits_bhts: jax.Array, mask_bts: jax.Array) -> jax.Array:
    logits = jnp.where(mask_bts[:, None], logits_bhts, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1)
