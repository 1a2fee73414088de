"""Stable LatentMoE (docs/spec.md#moe): f32 sigmoid router with a selection-only bias, latent down-projection,
SiTU-GLU experts on the latent, RMSNorm on the weighted sum, up-projection, plus unweighted shared experts.

Without a latent (`routed_expert_hidden_size=None`, Kimi-Linear) the experts act on the full width directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.numerics import upcast, wide

from k3jax.config import ModelConfig, parse_kernel_tiling
from k3jax.layers import params
from k3jax.layers.mlp import GatedMLP, glu, grouped_glu
from k3jax.layers.norms import rms_norm
from k3jax.layers.routing import margin_histogram, routing_margins
from k3jax.ops.linear import project as dense, unless_single_row
from k3jax.ops.gmm import (MXFP4Experts, dense_expert_weights, expert_weights, gmm, gpu_kernel_backend_here,
                           gpu_kernels_here, inference_only, refuse_gradients)
from sharding import expert_parallel


def router_logits(x_nd: jax.Array, router_de: jax.Array) -> jax.Array:
    """x_f32 @ W_f32 [N, E]: the router's logits, before the sigmoid."""
    x_wide = upcast(x_nd)
    return unless_single_row(lambda x: x @ router_de.astype(x_wide.dtype), x_wide, 1)


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


def route_selected(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array, cfg: ModelConfig, backend: str):
    """`route`'s (weights, experts) with the sigmoid and the selection (biased top-k, weights, renormalisation) in
    one kernel (`pallas_kernels.moe.select`) after XLA's router matmul: decode steps of the plan-free experts,
    ungrouped routing. Inference only. (The router matmul inside that kernel too, 4 programs streaming the router
    weights for 16 tokens each, measured 1.029x the k3_gpu B = 64 step: RESULTS.md, 2026-12-02.)"""
    from pallas_kernels.moe.select import select_experts  # lazy: pallas_kernels imports k3jax modules

    logits = _no_grad_through_select(router_logits(x_nd, router_de))
    return select_experts(logits, bias_e, cfg.num_experts_per_token, scale=cfg.routed_scaling_factor,
                          renormalize=cfg.moe_renormalize, backend=backend)


def plan_from_experts(experts_nk: jax.Array, num_experts: int):
    """The expert-sorted row plan (`pallas_kernels.moe.RoutePlan`) of a routing, in XLA: a stable argsort of the
    assignments, its inverse (a scatter with distinct indices) and the group sizes. (Counting instead of sorting,
    a one-hot [N*k, E] and its running sum, gave the same rows and the same k3_gpu decode speed: RESULTS.md,
    2026-11-30.)"""
    from pallas_kernels.moe import RoutePlan  # lazy: pallas_kernels imports k3jax modules

    n, k = experts_nk.shape
    flat_expert = experts_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    rows_nk = jnp.zeros((n * k,), jnp.int32).at[order].set(
        jnp.arange(n * k, dtype=jnp.int32), unique_indices=True).reshape(n, k)
    return RoutePlan(experts_nk, rows_nk, jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32),
                     (order // k).astype(jnp.int32))


def experts_dropless(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, *,
                     decode_tiling=None):
    """Σ_j w_j E_{idx_j}(z): rows sorted by expert, grouped matmuls, then each token gathers its k output rows and
    sums them weighted (f32, in j order): `experts_planned` on `plan_from_experts`. A gather, not a scatter-add: a
    GPU scatter-add adds with atomics in a run-dependent order, which made greedy decoding differ between identical
    runs (benchmarks/RESULTS.md, 2026-11-30)."""
    return experts_planned(z_nl, weights_nk, plan_from_experts(experts_nk, cfg.num_experts), w1_elm, w3_elm, w2_eml,
                           cfg, decode_tiling=decode_tiling)


def route_planned(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array, cfg: ModelConfig, backend: str):
    """`route` with the expert-sorted row plan from one kernel (`pallas_kernels.moe.route_plan`): returns
    (weights_nk f32, `RoutePlan`). Same selection and weights as `route` (ungrouped top-k; the kernel ranks the
    same sigmoid(logits) + bias values); the weights are a differentiable gather of the scores at the chosen
    experts, with `route`'s gradients."""
    from pallas_kernels.moe import route_plan  # lazy: pallas_kernels imports k3jax modules

    x_wide = upcast(x_nd)
    scores = jax.nn.sigmoid(unless_single_row(lambda x: x @ router_de.astype(x_wide.dtype), x_wide, 1))
    biased = jax.lax.stop_gradient(scores + bias_e.astype(x_wide.dtype))  # selection only: no gradient
    plan = route_plan(biased, cfg.num_experts_per_token, backend=backend)
    weights = jnp.take_along_axis(scores, plan.experts_nk, axis=-1)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, plan


def experts_planned(z_nl, weights_nk, plan, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, *, decode_tiling=None):
    """The routed experts on an expert-sorted `RoutePlan` (from `plan_from_experts` or the `route_plan` kernel):
    assignment (n, j) sits at row plan.rows_nk[n, j] and row r holds token plan.token_of_row_a[r]; grouped GLU and
    down matmuls, then each token gathers its k output rows and sums them weighted (f32, in j order).
    `decode_tiling`: the GPU kernels' `pallas_kernels.gmm.Tiling` for decode-sized calls (few rows per expert), e.g.
    another row tile or the group walk (`LatentMoE._decode_tiling`); None: the kernels' defaults. Only for the GPU
    kernel family, whose tiling it is (the XLA path ignores it)."""
    from pallas_kernels.gmm import DECODE_ROWS_PER_GROUP  # lazy: pallas_kernels imports k3jax

    n, k = plan.rows_nk.shape
    decode_sized = n * k <= DECODE_ROWS_PER_GROUP * cfg.num_experts
    tiling = decode_tiling if decode_sized else None
    sizes = plan.group_sizes_e
    hidden = grouped_glu(z_nl[plan.token_of_row_a], w1_elm, w3_elm, sizes, cfg, tiling=tiling)
    out_rows = gmm(hidden, w2_eml, sizes, preferred_element_type=wide(hidden.dtype), tiling=tiling)
    return (out_rows[plan.rows_nk] * weights_nk[..., None].astype(out_rows.dtype)).sum(axis=1)


# the plan-free expert kernels have no VJP
_no_grad_through_assigned = refuse_gradients(
    "the plan-free decode expert kernels (moe_decode_experts='assigned' / 'auto' on a one-token step) are "
    "inference-only; set moe_decode_experts='planned' to differentiate")
_no_grad_through_select = refuse_gradients(
    "the decode expert-selection kernel (moe_decode_select='kernel' on a one-token step) is inference-only; set "
    "moe_decode_select='xla' to differentiate")


def assigned_tilings(cfg: ModelConfig):
    """The plan-free GLU's and down kernel's tilings: the kernels' default (`assigned.ASSIGNED_TILING`) with
    `cfg.moe_decode_row_tile` rows and the load tiles of `cfg.moe_assigned_glu_tiling` / `moe_assigned_down_tiling`
    where set."""
    from pallas_kernels.moe.assigned import ASSIGNED_TILING  # lazy: pallas_kernels imports k3jax modules

    base = ASSIGNED_TILING._replace(tm=cfg.moe_decode_row_tile)
    out = []
    for name in ("moe_assigned_glu_tiling", "moe_assigned_down_tiling"):
        loads = parse_kernel_tiling(name, getattr(cfg, name))
        out.append(base if loads is None else base._replace(**dict(zip(("tk", "tn", "num_warps", "num_stages"),
                                                                        loads))))
    return tuple(out)


def experts_assigned(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, backend: str, *,
                     tiling=None, splits: int | None = None):
    """The routed experts of a decode step without the expert-sorted plan (`pallas_kernels.moe.assigned`): the
    fused GLU and the down kernels take the top-k ids as they are and write each assignment's row at n * k + j;
    each token sums its k rows weighted (f32, in j order, as `experts_planned`). Inference only; GPU kernels
    (or their interpreter), launched in `cfg.moe_assigned_order`. `tiling` (both kernels) / `splits`: overrides
    for benchmarks (default: `assigned_tilings(cfg)`, `cfg.moe_assigned_splits`)."""
    from pallas_kernels.moe import assigned  # lazy: pallas_kernels imports k3jax modules

    n, k = experts_nk.shape
    situ = cfg.hidden_act == "situ"
    glu_tiling, down_tiling = (tiling, tiling) if tiling else assigned_tilings(cfg)
    walk = dict(splits=splits or cfg.moe_assigned_splits, backend=backend, order=cfg.moe_assigned_order)
    z_nl, w1_elm, w3_elm, w2_eml = (_no_grad_through_assigned(a) for a in (z_nl, w1_elm, w3_elm, w2_eml))
    hidden = assigned.assigned_glu(z_nl, experts_nk, w1_elm, w3_elm, activation=cfg.hidden_act,
                                   beta1=cfg.activation_situ_beta if situ else None,
                                   beta2=cfg.activation_situ_linear_beta if situ else None, tiling=glu_tiling,
                                   **walk)
    out = assigned.assigned_down(hidden, experts_nk, w2_eml, out_dtype=wide(hidden.dtype), tiling=down_tiling,
                                 **walk)
    return (out[:n * k].reshape(n, k, -1) * weights_nk[..., None].astype(out.dtype)).sum(axis=1)


def experts_dense(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig):
    """Every expert on every token, combined with the sparse routing weights (tests and tiny runs only).
    MXFP4 weights are dequantized here (materialised in the compute dtype)."""
    if isinstance(w1_elm, MXFP4Experts):
        z_nl = inference_only(z_nl)
    w1_elm, w3_elm, w2_eml = (dense_expert_weights(w, z_nl.dtype) for w in (w1_elm, w3_elm, w2_eml))
    combine_ne = jnp.zeros((z_nl.shape[0], cfg.num_experts), weights_nk.dtype)
    combine_ne = combine_ne.at[jnp.arange(z_nl.shape[0])[:, None], experts_nk].add(weights_nk)
    hidden = glu(jnp.einsum("nl,elm->enm", z_nl, w1_elm), jnp.einsum("nl,elm->enm", z_nl, w3_elm), cfg)
    out = jnp.einsum("enm,eml->enl", hidden, w2_eml, preferred_element_type=wide(hidden.dtype))
    return jnp.einsum("enl,ne->nl", out, combine_ne)


class PackedExpertWeight(nnx.Variable):
    """MXFP4 bytes of the routed experts (E2M1 codes or E8M0 scales, uint8): inference-only state, not a gradient
    parameter (`cfg.expert_weights == 'mxfp4'`)."""


def _packed_experts(w: nnx.Param) -> tuple[PackedExpertWeight, PackedExpertWeight]:
    """Quantizes an initialised [E, in, out] expert stack to (packed [E, out, in/2], scales [E, out, in/32]),
    with the logical axes moved to match the HF orientation."""
    q = MXFP4Experts.quantize(w.get_value())
    e_axis, in_axis, out_axis = w.get_metadata()["out_sharding"]
    axes = (e_axis, out_axis, in_axis)
    return (PackedExpertWeight(q.packed, out_sharding=axes, eager_sharding=False),
            PackedExpertWeight(q.scales, out_sharding=axes, eager_sharding=False))


class LatentMoE(nnx.Module):
    """Routed experts held as `w1, w3 [E, L, M], w2 [E, M, L]` parameters, or with `cfg.expert_weights == 'mxfp4'`
    as packed bytes `wN_packed` u8 [E, out, in/2] + `wN_scale` u8 [E, out, in/32] (HF orientation; inference only:
    random init is the quantized normal init, loading fills them straight from an MXFP4 checkpoint)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e, m, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.jnp_param_dtype
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
        if cfg.expert_weights == "mxfp4":
            for name in ("w1", "w3", "w2"):
                packed, scales = _packed_experts(getattr(self, name))
                delattr(self, name)
                setattr(self, f"{name}_packed", packed)
                setattr(self, f"{name}_scale", scales)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.num_shared_experts * m, rngs=rngs)
        if cfg.record_routing_stats:  # this step's routing statistics, overwritten by every forward pass
            self.margin_counts = params.routing_stats((e, cfg.routing_histogram_bins), ("experts_router", None),
                                                      jnp.int32)
            self.expert_loads = params.routing_stats((e,), ("experts_router",), jnp.float32)
            # expert-parallel load per step: sharding.expert_parallel.STATS_FIELDS (max/mean rows per expert rank,
            # dropped rows, routed rows); the single-program path counts as one rank
            self.expert_parallel_stats = params.routing_stats((len(expert_parallel.STATS_FIELDS),), (None,),
                                                              jnp.float32)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(b * t, d).astype(dt)
        latent = cfg.routed_expert_hidden_size is not None
        plan_backend = self._plan_backend(b, t)
        select_backend = self._select_backend(b, t) if plan_backend is None else None
        if plan_backend is not None:  # decode-sized: the routing-plan kernel
            weights_nk, plan = route_planned(x_nd, self.router[...], self.router_bias[...], cfg, plan_backend)
        elif select_backend is not None:  # decode step of the plan-free experts: the selection kernel
            weights_nk, experts_nk = route_selected(x_nd, self.router[...], self.router_bias[...], cfg,
                                                    select_backend)
        else:
            weights_nk, experts_nk, scores_ne = route(x_nd, self.router[...], self.router_bias[...], cfg)
            if cfg.record_routing_stats:
                self._record_routing(scores_ne, experts_nk)
        z_nl = dense(x_nd, self.routed_expert_down_proj[...].astype(dt), cfg) if latent else x_nd
        if plan_backend is not None:
            w1, w3, w2 = (expert_weights(w, dt) for w in self.routed_expert_weights())
            u_nl = experts_planned(z_nl, weights_nk, plan, w1, w3, w2, cfg,
                                   decode_tiling=self._decode_tiling(t)).astype(dt)
        else:
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
        """The selection kernel's backend (`route_selected`) when `cfg.moe_decode_select == "kernel"` and the step
        takes the plan-free expert kernels (`_assigned_backend`), with ungrouped routing, no routing statistics and
        no expert parallelism; else None (the XLA `route`)."""
        cfg = self.cfg
        if cfg.moe_decode_select != "kernel" or cfg.num_expert_group > 1 or cfg.record_routing_stats:
            return None
        from pallas_kernels.moe import select  # lazy: pallas_kernels imports k3jax modules

        if b * t > select.MAX_TOKENS or cfg.num_experts > select.MAX_EXPERTS:
            return None
        if expert_parallel.active_mode(cfg, b, t) is not None:
            return None
        return self._assigned_backend((b * t, cfg.expert_input_size), b, t)

    def _plan_backend(self, b: int, t: int) -> str | None:
        """The `route_plan` kernel backend when `cfg.moe_route_impl == "pallas"` applies here (decode-sized,
        ungrouped, dropless, single program, no routing statistics), else None (the XLA `route`)."""
        cfg = self.cfg
        if cfg.moe_route_impl != "pallas" or cfg.moe_impl != "dropless" or cfg.num_expert_group > 1:
            return None
        from pallas_kernels.moe import MAX_EXPERTS, MAX_TOKENS  # lazy: pallas_kernels imports k3jax modules
        from sharding.mesh import gpu_kernel_backend

        if cfg.record_routing_stats or b * t > MAX_TOKENS or cfg.num_experts > MAX_EXPERTS:
            return None
        if expert_parallel.active_mode(cfg, b, t) is not None:
            return None
        return gpu_kernel_backend()

    def _decode_tiling(self, t: int):
        """The grouped matmuls' decode tiling when the config departs from the kernels' default
        (`cfg.moe_gmm_walk == "groups"` or `cfg.moe_decode_row_tile != 16`), else None: decode steps only (one
        token per sequence: a prefill or training batch can put hundreds of rows in one group, which one program
        would walk serially, and its backward would inherit the decode tiles), and only for the GPU kernel family
        (its tiling; the interpreter in tests), never for TPU or XLA."""
        from pallas_kernels.gmm import DECODE_TILING  # lazy: pallas_kernels imports k3jax

        cfg = self.cfg
        tiling = DECODE_TILING._replace(tm=cfg.moe_decode_row_tile, walk=cfg.moe_gmm_walk)
        return tiling if tiling != DECODE_TILING and t == 1 and gpu_kernels_here() else None

    def _assigned_backend(self, z_shape, b: int, t: int) -> str | None:
        """The GPU kernel backend ('gpu', or 'interpret' in tests) when the plan-free expert kernels apply: a decode
        step (t == 1) of the dropless single-program path with array weights on the GPU kernel family, at sizes
        `pallas_kernels.moe.assigned` takes, and `cfg.moe_decode_experts` "assigned" (or "auto" with at most
        `AUTO_MAX_ROWS_PER_EXPERT` rows per expert on average); else None (the planned path)."""
        cfg = self.cfg
        if cfg.moe_decode_experts == "planned" or cfg.moe_impl != "dropless" or t != 1:
            return None
        backend = gpu_kernel_backend_here()
        if cfg.expert_weights == "mxfp4" or backend is None:
            return None
        from pallas_kernels.moe import assigned  # lazy: pallas_kernels imports k3jax modules

        n, lat = z_shape
        m = cfg.moe_intermediate_size
        glu_tiling, down_tiling = assigned_tilings(cfg)
        if not (assigned.applies(n, lat, m, glu_tiling) and assigned.applies(n, m, lat, down_tiling)):
            return None
        if cfg.moe_decode_experts == "auto" and \
                n * cfg.num_experts_per_token > assigned.AUTO_MAX_ROWS_PER_EXPERT * cfg.num_experts:
            return None
        return backend

    def _routed_experts(self, z_nl, weights_nk, experts_nk, b: int, t: int) -> jax.Array:
        """Σ_j w_j E_{idx_j}(z) for the N = b*t tokens: expert-parallel (`sharding.expert_parallel`) when traced
        under a mesh whose 'expert' axis is > 1 and `moe_expert_parallel` allows it, else the single-program path.
        Records the expert-rank load statistics when the layer keeps them."""
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        w1, w3, w2 = (expert_weights(w, dt) for w in self.routed_expert_weights())
        ep = expert_parallel.active_mode(cfg, b, t)
        assigned_backend = self._assigned_backend(z_nl.shape, b, t) if ep is None else None
        if assigned_backend is not None:
            u_nl = experts_assigned(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg, assigned_backend).astype(dt)
            stats = expert_parallel.single_program_stats(experts_nk.size)
        elif ep is None:
            if cfg.moe_impl == "dense":
                u_nl = experts_dense(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg).astype(dt)
            else:
                u_nl = experts_dropless(z_nl, weights_nk, experts_nk, w1, w3, w2, cfg,
                                        decode_tiling=self._decode_tiling(t)).astype(dt)
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
        if self.cfg.expert_weights == "mxfp4":
            return tuple(MXFP4Experts(getattr(self, f"{n}_packed")[...], getattr(self, f"{n}_scale")[...])
                         for n in ("w1", "w3", "w2"))
        return self.w1[...], self.w3[...], self.w2[...]

    def _record_routing(self, scores_ne: jax.Array, experts_nk: jax.Array) -> None:
        """Histogram of this batch's routing margins (for Quantile Balancing) and the expert loads (metrics)."""
        cfg = self.cfg
        margins_ne = routing_margins(jax.lax.stop_gradient(scores_ne), self.router_bias[...],
                                     cfg.num_experts_per_token)
        self.margin_counts[...] = margin_histogram(margins_ne, num_bins=cfg.routing_histogram_bins)
        self.expert_loads[...] = jnp.zeros((cfg.num_experts,), jnp.float32).at[experts_nk.reshape(-1)].add(1.0)
