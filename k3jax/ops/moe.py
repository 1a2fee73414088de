"""The routed experts' computations and the one place the MoE layer's decode kernels are chosen: the dropless
expert-sorted plan (`plan_from_experts`, `experts_planned` on the grouped matmuls of `k3jax.ops.gmm`), the plan-free
decode kernels (`experts_assigned`, `pallas_kernels.moe.assigned`) and the decode expert selection kernel
(`route_selected`, `pallas_kernels.moe.select`), with the backends from `k3jax.ops.backend`. Expert parallelism
(`sharding.expert_parallel`) is the layer's choice, made before these."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig, parse_kernel_tiling
from k3jax.numerics import upcast, wide
from k3jax.ops import backend as backend_lib
from k3jax.ops.glu import grouped_glu
from k3jax.ops.gmm import DECODE_ROWS_PER_GROUP, DECODE_TILING, MXFP4Experts, gmm, refuse_gradients
from k3jax.ops.linear import unless_single_row
from pallas_kernels.moe import assigned, select

__all__ = ["RoutePlan", "assigned_backend", "assigned_tilings", "decode_tiling", "experts_assigned",
           "experts_dropless", "experts_planned", "inverse_permutation",
           "plan_from_experts", "route_selected", "router_logits", "select_backend", "take_rows"]


class RoutePlan(NamedTuple):
    """The expert-sorted row layout of a routing (the dropless grouped matmuls see each expert's rows together)."""

    experts_nk: jax.Array  # int32 [N, k]: chosen experts, best first
    rows_nk: jax.Array  # int32 [N, k]: row of each assignment in the expert-sorted layout
    group_sizes_e: jax.Array  # int32 [E]: assignments per expert
    token_of_row_a: jax.Array  # int32 [N * k]: the token at each expert-sorted row (rows_nk's inverse)
    assignment_of_row_a: jax.Array  # int32 [N * k]: the assignment n * k + j at each row (token_of_row_a * k + j)


# the plan-free expert kernels have no VJP
_no_grad_through_assigned = refuse_gradients(
    "the plan-free decode expert kernels (moe_decode_experts='assigned' / 'auto' on a one-token step) are "
    "inference-only; set moe_decode_experts='planned' to differentiate")
_no_grad_through_select = refuse_gradients(
    "the decode expert-selection kernel (moe_decode_select='kernel' on a one-token step) is inference-only; set "
    "moe_decode_select='xla' to differentiate")


def router_logits(x_nd: jax.Array, router_de: jax.Array) -> jax.Array:
    """x_f32 @ W_f32 [N, E]: the router's logits, before the sigmoid."""
    x_wide = upcast(x_nd)
    return unless_single_row(lambda x: x @ router_de.astype(x_wide.dtype), x_wide, 1)


# --------------------------------------------------------------------------------------------
# Choosing the decode kernels
# --------------------------------------------------------------------------------------------


def assigned_tilings(cfg: ModelConfig):
    """The plan-free GLU's and down kernel's tilings: the kernels' default (`assigned.ASSIGNED_TILING`) with
    `cfg.runtime.moe_decode_row_tile` rows and the load tiles of `cfg.runtime.moe_assigned_glu_tiling` /
    `moe_assigned_down_tiling` where set."""
    base = assigned.ASSIGNED_TILING._replace(tm=cfg.runtime.moe_decode_row_tile)
    out = []
    for name in ("moe_assigned_glu_tiling", "moe_assigned_down_tiling"):
        loads = parse_kernel_tiling(name, getattr(cfg.runtime, name))
        out.append(base if loads is None else base._replace(**dict(zip(("tk", "tn", "num_warps", "num_stages"),
                                                                        loads))))
    return tuple(out)


def assigned_backend(cfg: ModelConfig, z_shape, t: int) -> str | None:
    """The GPU kernel backend ('gpu', or 'interpret' in tests) when the plan-free expert kernels apply to the
    single-program path: a decode step (t == 1) of the dropless MoE with array weights on the GPU kernel family, at
    sizes `pallas_kernels.moe.assigned` takes, and `cfg.runtime.moe_decode_experts` "assigned" (or "auto" with at most
    `AUTO_MAX_ROWS_PER_EXPERT` rows per expert on average), without expert QAT; else None (the planned path)."""
    if cfg.runtime.moe_decode_experts == "planned" or cfg.runtime.moe_impl != "dropless" or t != 1:
        return None
    backend = backend_lib.gpu_kernel_backend_here()
    if cfg.runtime.expert_weights == "mxfp4" or backend is None or \
            (cfg.runtime.expert_qat, cfg.runtime.expert_act_qat) != ("none", "none"):
        return None  # the kernels decode packed bytes / do not fake-quantize: the planned path
    n, lat = z_shape
    m = cfg.moe_intermediate_size
    glu_tiling, down_tiling = assigned_tilings(cfg)
    if not (assigned.applies(n, lat, m, glu_tiling) and assigned.applies(n, m, lat, down_tiling)):
        return None
    if cfg.runtime.moe_decode_experts == "auto" and \
            n * cfg.num_experts_per_token > assigned.AUTO_MAX_ROWS_PER_EXPERT * cfg.num_experts:
        return None
    return backend


def select_backend(cfg: ModelConfig, b: int, t: int) -> str | None:
    """The selection kernel's backend (`route_selected`) when `cfg.runtime.moe_decode_select == "kernel"` and the
    step takes the plan-free expert kernels (`assigned_backend`), with ungrouped routing and no routing statistics;
    else None (the XLA `route`). The caller rules out expert parallelism first."""
    if cfg.runtime.moe_decode_select != "kernel" or cfg.num_expert_group > 1 or cfg.runtime.record_routing_stats:
        return None
    if b * t > select.MAX_TOKENS or cfg.num_experts > select.MAX_EXPERTS:
        return None
    return assigned_backend(cfg, (b * t, cfg.expert_input_size), t)


def decode_tiling(cfg: ModelConfig, t: int):
    """The grouped matmuls' decode tiling when the config departs from the kernels' default
    (`cfg.runtime.moe_decode_row_tile != 16`), else None: decode steps only (one token per sequence: a prefill or
    training batch can put hundreds of rows in one group, which one program would walk serially, and its backward would
    inherit the decode tiles), and only for the GPU kernel family (its tiling; the interpreter in tests), never for
    TPU or XLA."""
    tiling = DECODE_TILING._replace(tm=cfg.runtime.moe_decode_row_tile)
    return tiling if tiling != DECODE_TILING and t == 1 and backend_lib.gpu_kernel_backend_here() else None


# --------------------------------------------------------------------------------------------
# The experts
# --------------------------------------------------------------------------------------------


def route_selected(x_nd: jax.Array, router_de: jax.Array, bias_e: jax.Array, cfg: ModelConfig, backend: str):
    """`route`'s (weights, experts) with the sigmoid and the selection (biased top-k, weights, renormalisation) in
    one kernel (`pallas_kernels.moe.select`) after XLA's router matmul: decode steps of the plan-free experts,
    ungrouped routing. Inference only. (The router matmul inside that kernel too, 4 programs streaming the router
    weights for 16 tokens each, measured 1.029x the k3_gpu B = 64 step: RESULTS.md, 2026-12-02.)"""
    logits = _no_grad_through_select(router_logits(x_nd, router_de))
    return select.select_experts(logits, bias_e, cfg.num_experts_per_token, scale=cfg.routed_scaling_factor,
                                 renormalize=cfg.moe_renormalize, backend=backend)


def plan_from_experts(experts_nk: jax.Array, num_experts: int) -> RoutePlan:
    """The expert-sorted row plan of a routing, in XLA: a stable argsort of the assignments, its inverse (a scatter
    with distinct indices) and the group sizes. (Counting instead of sorting, a one-hot [N*k, E] and its running
    sum, gave the same rows and the same k3_gpu decode speed: RESULTS.md, 2026-11-30.)"""
    n, k = experts_nk.shape
    flat_expert = experts_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    return RoutePlan(experts_nk, inverse_permutation(order).reshape(n, k),
                     jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32), order // k, order)


@jax.custom_vjp
def take_rows(x_al: jax.Array, idx_b: jax.Array, readers_ak: jax.Array) -> jax.Array:
    """y[b] = x[idx[b]] (an out-of-range index reads a zero row), whose backward is a gather too.

    `readers_ak` [A, K] lists, for each row a of x, the positions b that read it (out-of-range entries: none), so
    dx[a] = Σ_j dy[readers[a, j]] (summed in f32). Autodiff would transpose the gather into a scatter-add: on GPU
    that adds with atomics (in the activations' dtype), on TPU a 16-bit scatter widens to 32 bits; the MoE row
    permutations cost ~0.3 s of a 7.9 s `k3_gpu` training step that way (benchmarks/RESULTS.md, 2026-12-04). Every
    row movement of the routed experts (the dropless plan, expert parallelism) goes through here."""
    return jnp.take(x_al, idx_b, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x_al, idx_b, readers_ak):
    return take_rows(x_al, idx_b, readers_ak), readers_ak


def _take_rows_bwd(readers_ak, dy_bl):
    d_akl = jnp.take(dy_bl, readers_ak, axis=0, mode="fill", fill_value=0)
    d_al = d_akl[:, 0] if readers_ak.shape[1] == 1 else upcast(d_akl).sum(axis=1).astype(dy_bl.dtype)
    return d_al, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def inverse_permutation(perm_a: jax.Array) -> jax.Array:
    """int32 [A]: inv[perm[i]] = i (an integer scatter with distinct indices: cheap, exact)."""
    n = perm_a.shape[0]
    return jnp.zeros((n,), jnp.int32).at[perm_a].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


def experts_dropless(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, *,
                     decode_tiling=None):
    """Σ_j w_j E_{idx_j}(z): rows sorted by expert, grouped matmuls, then each token gathers its k output rows and
    sums them weighted (f32, in j order): `experts_planned` on `plan_from_experts`. A gather, not a scatter-add: a
    GPU scatter-add adds with atomics in a run-dependent order, which made greedy decoding differ between identical
    runs (benchmarks/RESULTS.md, 2026-11-30). More tokens than `cfg.runtime.moe_token_chunk` (when set) run in
    pieces (`_experts_in_pieces`)."""
    chunk = cfg.runtime.moe_token_chunk
    if 0 < chunk < z_nl.shape[0]:
        return _experts_in_pieces(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg, chunk)
    return experts_planned(z_nl, weights_nk, plan_from_experts(experts_nk, cfg.num_experts), w1_elm, w3_elm, w2_eml,
                           cfg, decode_tiling=decode_tiling)


def _experts_in_pieces(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, chunk: int):
    """The dropless experts over pieces of `chunk` tokens, one after another, each rematerialised in the backward:
    the expert-sorted rows, GLU activations and their gradients exist for one piece at a time (at T = 131,072 and
    k = 8 one unchunked [N·k, 768] bf16 array is 1.5 GiB, and the backward holds several). Tokens are independent
    given the routing, so each row's output is the unchunked one. The weights enter the loop in f32 and are cast
    back inside each piece, so their gradients sum over the pieces in f32. N is padded to whole pieces with
    zero-weight rows, dropped from the result."""
    n = z_nl.shape[0]
    pieces = -(-n // chunk)
    pad = pieces * chunk - n
    stored = (w1_elm, w3_elm, w2_eml)
    packed = isinstance(w1_elm, MXFP4Experts)  # inference-only bytes: passed through as they are
    wide_ws = stored if packed else tuple(w.astype(jnp.float32) for w in stored)

    def split(a):
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(pieces, chunk, *a.shape[1:])

    @jax.checkpoint
    def piece(args):
        z, w, e = args
        ws = wide_ws if packed else tuple(x.astype(orig.dtype) for x, orig in zip(wide_ws, stored))
        return experts_planned(z, w, plan_from_experts(e, cfg.num_experts), *ws, cfg)

    out = jax.lax.map(piece, (split(z_nl), split(weights_nk), split(experts_nk)))
    return out.reshape(pieces * chunk, -1)[:n]


def experts_planned(z_nl, weights_nk, plan: RoutePlan, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, *,
                    decode_tiling=None):
    """The routed experts on an expert-sorted `RoutePlan`: assignment (n, j) sits at row plan.rows_nk[n, j] and row
    r holds token plan.token_of_row_a[r]; grouped GLU and down matmuls, then each token gathers its k output rows
    and sums them weighted (f32, in j order). `decode_tiling`: the GPU kernels' `pallas_kernels.gmm.Tiling` for
    decode-sized calls (few rows per expert), e.g. another row tile (`decode_tiling(cfg, t)`); None: the kernels'
    defaults. Only for the GPU kernel family, whose tiling it is (the XLA path ignores it)."""
    n, k = plan.rows_nk.shape
    decode_sized = n * k <= DECODE_ROWS_PER_GROUP * cfg.num_experts
    tiling = decode_tiling if decode_sized else None
    sizes = plan.group_sizes_e
    hidden = grouped_glu(take_rows(z_nl, plan.token_of_row_a, plan.rows_nk), w1_elm, w3_elm, sizes, cfg,
                         tiling=tiling)
    out_rows = gmm(hidden, w2_eml, sizes, preferred_element_type=wide(hidden.dtype), tiling=tiling)
    out_nkl = take_rows(out_rows, plan.rows_nk.reshape(-1), plan.assignment_of_row_a[:, None]).reshape(n, k, -1)
    return (out_nkl * weights_nk[..., None].astype(out_rows.dtype)).sum(axis=1)


def experts_assigned(z_nl, weights_nk, experts_nk, w1_elm, w3_elm, w2_eml, cfg: ModelConfig, backend: str, *,
                     tiling=None, splits: int | None = None):
    """The routed experts of a decode step without the expert-sorted plan (`pallas_kernels.moe.assigned`): the
    fused GLU and the down kernels take the top-k ids as they are and write each assignment's row at n * k + j;
    each token sums its k rows weighted (f32, in j order, as `experts_planned`). Inference only; GPU kernels
    (or their interpreter), launched in `cfg.runtime.moe_assigned_order`. `tiling` (both kernels) / `splits`: overrides
    for benchmarks (default: `assigned_tilings(cfg)`, `cfg.runtime.moe_assigned_splits`)."""
    n, k = experts_nk.shape
    situ = cfg.hidden_act == "situ"
    glu_tiling, down_tiling = (tiling, tiling) if tiling else assigned_tilings(cfg)
    run = cfg.runtime
    walk = dict(splits=splits or run.moe_assigned_splits, backend=backend, order=run.moe_assigned_order)
    z_nl, w1_elm, w3_elm, w2_eml = (_no_grad_through_assigned(a) for a in (z_nl, w1_elm, w3_elm, w2_eml))
    hidden = assigned.assigned_glu(z_nl, experts_nk, w1_elm, w3_elm, activation=cfg.hidden_act,
                                   beta1=cfg.activation_situ_beta if situ else None,
                                   beta2=cfg.activation_situ_linear_beta if situ else None, tiling=glu_tiling,
                                   **walk)
    out = assigned.assigned_down(hidden, experts_nk, w2_eml, out_dtype=wide(hidden.dtype), tiling=down_tiling,
                                 **walk)
    return (out[:n * k].reshape(n, k, -1) * weights_nk[..., None].astype(out.dtype)).sum(axis=1)
