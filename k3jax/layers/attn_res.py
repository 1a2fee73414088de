"""Block Attention Residuals (docs/spec.md#attn-res): a per-token softmax over the bank of block snapshots and the live
partial sum, with one learned pseudo-query per read site.

The bank has a fixed number of rows (`cfg.num_attn_res_snapshots`) so layers can be scanned; rows not yet written
are masked out by the count of filled rows, which may be a traced value inside a scan. With a static count (the
unrolled layer stack) a read slices the filled rows instead (no concatenation of unused rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.numerics import upcast
from k3jax.ops.attn_res import read_norm, read_norm_backend, static_count


def attn_res_mix(live_btd: jax.Array, bank_nbtd: jax.Array, num_filled, query_d: jax.Array, eps: float) -> jax.Array:
    """Mixes sources [bank[:num_filled]..., live] with softmax(rmsnorm_nogain(V) · query); values stay raw.

    `query_d` is the effective pseudo-query (norm gain ⊙ proj weight). Computed in f32, cast back to live's dtype.
    Each source's score is (V · query) · rsqrt(mean(V²) + eps) (the normalisation is a per-token scalar), and the
    bank and the live partial sum are scored and mixed separately: no [N+1, B, T, D] f32 copy of the sources is
    built (that concatenation cost ~0.5 s of a 8.8 s `k3_gpu` training step: benchmarks/RESULTS.md, 2026-12-04).
    """
    static = isinstance(num_filled, (int, np.integer)) and not isinstance(num_filled, (bool, np.bool_))
    if static:
        bank_nbtd = bank_nbtd[:max(0, min(int(num_filled), bank_nbtd.shape[0]))]  # static: only the filled rows
        num_filled = bank_nbtd.shape[0]
    live32 = upcast(live_btd)
    query = query_d.astype(live32.dtype)
    if bank_nbtd.shape[0] == 0:
        return live32.astype(live_btd.dtype)  # one source: softmax weight 1

    def scores(x32):
        return jnp.sum(x32 * query, axis=-1) * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)

    bank32 = upcast(bank_nbtd)
    bank_scores_nbt = scores(bank32)
    live_score_bt = scores(live32)
    if not static:  # a static count sliced the filled rows above: no mask (its ops ran as kernels in every step)
        valid_n = jnp.arange(bank_nbtd.shape[0]) < num_filled
        bank_scores_nbt = jnp.where(valid_n[:, None, None], bank_scores_nbt, -jnp.inf)
    top_bt = jnp.maximum(bank_scores_nbt.max(axis=0), live_score_bt)
    bank_w_nbt = jnp.exp(bank_scores_nbt - top_bt)
    live_w_bt = jnp.exp(live_score_bt - top_bt)
    inv_bt = 1.0 / (bank_w_nbt.sum(axis=0) + live_w_bt)
    mixed = jnp.sum((bank_w_nbt * inv_bt)[..., None] * bank32, axis=0) + (live_w_bt * inv_bt)[..., None] * live32
    return mixed.astype(live_btd.dtype)


class AttnResRead(nnx.Module):
    """One read site: `{site}_res_norm.weight` (key gain) and `{site}_res_proj.weight` (pseudo-query, init 0)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs | None = None):
        del rngs
        self.eps = cfg.rms_norm_eps
        pd = cfg.runtime.jnp_param_dtype
        self.norm_weight = params.constant(1.0, (cfg.hidden_size,), ("norm",), pd)
        self.query = params.constant(0.0, (cfg.hidden_size,), ("norm",), pd)  # report: init w = 0

    def __call__(self, live_btd: jax.Array, bank_nbtd: jax.Array, num_filled) -> jax.Array:
        query = upcast(self.norm_weight[...]) * upcast(self.query[...])
        return attn_res_mix(live_btd, bank_nbtd, num_filled, query, self.eps)


def snapshots_before(layer_index, block_size: int):
    """Number of bank rows filled when layer `layer_index` starts (snapshots are taken at l % block == 0)."""
    return (layer_index + block_size - 1) // block_size


def push_snapshot(bank_nbtd: jax.Array, row, value_btd: jax.Array, do_push) -> jax.Array:
    """Writes `value` into bank row `row` when `do_push` (traced or static); touches one row only. A static
    `do_push` (unscanned layers) writes nothing when False and no select when True: a write that keeps the row
    still makes a new version of the whole bank, which a layer's remat region then saves beside the old one."""
    if isinstance(do_push, (bool, np.bool_)):
        if not do_push:
            return bank_nbtd
        row = min(int(row), bank_nbtd.shape[0] - 1) if isinstance(row, (int, np.integer)) else row
        return jax.lax.dynamic_update_index_in_dim(bank_nbtd, value_btd.astype(bank_nbtd.dtype), row, axis=0)
    row = jnp.minimum(row, bank_nbtd.shape[0] - 1)
    current = jax.lax.dynamic_index_in_dim(bank_nbtd, row, axis=0, keepdims=False)
    new_row = jnp.where(do_push, value_btd.astype(bank_nbtd.dtype), current)
    return jax.lax.dynamic_update_index_in_dim(bank_nbtd, new_row, row, axis=0)


def read_normed(read: AttnResRead, live_btd: jax.Array, bank_nbtd: jax.Array, num_filled, norm: RMSNorm,
                cfg) -> jax.Array:
    """``norm(read(live, bank, num_filled))``: an AttnRes read and the RMSNorm that consumes it (the layers' inputs
    and the final norm); in one kernel each way where `cfg.runtime.attn_res_impl` allows (`k3jax.ops.attn_res`)."""
    rt = cfg.runtime
    n_static = static_count(num_filled, bank_nbtd.shape[0])
    b, t, d = live_btd.shape
    backend = read_norm_backend(rt.attn_res_impl, b, t, d, n_static, rt.attn_res_block_t, bank_nbtd.shape[0])
    if backend is None:
        return norm(read(live_btd, bank_nbtd, num_filled))
    query = upcast(read.norm_weight[...]) * upcast(read.query[...])
    count = num_filled if n_static is None else n_static
    return read_norm(live_btd, bank_nbtd, count, query, norm.weight[...], eps_read=read.eps, eps_norm=norm.eps,
                     backend=backend, block_t=rt.attn_res_block_t, warps=rt.attn_res_warps)
