"""Float64 NumPy reference of the MoonViT tower + projector (docs/spec.md, "Vision tower"), written from the spec
on release-named weights, independently of k3jax/vision: images one at a time (no packing, no mask), position grids
resampled point by point, the rotary applied pair by pair. A video chunk (t > 1 frames) adds each frame's time
sinusoid, attends across all its frames and averages each merged block over the frames, loop by loop.

`encode(w, cfg, pixels_nchw, grids)` -> image tokens [M, text_hidden] float64, images in order.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _linear(w, name, x):
    y = x @ _f64(w[name + ".weight"]).T
    return y + _f64(w[name + ".bias"]) if name + ".bias" in w else y


def _norm(w, name, x, cfg, eps):
    g = _f64(w[name + ".weight"])
    if cfg.norm_type == "rmsnorm" and not name.endswith("pre_norm"):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + _f64(w[name + ".bias"])


def _tap_weights(out_size, in_size, mode):
    """Per output index: list of (source index, weight) with half-pixel centres and clamped borders."""
    rows = []
    for i in range(out_size):
        x = (i + 0.5) * in_size / out_size - 0.5
        if mode == "bilinear":
            x = min(max(x, 0.0), in_size - 1)
            j = math.floor(x)
            f = x - j
            rows.append([(min(j, in_size - 1), 1 - f), (min(j + 1, in_size - 1), f)])
        else:
            j, a = math.floor(x), -0.75
            taps = []
            for k in (j - 1, j, j + 1, j + 2):
                d = abs(x - k)
                wt = ((a + 2) * d - (a + 3)) * d * d + 1 if d <= 1 else a * d ** 3 - 5 * a * d * d + 8 * a * d - 4 * a
                taps.append((min(max(k, 0), in_size - 1), wt))
            rows.append(taps)
    return rows


def _resample(grid_hwd, h, w, mode):
    if grid_hwd.shape[:2] == (h, w):
        return grid_hwd
    th, tw = _tap_weights(h, grid_hwd.shape[0], mode), _tap_weights(w, grid_hwd.shape[1], mode)
    out = np.zeros((h, w, grid_hwd.shape[2]))
    for i in range(h):
        for j in range(w):
            for si, wi in th[i]:
                for sj, wj in tw[j]:
                    out[i, j] += wi * wj * grid_hwd[si, sj]
    return out


def _rotate(x_nhk, rows_n, cols_n, theta):
    """Interleaved 2-D rotary: pair i = dims (2i, 2i+1); even pairs by column, odd by row, θ^(-4⌊i/2⌋/K)."""
    out = x_nhk.copy()
    k = x_nhk.shape[-1]
    for i in range(k // 2):
        pos = cols_n if i % 2 == 0 else rows_n
        ang = pos * theta ** (-4.0 * (i // 2) / k)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x0, x1 = x_nhk[:, :, 2 * i], x_nhk[:, :, 2 * i + 1]
        out[:, :, 2 * i], out[:, :, 2 * i + 1] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_erf(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _time_sinusoid(frame: int, dim: int) -> np.ndarray:
    """Frame f: [sin(f w_0), ..., sin(f w_{D/2-1}), cos(f w_0), ...], w_j = 10000^(-2j/D)."""
    out = np.zeros(dim)
    for j in range(dim // 2):
        ang = frame * 10000.0 ** (-2.0 * j / dim)
        out[j], out[dim // 2 + j] = math.sin(ang), math.cos(ang)
    return out


def _one_image(w, cfg, pixels_nchw, t, h, wd):
    tw, pm = "vision_tower.", "mm_projector."
    eps = cfg.tower_norm_eps
    conv = _f64(w[tw + "patch_embed.proj.weight"])  # [D, 3, p, p]
    x = np.einsum("ncij,dcij->nd", _f64(pixels_nchw), conv)
    if tw + "patch_embed.proj.bias" in w:
        x = x + _f64(w[tw + "patch_embed.proj.bias"])
    pos = _resample(_f64(w[tw + "patch_embed.pos_emb.weight"]), h, wd, cfg.pos_emb_interpolation_mode)
    d = x.shape[1]
    for f in range(t):  # frame-major: frame f holds patches [f*h*w, (f+1)*h*w)
        x[f * h * wd:(f + 1) * h * wd] += pos.reshape(h * wd, d) + (_time_sinusoid(f, d) if t > 1 else 0.0)
    rows_n = np.tile(np.repeat(np.arange(h), wd), t).astype(np.float64)  # every frame: the same spatial angles
    cols_n = np.tile(np.tile(np.arange(wd), h), t).astype(np.float64)
    heads, k = cfg.vt_num_attention_heads, cfg.head_dim
    for layer in range(cfg.vt_num_hidden_layers):
        p = f"{tw}encoder.blocks.{layer}."
        qkv = _linear(w, p + "wqkv", _norm(w, p + "norm0", x, cfg, eps))
        q, kk, v = (qkv[:, i * heads * k:(i + 1) * heads * k].reshape(-1, heads, k) for i in range(3))
        q, kk = _rotate(q, rows_n, cols_n, cfg.rope_theta), _rotate(kk, rows_n, cols_n, cfg.rope_theta)
        probs = _softmax(np.einsum("qhk,shk->hqs", q, kk) / math.sqrt(k))
        x = x + _linear(w, p + "wo", np.einsum("hqs,shk->qhk", probs, v).reshape(-1, heads * k))
        x = x + _linear(w, p + "mlp.fc1", _gelu_tanh(_linear(w, p + "mlp.fc0", _norm(w, p + "norm1", x, cfg, eps))))
    x = _norm(w, tw + "encoder.final_layernorm", x, cfg, eps)
    kh, kw = cfg.merge_kernel_size
    grid = x.reshape(t, h, wd, -1)
    merged = []  # [M, kh*kw, D]: block (i, j), its patches row-major, each averaged over the frames
    for i in range(0, h, kh):
        for j in range(0, wd, kw):
            block = []
            for a in range(kh):
                for b in range(kw):
                    total = np.zeros(grid.shape[-1])
                    for f in range(t):
                        total += grid[f, i + a, j + b]
                    block.append(total / t)
            merged.append(np.stack(block))
    merged = np.stack(merged)
    if cfg.mm_projector_type == "patchmerger":
        merged = _norm(w, pm + "pre_norm", merged, cfg, cfg.projector_ln_eps)
    y = _linear(w, pm + "proj.2", _gelu_erf(_linear(w, pm + "proj.0", merged.reshape(merged.shape[0], -1))))
    if cfg.mm_projector_type == "patchmergerv2":
        g = _f64(w[pm + "post_norm.weight"])
        y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + cfg.projector_ln_eps) * g
    return y


def encode(w, cfg, pixels_nchw, grids) -> np.ndarray:
    """Image tokens [sum h*w/(kh*kw), text_hidden] float64 of images and video chunks (grids (t, h, w)), in order."""
    out, start = [], 0
    for t, h, wd in grids:
        out.append(_one_image(w, cfg, np.asarray(pixels_nchw)[start:start + t * h * wd], t, h, wd))
        start += t * h * wd
    return np.concatenate(out, axis=0)
