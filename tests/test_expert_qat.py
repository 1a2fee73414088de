"""Quantization-aware training of the routed experts (`k3jax/ops/mx_quant.py`, `expert_qat` / `expert_act_qat`).

- The MXFP4 and MXFP8 fake quantizers equal an independent float64 NumPy implementation of the OCP MX v1.0
  conversion written here (shared_exp = floor(log2(amax)) - emax_elem clamped at -127, nearest element value with
  ties to the even code, saturation, NaN scale for groups holding NaN/Inf): all 16 E2M1 codes, every E4M3 value,
  amax at and around powers of two, ties, saturation, tiny groups, zero groups, NaN/Inf.
- Their gradient is the identity (straight-through), and the knobs reach the routed experts only.
- The QAT forward equals the MXFP4 serving forward of its export (`--to_hf --experts mxfp4`) bit for bit.
- A short QAT run loses less to MXFP4 than post-training quantization of the same run without QAT.
- Under expert-parallel meshes (8 emulated CPU devices) a QAT MoE layer's (slow: a two-layer model's) loss and
  gradients equal one device's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

import configs
import k3jax
from k3jax.config import ConfigError
from k3jax.convert.checkpoint import hf_to_orbax
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.layers.moe import LatentMoE
from k3jax.model import K3Model
from k3jax.ops import mx_quant
from sharding.shard import mesh_context
from tests.helpers import logits, make_sharded_loss_and_grad, shard_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_values() -> np.ndarray:
    """The 127 non-negative E4M3 (fn) values by code 0..126 (code 127 is NaN): bias 7, subnormals at exponent 0."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


E4M3 = e4m3_values()


def reference_mx(x: np.ndarray, table: np.ndarray, emax: int):
    """OCP MX v1.0 section 6.3 in float64, one group of 32 per row of x [g, 32]: (magnitude indices into `table`
    [g, 32], sign bits [g, 32], scale bytes [g], decoded values [g, 32]). Brute force over the element table."""
    idx = np.zeros(x.shape, np.int64)
    scales = np.zeros(x.shape[0], np.int64)
    values = np.zeros(x.shape)
    for g, row in enumerate(x.astype(np.float64)):
        if not np.all(np.isfinite(row)):
            scales[g], values[g] = 255, np.nan
            continue
        amax = np.max(np.abs(row))
        shared = -127 if amax == 0 else max(math.frexp(amax)[1] - 1 - emax, -127)
        scales[g] = shared + 127
        for i, v in enumerate(row / 2.0 ** shared):
            dist = np.abs(table - abs(v))
            best = np.flatnonzero(dist == dist.min())
            idx[g, i] = len(table) - 1 if abs(v) > table[-1] else best[best % 2 == 0][0] if len(best) > 1 else best[0]
            values[g, i] = math.copysign(table[idx[g, i]], v) * 2.0 ** shared
    return idx, np.signbit(x), scales, values


def edge_groups(grid: np.ndarray, emax: int, rng) -> np.ndarray:
    """f32 [g, 32] groups: every grid value and every midpoint (ties) at several scales, amax exactly at, just below
    and just above powers of two, saturating amax (between the format's max and the next binade), tiny groups whose
    shared exponent clamps at -127, zero groups, random normals."""
    groups = []
    mids = (grid[1:] + grid[:-1]) / 2
    pts = np.concatenate([grid, mids, -grid, -mids])
    for k in (-20, -3, 0, 5, 40):
        for start in range(0, len(pts), 31):
            chunk = pts[start:start + 31]
            groups.append(np.concatenate([chunk, [grid[-1]], np.zeros(31 - len(chunk))]) * 2.0 ** k)
    for j in (-100, -7, 0, 1, 3, 60):
        base = rng.standard_normal(32) * 2.0 ** (j - 3)
        for top in (2.0 ** j, np.nextafter(np.float32(2.0 ** j), np.float32(0)), np.nextafter(
                np.float32(2.0 ** j), np.float32(np.inf)), 1.5 * 2.0 ** j, 1.99 * 2.0 ** j):
            g = base.copy()
            g[7] = -top
            groups.append(g)
    top_binade = 2.0 ** (math.frexp(grid[-1])[1])  # e.g. 8 for E2M1, 512 for E4M3: (max, next binade) saturates
    for k in (0, -5):
        groups.append(np.linspace(-top_binade * 0.999, top_binade * 0.999, 32) * 2.0 ** k)
    for tiny in (2.0 ** -126, 2.0 ** -124, 2.0 ** -120):  # normal f32 inputs (XLA CPU flushes subnormal ones)
        groups.append(rng.choice([-1.0, 1.0], 32) * rng.uniform(1, 8, 32) * tiny)
    groups.append(np.zeros(32))
    groups.extend(rng.standard_normal((8, 32)) * rng.uniform(0.001, 10, (8, 1)))
    return np.stack(groups).astype(np.float32)


def normal_or_zero(values: np.ndarray) -> np.ndarray:
    """Where the reference decoded value is zero or a normal f32 (subnormals flush on XLA CPU: module docstring)."""
    return (values == 0) | (np.abs(values) >= np.finfo(np.float32).tiny) | np.isnan(values)


def test_mxfp4_matches_numpy_ocp_reference_on_all_codes_and_scale_edges():
    x = edge_groups(E2M1, 2, np.random.default_rng(0))
    codes, scales = mx_quant.mxfp4_encode(jnp.asarray(x).reshape(-1), axis=0)
    idx, sign, want_scales, want_values = reference_mx(x, E2M1, 2)
    finite = want_scales != 255
    np.testing.assert_array_equal(np.asarray(codes).reshape(x.shape)[finite], (idx | sign * 8)[finite])
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    assert set(np.unique(idx | sign * 8)) == set(range(16))  # every E2M1 code, both zeros included
    got = np.asarray(mx_quant.fake_quant_mxfp4(jnp.asarray(x), -1), np.float64)
    # the serving decoder's scale 2^-127 is an f32 subnormal, flushed to 0 on XLA CPU (module docstring)
    clamped = (want_scales == 0)[:, None] & np.ones_like(got, bool)
    ok = normal_or_zero(want_values) & ~clamped
    assert ok.mean() > 0.95 and clamped.any()
    np.testing.assert_array_equal(got[ok], want_values[ok])
    assert np.all((got[clamped] == want_values[clamped]) | (got[clamped] == 0))


def test_mxfp8_matches_numpy_ocp_reference_on_every_e4m3_value_and_scale_edges():
    x = edge_groups(E4M3, 8, np.random.default_rng(1))
    q, scales = mx_quant.mxfp8_encode(jnp.asarray(x), axis=-1)
    idx, sign, want_scales, want_values = reference_mx(x, E4M3, 8)
    finite = want_scales != 255
    np.testing.assert_array_equal(np.asarray(scales)[:, 0], want_scales)
    np.testing.assert_array_equal(np.asarray(q)[finite], np.where(sign, -1.0, 1.0)[finite] * E4M3[idx[finite]])
    assert set(np.unique(idx)) == set(range(127))  # every E4M3 magnitude
    got = np.asarray(mx_quant.fake_quant_mxfp8(jnp.asarray(x), -1), np.float64)
    ok = normal_or_zero(want_values)
    assert ok.mean() > 0.95
    np.testing.assert_array_equal(got[ok], want_values[ok])


@pytest.mark.parametrize("fake_quant", [mx_quant.fake_quant_mxfp4, mx_quant.fake_quant_mxfp8])
def test_nan_or_inf_poisons_only_its_group_and_zero_groups_stay_zero(fake_quant):
    x = np.random.default_rng(2).standard_normal((4, 96)).astype(np.float32)
    x[0, 40], x[1, 5], x[2, 70] = np.nan, np.inf, -np.inf
    x[3, 32:64] = 0.0
    _, scales = (mx_quant.mxfp4_encode if fake_quant is mx_quant.fake_quant_mxfp4 else mx_quant.mxfp8_encode)(
        jnp.asarray(x), -1)
    got = np.asarray(fake_quant(jnp.asarray(x), -1))
    bad = np.zeros((4, 3), bool)
    bad[0, 1] = bad[1, 0] = bad[2, 2] = True
    np.testing.assert_array_equal(np.asarray(scales) == 255, bad)
    assert np.isnan(got.reshape(4, 3, 32)[bad]).all() and np.isfinite(got.reshape(4, 3, 32)[~bad]).all()
    assert np.asarray(scales)[3, 1] == 0 and (got[3, 32:64] == 0).all()


@pytest.mark.parametrize("fake_quant", [mx_quant.fake_quant_mxfp4, mx_quant.fake_quant_mxfp8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_straight_through_gradient_is_the_identity(fake_quant, dtype):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((64, 8)), dtype)
    cot = jnp.asarray(np.random.default_rng(4).standard_normal((64, 8)), dtype)
    out, vjp = jax.vjp(lambda v: fake_quant(v, 0), x)
    assert out.dtype == dtype and not np.array_equal(np.asarray(out), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(vjp(cot)[0]), np.asarray(cot))
    grad = jax.jit(jax.grad(lambda v: jnp.sum(fake_quant(v, 0).astype(jnp.float32) * cot.astype(jnp.float32))))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(cot))


def test_quantizers_are_idempotent_and_need_whole_groups():
    w = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64, 40)), jnp.float32)
    for fake_quant in (mx_quant.fake_quant_mxfp4, mx_quant.fake_quant_mxfp8):
        q = fake_quant(w, -2)
        np.testing.assert_array_equal(np.asarray(fake_quant(q, -2)), np.asarray(q))
    with pytest.raises(ValueError, match="divisible by 32, got 40"):
        mx_quant.fake_quant_mxfp4(w, -1)


def _bits(a) -> np.ndarray:
    a = np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)
    return a.view(np.uint32)


@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
                                                (jnp.bfloat16, jnp.bfloat16)])
def test_weight_qat_kernel_writes_the_xla_quantizers_copy_bit_for_bit(in_dtype, out_dtype):
    """The one-pass weight QAT kernel (`pallas_kernels.gmm.qat`, interpreted) writes exactly
    `fake_quant_mxfp4(w, -2).astype(dtype)`: every E2M1 code and tie, scale edges, saturation, clamped tiny groups,
    zero groups and NaN / Inf groups, each group of 32 along the reduction axis of an [E, k, n] stack."""
    rng = np.random.default_rng(6)
    x = edge_groups(E2M1, 2, rng)
    x = np.concatenate([x, rng.standard_normal((64 - len(x) % 64, 32)).astype(np.float32)])
    x[3, 9], x[5, 0], x[6, 31] = np.nan, np.inf, -np.inf
    w = jnp.asarray(x.reshape(2, -1, 16, 32).transpose(0, 1, 3, 2).reshape(2, -1, 16), in_dtype)  # [2, k, 16]
    want = mx_quant.fake_quant_mxfp4_cast(w, out_dtype, impl="xla")
    got = mx_quant.fake_quant_mxfp4_cast(w, out_dtype, impl="kernel")
    assert got.dtype == want.dtype == out_dtype and np.isnan(np.asarray(want, np.float32)).any()
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_weight_qat_kernel_has_the_xla_paths_straight_through_gradient_and_refuses_misfits():
    w = jnp.asarray(np.random.default_rng(7).standard_normal((2, 64, 48)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(8).standard_normal((2, 64, 48)), jnp.bfloat16)
    grads = {}
    for impl in ("xla", "kernel"):
        out, vjp = jax.vjp(lambda v, impl=impl: mx_quant.fake_quant_mxfp4_cast(v, jnp.bfloat16, impl=impl), w)
        grads[impl] = vjp(cot)[0]
        assert grads[impl].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(grads["kernel"]), np.asarray(grads["xla"]))
    np.testing.assert_array_equal(np.asarray(grads["xla"]), np.asarray(cot, np.float32))
    cfg = configs.get_config("tiny", ["expert_qat=mxfp4"])
    assert mx_quant.expert_weight_qat(w, cfg).dtype == cfg.runtime.jnp_dtype  # auto: XLA on CPU
    with pytest.raises(ValueError, match="k a multiple of 32 and n of 16; got backend 'interpret', shape"):
        mx_quant.fake_quant_mxfp4_cast(w[:, :, :40], jnp.bfloat16, impl="kernel")
    with pytest.raises(ValueError, match="unknown weight QAT impl 'fast'"):
        mx_quant.fake_quant_mxfp4_cast(w, jnp.bfloat16, impl="fast")


def test_moe_layer_with_the_weight_qat_kernel_equals_the_xla_qat_path():
    """A latent MoE layer under expert_qat=mxfp4 and expert_act_qat=mxfp8 with its weights quantized by the kernel
    (`mx_quant.weight_qat_impl("kernel")`, as `auto` does on a GPU) gives the XLA QAT path's output and gradients
    (to the f32 masters and the input) bit for bit."""
    cfg = configs.get_config("tiny", WIDTHS + ["expert_qat=mxfp4", "expert_act_qat=mxfp8"])
    layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 16, cfg.hidden_size)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(10).standard_normal((2, 16, cfg.hidden_size)), jnp.float32)
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32) * cot)

    out = {}
    for impl in ("xla", "kernel"):
        with mx_quant.weight_qat_impl(impl):
            out[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    leaves = [jax.tree.leaves(out[impl]) for impl in ("xla", "kernel")]
    assert len(leaves[0]) > 5
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_knobs_reach_the_runtime_config_and_bad_values_are_refused():
    cfg = configs.get_config("tiny", ["expert_qat=mxfp4", "expert_act_qat=mxfp8"])
    assert (cfg.runtime.expert_qat, cfg.runtime.expert_act_qat) == ("mxfp4", "mxfp8")
    assert "expert_qat" not in type(cfg.runtime).state_fields()  # QAT may start on a bf16-trained checkpoint
    with pytest.raises(ConfigError, match="expert_qat must be one of"):
        configs.get_config("tiny", ["expert_qat=int4"])
    with pytest.raises(ConfigError, match="expert_act_qat='mxfp8' needs both expert matmul input widths divisible"):
        configs.get_config("tiny", ["expert_act_qat=mxfp8", "moe_intermediate_size=48"])
    with pytest.raises(ConfigError, match="holds them packed already"):
        configs.get_config("tiny", ["expert_qat=mxfp4", "expert_weights=mxfp4"])


# tiny with expert widths of 64: two 32-wide scale groups along both expert matmuls' reduction axes
WIDTHS = ["routed_expert_hidden_size=64", "moe_intermediate_size=64"]
EXPERTS = ("w1", "w3", "w2")


def _routed(model) -> dict:
    return {path: var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)) if str(path[-1]) in EXPERTS}


def _ids(cfg, shape=(2, 32)):
    return jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, shape), jnp.int32)


def test_weight_qat_quantizes_exactly_the_routed_experts_along_their_reduction_axis():
    """With MXFP4-representable routed experts (each stack quantized along its input axis), expert_qat=mxfp4 changes
    nothing: attention, router, latent projections and shared experts are not quantized, and the experts' axis is
    the reduction axis. Before that the quantization does change the logits."""
    cfg = configs.get_config("tiny", WIDTHS).replace(num_hidden_layers=2, full_attn_layers=(2,))  # one MoE layer
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    model_q = nnx.eval_shape(lambda: K3Model(cfg.replace(expert_qat="mxfp4"), rngs=nnx.Rngs(1)))
    nnx.update(model_q, nnx.state(model))
    ids = _ids(cfg)
    plain = logits(model, ids)
    assert np.abs(logits(model_q, ids) - plain).max() > 1e-4
    for var in _routed(model).values():
        var.set_value(mx_quant.fake_quant_mxfp4(var.get_value(), -2))
    nnx.update(model_q, nnx.state(model))
    np.testing.assert_array_equal(logits(model_q, ids), logits(model, ids))


def test_dense_and_dropless_experts_apply_the_same_qat():
    """The all-experts dense path quantizes like the dropless one (weights and both matmul inputs), and MXFP8
    activations change the logits."""
    cfg = configs.get_config("tiny", WIDTHS).replace(num_hidden_layers=2, full_attn_layers=(2,))
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    ids, state = _ids(cfg), nnx.state(model)
    out = {}
    for name, knobs in (("weights", dict(expert_qat="mxfp4")), ("both", dict(expert_qat="mxfp4",
                                                                           expert_act_qat="mxfp8"))):
        for impl in ("dropless", "dense"):
            twin = nnx.eval_shape(lambda: K3Model(cfg.replace(moe_impl=impl, **knobs), rngs=nnx.Rngs(0)))
            nnx.update(twin, state)
            out[name, impl] = logits(twin, ids)
    scale = np.abs(out["weights", "dropless"]).max()
    for name in ("weights", "both"):
        np.testing.assert_allclose(out[name, "dense"], out[name, "dropless"], atol=2e-4 * scale, err_msg=name)
    assert np.abs(out["both", "dense"] - out["weights", "dense"]).max() > 1e-3 * scale


def test_qat_forward_equals_the_mxfp4_serving_forward_of_its_export(tmp_path):
    """`save_checkpoint` + `--to_hf --experts mxfp4` of an expert_qat=mxfp4 model, loaded packed
    (`expert_weights='mxfp4'`, the serving path: the grouped matmul decodes the bytes), gives the QAT forward's
    logits bit for bit; the packed bytes are exactly `pack_mxfp4` of the f32 masters."""
    cfg = configs.get_config("tiny", WIDTHS + ["expert_qat=mxfp4"])
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    for var in _routed(model).values():  # spread the scales over several binades, amax near powers of two
        w = np.asarray(var.get_value())
        var.set_value(jnp.asarray(w * np.ldexp(1.0, np.random.RandomState(1).randint(-3, 4, w.shape[:-2] + (1, 1)))))
    ids = _ids(cfg)
    want = logits(model, ids)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    k3jax.save_checkpoint(model, ckpt)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "k3jax.convert", "--to_hf", "--checkpoint", ckpt, "--out", out,
                          "--experts", "mxfp4", "--dtype", "f32"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "mxfp4"
    served_cfg, served = k3jax.load_hf(out, config=cfg.replace(expert_qat="none"), expert_weights="mxfp4")
    assert served_cfg.runtime.expert_weights == "mxfp4" and served_cfg.runtime.expert_qat == "none"
    flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(served))}
    for path, var in _routed(model).items():
        key = tuple(str(p) for p in path)
        packed, scales = mx_quant.pack_mxfp4(jnp.swapaxes(var.get_value(), -1, -2))
        np.testing.assert_array_equal(np.asarray(flat[key[:-1] + (key[-1] + "_packed",)].get_value()), packed)
        np.testing.assert_array_equal(np.asarray(flat[key[:-1] + (key[-1] + "_scale",)].get_value()), scales)
    got = logits(served, ids)
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(got, want)


def test_to_hf_experts_bf16_decodes_kept_packed_experts_exactly(tmp_path):
    """A checkpoint that kept MXFP4 experts packed, written with `--experts bf16`: dense experts equal to the
    fake-quantized masters they came from (and no quantization_config)."""
    cfg = configs.get_config("tiny", WIDTHS).replace(num_hidden_layers=2, full_attn_layers=(2,))
    model = K3Model(cfg, rngs=nnx.Rngs(0))
    paths = [str(tmp_path / n) for n in ("ckpt", "hf4", "packed", "hf16")]
    k3jax.save_checkpoint(model, paths[0])
    orbax_to_hf(paths[0], paths[1], experts="mxfp4", dtype="f32")
    hf_to_orbax(paths[1], paths[2], experts="mxfp4")
    orbax_to_hf(paths[2], paths[3], experts="bf16", dtype="f32")
    with open(os.path.join(paths[3], "config.json")) as f:
        assert "quantization_config" not in json.dumps(json.load(f))
    tensors = {}
    for file in sorted(os.listdir(paths[3])):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(paths[3], file), "numpy") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    assert experts and not any(k.endswith(("_packed", "_scale")) for k in tensors)
    for path, var in _routed(model).items():  # one MoE layer: each stack is [E, in, out] (after a scan axis of 1)
        fq = np.asarray(mx_quant.fake_quant_mxfp4(var.get_value(), -2))
        fq = fq.reshape(-1, *fq.shape[-3:])
        assert fq.shape[0] == 1, path
        for e in range(cfg.num_experts):
            (got,) = [v for k, v in experts.items() if k.endswith(f".experts.{e}.{path[-1]}.weight")]
            np.testing.assert_array_equal(got, fq[0, e].T, err_msg=f"{path} expert {e}")


def _ce(model, ids):
    logits_btv = model(ids[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits_btv), ids[:, 1:, None], -1))


def _train(cfg, data, steps: int):
    """`steps` of Adam on the next-token loss of `data` from seed 0; returns (params, other state)."""
    graphdef, params, rest = nnx.split(K3Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt):
        grads = jax.grad(lambda p: _ce(nnx.merge(graphdef, p, rest), data))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    opt = tx.init(params)
    for _ in range(steps):
        params, opt = step(params, opt)
    return params, rest


def _loss(cfg, state, data) -> float:
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    return float(jax.jit(lambda p, r: _ce(nnx.merge(graphdef, p, r), data))(*state))


@pytest.mark.slow
def test_qat_loses_less_to_mxfp4_than_post_training_quantization():
    """Two-layer tiny (one MoE layer), 50 Adam steps on a fixed batch, same init: the QAT run's loss under MXFP4
    experts is closer to the bf16-trained run's loss than that run's own loss after post-training quantization
    (its experts through the same MXFP4 forward)."""
    base = configs.get_config("tiny", WIDTHS).replace(num_hidden_layers=2, full_attn_layers=(2,))
    qat = base.replace(expert_qat="mxfp4")
    data = jnp.asarray(np.random.RandomState(0).randint(0, 64, (16, 33)), jnp.int32)
    bf16_run, qat_run = _train(base, data, 50), _train(qat, data, 50)
    bf16_loss = _loss(base, bf16_run, data)
    ptq_gap = _loss(qat, bf16_run, data) - bf16_loss
    qat_gap = _loss(qat, qat_run, data) - bf16_loss
    assert ptq_gap > 0 and qat_gap < ptq_gap, (bf16_loss, ptq_gap, qat_gap)


# ------------------------------------------------------------------------------------------ expert parallelism
EP_B, EP_T = 8, 6


def _moe_loss_and_grads(cfg, mesh, x_btd, cotangent_btd):
    """<LatentMoE(x), cotangent> and its gradients w.r.t. every parameter and x, jitted (under `mesh` when given)
    from the same seed-0 layer; also whether the EP path ran (an all-to-all in the program)."""
    from k3jax.layers.moe import LatentMoE

    layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) * cotangent_btd)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with mesh_context(mesh) if mesh is not None else contextlib.nullcontext():
        lowered = fn.lower(params, x_btd)
        value, (grads, grad_x) = lowered.compile()(params, x_btd)
    flat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
    return float(value), {**flat, "x": np.asarray(grad_x)}, "all_to_all" in lowered.as_text()


# (data, expert, context, model) and EP mode; (1,4,1,2) also splits the expert width over 'model' (32 of 64 per
# device: the GLU output's MXFP8 groups stay whole), capacity:8 drops nothing
EP_CASES = [((2, 4, 1, 1), "dropless"), ((1, 8, 1, 1), "capacity:8"), ((1, 4, 1, 2), "dropless")]


@pytest.mark.parametrize("shape,mode", EP_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_qat_under_expert_parallelism_matches_single_device_loss_and_gradients(shape, mode):
    """A QAT LatentMoE layer (MXFP4 weights, MXFP8 activations) on 8 emulated devices with the expert-parallel path
    gives the single-device QAT loss and gradients (straight-through, so the expert gradients include the
    quantization); and QAT changes both, so the comparison sees it."""
    from sharding.mesh import make_mesh

    cfg = configs.get_config("tiny", WIDTHS + ["expert_qat=mxfp4", "expert_act_qat=mxfp8",
                                               f"moe_expert_parallel={mode}"])
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.randn(EP_B, EP_T, cfg.hidden_size), jnp.float32)
    cot = jnp.asarray(rng.randn(EP_B, EP_T, cfg.hidden_size), jnp.float32)
    want_loss, want, ran_ep = _moe_loss_and_grads(cfg, None, x, cot)
    assert not ran_ep
    loss, got, ran_ep = _moe_loss_and_grads(cfg, make_mesh(*shape), x, cot)
    assert ran_ep
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    assert got.keys() == want.keys() and {"w1", "w3", "w2"} <= {k.split(".")[-1] for k in got}
    for key, g in got.items():
        np.testing.assert_allclose(g, want[key], rtol=1e-4, atol=1e-5 * (float(np.abs(want[key]).max()) or 1.0),
                                   err_msg=key)
    plain_loss, plain, _ = _moe_loss_and_grads(cfg.replace(expert_qat="none", expert_act_qat="none"), None, x, cot)
    assert abs(plain_loss - want_loss) > 1e-3 * abs(want_loss)
    assert np.abs(plain["x"] - want["x"]).max() > 1e-3 * np.abs(want["x"]).max()


def _fit_moe_layer(cfg, x, y, steps: int):
    """`steps` of Adam on the mean squared error of a seed-0 LatentMoE(x) against y; returns (params, rest)."""
    from k3jax.layers.moe import LatentMoE

    graphdef, params, rest = nnx.split(LatentMoE(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adam(3e-3)

    def step(params, opt):
        grads = jax.grad(lambda p: jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    opt = tx.init(params)
    step = jax.jit(step)
    for _ in range(steps):
        params, opt = step(params, opt)
    return params, rest


def test_qat_loses_less_to_mxfp4_than_post_training_quantization_on_one_moe_layer():
    """The fast sibling of the slow tiny-run test: one latent MoE layer (no shared expert) fit by 100 Adam steps to
    a teacher layer's outputs, from the same init with and without expert_qat=mxfp4. Under MXFP4 experts, the QAT
    fit's error is well below that of the float fit quantized after training."""
    from k3jax.layers.moe import LatentMoE

    base = configs.get_config("tiny", WIDTHS + ["num_shared_experts=0"])
    qat = base.replace(expert_qat="mxfp4")
    x = jnp.asarray(np.random.RandomState(0).randn(16, 8, base.hidden_size), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(LatentMoE(base, rngs=nnx.Rngs(1)), x)

    def mse(cfg, state) -> float:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg, rngs=nnx.Rngs(0))))
        return float(jax.jit(lambda p, r: jnp.mean((nnx.merge(graphdef, p, r)(x) - y) ** 2))(*state))

    float_fit, qat_fit = _fit_moe_layer(base, x, y, 100), _fit_moe_layer(qat, x, y, 100)
    float_err = mse(base, float_fit)
    ptq_gap = mse(qat, float_fit) - float_err
    qat_gap = mse(qat, qat_fit) - float_err
    assert ptq_gap > 0 and qat_gap < 0.7 * ptq_gap, (float_err, ptq_gap, qat_gap)


@pytest.mark.slow
@pytest.mark.parametrize("act_qat", ["none", "mxfp8"])
def test_two_layer_tiny_qat_loss_and_gradients_under_expert_parallelism_match_single_device(act_qat):
    """The whole model: a two-layer `tiny` (KDA + MoE, MLA) with MXFP4 expert weights, next-token loss and every
    parameter's gradient under mesh (2,4,1,1) with the EP path equal one device's (routing pinned by a
    well-separated selection bias, as tests/test_expert_parallel.py does, so both meshes route alike).

    With MXFP8 activations too the loss still agrees to 1e-5, but elementwise gradient equality cannot hold: the
    layers before the experts sum in another order under the mesh, and an expert input that lands within an f32
    ulp of an FP8 rounding boundary flips to the neighbouring FP8 value (a 6-12% step of that element). So that case
    bounds each gradient's relative error norm instead; the elementwise EP equality of the MXFP8 path, with expert
    inputs identical on both sides, is test_qat_under_expert_parallelism_matches_single_device_loss_and_gradients."""
    from k3jax.layers.params import RouterBias
    from sharding.mesh import make_mesh
    from sharding.shard import shard_batch

    cfg = configs.get_config("tiny", WIDTHS + ["num_hidden_layers=2", "full_attn_layers=(2,)", "kda_impl=recurrent",
                                               "expert_qat=mxfp4", f"expert_act_qat={act_qat}"])
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 17)).astype(np.int32)

    def run(mesh):
        model = K3Model(cfg, rngs=nnx.Rngs(0))
        biases = nnx.state(model, RouterBias)
        nnx.update(model, jax.tree.map(lambda b: jnp.broadcast_to(jnp.arange(b.shape[-1]) * 10.0, b.shape), biases))
        shard_model(model, mesh)
        fn = make_sharded_loss_and_grad(model, mesh)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        lowered = fn.jitted.lower(params, rest, shard_batch(ids, mesh))
        loss, grads = lowered.compile()(params, rest, shard_batch(ids, mesh))
        flat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
        return float(loss), flat, "all_to_all" in lowered.as_text()

    want_loss, want, ran_ep = run(make_mesh(devices=jax.devices()[:1]))
    assert not ran_ep
    loss, got, ran_ep = run(make_mesh(2, 4, 1, 1))
    assert ran_ep and abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    assert got.keys() == want.keys()
    for key, g in got.items():
        if act_qat == "none":
            np.testing.assert_allclose(g, want[key], rtol=1e-3, atol=2e-4 * (float(np.abs(want[key]).max()) or 1.0),
                                       err_msg=key)
        else:  # measured worst 1.4e-3 (the routed w2 on 2026-12-04)
            err = np.linalg.norm(g - want[key]) / (np.linalg.norm(want[key]) or 1.0)
            assert err <= 1e-2, (key, err)
