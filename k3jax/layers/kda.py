"""Kimi Delta Attention layer (docs/spec.md#kda): projections, causal depthwise short conv + SiLU, L2 norm,
per-channel decay gate (lower-bounded sigmoid for K3, softplus for Kimi-Linear), β, the delta-rule core
(`k3jax.ops.kda`), per-head RMSNorm and the sigmoid output gate (full rank for K3, low rank for Kimi-Linear).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import params
from k3jax.layers.norms import rms_normalize
from k3jax.numerics import upcast, wide
from k3jax.ops import kda as kda_ops
from k3jax.ops.backend import kernel_mesh
from k3jax.ops.conv import causal_depthwise_conv, conv_prologue, prologue_backend
from k3jax.ops.kda import l2_normalize
from k3jax.ops.linear import project as dense
from sharding import context_parallel, kda_kernel


class KDAState(NamedTuple):
    """Decode state of one KDA layer: the last W-1 pre-conv q/k/v inputs, stacked ``[B, W-1, 3, H*K]`` (q, k, v
    along axis 2, so a decode step runs one short conv and one history update for all three), and the f32
    recurrent state ``[B, H, K, V]``."""

    conv_bwcp: jax.Array
    state_bhkv: jax.Array


def init_kda_state(cfg: ModelConfig, batch_size: int) -> KDAState:
    """Zero decode state: empty conv history (dtype of activations) and a zero recurrent state (at least f32)."""
    p, w = cfg.kda_projection_size, cfg.kda_short_conv_kernel_size
    conv = jnp.zeros((batch_size, w - 1, 3, p), cfg.runtime.jnp_dtype)
    s = jnp.zeros((batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), wide(cfg.runtime.jnp_dtype))
    return KDAState(conv, s)


class KDA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, k, w, pd = (cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_short_conv_kernel_size,
                          cfg.runtime.jnp_param_dtype)
        p = h * k
        f32 = wide(pd)  # tensors the checkpoint stores in f32
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, params.normal(rngs, (d, h, k), ("embed", "kda_heads", "kda_head_dim"), pd))
        conv_std = 1.0 / math.sqrt(w)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, params.normal(rngs, (w, p), ("conv_window", "kda_proj"), f32, std=conv_std))
        self.f_a_proj = params.normal(rngs, (d, k), ("embed", "kda_gate_rank"), pd)
        self.f_b_proj = params.normal(rngs, (k, h, k), ("kda_gate_rank", "kda_heads", "kda_head_dim"), pd)
        # FLA-style init: A = U[1, 16]; dt = exp(U[log 1e-3, log 1e-1]) stored as inverse-softplus.
        self.A_log = params.from_array(
            jnp.log(jax.random.uniform(rngs.params(), (h,), f32, 1.0, 16.0)), ("kda_heads",))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h, k), f32, math.log(1e-3), math.log(1e-1)))
        self.dt_bias = params.from_array(dt + jnp.log(-jnp.expm1(-dt)), ("kda_heads", "kda_head_dim"))
        self.b_proj = params.normal(rngs, (d, h), ("embed", "kda_heads"), pd)
        if cfg.kda_output_gate == "full_rank":
            self.g_proj = params.normal(rngs, (d, h, k), ("embed", "kda_heads", "kda_head_dim"), pd)
        else:
            self.g_a_proj = params.normal(rngs, (d, k), ("embed", "kda_gate_rank"), pd)
            self.g_b_proj = params.normal(rngs, (k, h, k), ("kda_gate_rank", "kda_heads", "kda_head_dim"), pd)
        self.o_norm = params.constant(1.0, (k,), ("kda_head_dim",), f32)
        self.o_proj = params.normal(rngs, (h, k, d), ("kda_heads", "kda_head_dim", "embed"), pd, fan_in=p)

    def init_state(self, batch_size: int) -> KDAState:
        return init_kda_state(self.cfg, batch_size)

    def _project_inputs(self, x_btd: jax.Array) -> dict[str, jax.Array]:
        """Every projection of the layer input by weight name: q, k, v, the decay gate's f_a, β's b and the output
        gate's g (full rank) or g_a (low rank), in x's dtype."""
        gate = "g_proj" if self.cfg.kda_output_gate == "full_rank" else "g_a_proj"
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", gate)
        xs = {n: x_btd for n in names}
        if x_btd.shape[1] == 1:
            # decode: f_a and b each from their own copy of x, so XLA's dot merger cannot join their weights; it did,
            # and re-built the joined [D, K + H] weight in every step (a loop-invariant concatenate XLA does not
            # hoist after merging; k3_gpu B = 64: 0.996x the step time, 0.986x with the static AttnRes reads' mask
            # removed; RESULTS.md, 2026-12-02)
            xs["f_a_proj"], xs["b_proj"] = jax.lax.optimization_barrier((x_btd, x_btd))
        return {n: dense(xs[n], getattr(self, n)[...].astype(x_btd.dtype), self.cfg) for n in names}

    def _gate_logits(self, f_a_btk: jax.Array) -> jax.Array:
        """The decay gate's low-rank projection z = f_b(f_a(x)) [B,T,H,K] in the compute dtype, from f_a(x)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        return dense(f_a_btk, self.f_b_proj[...].astype(dt), cfg)

    def conv_kernels(self) -> jax.Array:
        """The q, k, v short-conv kernels stacked as [W, 3, H*K] (the layout of the stacked conv state)."""
        return jnp.stack([getattr(self, f"{name}_conv1d")[...] for name in "qkv"], axis=1)

    def _decay(self, f_a_btk: jax.Array) -> jax.Array:
        """Per-channel log-decay g [B,T,H,K] in f32: g_min·sigmoid(A·(z+dt)) or −A·softplus(z+dt), from f_a(x)."""
        cfg = self.cfg
        z = upcast(self._gate_logits(f_a_btk)) + upcast(self.dt_bias[...])
        a_h = jnp.exp(upcast(self.A_log[...]))[:, None]
        if cfg.kda_gate == "lower_bound":
            return cfg.kda_gate_lower_bound * jax.nn.sigmoid(a_h * z)
        return -a_h * jax.nn.softplus(z)

    def _output_gate(self, proj: dict[str, jax.Array]) -> jax.Array:
        """The output gate's logits [B,T,H,V] (before the sigmoid) from the input projections."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        if cfg.kda_output_gate == "full_rank":
            return proj["g_proj"]
        return dense(proj["g_a_proj"], self.g_b_proj[...].astype(dt), cfg)

    def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Training forward from a zero state. `segment_ids_bt` int [B, T] (optional) packs several documents
        per row: the short conv and the recurrent state restart wherever the id changes (`k3jax.ops.kda`).
        Traced under a mesh whose 'context' axis is > 1, the conv and the core run context-parallel
        (`sharding.context_parallel`: conv halo from the left neighbour, KCP affine state passing)."""
        cp_mesh = context_parallel.context_mesh(x_btd.shape[1], self.cfg.kda_short_conv_kernel_size - 1)
        return self._forward(x_btd, None, None, segment_ids_bt, cp_mesh, with_state=False)[0]

    def forward(self, x_btd: jax.Array, state: KDAState | None) -> tuple[jax.Array, KDAState]:
        """Runs T >= 1 tokens from `state` (None: zeros); returns the output and the state after the last token."""
        return self._forward(x_btd, state, None)

    def forward_cached(self, x_btd: jax.Array, state: KDAState, valid_len_b: jax.Array) -> tuple[jax.Array, KDAState]:
        """Like `forward`, but only the first `valid_len_b[b]` tokens of sequence b are real (right padding).

        Padded tokens are no-ops for the state: β = 0 and g = 0 there (the delta-rule write vanishes and nothing
        decays), and the conv history is the W-1 pre-conv inputs before each sequence's true end. A sequence with
        `valid_len == 0` keeps its state unchanged. Outputs at padded positions are meaningless. T == 1 (decode)
        uses the one-token step: the fused Pallas decode kernel on a GPU with the "pallas" core, else the XLA step;
        longer inputs the configured core.
        """
        return self._forward(x_btd, state, valid_len_b)

    def _forward(self, x_btd, state, valid_len_b, segment_ids_bt=None, cp_mesh=None, with_state=True):
        """`cp_mesh` (training only: zero state, no `valid_len_b`): run the conv and the core context-parallel on
        that mesh. `with_state=False` (the training forward): the conv histories are not formed (None)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        if cp_mesh is not None and (state is not None or valid_len_b is not None or with_state):
            raise ValueError("KDA: the context-parallel path is for the training forward (no state, no valid_len)")
        b, t, _ = x_btd.shape
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        x = x_btd.astype(dt)

        proj_in = self._project_inputs(x)

        def project(name):
            return proj_in[f"{name}_proj"].reshape(b, t, h * k)

        impl = kda_ops.resolve_impl(cfg)
        fused_backend = self._fused_decode_backend(state, t, with_state, cp_mesh)
        if fused_backend is not None:
            return self._decode_fused(x, state, valid_len_b, proj_in, fused_backend)

        prologue = None  # training: the backend of the fused conv → SiLU → L2 norm kernels, or None (XLA)
        if with_state:  # q, k, v through one short conv over the stacked [B, T, 3, H*K] (one history update)
            history = None if state is None else state.conv_bwcp.reshape(b, -1, 3 * h * k)
            proj = jnp.stack([project(name) for name in "qkv"], axis=2).reshape(b, t, 3 * h * k)
            kernel = self.conv_kernels().reshape(-1, 3 * h * k)
            y, new_history = causal_depthwise_conv(proj, kernel, history, segment_ids_bt)
            if valid_len_b is not None:
                new_history = history_at(history, proj, valid_len_b)
            q, k_, v = (y.astype(dt).reshape(b, t, 3, h, k)[:, :, i] for i in range(3))
            conv_bwcp = new_history.reshape(b, -1, 3, h * k)
        else:  # training: one conv per projection (no stacked copy of the activations)
            # the kernels give the "pallas" core's numerics; GSPMD would not partition them (no shard_map form yet)
            if cp_mesh is None and impl == "pallas" and kernel_mesh() is None:
                rt = cfg.runtime
                prologue = prologue_backend(rt.kda_conv_impl, t, h * k, k,
                                            max(rt.kda_conv_block_t, rt.kda_conv_bwd_block_t))

            def project_conv(name):
                proj, kernel = project(name), getattr(self, f"{name}_conv1d")[...]
                if prologue is not None:  # q and k come out normalised
                    return conv_prologue(proj, kernel, segment_ids_bt, head_dim=k, normalize=name != "v",
                                         backend=prologue, block_t=cfg.runtime.kda_conv_block_t,
                                         warps=cfg.runtime.kda_conv_warps,
                                         bwd_block_t=cfg.runtime.kda_conv_bwd_block_t,
                                         bwd_warps=cfg.runtime.kda_conv_bwd_warps).reshape(b, t, h, k)
                if cp_mesh is not None:
                    y = context_parallel.short_conv_context_parallel(proj, kernel, segment_ids_bt, mesh=cp_mesh)
                else:
                    y = causal_depthwise_conv(proj, kernel, None, segment_ids_bt)[0]
                return y.astype(dt).reshape(b, t, h, k)

            q, k_, v = (project_conv(name) for name in "qkv")
            conv_bwcp = None
        g = self._decay(proj_in["f_a_proj"])
        beta = jax.nn.sigmoid(upcast(proj_in["b_proj"]))
        if prologue is None:
            q, k_ = l2_normalize(q), l2_normalize(k_)
        if impl == "pallas":  # the kernel's numerics policy: model-dtype q/k/v operands, f32 state and accumulation
            q, k_, v = (x.astype(dt) for x in (q, k_, v))
        if valid_len_b is not None:
            valid_bt = jnp.arange(t)[None, :] < valid_len_b[:, None]
            g = jnp.where(valid_bt[:, :, None, None], g, 0.0)
            beta = jnp.where(valid_bt[:, :, None], beta, 0.0)
            if t == 1 and impl != "pallas":  # "pallas" decodes with its one-token step (kda_ops.kda)
                impl = "recurrent"
        core = kda_ops.kda
        if cp_mesh is not None:
            core = functools.partial(context_parallel.kda_context_parallel, mesh=cp_mesh)  # "pallas": the kernel
        elif impl == "pallas" and (mesh := kernel_mesh()) is not None:
            core = functools.partial(kda_kernel.kda_kernel_on_mesh, mesh=mesh)  # GSPMD cannot split a Pallas call
        o_bthv, new_s = core(
            q, k_, v, g, beta, scale=k ** -0.5, initial_state=None if state is None else state.state_bhkv,
            impl=impl, chunk_size=cfg.runtime.kda_chunk_size, segment_ids=segment_ids_bt)
        return self._output(self._output_gate(proj_in), o_bthv), KDAState(conv_bwcp, new_s)

    def _output(self, gate_bthv: jax.Array, o_bthv: jax.Array) -> jax.Array:
        """Per-head RMSNorm of the core's output, the sigmoid output gate (its logits `gate_bthv`) and o_proj."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        o = rms_normalize(o_bthv.astype(dt), cfg.rms_norm_eps) * upcast(self.o_norm[...])
        o = (o * jax.nn.sigmoid(upcast(gate_bthv))).astype(dt)
        return self._o_proj(o)

    def _o_proj(self, o_bthv: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        return dense(o_bthv.astype(dt), self.o_proj[...].astype(dt), cfg, contract=2)

    def _fused_decode_backend(self, state, t: int, with_state: bool, cp_mesh) -> str | None:
        """The decode kernel backend when `kda_decode_fusion` fuses the prologue and applies (one token with a
        state: `k3jax.ops.kda.fused_decode_backend`), else None."""
        if t != 1 or state is None or not with_state or cp_mesh is not None:
            return None
        return kda_ops.fused_decode_backend(self.cfg)

    def _decode_fused(self, x_btd, state: KDAState, valid_len_b, proj_in: dict[str, jax.Array], backend: str):
        """One token through the fused decode kernel (`k3jax.ops.kda.decode_fused`: conv + activations + delta
        step in one kernel)."""
        cfg, dt = self.cfg, self.cfg.runtime.jnp_dtype
        b = x_btd.shape[0]
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        proj_qkv = tuple(proj_in[f"{name}_proj"].reshape(b, h * k)  # [B, H*K] each: the kernel takes them unstacked
                         for name in "qkv")
        conv_qkv = tuple(getattr(self, f"{name}_conv1d")[...] for name in "qkv")  # [W, H*K] each
        z_bhk = self._gate_logits(proj_in["f_a_proj"])[:, 0]
        b_raw_bh = proj_in["b_proj"][:, 0]
        valid_b = jnp.ones((b,), jnp.int32) if valid_len_b is None else (valid_len_b > 0).astype(jnp.int32)
        history = state.conv_bwcp.astype(dt)
        gate_bp = self._output_gate(proj_in).reshape(b, h * k)
        epilogue = {}
        if cfg.runtime.kda_decode_fusion == "prologue_output":  # the output RMSNorm and gate in the kernel too
            epilogue = dict(out_gate_bp=gate_bp, out_norm_v=self.o_norm[...], out_eps=cfg.rms_norm_eps)
        o_bhv, new_s = kda_ops.decode_fused(
            proj_qkv, history, conv_qkv, z_bhk, self.A_log[...], self.dt_bias[...], b_raw_bh, valid_b,
            state.state_bhkv.astype(jnp.float32), scale=k ** -0.5, lower_bound=cfg.kda_gate_lower_bound,
            backend=backend, block_v=cfg.runtime.kda_decode_block_v, warps=cfg.runtime.kda_decode_warps, **epilogue)
        wm1 = history.shape[1]
        flat_history = history.reshape(b, wm1, 3 * h * k)
        new_history = history_at(flat_history, jnp.concatenate(proj_qkv, axis=-1)[:, None], valid_b)
        if epilogue:
            y = self._o_proj(o_bhv[:, None])
        else:
            y = self._output(gate_bp.reshape(b, 1, h, k), o_bhv[:, None].astype(dt))
        return y, KDAState(new_history.reshape(b, wm1, 3, h * k), new_s)


def history_at(history_bwp: jax.Array | None, x_btp: jax.Array, end_b: jax.Array) -> jax.Array:
    """The W-1 inputs before position `end_b[b]` of x (continuing `history`): rows end-(W-1) .. end-1 of
    [history, x]. With end == T this is the usual new history; with end == 0 it is the old history."""
    b, t, p = x_btp.shape
    if history_bwp is None:
        raise ValueError("history_at needs an explicit conv history (use KDA.init_state)")
    wm1 = history_bwp.shape[1]
    padded = jnp.concatenate([history_bwp.astype(x_btp.dtype), x_btp], axis=1)  # [B, W-1+T, P]
    end_b = jnp.clip(end_b.astype(jnp.int32), 0, t)
    if t == 1:  # decode: the shifted window or the old history (a select, no gather)
        return jnp.where((end_b > 0)[:, None, None], padded[:, 1:], padded[:, :wm1])
    idx_bw = end_b[:, None] + jnp.arange(wm1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(padded, idx_bw[:, :, None], axis=1)
