"""Side-by-side peer of issue 8: HF transformers `KimiLinearForCausalLM.generate` vs our engine, same weights.

One process, one GPU (or CPU for a smoke run): a Kimi-Linear-shaped config (`--peer_config`, default the
`kimi_linear_small` preset below: vocab 163840, hidden 2048, 8 layers = (3 KDA + 1 MLA) x 2, layer 0 dense, 7 MoE
layers of 64 experts / top-8, ~1.6B parameters, ~3.1 GB in bf16) is randomly initialised as an HF
`KimiLinearForCausalLM` in torch (bf16 on CUDA), every tensor re-drawn at O(1)-activation scales (so greedy argmax
is well separated and the agreement check means something), then moved into our `K3Model` through
`k3jax.convert.transformers_names.release_weights_from_transformers` + `hf_names.load_hf_weights` (the path the HF
oracle test pins).

Measured, with the SAME random prompts (no padding, every row `--peer_prompt_len` tokens):
  agreement: greedy `generate` of both on one prompt (default: the B=1 timing shapes, so it adds no compile): match
             fraction of the free-running tokens and the first divergence; then teacher-forced on HF's sequence
             (prompt + HF's tokens through both full forwards): argmax agreement and max |Δlogits|.
  timing:    per batch B, end-to-end `generate` (HF: greedy, use_cache, EOS disabled; ours: `Engine.generate`,
             greedy, no EOS) for N1 = N//2 + 1 and N = `--peer_new_tokens` new tokens, median of `--peer_iters`
             (ours: at least 3), every call's time kept in the JSON row: decode tokens/s = B (N - N1) / (T(N) - T(N1))
             (both include their per-token host loop). HF is also timed at N = 1 (prefill + 1 token; no compile
             there) and its step over tokens 1..N1, (T(N1) - T(1)) / (N1 - 1), is reported as a cross-check; the
             speedup's "low" value uses the smaller HF step of the two. Our prefill ≈ T(N1) - (N1 - 1) x step (an
             N = 1 call would compile another output bucket). Our first call (compile) is reported apart; HF is
             warmed up once at N before timing.

torch and transformers are imported lazily: nothing here is needed unless `--hf_peer` is given.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from k3jax.convert.hf_names import load_hf_weights
from k3jax.convert.transformers_names import kimi_linear_config_kwargs, release_weights_from_transformers
from k3jax.inference import Engine
from k3jax.inference.engine import MIN_CACHE_BUCKET, bucket
from k3jax.model import K3Model

# Kimi-Linear-shaped, GPU-meaningful, small enough to build and convert in well under a minute.
PEER_PRESETS = {
    "kimi_linear_small": [
        "hidden_size=2048", "num_hidden_layers=8", "full_attn_layers=4,8", "intermediate_size=8192",
        "kda_num_heads=16", "num_attention_heads=16", "num_experts=64", "num_experts_per_token=8",
        "moe_intermediate_size=256", "max_position_embeddings=8192",
    ],
}


def peer_config(name: str, dtype: str | None = None):
    """Our ModelConfig for the peer: a `PEER_PRESETS` name (overrides of `kimi_linear`) or a registry name.
    `dtype`: "bfloat16" / "float32" for params and compute (None: the config's own)."""
    if name in PEER_PRESETS:
        cfg = configs.get_config("kimi_linear", PEER_PRESETS[name])
        cfg = cfg.replace(name=name)
    else:
        cfg = configs.get_config(name)
    if cfg.routed_expert_hidden_size is not None or cfg.attn_res_block_size is not None or cfg.hidden_act != "silu":
        raise ValueError(f"config {cfg.name!r} is not Kimi-Linear-shaped (latent MoE / AttnRes / SiTU have no HF "
                         "transformers counterpart); use a kimi_linear preset or tiny_kimi_linear")
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    return cfg


def kimi_linear_modules(no_fla: bool = False):
    """(configuration, modeling) modules of transformers' kimi_linear. `no_fla`: (re-)import them with `fla` made
    unimportable, so HF binds its pure-torch KDA fallbacks (HF picks fla or torch when the module is imported)."""
    import importlib
    import sys

    if no_fla:
        sys.modules["fla"] = None
        for name in [m for m in sys.modules if m.startswith("transformers.models.kimi_linear.")]:
            del sys.modules[name]
    return (importlib.import_module("transformers.models.kimi_linear.configuration_kimi_linear"),
            importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear"))


def hf_config(cfg, torch_dtype_name: str, no_fla: bool = False):
    """A transformers KimiLinearConfig with exactly our config's dimensions."""
    configuration, _ = kimi_linear_modules(no_fla)
    return configuration.KimiLinearConfig(**kimi_linear_config_kwargs(cfg), dtype=torch_dtype_name)


def randomise_(model, seed: int) -> None:
    """Re-draws every parameter and buffer at scales that keep activations O(1) (logit std ~1): HF's own init
    (std 0.02) gives near-flat logits whose greedy argmax is decided by rounding."""
    import torch

    gen = None
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if gen is None:
                gen = torch.Generator(device=t.device).manual_seed(seed)

            def normal(std, mean=0.0, t=t, gen=gen):
                return mean + std * torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)

            if name.endswith("A_log"):
                v = normal(0.5)
            elif name.endswith("dt_bias"):
                v = normal(0.5, -1.0)
            elif name.endswith("e_score_correction_bias"):
                v = normal(0.1)
            elif "norm" in name:
                v = normal(0.1, 1.0)
            elif name.endswith("embed_tokens.weight"):
                v = normal(1.0)
            elif t.ndim in (2, 3):  # [out, in] linears, [E, out, in] experts, [C, 1, W] conv: 1/sqrt(fan-in)
                v = normal(1.0 / math.sqrt(t.shape[-1]))
            else:
                raise ValueError(f"no randomisation rule for {name} {tuple(t.shape)}")
            t.copy_(v.to(t.dtype))


def build_hf_model(cfg, device: str, dtype_name: str, seed: int, no_fla: bool = False, weights_from=None):
    """A randomly initialised HF KimiLinearForCausalLM built directly on `device` in `dtype_name`, eval mode.
    `weights_from`: an HF model whose weights to copy instead of drawing new ones."""
    import torch

    torch_dtype = getattr(torch, dtype_name)
    hcfg = hf_config(cfg, dtype_name, no_fla)
    _, modeling = kimi_linear_modules()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            model = modeling.KimiLinearForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(old)
    model = model.eval()
    if weights_from is not None:
        model.load_state_dict(weights_from.state_dict())
    else:
        randomise_(model, seed)
    model.generation_config.eos_token_id = None  # fixed-length generation: never stop early
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model


def _bound_kernel(fn, depth: int = 4) -> str:
    """The fla function HF's kernel wrapper `fn` dispatches to (found in its closures), or "torch fallback"."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if callable(v) and str(getattr(v, "__module__", "")).startswith("fla"):
            return f"{v.__module__}.{v.__name__}"
        if callable(v) and depth > 0 and v is not fn:
            found = _bound_kernel(v, depth - 1)
            if found != "torch fallback":
                return found
    return "torch fallback"


def hf_backend_info(model) -> dict:
    """Which implementations HF picked (they decide its speed): attention, experts, fla kernels or torch fallback."""
    info = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}
    try:
        info["experts_implementation"] = model.config._experts_implementation_internal
    except AttributeError:
        info["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    _, modeling = kimi_linear_modules()
    kda_impl = _bound_kernel(modeling.chunk_kimi_delta_attention)
    try:
        import fla

        info["fla"] = f"{getattr(fla, '__version__', 'available')}; chunk KDA from {kda_impl}"
    except Exception as e:  # noqa: BLE001 -- report, do not fail
        info["fla"] = f"unavailable ({type(e).__name__}): chunk KDA from {kda_impl}"
    import torch
    import transformers

    info.update(torch=torch.__version__, transformers=transformers.__version__)
    return info


def ours_from_hf(cfg, hf_model):
    """Our K3Model holding the HF model's weights (built abstractly, so no random init is spent)."""
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    load_hf_weights(abstract, release_weights_from_transformers(hf_model.state_dict(), cfg))
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(jnp.asarray, state)
    return nnx.merge(graphdef, state)


def _times(fn, iters: int) -> list[float]:
    """Wall seconds of `iters` calls of `fn` (each call synchronises)."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_peer(*, peer: str = "kimi_linear_small", batches=(1, 16, 64), prompt_len: int = 128, new_tokens: int = 64,
             iters: int = 3, agree_prompt_len: int | None = None, agree_new_tokens: int | None = None, seed: int = 0,
             no_fla: bool = False, deadline: float = float("inf"), record=print) -> list[dict]:
    """Runs the agreement check and the per-batch timings; calls `record(dict)` for every result row.
    HF uses fla's KDA kernels when fla imports (unless `no_fla`); if its first generate fails with them, the row
    says so and the run continues on HF's torch fallback (same weights)."""
    import torch

    agree_prompt_len = agree_prompt_len or prompt_len  # default: the B=1 timing shapes (no extra compile)
    agree_new_tokens = agree_new_tokens or new_tokens
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype_name = "bfloat16" if cuda else "float32"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = peer_config(peer, dtype_name)
    t0 = time.perf_counter()
    hf = build_hf_model(cfg, device, dtype_name, seed, no_fla)
    sync()
    n_params = sum(p.numel() for p in hf.parameters())
    t_hf = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = ours_from_hf(cfg, hf)
    jax.block_until_ready(nnx.state(ours))
    t_conv = time.perf_counter() - t0
    rows = []

    def rec(row):
        rows.append(row)
        record(row)

    rec({"kind": "peer_setup", "peer_config": cfg.name, "dtype": dtype_name, "torch_device": device,
         "jax_device": jax.devices()[0].device_kind, "params": int(n_params),
         "weight_bytes": int(sum(p.numel() * p.element_size() for p in hf.parameters())),
         "hf_build_s": round(t_hf, 1), "convert_to_ours_s": round(t_conv, 1), **hf_backend_info(hf),
         "shape": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                 "full_attn_layers", "kda_num_heads", "num_attention_heads",
                                                 "num_experts", "num_experts_per_token", "moe_intermediate_size",
                                                 "intermediate_size")}})
    rng = np.random.default_rng(seed + 1)

    def hf_generate(ids_bt: np.ndarray, n: int) -> np.ndarray:
        ids = torch.as_tensor(ids_bt, dtype=torch.long, device=device)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=cfg.pad_token_id)
        sync()
        return out[:, ids.shape[1]:].cpu().numpy()

    n2, n1 = new_tokens, new_tokens // 2 + 1
    # one cache shape for N1 and N (and the agreement run at the default lengths): compiles are shared
    need = max(prompt_len + n2, agree_prompt_len + agree_new_tokens)
    engine = Engine(ours, max_len=bucket(need, MIN_CACHE_BUCKET))

    # ---- agreement: free-running greedy, then teacher-forced on HF's sequence
    prompt = rng.integers(0, cfg.vocab_size, (1, agree_prompt_len))
    try:
        hf_tokens = hf_generate(prompt, agree_new_tokens)[0]
    except Exception as e:  # fla kernels are the likeliest failure: fall back to HF's torch path
        if no_fla:
            raise
        import traceback

        traceback.print_exc()
        rec({"kind": "peer_fla_error", "error": repr(e)[:500], "then": "HF torch fallback, same weights"})
        hf = build_hf_model(cfg, device, dtype_name, seed, no_fla=True, weights_from=hf)
        rec({"kind": "peer_setup", "peer_config": cfg.name, "rebuilt": True, **hf_backend_info(hf)})
        hf_tokens = hf_generate(prompt, agree_new_tokens)[0]
    our_tokens = np.asarray(engine.generate([prompt[0].tolist()], agree_new_tokens, eos_id=-1)[0].tokens)
    same = hf_tokens[:len(our_tokens)] == our_tokens
    first_diff = int(np.argmin(same)) if not same.all() else len(same)
    rec({"kind": "agreement", "prompt_len": agree_prompt_len, "new_tokens": agree_new_tokens,
         "free_running_match_frac": float(same.mean()), "first_divergence": first_diff,
         "hf_tokens_head": hf_tokens[:8].tolist(), "our_tokens_head": our_tokens[:8].tolist()})

    # ---- timing
    for b in batches:
        if time.perf_counter() > deadline:
            rec({"kind": "peer", "batch": b, "skipped": "budget"})
            continue
        try:
            ids = rng.integers(0, cfg.vocab_size, (b, prompt_len))
            prompts = [row.tolist() for row in ids]
            t0 = time.perf_counter()
            engine.generate(prompts, n2, eos_id=-1)  # compiles prefill + decode for this batch
            ours_first_s = time.perf_counter() - t0
            o1s = _times(lambda p=prompts: engine.generate(p, n1, eos_id=-1), max(iters, 3))  # cheap: >= 3
            o2s = _times(lambda p=prompts: engine.generate(p, n2, eos_id=-1), max(iters, 3))
            t0 = time.perf_counter()
            out = hf_generate(ids, n2)  # warm-up at the longest length (fla autotuning, cuBLAS/sdpa choices)
            hf_first_s = time.perf_counter() - t0
            assert out.shape == (b, n2), out.shape
            h1s = _times(lambda x=ids: hf_generate(x, n1), iters)
            h2s = _times(lambda x=ids: hf_generate(x, n2), iters)
            hps = _times(lambda x=ids: hf_generate(x, 1), iters)
            o1, o2, h1, h2, hp = (statistics.median(t) for t in (o1s, o2s, h1s, h2s, hps))
            o_step, h_step = (o2 - o1) / (n2 - n1), (h2 - h1) / (n2 - n1)
            h_step_from_1 = (h1 - hp) / (n1 - 1)  # cross-check over the first N1 tokens (HF has no compile at N=1)
            rec({"kind": "peer", "batch": b, "prompt_len": prompt_len, "new_tokens": [n1, n2],
                 "ours_decode_step_ms": o_step * 1e3, "hf_decode_step_ms": h_step * 1e3,
                 "hf_decode_step_ms_tokens_1_to_n1": h_step_from_1 * 1e3,
                 "ours_decode_tok_s": b / o_step, "hf_decode_tok_s": b / h_step, "decode_speedup": h_step / o_step,
                 "decode_speedup_low": min(h_step, h_step_from_1) / o_step,
                 "ours_prefill_ms": (o1 - (n1 - 1) * o_step) * 1e3, "hf_generate_1_token_ms": hp * 1e3,
                 "ours_generate_s": {"n1": o1s, "n2": o2s}, "hf_generate_s": {"1": hps, "n1": h1s, "n2": h2s},
                 "ours_first_call_s": ours_first_s, "hf_first_call_s": hf_first_s})
        except Exception as e:  # noqa: BLE001 -- one failure (e.g. OOM) must not lose the other rows
            import traceback

            traceback.print_exc()
            rec({"kind": "peer", "batch": b, "error": repr(e)[:500]})
    # ---- teacher-forced agreement on HF's sequence (last: its full-forward compile is the least needed cost)
    if time.perf_counter() > deadline:
        rec({"kind": "agreement_tf", "skipped": "budget"})
    else:
        full = np.concatenate([prompt[0], hf_tokens])[None]
        with torch.no_grad():
            hf_logits = hf(torch.as_tensor(full, device=device)).logits.float().cpu().numpy()[0]
        our_logits = np.asarray(nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(full, jnp.int32)), np.float32)[0]
        pred = slice(agree_prompt_len - 1, full.shape[1] - 1)  # positions that predict the generated tokens
        top2 = np.sort(hf_logits[pred], axis=-1)[:, -2:]
        match = our_logits[pred].argmax(-1) == hf_logits[pred].argmax(-1)
        rec({"kind": "agreement_tf", "positions": int(match.size), "argmax_match_frac": float(match.mean()),
             "max_abs_dlogits": float(np.abs(our_logits - hf_logits).max()), "hf_logits_std": float(hf_logits.std()),
             "median_top2_margin": float(np.median(top2[:, 1] - top2[:, 0]))})
    engine = ours = hf = None  # release both models' device memory before the caller goes on
    if cuda:
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    setup = {}
    for r in rows:
        if r["kind"] == "peer_setup":
            setup.update(r)
        elif r["kind"] == "peer_fla_error":
            print(f"\nHF with fla kernels failed ({r['error'][:200]}); the rows below use HF's torch fallback")
    for r in [setup] if setup else []:
        print(f"\npeer {r['peer_config']} ({r['params'] / 1e9:.2f}B params, {r['weight_bytes'] / 1e9:.2f} GB "
              f"{r['dtype']}); HF: attn={r['attn_implementation']} experts={r['experts_implementation']} "
              f"fla={r['fla']} torch {r['torch']} transformers {r['transformers']}")
    for r in rows:
        if r["kind"] == "agreement":
            print(f"greedy agreement ({r['prompt_len']}-token prompt, {r['new_tokens']} new): free-running "
                  f"{100 * r['free_running_match_frac']:.0f}% (first divergence at token {r['first_divergence']})")
        elif r["kind"] == "agreement_tf" and "skipped" not in r:
            print(f"teacher-forced on HF's sequence ({r['positions']} positions): argmax "
                  f"{100 * r['argmax_match_frac']:.0f}%, max|Δlogits| {r['max_abs_dlogits']:.3g} (logit std "
                  f"{r['hf_logits_std']:.2f}, median top-2 margin {r['median_top2_margin']:.3g})")
    print("\n| B | ours decode ms/step | HF decode ms/step (tokens N1..N / 1..N1) | ours tok/s | HF tok/s | ours / HF "
          "(low) | ours prefill ms | HF generate(1 token) ms | ours first call s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["kind"] != "peer":
            continue
        if "error" in r or "skipped" in r:
            print(f"| {r['batch']} | {r.get('error') or r.get('skipped')} | | | | | | | |")
            continue
        print(f"| {r['batch']} | {r['ours_decode_step_ms']:.2f} | {r['hf_decode_step_ms']:.2f} / "
              f"{r['hf_decode_step_ms_tokens_1_to_n1']:.2f} | {r['ours_decode_tok_s']:,.0f} | "
              f"{r['hf_decode_tok_s']:,.0f} | **{r['decode_speedup']:.1f}x** ({r['decode_speedup_low']:.1f}x) | "
              f"{r['ours_prefill_ms']:.1f} | {r['hf_generate_1_token_ms']:.1f} | {r['ours_first_call_s']:.0f} |")


def _json_default(x):
    return x.tolist() if hasattr(x, "tolist") else str(x)


def dumps(row: dict) -> str:
    return json.dumps(row, default=_json_default)
