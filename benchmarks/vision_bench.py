"""Vision tower + projector forward for one 1024 x 1024 image: ours (`k3jax.vision`, jitted) beside transformers'
`kimi_k25` tower + projector on the same GPU (issue 31's target).

The image (random uint8) goes through `k3jax.vision.preprocess` (navit: 1024 px -> 73 patches a side, padded to
1036 px = 74 x 74 = 5476 patches, 1369 merged tokens); both towers take the same patches.
  k25: the K2.5 release size (27 layers, 1152 wide, 16 heads, MLP 4304, into 7168), random weights drawn in
       transformers (O(1) activations), copied into ours by release names (`k3jax.convert.vision`); reported: the
       relative L2 error of ours against transformers' output, and both times.
  k3:  ours at K3's size (27 layers, 1024 wide, 12 heads x 128 over a 1536-wide qkv, MLP 4096, patchmergerv2); no
       executable peer exists for it.
Time: median of `--iters` calls after `--warmup` (ours: jitted, blocked until ready; transformers: eager,
`torch.cuda.synchronize`), in `--dtype` (bf16 default). transformers' attention: `--hf_attn` (sdpa default).

  python benchmarks/vision_bench.py [--dtype bf16|f32] [--iters 20] [--image 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import median_ms
from k3jax.convert.vision import export_vision_weights, load_vision_weights
from k3jax.vision import VisionConfig, VisionModel, pack
from k3jax.vision.preprocess import preprocess_images

K25 = dict(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, num_attention_heads=16,
           num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, merge_kernel_size=[2, 2])
TEXT = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=64, n_group=1, topk_group=1)


def _jitted(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, x, lay: nnx.merge(graphdef, st)(x, lay), static_argnums=2)
    return lambda x, lay: fn(state, x, lay)


def _release_from_transformers(hf_model, heads: int) -> dict[str, np.ndarray]:
    """transformers' in-memory kimi_k25 vision names -> release names (fused wqkv, interleaved rotary pairs)."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in hf_model.state_dict().items()
          if "vision_tower" in k or "mm_projector" in k}
    renames = [("model.", ""), ("vision_tower.layers.", "vision_tower.encoder.blocks."),
               ("vision_tower.final_layernorm", "vision_tower.encoder.final_layernorm"),
               ("pos_emb.position_embeddings", "pos_emb.weight"), (".attn.proj.", ".wo."),
               ("mm_projector.in_proj.", "mm_projector.proj.0."), ("mm_projector.out_proj.", "mm_projector.proj.2.")]
    out = {}
    for k, v in sd.items():
        for a, b in renames:
            k = k.replace(a, b, 1) if a == "model." else k.replace(a, b)
        k = k.replace(".norm1.", ".norm0_").replace(".norm2.", ".norm1.").replace(".norm0_", ".norm0.")
        k = k.replace(".mlp.fc1.", ".mlp.fc0_").replace(".mlp.fc2.", ".mlp.fc1.").replace(".fc0_", ".fc0.")
        out[k] = v
    blocks = {k.split(".attn.")[0] for k in out if ".attn.q_proj." in k}
    for p in blocks:
        for leaf in ("weight", "bias"):
            q, k, v = (out.pop(f"{p}.attn.{n}_proj.{leaf}") for n in "qkv")
            inter = [w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape) for w in (q, k)]
            out[f"{p}.wqkv.{leaf}"] = np.concatenate([*inter, v], axis=0)
    return out


def bench_k25(pixels, grids, dtype, iters, warmup, hf_attn):
    import torch
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    tdt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    config = Kimi_K25Config(text_config=TEXT, vision_config=K25, projection_hidden_size=K25["hidden_size"])
    config._attn_implementation = hf_attn
    config.vision_config._attn_implementation = hf_attn
    torch.manual_seed(0)
    hf = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "vision_tower" not in name and "mm_projector" not in name:
                continue
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            elif "pos_emb" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 4:
                p.copy_(torch.randn_like(p) / (p[0].numel() ** 0.5))
            else:
                p.copy_(0.02 * torch.randn_like(p))
    weights = _release_from_transformers(hf, K25["num_attention_heads"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run only
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    hf = hf.to(dev, tdt)
    x_t = torch.from_numpy(pixels).to(dev, tdt)
    g_t = torch.tensor(grids, device=dev)

    def hf_call():
        with torch.no_grad():
            return hf.model.get_image_features(x_t, g_t).pooler_output[0]

    for _ in range(warmup):
        hf_call()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        want = hf_call()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    hf_ms = statistics.median(times)

    jdt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]
    cfg = VisionConfig.from_transformers_k25(K25, text_hidden_size=TEXT["hidden_size"])
    ours = VisionModel(cfg, dtype=jdt, param_dtype=jdt, rngs=nnx.Rngs(0))
    load_vision_weights(ours, weights)
    got, first_s, ours_ms = _time_ours(ours, pixels, grids, cfg, jdt, iters)
    got32 = np.asarray(got.astype(jnp.float32))
    want32 = want.float().cpu().numpy()
    rel = float(np.linalg.norm(got32 - want32) / np.linalg.norm(want32))
    return {"tower": "k25", "dtype": dtype, "patches": int(pixels.shape[0]), "tokens": int(got32.shape[0]),
            "hf_attn": hf_attn, "hf_ms": round(hf_ms, 3), "ours_ms": round(ours_ms, 3),
            "speedup": round(hf_ms / ours_ms, 3), "ours_first_call_s": round(first_s, 1), "rel_l2_vs_hf": rel}


def _time_ours(model, pixels, grids, cfg, jdt, iters):
    """Our jitted tower on the packed images: (output, first call incl. compile in s, median ms of `iters`)."""
    layout = pack(grids, cfg)
    fn = _jitted(model)
    x = jnp.asarray(pixels, jdt)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(x, layout))
    first_s = time.perf_counter() - t0
    return out, first_s, median_ms(lambda: fn(x, layout), iters)


def bench_k3(pixels, grids, dtype, iters):
    jdt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]
    cfg = VisionConfig()
    model = VisionModel(cfg, dtype=jdt, param_dtype=jdt, rngs=nnx.Rngs(0))
    n_params = sum(int(np.prod(v.shape)) for v in export_vision_weights(model).values())
    out, first_s, ms = _time_ours(model, pixels, grids, cfg, jdt, iters)
    return {"tower": "k3", "dtype": dtype, "params": n_params, "patches": int(pixels.shape[0]),
            "tokens": int(out.shape[0]), "ours_ms": round(ms, 3), "ours_first_call_s": round(first_s, 1),
            "finite": bool(np.isfinite(np.asarray(out.astype(jnp.float32))).all())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--image", type=int, default=1024)
    p.add_argument("--hf_attn", default="sdpa")
    p.add_argument("--towers", default="k25,k3")
    args = p.parse_args()
    image = np.random.default_rng(0).integers(0, 256, (args.image, args.image, 3), dtype=np.uint8)
    pixels, grids = preprocess_images([image])
    print(json.dumps({"device": str(jax.devices()[0]), "image": args.image, "grids": grids}), flush=True)
    for tower in args.towers.split(","):
        row = (bench_k25(pixels, grids, args.dtype, args.iters, args.warmup, args.hf_attn) if tower == "k25"
               else bench_k3(pixels, grids, args.dtype, args.iters))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
