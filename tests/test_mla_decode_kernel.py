"""Paged absorbed MLA decode kernel (pallas_kernels/mla, interpret mode): equals a float64 NumPy softmax attention
over the rows gathered through a shuffled, shared page table (never reading pages or rows past a sequence's
length); the MLA layer's decode step with mla_decode_impl="pallas" runs the kernel and gives the XLA path's
outputs and the full forward's; the kernel lowers to one Triton kernel for CUDA at a K3 decode shape; bad inputs
raise clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.config import ConfigError
from k3jax.layers.mla import MLA
from k3jax.ops.attention import mla_decode_backend
from pallas_kernels.cuda_lowering import triton_kernels
from pallas_kernels.mla import DecodeConfig, gpu_compatible, paged_latent_attention

LATENT, ROPE, PAGE, NUM_PAGES = 32, 16, 8, 11
SCALE = 0.2
# 5 sequences over 4 table slots of 8 positions: out of order, pages 7 and 2 shared by sequences 0 and 3, lengths
# ending mid-page (21), on a page edge (32 = full, 16), 1 and 0; ids -1 and 11 (= N, out of range) past the length.
TABLE = np.array([[7, 2, 9, -1],
                  [2, 5, 0, 3],
                  [4, -1, -1, 11],
                  [7, 2, 6, -1],
                  [-1, -1, -1, -1]], np.int32)
LENGTHS = np.array([21, 32, 1, 16, 0], np.int32)


def _inputs(dtype, heads=3, seed=0):
    """q [B, H, C], pages [N, PAGE, C]; rows no sequence may read (page 6: only past sequence 3's length; rows
    5..7 of page 9: past sequence 0's length; pages 1, 8, 10: unmapped) are NaN."""
    rng = np.random.RandomState(seed)
    q = rng.randn(len(LENGTHS), heads, LATENT + ROPE)
    pages = rng.randn(NUM_PAGES, PAGE, LATENT + ROPE)
    pages[[1, 6, 8, 10]] = np.nan
    pages[9, 5:] = np.nan
    return jnp.asarray(q, dtype), jnp.asarray(pages, dtype)


def _reference(q, pages, table, lengths, scale):
    """float64: softmax(scale * q . rows) @ rows[:, :LATENT] over positions < length, rows read through the table."""
    q, pages = np.asarray(q, np.float64), np.asarray(pages, np.float64)
    out = np.zeros(q.shape[:2] + (LATENT,))
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = np.stack([pages[table[b, p // PAGE], p % PAGE] for p in range(n)])  # [n, C]
        logits = q[b] @ rows.T * scale
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        out[b] = probs @ rows[:, :LATENT]
    return out


F32, BF16 = (jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)


@pytest.mark.parametrize("dtype, tol, config", [
    (*F32, DecodeConfig()),
    (*BF16, DecodeConfig()),
    (*F32, DecodeConfig(block_h=2, block_s=4, num_splits=1)),
    (*F32, DecodeConfig(num_splits=2)),
], ids=["f32_auto", "bf16_auto", "f32_one_split_head_blocks_substeps", "f32_two_uneven_splits"])
def test_kernel_matches_float64_reference_through_shuffled_shared_table(dtype, tol, config):
    """auto: 4 page ranges (capped by the table's 4 slots), each sequence's own pages spread over them (the short
    ones leave ranges empty) and merged by the combine; one range with 2 head blocks (H = 3 padded to 4) and 2
    steps of 4 rows per page (the kernel writes the output, no combine); 2 ranges over 3 pages (2 + 1)."""
    q, pages = _inputs(dtype)
    got = paged_latent_attention(q, pages, jnp.asarray(TABLE), jnp.asarray(LENGTHS), scale=SCALE,
                                 latent_dim=LATENT, backend="interpret", config=config)
    assert got.dtype == jnp.float32 and got.shape == (5, 3, LATENT)
    want = _reference(q.astype(jnp.float32), pages.astype(jnp.float32), TABLE, LENGTHS, SCALE)
    assert np.all(np.isfinite(np.asarray(got)))  # the NaN rows were never read
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got)[4], 0.0)  # length 0: nothing attended


def _decode_layer(impl, splits=0):
    cfg = configs.get_config("tiny", [f"mla_decode_impl={impl}", f"mla_decode_splits={splits}"])
    return MLA(cfg, rngs=nnx.Rngs(3))  # same seed: same weights for every impl


@pytest.mark.parametrize("splits", [0, 1], ids=["auto_splits", "one_split"])
def test_mla_layer_decode_with_kernel_equals_xla_path_and_full_forward(splits):
    """Two sequences in 4-token pages scattered over a pool of garbage rows: 6-token prefill (expanded form),
    then 5 single-token decode steps (absorbed form) by the kernel (interpret; `mla_decode_splits` auto: 3, or one
    page range, no combine) and by the XLA gather path; both equal each other and the full forward. The kernel
    path's trace has the Pallas call and no page gather."""
    layers = {"pallas": _decode_layer("pallas", splits), "xla": _decode_layer("xla")}
    cfg = layers["xla"].cfg
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.randn(2, 11, cfg.hidden_size), jnp.float32)
    full = np.asarray(layers["xla"](x))
    table = jnp.asarray([[5, 0, 7], [2, 6, 1]], jnp.int32)
    pool = jnp.asarray(rng.uniform(-50, 50, (8, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)), jnp.float32)
    step = {impl: jax.jit(lambda xt, pages, start, layer=layer: layer.forward_cached(xt, pages, table, start))
            for impl, layer in layers.items()}
    _, pages = step["xla"](x[:, :6], pool, jnp.zeros((2,), jnp.int32))
    jaxprs = {impl: str(jax.make_jaxpr(fn)(x[:, 6:7], pages, jnp.full((2,), 6, jnp.int32)))
              for impl, fn in step.items()}
    assert "pallas_call" in jaxprs["pallas"] and "pallas_call" not in jaxprs["xla"]
    assert f"grid=(2, {splits or 3}, 1)" in jaxprs["pallas"]  # (sequences, page ranges, head blocks)
    dense = "f32[2,3,4,40]"  # every sequence's pages gathered: [B, P, page_size, C]
    assert dense in jaxprs["xla"] and dense not in jaxprs["pallas"]
    caches = {impl: pages for impl in layers}
    for t in range(6, 11):
        ys = {}
        for impl in layers:
            ys[impl], caches[impl] = step[impl](x[:, t:t + 1], caches[impl], jnp.full((2,), t, jnp.int32))
        np.testing.assert_allclose(np.asarray(ys["pallas"]), np.asarray(ys["xla"]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ys["pallas"]), full[:, t:t + 1], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(caches["pallas"]), np.asarray(caches["xla"]))


def test_decode_impl_resolution(monkeypatch):
    """auto: the XLA path on CPU (the kernel only on GPU, for shapes Triton takes); pallas: the interpreter on CPU;
    under a multi-device mesh always XLA."""
    cfg = configs.get_config("tiny")
    assert cfg.runtime.mla_decode_impl == "auto" and mla_decode_backend(cfg, 16, 64) is None
    assert mla_decode_backend(cfg.replace(mla_decode_impl="pallas"), 16, 4) == "interpret"
    assert mla_decode_backend(cfg.replace(mla_decode_impl="xla"), 16, 64) is None
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh):
        assert mla_decode_backend(cfg.replace(mla_decode_impl="pallas"), 16, 4) is None
    k3 = configs.get_config("k3_gpu")  # what "auto" checks before taking the kernel on a GPU
    assert gpu_compatible(k3.kv_lora_rank, k3.qk_rope_head_dim, 64, num_pages=4096)
    assert not gpu_compatible(k3.kv_lora_rank, k3.qk_rope_head_dim, 48, num_pages=4096)  # 48-row steps
    assert not gpu_compatible(k3.kv_lora_rank, k3.qk_rope_head_dim, 64, num_pages=2 ** 16)  # > 2**31 elements
    assert not gpu_compatible(cfg.kv_lora_rank, cfg.qk_rope_head_dim, 64)  # tiny: 8-wide rope
    monkeypatch.setattr("k3jax.ops.backend.traced_accelerator", lambda: "gpu")  # as if traced for a GPU
    assert mla_decode_backend(k3, 4096, 64) == "gpu"
    assert mla_decode_backend(k3, 4096, 48) is None and mla_decode_backend(cfg, 16, 64) is None
    assert mla_decode_backend(cfg.replace(mla_decode_impl="pallas"), 16, 4) == "gpu"  # forced: the kernel's error
    with pytest.raises(ConfigError, match="mla_decode_impl must be one of"):
        configs.get_config("tiny", ["mla_decode_impl=triton"])


def test_kernel_lowers_to_one_triton_kernel_for_cuda_at_k3_decode_shape():
    """B=64, k3_gpu's heads, C=576, 64-token pages, 10 per sequence, bf16 (Pallas -> Triton lowering on this
    host; the Triton compiler itself only runs on a GPU)."""
    heads = configs.get_config("k3_gpu").num_attention_heads
    sd = jax.ShapeDtypeStruct
    args = (sd((64, heads, 576), jnp.bfloat16), sd((640, 64, 576), jnp.bfloat16), sd((64, 10), jnp.int32),
            sd((64,), jnp.int32))

    def attend(q, pages, table, lengths):
        return paged_latent_attention(q, pages, table, lengths, scale=192 ** -0.5, backend="gpu")

    assert triton_kernels(attend, *args, name_pattern=r"k3_mla_[a-z_]+") == (1, ["k3_mla_decode"])


def test_bad_inputs_raise_clear_errors():
    q, pages = _inputs(jnp.float32)
    table, lengths = jnp.asarray(TABLE), jnp.asarray(LENGTHS)

    def call(q=q, pages=pages, table=table, lengths=lengths, **kw):
        kw = {"latent_dim": LATENT, "backend": "interpret", **kw}
        return paged_latent_attention(q, pages, table, lengths, scale=SCALE, **kw)

    cases = [
        (dict(pages=pages.astype(jnp.bfloat16)), "share a dtype"),
        (dict(pages=pages[..., :40]), "C=48 columns but the pages have 40"),
        (dict(q=q[0]), r"q must be \[B, H, C\]"),
        (dict(table=table.astype(jnp.float32)), "page_table must be an integer array"),
        (dict(table=table[:3]), r"page_table must be \[B, P\] with B=5"),
        (dict(lengths=lengths[:2]), r"length must be \[B\]"),
        (dict(latent_dim=64), "latent_dim must be in"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(config=DecodeConfig(block_s=3)), "block_s=3 must divide page_size=8"),
        (dict(backend="gpu"), "powers of two >= 16"),  # page_size 8 -> 8-row steps
        (dict(q=q.astype(jnp.int32), pages=pages.astype(jnp.int32)), "dtype must be"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**kw)
    huge = jax.ShapeDtypeStruct((2 ** 16, 64, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="fewer than 2\\*\\*31"):
        jax.eval_shape(lambda p: paged_latent_attention(jnp.zeros((5, 3, 576), jnp.bfloat16), p, table, lengths,
                                                        scale=SCALE, backend="gpu"), huge)
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        DecodeConfig(num_splits=-1)
