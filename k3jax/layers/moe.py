"""Stable LatentMoE (docs/spec.md#moe): f32 sigmoid router with a selection-only bias, latent down-projection,
SiTU-GLU experts on the latent, RMSNorm on the weighted sum, up-projection, plus unweighted shared experts.

Without a latent (`routed_expert_hidden_size=None`, Kimi-Linear) the experts act on the full width directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.layers.mlp import GatedMLP
from k3jax.layers.norms import rms_norm
from k3jax.layers.routing import margin_histogram, routing_margins
from k3jax.numerics import wide
from k3jax.ops.glu import glu
from k3jax.ops.gmm import MXFP4Experts, dense_expert_weights, expert_weights, inference_only
from k3jax.ops.linear import project as dense
from k3jax.ops.moe import (
    assigned_backend,
    decode_tiling,
    experts_assigned,
    experts_dropless,
    route_selected,
    router_logits,
    select_backend,
)
from k3jax.ops.mx_quant import expert_activation_qat, expert_weight_qat
from sharding import expert_parallel


def route(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array, cfg: ModelConfig):
    """Returns (weights_nk f32, experts_nk int32, scores_ne f32).

    Scores are sigmoid(x_f32 @ W_f32); the bias only selects (group-limited top-k as in DeepSeek-V3 when
    num_expert_group > 1); combine weights are the unbiased scores, renormalised, times routed_scaling_factor.
    """
    scores = jax.nn.sigmoid(router_logits(x_nd, router_de))
    biased = scores + bias_e.astype(scores.dtype)
    if cfg.num_expert_group > 1:
        n, e = biased.shape
        grouped = biased.reshape(n, cfg.num_expert_group, e // cfg.num_expert_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(n)[:, None], keep].set(True)
        biased = jnp.where(jnp.repeat(group_mask, e // cfg.num_expert_group, axis=1), biased, -jnp.inf)
    _, experts = jax.lax.top_k(biased, cfg.num_experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32), scores


def experts_dense(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig):
    """Every expert on every token, combined with the sparse routing weights (tests and tiny runs only).
    MXFP4 weights are dequantized here (materialised in the compute dtype)."""
    if isinstance(w1_elm, MXFP4Experts):
        z_nl = inference_only(z_nl)
    w1_elm, w3_elm, w2_eml = (dense_expert_weights(w, z_nl.dtype) for w in (w1_elm, w3_elm, w2_eml))
    combine_ne = jnp.zeros((z_nl.shape[0], cfg.num_experts), weights_nk.dtype)
    combine_ne = combine_ne.at[jnp.arange(z_nl.shape[0])[:, None], experts_nk].add(weights_nk)
    hidden = glu(jnp.einsum("nl,elm->enm", z_nl, w1_elm), jnp.einsum("nl,elm->enm", z_nl, w3_elm), cfg)
    hidden = expert_activation_qat(hidden, cfg)  # the down projection's input (as `grouped_glu`'s output)
    out = jnp.einsum("enm,eml->enl", hidden, w2_eml, preferred_element_type=wide(hidden.dtype))
    return jnp.einsum("enl,ne->nl", out, combine_ne)


class PackedExpertWeight(nnx.Variable):
    """MXFP4 bytes of the routed experts (E2M1 codes or E8M0 scales, uint8): inference-only state, not a gradient
    parameter (`cfg.runtime.expert_weights == 'mxfp4'`)."""


def _packed_experts(w: nnx.Param) -> tuple[PackedExpertWeight, PackedExpertWeight]:
    """Quantizes an initialised [E, in, out] expert stack to (packed [E, out, in/2], scales [E, out, in/32]),
    with the logical axes moved to match the HF orientation."""
    q = MXFP4Experts.quantize(w.get_value())
    e_axis, in_axis, out_axis = w.get_metadata()["out_sharding"]
    axes = (e_axis, out_axis, in_axis)
    return (PackedExpertWeight(q.packed, out_sharding=axes, eager_sharding=False),
            PackedExpertWeight(q.scales, out_sharding=axes, eager_sharding=False))


class LatentMoE(nnx.Module):
    """Routed experts held as `w1, w3 [E, L, M], w2 [E, M, L]` parameters, or with
    `cfg.runtime.expert_weights == 'mxfp4'` as packed bytes `wN_packed` u8 [E, out, in/2] + `wN_scale` u8
    [E, out, in/32] (HF orientation; inference only: random init is the quantized normal init, loading fills them
    straight from an MXFP4 checkpoint)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e, m, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.runtime.jnp_param_dtype
        lat = cfg.expert_input_size
        self.router = params.normal(rngs, (d, e), ("embed", "experts_router"), pd, std=cfg.initializer_range)
        self.router_bias = params.router_bias(e, wide(pd))
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = params.normal(rngs, (d, lat), ("embed", "expert_latent"), pd)
            self.routed_expert_up_proj = params.normal(rngs, (lat, d), ("expert_latent", "embed"), pd)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = params.constant(1.0, (lat,), ("expert_latent",), wide(pd))
        self.w1 = params.normal(rngs, (e, lat, m), ("experts", "expert_latent", "expert_mlp"), pd, fan_in=lat)
        self.w3 = params.normal(rngs, (e, lat, m), ("experts", "expert_latent", "expert_mlp"), pd, fan_in=lat)
        self.w2 = params.normal(rngs, (e, m, lat), ("experts", "expert_mlp", "expert_latent"), pd, fan_in=m)
        if cfg.runtime.expert_weights == "mxfp4":
            for name in ("w1", "w3", "w2"):
                packed, scales = _packed_experts(getattr(self, name))
                delattr(self, name)
                setattr(self, f"{name}_packed", packed)
                setattr(self, f"{name}_scale", scales)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.num_shared_experts * m, rngs=rngs)
        if cfg.runtime.record_routing_stats:  # this step's routing statistics, overwritten by every forward pass
            self.margin_counts = params.routing_stats((e, cfg.runtime.routing_histogram_bins), ("experts_router", None),
                                                      jnp.int32)
            self.expert_loads = params.routing_stats((e,), ("experts_router",), jnp.float32)
            # expert-parallel load per step: sharding.expert_parallel.STATS_FIELDS (max/mean rows per expert rank,
            # dropped rows, routed rows); the single-program path counts as one rank
            self.expert_parallel_stats = params.routing_stats((len(expert_parallel.STATS_FIELDS),), (None,),
                                                              jnp.float32)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(b * t, d).astype(dt)
        latent = cfg.routed_expert_hidden_size is not None
        selection = self._select_backend(b, t)
        if selection is not None:  # decode step of the plan-free experts: the selection kernel
            weights_nk, experts_nk = route_selected(x_nd, self.router[...], self.router_bias[...], cfg, selection)
        else:
            weights_nk, experts_nk, scores_ne = route(x_nd, self.router[...], self.router_bias[...], cfg)
            if cfg.runtime.record_routing_stats:
                self._record_routing(scores_ne, experts_nk)
        z_nl = dense(x_nd, self.routed_expert_down_proj[...].astype(dt), cfg) if latent else x_nd
        u_nl = self._routed_experts(z_nl, weights_nk, experts_nk, b, t)
        if latent:
            if cfg.latent_moe_use_norm:
                u_nl = rms_norm(u_nl, self.routed_expert_norm[...], cfg.rms_norm_eps).astype(dt)
            u_nl = dense(u_nl, self.routed_expert_up_proj[...].astype(dt), cfg)
        y_btd = u_nl.reshape(b, t, d)
        if cfg.num_shared_experts:
            y_btd = y_btd + self.shared_experts(x_btd)
        return y_btd

    def _select_backend(self, b: int, t: int) -> str | None:
        """The selection kernel's backend (`k3jax.ops.moe.select_backend`) when the step runs on a single program
        (no expert parallelism), else None (the XLA `route`)."""
        if expert_parallel.active_mode(self.cfg, b, t) is not None:
            return None
        return select_backend(self.cfg, b, t)

    def _routed_experts(self, z_nl, weights_nk, experts_nk, b: int, t: int) -> jax.Array:
        """Σ_j w_j E_{idx_j}(z) for the N = b*t tokens: expert-parallel (`sharding.expert_parallel`) when traced
        under a mesh whose 'expert' axis is > 1 and `moe_expert_parallel` allows it, per device on its own tokens
        (mode 'local') under a mesh that splits tokens with an expert axis of 1, else the single-program path.
        Records the expert-rank load statistics when the layer keeps them.

        Quantization-aware training (`expert_qat`, `expert_act_qat`) happens here for every path: the weights are
        fake-quantized along their reduction axis before the cast to the compute dtype (so the f32 masters are what
        is quantized, as the MXFP4 export does), the experts' input rows along the width; the down projection's
        input is quantized where the GLU produces it (`k3jax.ops.glu.grouped_glu`, `experts_dense`)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        w1, w3, w2 = (expert_weights(expert_weight_qat(w, cfg), dt) for w in self.routed_expert_weights())
        z_nl = expert_activation_qat(z_nl, cfg)
        ep = expert_parallel.active_mode(cfg, b, t)
        kernels = assigned_backend(cfg, z_nl.shape, t) if ep is None else None
        if kernels is not None:
            u_nl = experts_assigned(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg, kernels).astype(dt)
            stats = expert_parallel.single_program_stats(experts_nk.size)
        elif ep is None:
            if cfg.runtime.moe_impl == "dense":
                u_nl = experts_dense(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg).astype(dt)
            else:
                u_nl = experts_dropless(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg,
                                        decode_tiling=decode_tiling(cfg, t)).astype(dt)
            stats = expert_parallel.single_program_stats(experts_nk.size)
        else:
            mode, factor = ep
            k = experts_nk.shape[-1]
            u_btl, stats = expert_parallel.routed_experts(
                z_nl.reshape(b, t, -1), weights_nk.reshape(b, t, k), experts_nk.reshape(b, t, k), w1, w3, w2, cfg,
                mode=mode, capacity_factor=factor)
            u_nl = u_btl.reshape(b * t, -1).astype(dt)
        if hasattr(self, "expert_parallel_stats"):
            self.expert_parallel_stats[...] = stats
        return u_nl

    def routed_expert_weights(self) -> tuple:
        """(w1, w3, w2) as stored: arrays [E, L, M] / [E, M, L], or `MXFP4Experts` with the same logical shapes."""
        if self.cfg.runtime.expert_weights == "mxfp4":
            return tuple(MXFP4Experts(getattr(self, f"{n}_packed")[...], getattr(self, f"{n}_scale")[...])
                         for n in ("w1", "w3", "w2"))
        return self.w1[...], self.w3[...], self.w2[...]

    def _record_routing(self, scores_ne: jax.Array, experts_nk: jax.Array) -> None:
        """Histogram of this batch's routing margins (for Quantile Balancing) and the expert loads (metrics)."""
        cfg = self.cfg
        margins_ne = routing_margins(jax.lax.stop_gradient(scores_ne), self.router_bias[...],
                                     cfg.num_experts_per_token)
        self.margin_counts[...] = margin_histogram(margins_ne, num_bins=cfg.runtime.routing_histogram_bins)
        self.expert_loads[...] = jnp.zeros((cfg.num_experts,), jnp.float32).at[experts_nk.reshape(-1)].add(1.0)
