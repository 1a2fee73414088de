"""Independent float64 NumPy reference of the Kimi K3 text backbone (docs/spec.md).

Written straight from the specification, deliberately naive (token-by-token KDA recurrence, full attention
matrices, per-token expert loops) and sharing no code with `k3jax`: it is the oracle the fast implementation is
tested against.

Weights are a dict of NumPy arrays keyed by the HF checkpoint tensor names of docs/spec.md#checkpoint *without* the
`language_model.` prefix (e.g. `model.layers.3.self_attn.q_a_proj.weight`). Linear weights are torch `[out, in]`,
so a linear layer is `x @ W.T`. Every weight is cast to float64 on use and all arithmetic is float64.

`cfg` is any object with the config attributes named in the functions below (a `ModelConfig` dataclass or a
`types.SimpleNamespace`); it is only read. A few optional attributes have spec defaults (see `_opt`).

Public API
  rms_norm, silu, sigmoid, softplus, situ_glu, silu_glu, l2norm
  attn_res(sources, norm_w, proj_w, eps)                  #attn-res
  kda_short_conv, kda_recurrence, kda_layer(w, prefix, x_td, cfg)   #kda
  mla_layer(w, prefix, x_td, cfg)                         #mla
  route(w, prefix, x_nd, cfg), moe_layer(w, prefix, x_nd, cfg), dense_mlp(w, prefix, x_nd, cfg)   #moe
  forward(w, cfg, ids_bt) -> logits [B, T, V] float64     #attn-res
  make_random_weights(cfg, seed=0, a_log_len=None) -> dict of float32 arrays with the exact checkpoint names
"""

from __future__ import annotations

import numpy as np

# Defaults for attributes a cfg object might not carry (values from docs/spec.md#configs).
_DEFAULTS = {
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "kda_gate": "lower_bound",
    "kda_gate_lower_bound": -5.0,
    "kda_output_gate": "full_rank",
    "mla_use_output_gate": True,
    "mla_lora_norm_eps": 1e-6,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "attn_res_block_size": None,
    "routed_expert_hidden_size": None,
    "q_lora_rank": None,
    "num_shared_experts": 0,
    "tie_word_embeddings": False,
}


def _opt(cfg, name):
    return getattr(cfg, name, _DEFAULTS[name])


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _join(prefix: str, name: str) -> str:
    if prefix and not prefix.endswith("."):
        prefix = prefix + "."
    return prefix + name


def _w(w: dict, prefix: str, name: str) -> np.ndarray:
    """Fetch a tensor and cast it to float64."""
    return _f64(w[_join(prefix, name)])


def _linear(w: dict, prefix: str, name: str, x: np.ndarray) -> np.ndarray:
    """torch-layout linear: x @ W.T with W = w[prefix + name + '.weight'] of shape [out, in]."""
    return x @ _w(w, prefix, name + ".weight").T


# --------------------------------------------------------------------------------------------------------------
# Elementwise pieces
# --------------------------------------------------------------------------------------------------------------


def sigmoid(x):
    """Numerically safe logistic function in float64."""
    x = _f64(x)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def silu(x):
    x = _f64(x)
    return x * sigmoid(x)


def softplus(x):
    """log(1 + e^x), stable for large |x| (used by the Kimi-Linear gate, §3.2)."""
    x = _f64(x)
    return np.logaddexp(0.0, x)


def rms_norm(x, weight, eps):
    """§3 Numerics: RMSNorm(x) = w * (x * rsqrt(mean(x^2) + eps)) over the last axis (float64, so the cast-back
    before the gain is a no-op). `weight=None` gives the gain-free norm used for AttnRes keys."""
    x = _f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else _f64(weight) * y


def l2norm(x, eps=1e-6):
    """§3 Numerics / §3.2: x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    x = _f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(g, u, beta1=4.0, beta2=25.0):
    """§3.4: SiTU(g, u) = beta1*tanh(g/beta1)*sigmoid(g) * beta2*tanh(u/beta2); the sigmoid sees the uncapped g,
    so |SiTU| < beta1*beta2."""
    g = _f64(g)
    u = _f64(u)
    return beta1 * np.tanh(g / beta1) * sigmoid(g) * beta2 * np.tanh(u / beta2)


def silu_glu(g, u):
    """SwiGLU: SiLU(g) * u (hidden_act == "silu", Kimi-Linear)."""
    return silu(g) * _f64(u)


def _glu(cfg, g, u):
    act = _opt(cfg, "hidden_act")
    if act == "situ":
        return situ_glu(g, u, _opt(cfg, "activation_situ_beta"), _opt(cfg, "activation_situ_linear_beta"))
    if act == "silu":
        return silu_glu(g, u)
    raise ValueError(f"unknown hidden_act {act!r}")


# --------------------------------------------------------------------------------------------------------------
# Block AttnRes (§3.1)
# --------------------------------------------------------------------------------------------------------------


def attn_res(sources, norm_w, proj_w, eps):
    """§3.1 `AttnRes(x, bank; proj, norm)`: sources V = [bank..., x] (each [..., D]);
    keys K = V * rsqrt(mean(V^2) + eps) (no gain); score = K . (norm.weight ⊙ proj.weight[0]) (no 1/sqrt(d));
    p = softmax over the sources; out = sum_s p_s * V_s (raw values)."""
    V = np.stack([_f64(s) for s in sources], axis=0)  # [S, ..., D]
    K = rms_norm(V, None, eps)
    query = _f64(norm_w).reshape(-1) * _f64(proj_w).reshape(-1)  # proj is [1, D]
    scores = K @ query  # [S, ...]
    scores = scores - scores.max(axis=0, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=0, keepdims=True)
    return np.sum(p[..., None] * V, axis=0)


# --------------------------------------------------------------------------------------------------------------
# KDA (§3.2)
# --------------------------------------------------------------------------------------------------------------


def kda_short_conv(x_tc, kernel):
    """§2/§3.2 depthwise causal conv without bias: kernel [C, 1, W] (or [C, W]); tap W-1 multiplies the current
    token, tap W-1-j the token j steps back (zero padding before the sequence). Returns [T, C] (no activation)."""
    x = _f64(x_tc)
    k = _f64(kernel).reshape(x.shape[-1], -1)  # [C, W]
    T, W = x.shape[0], k.shape[1]
    y = np.zeros_like(x)
    for t in range(T):
        for j in range(W):  # j = how many steps back
            if t - j >= 0:
                y[t] += k[:, W - 1 - j] * x[t - j]
    return y


def kda_recurrence(q, k, v, g, beta, initial_state=None):
    """§3.2 naive KDA recurrence for one sequence.
    q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H, dk] log-decay; beta: [T, H]; initial_state: [H, dk, dv] or None.
    Per head, per token: S = Diag(exp g_t) S (decay first); S = S + k_t (beta_t (v_t - S^T k_t))^T (delta rule
    against the decayed state); o_t = S^T q_t (read after the update).
    Returns (o [T, H, dv], final state [H, dk, dv])."""
    q, k, v, g, beta = (_f64(a) for a in (q, k, v, g, beta))
    T, H, dk = q.shape
    dv = v.shape[-1]
    S_all = np.zeros((H, dk, dv)) if initial_state is None else _f64(initial_state).copy()
    o = np.zeros((T, H, dv))
    for h in range(H):
        S = S_all[h]
        for t in range(T):
            S = np.exp(g[t, h])[:, None] * S
            err = v[t, h] - S.T @ k[t, h]
            S = S + np.outer(k[t, h], beta[t, h] * err)
            o[t, h] = S.T @ q[t, h]
        S_all[h] = S
    return o, S_all


def _a_log(w, prefix, H):
    """A_log may be stored as [128] with a zero tail, [H], or [1, 1, H, 1]: flatten, keep the first H (§5)."""
    return _w(w, prefix, "A_log").reshape(-1)[:H]


def kda_gate(w, prefix, x_td, cfg):
    """§3.2 log-decay g [T, H, dk]. z = f_b_proj(f_a_proj(x)).
    lower_bound (K3): g = g_min * sigmoid(exp(A_log[h]) * (z + dt_bias[h, :]));
    softplus (Kimi-Linear): g = -exp(A_log[h]) * softplus(z + dt_bias[h, :])."""
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    T = x_td.shape[0]
    z = _linear(w, prefix, "f_b_proj", _linear(w, prefix, "f_a_proj", x_td)).reshape(T, H, dk)
    dt_bias = _w(w, prefix, "dt_bias").reshape(H, dk)
    A = np.exp(_a_log(w, prefix, H))[None, :, None]  # [1, H, 1]
    kind = _opt(cfg, "kda_gate")
    if kind == "lower_bound":
        return _opt(cfg, "kda_gate_lower_bound") * sigmoid(A * (z + dt_bias))
    if kind == "softplus":
        return -A * softplus(z + dt_bias)
    raise ValueError(f"unknown kda_gate {kind!r}")


def kda_layer(w, prefix, x_td, cfg):
    """§3.2 KDA layer on ONE sequence x [T, D] (already input_layernorm'ed); prefix e.g. 'model.layers.0.self_attn.'.
    q/k/v = SiLU(conv(proj(x))); q = l2norm(q)*dk^-0.5; k = l2norm(k); beta = sigmoid(b_proj(x));
    naive recurrence; o = RMSNorm_head(o; o_norm, rms_norm_eps) * sigmoid(gate); y = o_proj(o).
    gate = g_proj(x) (full_rank) or g_b_proj(g_a_proj(x)) (low_rank). The conv activation is always SiLU."""
    x = _f64(x_td)
    T = x.shape[0]
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    dv = dk

    def branch(name):
        pre = _linear(w, prefix, f"{name}_proj", x)
        return silu(kda_short_conv(pre, _w(w, prefix, f"{name}_conv1d.weight")))

    q = l2norm(branch("q").reshape(T, H, dk)) * dk**-0.5
    k = l2norm(branch("k").reshape(T, H, dk))
    v = branch("v").reshape(T, H, dv)
    g = kda_gate(w, prefix, x, cfg)
    beta = sigmoid(_linear(w, prefix, "b_proj", x))  # [T, H]

    o, _ = kda_recurrence(q, k, v, g, beta)
    o = rms_norm(o, _w(w, prefix, "o_norm.weight"), cfg.rms_norm_eps)  # per head over dv

    kind = _opt(cfg, "kda_output_gate")
    if kind == "full_rank":
        gate = _linear(w, prefix, "g_proj", x)
    elif kind == "low_rank":
        gate = _linear(w, prefix, "g_b_proj", _linear(w, prefix, "g_a_proj", x))
    else:
        raise ValueError(f"unknown kda_output_gate {kind!r}")
    o = o * sigmoid(gate).reshape(T, H, dv)
    return _linear(w, prefix, "o_proj", o.reshape(T, H * dv))


# --------------------------------------------------------------------------------------------------------------
# MLA (§3.3)
# --------------------------------------------------------------------------------------------------------------


def mla_layer(w, prefix, x_td, cfg):
    """§3.3 gated MLA with NoPE on ONE sequence x [T, D]; prefix e.g. 'model.layers.3.self_attn.'.
    q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None) -> [T, H, nope+rope];
    c = kv_a_proj_with_mqa(x) = [latent | k_r]; kv = kv_b_proj(kv_a_layernorm(latent)) -> per head [k_nope | v];
    K = [k_nope | k_r] (k_r shared by all heads, never rotated); causal softmax with scale (nope+rope)^-0.5;
    o *= sigmoid(g_proj(x)) if mla_use_output_gate; y = o_proj(o). LoRA norms use mla_lora_norm_eps."""
    x = _f64(x_td)
    T = x.shape[0]
    H = cfg.num_attention_heads
    dn, dr, dvh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lora_eps = _opt(cfg, "mla_lora_norm_eps")
    r = cfg.kv_lora_rank

    if _opt(cfg, "q_lora_rank") is None:
        q = _linear(w, prefix, "q_proj", x)
    else:
        qa = rms_norm(_linear(w, prefix, "q_a_proj", x), _w(w, prefix, "q_a_layernorm.weight"), lora_eps)
        q = _linear(w, prefix, "q_b_proj", qa)
    q = q.reshape(T, H, dn + dr)

    c = _linear(w, prefix, "kv_a_proj_with_mqa", x)  # [T, r + dr]
    latent, k_r = c[:, :r], c[:, r:]
    kv = _linear(w, prefix, "kv_b_proj", rms_norm(latent, _w(w, prefix, "kv_a_layernorm.weight"), lora_eps))
    kv = kv.reshape(T, H, dn + dvh)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    K = np.concatenate([k_nope, np.broadcast_to(k_r[:, None, :], (T, H, dr))], axis=-1)  # [T, H, dn+dr]

    scale = (dn + dr) ** -0.5
    o = np.zeros((T, H, dvh))
    for h in range(H):
        s = (q[:, h] @ K[:, h].T) * scale  # [Tq, Tk]
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p = p / p.sum(axis=-1, keepdims=True)
        o[:, h] = p @ v[:, h]
    o = o.reshape(T, H * dvh)
    if _opt(cfg, "mla_use_output_gate"):
        o = o * sigmoid(_linear(w, prefix, "g_proj", x))
    return _linear(w, prefix, "o_proj", o)


# --------------------------------------------------------------------------------------------------------------
# FFNs (§3.4)
# --------------------------------------------------------------------------------------------------------------


def dense_mlp(w, prefix, x_nd, cfg):
    """§3.4 dense MLP / shared expert: down_proj(act(gate_proj(x), up_proj(x))); prefix e.g. 'model.layers.0.mlp.'."""
    x = _f64(x_nd)
    hidden = _glu(cfg, _linear(w, prefix, "gate_proj", x), _linear(w, prefix, "up_proj", x))
    return _linear(w, prefix, "down_proj", hidden)


def _topk_desc(values, k):
    """Indices of the k largest entries, largest first; ties broken by the lower index (stable)."""
    return np.argsort(-values, kind="stable")[:k]


def route(w, prefix, x_nd, cfg):
    """§3.4 router; prefix e.g. 'model.layers.1.block_sparse_moe.'. x [N, D] (full width).
    s = sigmoid(x @ gate.weight^T); selection on s + e_score_correction_bias (group-limited as DeepSeek-V3 when
    num_expert_group > 1: group score = sum of the top-2 biased scores, keep topk_group groups, others -> -inf);
    weights = s[idx] (UNBIASED), / (sum + 1e-20) if moe_renormalize, * routed_scaling_factor.
    Returns (idx [N, K] int64, largest biased score first; weights [N, K] float64)."""
    x = _f64(x_nd)
    s = sigmoid(_linear(w, prefix, "gate", x))  # [N, E]
    bias = _w(w, prefix, "gate.e_score_correction_bias").reshape(-1)
    biased = s + bias
    N, E = s.shape
    K = cfg.num_experts_per_token
    G = _opt(cfg, "num_expert_group") or 1
    kg = _opt(cfg, "topk_group") or G
    idx = np.zeros((N, K), dtype=np.int64)
    for n in range(N):
        sel = biased[n].copy()
        if G > 1:
            per = sel.reshape(G, E // G)
            top2 = min(2, E // G)
            group_score = np.array([np.sum(np.sort(per[gi])[::-1][:top2]) for gi in range(G)])
            keep = _topk_desc(group_score, kg)
            mask = np.full(G, True)
            mask[keep] = False
            per = per.copy()
            per[mask] = -np.inf
            sel = per.reshape(E)
        idx[n] = _topk_desc(sel, K)
    weights = np.take_along_axis(s, idx, axis=1)
    if _opt(cfg, "moe_renormalize"):
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def _expert(w, prefix, e, z, cfg):
    """E(z) = w2(act(w1 z, w3 z)) on a single vector z."""
    ep = _join(prefix, f"experts.{e}.")
    return _linear(w, ep, "w2", _glu(cfg, _linear(w, ep, "w1", z), _linear(w, ep, "w3", z)))


def moe_layer(w, prefix, x_nd, cfg):
    """§3.4 Stable LatentMoE on x [N, D]; prefix e.g. 'model.layers.1.block_sparse_moe.'.
    Latent (routed_expert_hidden_size set): z = routed_expert_down_proj(x); u = sum_j w_j E_j(z);
    y = routed_expert_up_proj(RMSNorm(u; routed_expert_norm, rms_norm_eps)) + shared(x) (norm skipped if
    latent_moe_use_norm is False). Without latent: y = sum_j w_j E_j(x) + shared(x). Shared experts are unweighted
    and see the full-width input."""
    x = _f64(x_nd)
    idx, wts = route(w, prefix, x, cfg)
    latent = _opt(cfg, "routed_expert_hidden_size") is not None
    z = _linear(w, prefix, "routed_expert_down_proj", x) if latent else x
    u = np.zeros_like(z)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            u[n] += wts[n, j] * _expert(w, prefix, int(idx[n, j]), z[n], cfg)
    if latent:
        if _opt(cfg, "latent_moe_use_norm"):
            u = rms_norm(u, _w(w, prefix, "routed_expert_norm.weight"), cfg.rms_norm_eps)
        y = _linear(w, prefix, "routed_expert_up_proj", u)
    else:
        y = u
    if _opt(cfg, "num_shared_experts"):
        y = y + dense_mlp(w, _join(prefix, "shared_experts."), x, cfg)
    return y


# --------------------------------------------------------------------------------------------------------------
# Whole model (§3.1)
# --------------------------------------------------------------------------------------------------------------


def is_mla_layer(cfg, l):
    """full_attn_layers is 1-based (§1): 0-based layer l is MLA iff l + 1 is listed."""
    return (l + 1) in tuple(cfg.full_attn_layers)


def _strip_language_model(w):
    if "model.embed_tokens.weight" in w:
        return w
    pre = "language_model."
    return {k[len(pre):]: v for k, v in w.items() if k.startswith(pre)}


def forward(w, cfg, ids_bt, return_hidden=False, inputs_embeds=None, return_blocks=False):
    """§3.1 full text forward: ids [B, T] -> logits [B, T, V] float64 (`inputs_embeds` [B, T, D]: these instead of
    the ids' embedding rows, as a multimodal prompt with image tokens merged in).
    With attn_res_block_size set, the Block-AttnRes wiring of §3.1 exactly (bank snapshot pushed at l % block == 0,
    before that layer's attention, the live partial sum restarting from the attention output); otherwise plain
    pre-norm residuals h += attn(ln1(h)); h += ffn(ln2(h)). Final: logits = lm_head(norm(h)) (embed if tied).
    With return_hidden=True also returns the final pre-norm hidden states [B, T, D]; with return_blocks=True (Block
    AttnRes) also the block outputs [B, N, T, D]: block n (1-based) is the sum of its layers' outputs, i.e. bank
    entry n for n < N and the live partial sum after the last layer for the last block N."""
    w = _strip_language_model(w)
    ids = np.asarray(ids_bt)
    if ids.ndim == 1:
        ids = ids[None]
    B, T = ids.shape
    eps = cfg.rms_norm_eps
    block = _opt(cfg, "attn_res_block_size")
    embed = _w(w, "", "model.embed_tokens.weight")
    head = embed if _opt(cfg, "tie_word_embeddings") else _w(w, "", "lm_head.weight")

    def attn(l, x_td):
        p = f"model.layers.{l}.self_attn."
        return mla_layer(w, p, x_td, cfg) if is_mla_layer(cfg, l) else kda_layer(w, p, x_td, cfg)

    def ffn(l, x_td):
        if l < cfg.first_k_dense_replace:
            return dense_mlp(w, f"model.layers.{l}.mlp.", x_td, cfg)
        return moe_layer(w, f"model.layers.{l}.block_sparse_moe.", x_td, cfg)

    def ln(l, name, x):
        return rms_norm(x, _w(w, "", f"model.layers.{l}.{name}.weight"), eps)

    def res(l, name, live, bank):
        lp = f"model.layers.{l}." if l is not None else "model."
        norm_w, proj_w = _w(w, "", lp + f"{name}_norm.weight"), _w(w, "", lp + f"{name}_proj.weight")
        return attn_res(list(bank) + [live], norm_w, proj_w, eps)

    logits = np.zeros((B, T, head.shape[0]))
    hidden = np.zeros((B, T, embed.shape[1]))
    blocks = []
    for b in range(B):
        h = embed[ids[b]] if inputs_embeds is None else _f64(inputs_embeds[b])  # [T, D]
        if block is None:
            for l in range(cfg.num_hidden_layers):
                h = h + attn(l, ln(l, "input_layernorm", h))
                h = h + ffn(l, ln(l, "post_attention_layernorm", h))
        else:
            bank = []
            for l in range(cfg.num_hidden_layers):
                prefix = h
                x = h if not bank else res(l, "self_attention_res", prefix, bank)
                if l % block == 0:
                    bank.append(prefix)  # snapshot BEFORE this layer's attention
                    prefix = None
                a = attn(l, ln(l, "input_layernorm", x))
                prefix = a if prefix is None else prefix + a
                x = res(l, "mlp_res", prefix, bank)
                prefix = prefix + ffn(l, ln(l, "post_attention_layernorm", x))
                h = prefix
            blocks.append(np.stack(bank[1:] + [h]))
            h = res(None, "output_attn_res", h, bank)
        hidden[b] = h
        logits[b] = rms_norm(h, _w(w, "", "model.norm.weight"), eps) @ head.T
    out = (logits,) + ((hidden,) if return_hidden else ()) + ((np.stack(blocks),) if return_blocks else ())
    return out if len(out) > 1 else logits


# --------------------------------------------------------------------------------------------------------------
# Random weights with the exact checkpoint names
# --------------------------------------------------------------------------------------------------------------


def weight_shapes(cfg, a_log_len=None):
    """Ordered {name: shape} of every text tensor for cfg (§2 names, no `language_model.` prefix).
    Kinds (used by make_random_weights for the init): see `_init_kind`."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D)}
    block = _opt(cfg, "attn_res_block_size")
    Hk, dk = cfg.kda_num_heads, cfg.kda_head_dim
    P, W = Hk * dk, cfg.kda_short_conv_kernel_size
    H = cfg.num_attention_heads
    dn, dr, dvh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    r, qr = cfg.kv_lora_rank, _opt(cfg, "q_lora_rank")
    E, M = cfg.num_experts, cfg.moe_intermediate_size
    L = _opt(cfg, "routed_expert_hidden_size")
    S = _opt(cfg, "num_shared_experts") or 0
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        if block is not None:
            shapes[p + "self_attention_res_norm.weight"] = (D,)
            shapes[p + "self_attention_res_proj.weight"] = (1, D)
            shapes[p + "mlp_res_norm.weight"] = (D,)
            shapes[p + "mlp_res_proj.weight"] = (1, D)
        a = p + "self_attn."
        if is_mla_layer(cfg, l):
            if qr is None:
                shapes[a + "q_proj.weight"] = (H * (dn + dr), D)
            else:
                shapes[a + "q_a_proj.weight"] = (qr, D)
                shapes[a + "q_a_layernorm.weight"] = (qr,)
                shapes[a + "q_b_proj.weight"] = (H * (dn + dr), qr)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (r + dr, D)
            shapes[a + "kv_a_layernorm.weight"] = (r,)
            shapes[a + "kv_b_proj.weight"] = (H * (dn + dvh), r)
            if _opt(cfg, "mla_use_output_gate"):
                shapes[a + "g_proj.weight"] = (H * dvh, D)
            shapes[a + "o_proj.weight"] = (D, H * dvh)
        else:
            for n in ("q", "k", "v"):
                shapes[a + f"{n}_proj.weight"] = (P, D)
            for n in ("q", "k", "v"):
                shapes[a + f"{n}_conv1d.weight"] = (P, 1, W)
            shapes[a + "f_a_proj.weight"] = (dk, D)
            shapes[a + "f_b_proj.weight"] = (P, dk)
            shapes[a + "dt_bias"] = (P,)
            shapes[a + "A_log"] = (max(Hk, a_log_len or 0),)
            shapes[a + "b_proj.weight"] = (Hk, D)
            if _opt(cfg, "kda_output_gate") == "low_rank":
                shapes[a + "g_a_proj.weight"] = (dk, D)
                shapes[a + "g_b_proj.weight"] = (P, dk)
            else:
                shapes[a + "g_proj.weight"] = (P, D)
            shapes[a + "o_norm.weight"] = (dk,)
            shapes[a + "o_proj.weight"] = (D, P)
        if l < cfg.first_k_dense_replace:
            m = p + "mlp."
            I = cfg.intermediate_size
            shapes[m + "gate_proj.weight"] = (I, D)
            shapes[m + "up_proj.weight"] = (I, D)
            shapes[m + "down_proj.weight"] = (D, I)
        else:
            m = p + "block_sparse_moe."
            shapes[m + "gate.weight"] = (E, D)
            shapes[m + "gate.e_score_correction_bias"] = (E,)
            if L is not None:
                shapes[m + "routed_expert_down_proj.weight"] = (L, D)
                shapes[m + "routed_expert_up_proj.weight"] = (D, L)
                if _opt(cfg, "latent_moe_use_norm"):
                    shapes[m + "routed_expert_norm.weight"] = (L,)
            width = D if L is None else L
            for e in range(E):
                shapes[m + f"experts.{e}.w1.weight"] = (M, width)
                shapes[m + f"experts.{e}.w3.weight"] = (M, width)
                shapes[m + f"experts.{e}.w2.weight"] = (width, M)
            if S:
                shapes[m + "shared_experts.gate_proj.weight"] = (S * M, D)
                shapes[m + "shared_experts.up_proj.weight"] = (S * M, D)
                shapes[m + "shared_experts.down_proj.weight"] = (D, S * M)
    shapes["model.norm.weight"] = (D,)
    if block is not None:
        shapes["model.output_attn_res_norm.weight"] = (D,)
        shapes["model.output_attn_res_proj.weight"] = (1, D)
    if not _opt(cfg, "tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, D)
    return shapes


def make_random_weights(cfg, seed=0, a_log_len=None):
    """Complete random float32 weight dict for cfg with the exact §2 names (no `language_model.` prefix).
    Init: linear [out, in] ~ N(0, 1/in); embedding ~ N(0, 1); conv [P,1,W] ~ N(0, 1/W); every norm gain
    (incl. o_norm, routed_expert_norm, AttnRes norms) ~ 1 + 0.1 N; AttnRes proj ~ 0.5 N; A_log = log U[1, 16]
    for the Hk used entries, zero-padded to a_log_len if that is larger; dt_bias ~ 0.1 N; router bias ~ 0.1 N."""
    rng = np.random.default_rng(seed)
    Hk = cfg.kda_num_heads
    out = {}
    for name, shape in weight_shapes(cfg, a_log_len).items():
        if name.endswith("A_log"):
            a = np.zeros(shape)
            a[:Hk] = np.log(rng.uniform(1.0, 16.0, size=Hk))
        elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name.endswith("_res_proj.weight"):
            a = 0.5 * rng.standard_normal(shape)
        elif len(shape) == 1:  # every remaining 1-D tensor is a norm gain
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        elif len(shape) == 3:  # conv kernels [P, 1, W]
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:  # linear [out, in]
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = a.astype(np.float32)
    return out


# --------------------------------------------------------------------------------------------------------------


def _self_check():
    rng = np.random.default_rng(0)
    D = 16
    sources = [rng.standard_normal((5, D)) for _ in range(4)]
    out = attn_res(sources, np.ones(D), np.zeros((1, D)), 1e-5)
    assert np.allclose(out, np.mean(sources, axis=0), atol=1e-12, rtol=0), "zero pseudo-queries must average"
    # a strongly aligned query picks (almost only) the source it points at
    q = 50.0 * rms_norm(sources[2][0], None, 1e-5)[None]
    picked = attn_res([s[:1] for s in sources], np.ones(D), q, 1e-5)
    assert np.allclose(picked, sources[2][:1], atol=1e-6)
    print("numpy_k3 self-check OK: AttnRes with zero pseudo-queries = mean of sources")


if __name__ == "__main__":
    _self_check()
