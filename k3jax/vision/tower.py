"""The MoonViT vision tower and patch-merger projector in Flax NNX (docs/spec.md, "Vision tower").

Module paths mirror the release's tensor names (`vision_tower.encoder.blocks.{i}.wqkv.weight`,
`mm_projector.proj.0.weight` -> `mm_projector.proj_0.weight`); weights are stored `[in, out]` (`x @ W`). The rotary
runs on the release's q/k layout: dims (2i, 2i+1) of a head are one rotated pair.

Forward for images packed NaViT-style (`k3jax.vision.packing.pack`):
    x = patches @ W_patch (+ b) + resample(pos_grid, h, w) [+ sincos(frame) when t > 1]
    27 x { x += wo(attn(rope(wqkv(norm0 x)))) ; x += fc1(gelu_tanh(fc0(norm1 x))) }   attention block-diagonal
    x = final_layernorm(x); merged = sd2_tpool(x) [M, kh*kw, D]; out = projector(merged) [M, text_hidden]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.numerics import upcast, wide
from k3jax.ops.attention import segment_attention, segment_attention_impl
from k3jax.vision.config import VisionConfig
from k3jax.vision.packing import PackedLayout, interpolation_matrix, pack, time_embedding

__all__ = ["VisionModel", "VisionTower", "Projector", "packed_attention", "apply_rope_2d", "sd2_tpool", "split_images"]


def _matmul(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    return jnp.einsum("...i,io->...o", x.astype(dtype), w.astype(dtype), preferred_element_type=wide(dtype))


class Dense(nnx.Module):
    """`x @ weight (+ bias)`, weight [in, out]; accumulates in at least f32, returns `dtype`."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.dtype = dtype
        self.weight = params.normal(rngs, (d_in, d_out), axes, param_dtype)
        self.bias = params.constant(0.0, (d_out,), (axes[1],), param_dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _matmul(x, self.weight[...], self.dtype)
        if self.bias is not None:
            y = y + upcast(self.bias[...])
        return y.astype(self.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis (biased variance), normalised and scaled in at least f32."""

    def __init__(self, size: int, *, eps: float, param_dtype, axis_name: str):
        self.eps = eps
        self.weight = params.constant(1.0, (size,), (axis_name,), param_dtype)
        self.bias = params.constant(0.0, (size,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = upcast(x)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * upcast(self.weight[...]) + upcast(self.bias[...])
        return y.astype(x.dtype)


def _norm(cfg: VisionConfig, size: int, param_dtype, eps: float | None = None):
    eps = cfg.tower_norm_eps if eps is None else eps
    if cfg.norm_type == "rmsnorm":
        return RMSNorm(size, eps=eps, param_dtype=param_dtype, axis_name="vision_embed")
    return LayerNorm(size, eps=eps, param_dtype=param_dtype, axis_name="vision_embed")


def apply_rope_2d(x_nhk: jax.Array, cos_nr: jax.Array, sin_nr: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of every head by the pair's angle (cos/sin [N, K/2]), in at
    least f32; returns x's dtype."""
    n, h, k = x_nhk.shape
    x = upcast(x_nhk).reshape(n, h, k // 2, 2)
    x0, x1 = x[..., 0], x[..., 1]
    c, s = cos_nr[:, None, :], sin_nr[:, None, :]
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(n, h, k).astype(x_nhk.dtype)


ATTN_BLOCK_Q = 4096  # queries per attention block: K3's 65536-patch image needs 12 x 4096 x 65536 f32 logits a block


def _masked_softmax_attention(q_nhk, k_nhk, v_nhk, seg_q_n, seg_k_n, scale):
    logits = jnp.einsum("qhk,shk->hqs", q_nhk, k_nhk, preferred_element_type=wide(q_nhk.dtype)) * scale
    mask = seg_q_n[:, None] == seg_k_n[None, :]
    probs = jax.nn.softmax(jnp.where(mask[None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("hqs,shk->qhk", probs, v_nhk.astype(probs.dtype))


def packed_attention(q_nhk: jax.Array, k_nhk: jax.Array, v_nhk: jax.Array, segment_ids_n: jax.Array, *,
                     scale: float, block_q: int | None = ATTN_BLOCK_Q) -> jax.Array:
    """Bidirectional softmax attention within each segment (block-diagonal mask), f32 logits and softmax;
    returns [N, H, K] in at least f32. A padding patch (one shared segment) sees only padding. On a GPU with
    16-bit operands: cuDNN's packed layout (`k3jax.ops.attention.segment_attention`, images as runs; with the
    masked XLA core below the tower took 3.7x transformers' time on one 1024 x 1024 image, RESULTS.md
    2026-12-04). Otherwise, longer than
    `block_q`, the queries go in blocks of `block_q` against all keys (memory H x block_q x N, each block
    recomputed in the backward pass)."""
    if segment_attention_impl(q_nhk.dtype) == "cudnn":
        out = segment_attention(q_nhk[None], k_nhk[None], v_nhk[None], segment_ids_n[None], scale=scale,
                                xla_core=lambda q, k, v: _xla_packed_attention(q[0], k[0], v[0], segment_ids_n,
                                                                               scale, block_q)[None])
        return out[0]
    return _xla_packed_attention(q_nhk, k_nhk, v_nhk, segment_ids_n, scale, block_q)


def _xla_packed_attention(q_nhk, k_nhk, v_nhk, segment_ids_n, scale, block_q):
    n = q_nhk.shape[0]
    if block_q is None or n <= block_q:
        return _masked_softmax_attention(q_nhk, k_nhk, v_nhk, segment_ids_n, segment_ids_n, scale)
    blocks = -(-n // block_q)
    pad = blocks * block_q - n
    q_pad = jnp.pad(q_nhk, ((0, pad), (0, 0), (0, 0)))
    seg_pad = jnp.pad(segment_ids_n, (0, pad), mode="edge")  # padded queries copy a real row's segment: no NaN

    @jax.checkpoint
    def one(args):
        q_bhk, seg_b = args
        return _masked_softmax_attention(q_bhk, k_nhk, v_nhk, seg_b, segment_ids_n, scale)

    out = jax.lax.map(one, (q_pad.reshape(blocks, block_q, *q_nhk.shape[1:]), seg_pad.reshape(blocks, block_q)))
    return out.reshape(blocks * block_q, *out.shape[2:])[:n]


class MLP(nnx.Module):
    """fc1(gelu_tanh(fc0 x))."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, m = cfg.vt_hidden_size, cfg.vt_intermediate_size
        kw = dict(bias=cfg.linear_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc0 = Dense(d, m, ("vision_embed", "vision_mlp"), **kw)
        self.fc1 = Dense(m, d, ("vision_mlp", "vision_embed"), **kw)

    def __call__(self, x_nd):
        return self.fc1(jax.nn.gelu(upcast(self.fc0(x_nd)), approximate=True).astype(x_nd.dtype))


class Block(nnx.Module):
    """Pre-norm encoder layer: x += wo(attn(norm0 x)); x += mlp(norm1 x). Attention: fused `wqkv`
    [D, 3 * qkv_hidden] -> heads of `head_dim` -> 2-D rotary on q, k -> packed attention -> `wo` [qkv_hidden, D]
    (the release keeps `wqkv` / `wo` directly under the block)."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, attn_block_q: int | None):
        d, q = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.cfg, self.dtype, self.attn_block_q = cfg, dtype, attn_block_q
        self.norm0 = _norm(cfg, d, param_dtype)
        self.norm1 = _norm(cfg, d, param_dtype)
        self.wqkv = Dense(d, 3 * q, ("vision_embed", "vision_qkv"), bias=cfg.attn_bias, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
        self.wo = Dense(q, d, ("vision_heads", "vision_embed"), bias=cfg.attn_bias, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def attention(self, x_nd, segment_ids_n, cos_nr, sin_nr):
        cfg = self.cfg
        n, h, k = x_nd.shape[0], cfg.vt_num_attention_heads, cfg.head_dim
        qkv = self.wqkv(x_nd).reshape(n, 3, h, k)
        q_nhk = apply_rope_2d(qkv[:, 0], cos_nr, sin_nr)
        k_nhk = apply_rope_2d(qkv[:, 1], cos_nr, sin_nr)
        o_nhk = packed_attention(q_nhk, k_nhk, qkv[:, 2], segment_ids_n, scale=k ** -0.5,
                                 block_q=self.attn_block_q)
        return self.wo(o_nhk.astype(self.dtype).reshape(n, h * k))

    def __call__(self, x_nd, segment_ids_n, cos_nr, sin_nr):
        x_nd = x_nd + self.attention(self.norm0(x_nd), segment_ids_n, cos_nr, sin_nr)
        return x_nd + self.mlp(self.norm1(x_nd))


class PosEmb(nnx.Module):
    """Learned [H, W, D] grid, resampled per image to its h x w (bilinear or bicubic, `interpolation_matrix`);
    frames of a multi-frame grid add a fixed sinusoid of their index."""

    def __init__(self, cfg: VisionConfig, *, param_dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        shape = (cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size)
        axes = ("vision_pos_h", "vision_pos_w", "vision_embed")
        self.weight = params.normal(rngs, shape, axes, param_dtype, std=0.02)

    def __call__(self, layout: PackedLayout) -> jax.Array:
        """[length, D] in at least f32 (zeros on padding)."""
        cfg, table = self.cfg, upcast(self.weight[...])
        big_h, big_w, d = table.shape
        parts = []
        for t, h, w in layout.grids:
            if (h, w) == (big_h, big_w):
                grid_hwd = table
            else:
                m_h = jnp.asarray(interpolation_matrix(h, big_h, cfg.pos_emb_interpolation_mode), table.dtype)
                m_w = jnp.asarray(interpolation_matrix(w, big_w, cfg.pos_emb_interpolation_mode), table.dtype)
                grid_hwd = jnp.einsum("hH,wW,HWd->hwd", m_h, m_w, table)
            pos = jnp.broadcast_to(grid_hwd.reshape(1, h * w, d), (t, h * w, d))
            if t > 1:
                pos = pos + jnp.asarray(time_embedding(t, d), table.dtype)[:, None, :]
            parts.append(pos.reshape(t * h * w, d))
        pad = layout.length - layout.num_patches
        if pad:
            parts.append(jnp.zeros((pad, d), table.dtype))
        return jnp.concatenate(parts, axis=0)


class PatchEmbed(nnx.Module):
    """Patch projection (the release's stride-p conv, as [3*p*p, D] over (channel, row, col)) + positions."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.proj = Dense(3 * cfg.patch_size ** 2, cfg.vt_hidden_size, ("vision_patch", "vision_embed"),
                          bias=cfg.patch_embed_proj_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.pos_emb = PosEmb(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixels_np: jax.Array, layout: PackedLayout) -> jax.Array:
        return (self.proj(pixels_np) + self.pos_emb(layout).astype(self.dtype)).astype(self.dtype)


class Encoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, attn_block_q: int | None):
        self.blocks = nnx.List([Block(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, attn_block_q=attn_block_q)
                                for _ in range(cfg.vt_num_hidden_layers)])
        self.final_layernorm = _norm(cfg, cfg.vt_hidden_size, param_dtype)

    def __call__(self, x_nd, segment_ids_n, cos_nr, sin_nr):
        for block in self.blocks:
            x_nd = block(x_nd, segment_ids_n, cos_nr, sin_nr)
        return self.final_layernorm(x_nd)


def sd2_tpool(x_nd: jax.Array, layout: PackedLayout, kernel: tuple[int, int]) -> jax.Array:
    """Per image: group each kh x kw spatial block and average over frames -> [M, kh*kw, D] (images in order,
    merged tokens row-major, the kh*kw patches of a block row-major), pooled in at least f32."""
    kh, kw = kernel
    parts = []
    for (t, h, w), start in zip(layout.grids, layout.offsets):
        x = upcast(x_nd[start:start + t * h * w]).reshape(t, h // kh, kh, w // kw, kw, -1)
        x = jnp.mean(x.transpose(0, 1, 3, 2, 4, 5), axis=0)
        parts.append(x.reshape((h // kh) * (w // kw), kh * kw, -1))
    return jnp.concatenate(parts, axis=0).astype(x_nd.dtype)


class VisionTower(nnx.Module):
    """`vision_tower.*`: patches [N, 3, p, p] (or [N, 3*p*p]) of packed images -> merged [M, kh*kw, D].
    `attn_block_q`: queries per attention block (None: all at once)."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 attn_block_q: int | None = ATTN_BLOCK_Q):
        self.cfg, self.dtype = cfg, dtype
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, attn_block_q=attn_block_q)

    def hidden_states(self, pixels: jax.Array, layout: PackedLayout) -> jax.Array:
        """[length, D] after the final norm (padding rows included)."""
        cfg = self.cfg
        x = jnp.asarray(pixels).reshape(pixels.shape[0], 3 * cfg.patch_size ** 2).astype(self.dtype)
        if x.shape[0] != layout.num_patches:
            raise ValueError(f"pixels hold {x.shape[0]} patches, the grids {layout.grids} need "
                             f"{layout.num_patches}")
        if layout.length > x.shape[0]:
            x = jnp.concatenate([x, jnp.zeros((layout.length - x.shape[0], x.shape[1]), x.dtype)], axis=0)
        cos = jnp.asarray(layout.rope_cos_nr, wide(self.dtype))
        sin = jnp.asarray(layout.rope_sin_nr, wide(self.dtype))
        h_nd = self.patch_embed(x, layout)
        return self.encoder(h_nd, jnp.asarray(layout.segment_ids_n), cos, sin)

    def __call__(self, pixels: jax.Array, layout: PackedLayout) -> jax.Array:
        return sd2_tpool(self.hidden_states(pixels, layout), layout, self.cfg.merge_kernel_size)


class Projector(nnx.Module):
    """`mm_projector.*`: merged [M, kh*kw, D] -> [M, text_hidden]. "patchmerger" (K2.5): LayerNorm over each
    patch's D, flatten, proj.0, GELU, proj.2. "patchmergerv2" (K3): flatten, proj.0, GELU, proj.2, RMSNorm."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        wide_in, out = cfg.merged_hidden_size, cfg.text_hidden_size
        kw = dict(bias=cfg.linear_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.pre_norm = (LayerNorm(cfg.mm_hidden_size, eps=cfg.projector_ln_eps, param_dtype=param_dtype,
                                   axis_name="vision_embed") if cfg.mm_projector_type == "patchmerger" else None)
        self.proj_0 = Dense(wide_in, wide_in, ("vision_merged", "vision_merged_out"), **kw)
        self.proj_2 = Dense(wide_in, out, ("vision_merged_out", "embed"), **kw)
        self.post_norm = (RMSNorm(out, eps=cfg.projector_ln_eps, param_dtype=param_dtype, axis_name="embed")
                          if cfg.mm_projector_type == "patchmergerv2" else None)

    def __call__(self, merged_mkd: jax.Array) -> jax.Array:
        x = merged_mkd.astype(self.dtype)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        x = x.reshape(x.shape[0], self.cfg.merged_hidden_size)
        x = self.proj_2(jax.nn.gelu(upcast(self.proj_0(x)), approximate=False).astype(self.dtype))
        return self.post_norm(x) if self.post_norm is not None else x


class VisionModel(nnx.Module):
    """Tower + projector: `encode(pixels, grids)` -> image tokens [M, text_hidden] in the text stream's width,
    images in order (`layout.merged_counts` tokens each)."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 attn_block_q: int | None = ATTN_BLOCK_Q):
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                        attn_block_q=attn_block_q)
        self.mm_projector = Projector(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixels: jax.Array, layout: PackedLayout) -> jax.Array:
        return self.mm_projector(self.vision_tower(pixels, layout))

    def encode(self, pixels, grids, *, pad_to: int | None = None) -> jax.Array:
        return self(pixels, pack(grids, self.cfg, pad_to=pad_to))


def split_images(tokens_md: jax.Array, layout: PackedLayout) -> list[jax.Array]:
    """Per-image slices of `VisionModel` output."""
    return list(jnp.split(tokens_md, np.cumsum(layout.merged_counts)[:-1].tolist(), axis=0))
