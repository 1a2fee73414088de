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

`--ttft`: an image chat request end to end through the serving `Scheduler` (issue 31's second target): `--config`
text model with random weights (`benchmarks.decode_bench.build_params`; k3_gpu: bf16) and a random vision tower of
`--vision_config` (default `k3`, `tiny` for `--config=tiny`; `--vision_dtype` f32 default, as serve.py loads it)
attached as serve.py attaches it, the prefix cache as serve.py sets it up (`--prefix_block=512`; 0 = off), one slot,
the serving XLA flags. The request: a synthetic uint8 `--image` x `--image` picture (what `/v1/chat/completions`
holds after decoding a data URL) in a prompt of 8 text ids, the image's placeholders, `--text_tokens` - 8 text ids.
Time to first token = `prepare_image` (resize, normalise, patchify) + `Scheduler.generate` of max_tokens 1 (tower,
image-token prefill, the first sampled token on the host); median of `--runs`, each with a new image and the prefix
cache emptied, after one warm-up request of the same shapes (its time: compile_image_s). Beside it: the tower alone and
the preprocessing alone (medians; tower_share = tower / ttft) and a text-only prompt of the same length (its own
warm-up: compile_text_s). peak_gib: the device's peak_bytes_in_use over the process (None on CPU). One JSON line:

  python -m benchmarks.vision_bench --ttft --config=k3_gpu
  python -m benchmarks.vision_bench --ttft --config=tiny --image=64 --runs=2   # CPU smoke run
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

import configs
from benchmarks.decode_bench import build_params
from benchmarks.timing import median_ms
from k3jax.convert.vision import export_vision_weights, load_vision_weights
from k3jax.inference.image_slots import default_placeholder_id
from k3jax.inference.images import prepare_image
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.xla_flags import apply_serving_flags
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


def _peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else round(stats["peak_bytes_in_use"] / 2**30, 2)


def _wall(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def image_ttft(config: str, overrides=(), *, vision_config: str | None = None, vision_dtype: str = "f32",
               image: int = 1024, text_tokens: int = 64, runs: int = 5, prefix_block: int = 512,
               page_size: int = 64) -> dict:
    """Time to first token of an image chat request and of a text-only one of the same length (module docstring)."""
    cfg = configs.get_config(config, list(overrides))
    vname = vision_config or ("tiny" if config == "tiny" else "k3")
    vcfg = VisionConfig(**{**configs.get_vision_config(vname), "text_hidden_size": cfg.hidden_size})
    jdt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[vision_dtype]
    spec, leaves, _ = build_params(cfg)
    graphdef, treedef = spec.value
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    vision = VisionModel(vcfg, dtype=jdt, param_dtype=jdt, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (image, image, 3), dtype=np.uint8) for _ in range(runs + 1)]
    m = prepare_image(pictures[0], vcfg).num_tokens
    n = m + text_tokens
    sched = Scheduler(model, num_slots=1, max_len=n + 64, prefix_block=prefix_block or None, page_size=page_size)
    ph = default_placeholder_id(cfg)
    sched.attach_vision(vision, ph)
    low = min(1000, cfg.vocab_size // 4)

    def ids(k: int) -> list[int]:
        return [int(t) + (int(t) >= ph) for t in rng.integers(low, cfg.vocab_size - low - 1, k)]

    def first_token(name, prompt, picture=None):
        if sched.prefix_cache is not None:
            sched.prefix_cache.clear()

        def call():
            images = () if picture is None else (prepare_image(picture, vcfg),)
            return sched.generate([Request(name, prompt, 1, eos_ids=[], images=images)])[name][0]

        tokens, s = _wall(call)
        assert len(tokens) == 1, tokens
        return s

    head = min(8, text_tokens)
    image_prompt = lambda: ids(head) + [ph] * m + ids(text_tokens - head)  # noqa: E731
    compile_image_s = first_token("warmup-image", image_prompt(), pictures[0])
    image_s = [first_token(f"image-{i}", image_prompt(), pictures[i + 1]) for i in range(runs)]
    compile_text_s = first_token("warmup-text", ids(n))
    text_s = [first_token(f"text-{i}", ids(n)) for i in range(runs)]
    inputs = [prepare_image(p, vcfg) for p in pictures]
    tower_s = [_wall(lambda: sched.images.encode((im,)))[1] for im in inputs[1:]]
    prep_s = [_wall(lambda: prepare_image(p, vcfg))[1] for p in pictures[1:]]
    ttft, text = statistics.median(image_s), statistics.median(text_s)
    tower, prep = statistics.median(tower_s), statistics.median(prep_s)
    return {"mode": "ttft", "config": config, "vision_config": vname, "vision_dtype": vision_dtype,
            "device": jax.devices()[0].device_kind, "image": image, "grid": list(inputs[0].grid), "image_tokens": m,
            "prompt_tokens": n, "prefix_block": prefix_block, "runs": runs,
            "compile_image_s": round(compile_image_s, 1), "compile_text_s": round(compile_text_s, 1),
            "ttft_image_ms": round(ttft * 1e3, 2), "ttft_text_ms": round(text * 1e3, 2),
            "image_over_text": round(ttft / text, 3), "tower_ms": round(tower * 1e3, 2),
            "preprocess_ms": round(prep * 1e3, 2), "tower_share": round(tower / ttft, 3),
            "ttft_image_runs_ms": [round(t * 1e3, 2) for t in image_s], "peak_gib": _peak_gib()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--image", type=int, default=1024)
    p.add_argument("--hf_attn", default="sdpa")
    p.add_argument("--towers", default="k25,k3")
    p.add_argument("--ttft", action="store_true", help="image request time to first token through the Scheduler")
    p.add_argument("--config", default="k3_gpu", help="--ttft: the text model config")
    p.add_argument("--set", action="append", default=[], help="--ttft: config override key=value (repeatable)")
    p.add_argument("--vision_config", default=None, help="--ttft: configs/vision.py name (default k3; tiny: tiny)")
    p.add_argument("--vision_dtype", default="f32", choices=["bf16", "f32"])
    p.add_argument("--text_tokens", type=int, default=64, help="--ttft: prompt tokens besides the image's")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prefix_block", type=int, default=512)
    p.add_argument("--page_size", type=int, default=64)
    args = p.parse_args()
    if args.ttft:
        apply_serving_flags()
        row = image_ttft(args.config, args.set, vision_config=args.vision_config, vision_dtype=args.vision_dtype,
                         image=args.image, text_tokens=args.text_tokens, runs=args.runs,
                         prefix_block=args.prefix_block, page_size=args.page_size)
        print(json.dumps(row), flush=True)
        return
    image = np.random.default_rng(0).integers(0, 256, (args.image, args.image, 3), dtype=np.uint8)
    pixels, grids = preprocess_images([image])
    print(json.dumps({"device": str(jax.devices()[0]), "image": args.image, "grids": grids}), flush=True)
    for tower in args.towers.split(","):
        row = (bench_k25(pixels, grids, args.dtype, args.iters, args.warmup, args.hf_attn) if tower == "k25"
               else bench_k3(pixels, grids, args.dtype, args.iters))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
