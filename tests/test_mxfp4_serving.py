"""Serving with the routed experts held as MXFP4 (`expert_weights='mxfp4'`): packed uint8 in device memory, run by
the MXFP4 grouped matmul through `k3jax.ops.gmm`.

- A model with packed experts gives the logits of the same model whose experts were dequantized by an independent
  NumPy E2M1/E8M0 decoder written here; greedy generation gives the same tokens.
- Loading an MXFP4 HF directory / `--experts mxfp4` checkpoint keeps the released bytes as they are (uint8, 4.25
  bits per weight); a bf16-experts checkpoint is quantized, and the quantizer rounds to the nearest MXFP4 value
  (checked against a NumPy brute force).
- `serve.py --expert_weights=mxfp4` runs end to end and matches the dequantized model's greedy tokens.
- Training refuses packed experts (config and gradients); expert parallelism runs them, with the 'model' axis
  splitting the expert width too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import k3jax
from k3jax.config import ConfigError
from k3jax.model import K3Model
from k3jax.ops.gmm import InferenceOnlyError, MXFP4Experts, gmm
from tests.helpers import logits
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny with expert widths of 64: two 32-column scale groups per weight row in both expert matmuls
WIDTHS = ["routed_expert_hidden_size=64", "moe_intermediate_size=64"]
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROMPTS = [[256, 10, 20, 30, 40, 50, 60], [256, 5], [256, 1, 2, 3, 4]]
EXPERTS = ("w1", "w3", "w2")


def numpy_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Independent MXFP4 decoder: u8 [..., n, k/2] (low nibble = even column) + E8M0 u8 [..., n, k/32] -> f64."""
    packed = np.asarray(packed).astype(np.int64)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    return values * np.repeat(np.ldexp(1.0, np.asarray(scales).astype(np.int64) - 127), 32, axis=-1)


def _flat(model):
    return {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable))}


def packed_experts(model) -> dict:
    """{(path..., 'w1'): (packed, scales)} over every MoE layer of a model with packed experts."""
    flat = _flat(model)
    return {key[:-1] + (key[-1][:-len("_packed")],): (np.asarray(var.get_value()),
                                                     np.asarray(flat[key[:-1] + (key[-1][:-6] + "scale",)].get_value()))
            for key, var in flat.items() if key[-1].endswith("_packed")}


def dequantized_twin(model_q):
    """The same model with parameter experts = `numpy_decode` of the packed bytes (every other tensor copied)."""
    ref = nnx.eval_shape(lambda: K3Model(model_q.cfg.replace(expert_weights="bf16"), rngs=nnx.Rngs(0)))
    q_flat, packed = _flat(model_q), packed_experts(model_q)
    for key, var in _flat(ref).items():
        if key in packed:
            value = np.swapaxes(numpy_decode(*packed[key]), -1, -2)  # [.., E, out, in] -> our [.., E, in, out]
        else:
            value = np.asarray(q_flat[key].get_value())
        assert value.shape == var.get_value().shape, key
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    return ref


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny K3-format HF directory with MXFP4 experts (written by the tests' own encoder), declared f32 so loads
    compute in f32."""
    path = str(tmp_path_factory.mktemp("k3_mxfp4") / "tiny_mxfp4")
    _, stored = write_hf_dir(path, configs.get_config("tiny", WIDTHS), k3=True)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["torch_dtype"] = hf["text_config"]["torch_dtype"] = "float32"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return path, stored


def test_mxfp4_model_logits_equal_numpy_dequantized_model(hf_dir):
    from k3jax.layers.params import RouterBias

    cfg, model_q = k3jax.load_hf(hf_dir[0], expert_weights="mxfp4")
    assert cfg.runtime.param_dtype == "float32" and cfg.runtime.expert_weights == "mxfp4"
    assert not any(k[-1] in EXPERTS for k in _flat(model_q)) and packed_experts(model_q)  # no dense expert copy
    # the fixture pins routing with a separated selection bias; zero it so tokens spread over the experts
    nnx.update(model_q, jax.tree.map(jnp.zeros_like, nnx.state(model_q, RouterBias)))
    model_ref = dequantized_twin(model_q)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 32)), jnp.int32)
    got, want = logits(model_q, ids), logits(model_ref, ids)
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_gmm_dispatch_runs_packed_weights_like_numpy():
    """`k3jax.ops.gmm.gmm` with `MXFP4Experts`: the XLA path and the Pallas kernel (interpreted on CPU) equal a
    float64 NumPy grouped matmul with the NumPy-decoded weights (logical [E, in, out] orientation)."""
    rng = np.random.RandomState(0)
    g, k, n = 4, 64, 32
    w = rng.randn(g, k, n).astype(np.float32) * np.ldexp(1.0, rng.randint(-6, 3, (g, 1, n)))
    q = MXFP4Experts.quantize(jnp.asarray(w))
    assert q.packed.shape == (g, n, k // 2) and q.scales.shape == (g, n, k // 32) and q.shape == (g, k, n)
    sizes = np.array([5, 0, 9, 3])  # an empty group; 2 rows past the groups give zeros
    lhs = rng.randn(19, k).astype(np.float32)
    w_dec = np.swapaxes(numpy_decode(np.asarray(q.packed), np.asarray(q.scales)), 1, 2)
    want = np.zeros((19, n))
    for i, (s, e) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        want[s:e] = lhs[s:e].astype(np.float64) @ w_dec[i]
    with jax.default_matmul_precision("float32"):
        for impl in ("auto", "pallas"):
            got = np.asarray(gmm(jnp.asarray(lhs), q, jnp.asarray(sizes), impl=impl))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=impl)


def test_quantizer_rounds_to_the_nearest_mxfp4_value():
    """Per 32-column group the scale is the smallest 2^X with amax <= 6·2^X, and every value decodes to a nearest
    point of ±E2M1·2^X (NumPy brute force; tie-agnostic distance check)."""
    rng = np.random.RandomState(1)
    w = rng.randn(3, 16, 128) * np.ldexp(1.0, rng.randint(-20, 20, (3, 16, 4))).repeat(32, axis=-1)
    w[0, 0, :32] = 0.0  # an all-zero group
    w[0, 1, :32] = 6.0 * 2.0 ** -3  # amax exactly on a power-of-two multiple of 6
    w[0, 2, :32] = np.linspace(-1.75, 1.75, 32)  # ties between codes
    w = w.astype(np.float32)
    packed, scales = (np.asarray(a) for a in MXFP4Experts.quantize(jnp.asarray(np.swapaxes(w, -1, -2))))
    w_nk = w.astype(np.float64)
    groups = w_nk.reshape(3, 16, 4, 32)
    amax = np.abs(groups).max(-1)
    x = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0)), 0).astype(np.int64)
    np.testing.assert_array_equal(scales.astype(np.int64), x + 127)
    grid = np.concatenate([E2M1, -E2M1])[None, None, None, None, :] * np.ldexp(1.0, x)[..., None, None]
    dist = np.abs(groups[..., None] - grid).min(-1)
    decoded = numpy_decode(packed, scales).reshape(groups.shape)
    np.testing.assert_array_equal(np.abs(decoded - groups), dist)
    assert (decoded[0, 0, 0] == 0).all() and (decoded[0, 1, 0] == 6.0 * 2.0 ** -3).all()


# --------------------------------------------------------------------------------------------------- loading
def _released_bytes(stored: dict, cfg, key: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The stored HF tensors of one packed variable path, stacked over experts (and scanned layers)."""
    group = cfg.layer_groups()[int(key[1])]
    j = int(key[4] if key[2] == "units" else key[3])
    layers = [group.start + r * len(group.pattern) + j for r in range(group.num_repeats)]
    out = []
    for part in ("_packed", "_scale"):
        per_layer = [np.stack([stored[f"language_model.model.layers.{li}.block_sparse_moe.experts.{e}.{key[-1]}."
                                      f"weight{part}"] for e in range(cfg.num_experts)]) for li in layers]
        out.append(np.stack(per_layer) if key[2] == "units" else per_layer[0])
    return tuple(out)


def _check_packed(model, stored, *, same_bytes: bool = True):
    """Every MoE layer holds its experts packed (uint8, 4.25 bits per weight) equal to the released tensors: byte for
    byte, or (`same_bytes=False`, requantized) value for value under the NumPy decoder."""
    cfg = model.cfg
    packed = packed_experts(model)
    moe_variables = sum(f == "moe" for g in cfg.layer_groups() for _, f in g.pattern)  # scanned: one per unit slot
    assert len(packed) == 3 * moe_variables and not any(k[-1] in EXPERTS for k in _flat(model))
    weights = bits = 0
    for key, (p, s) in packed.items():
        assert p.dtype == np.uint8 and s.dtype == np.uint8
        want_p, want_s = _released_bytes(stored, cfg, key)
        if same_bytes:
            np.testing.assert_array_equal(p, want_p, err_msg=str(key))  # never decoded on the way
            np.testing.assert_array_equal(s, want_s, err_msg=str(key))
        else:
            np.testing.assert_array_equal(numpy_decode(p, s), numpy_decode(want_p, want_s), err_msg=str(key))
        weights += 2 * p.size
        bits += 8 * (p.nbytes + s.nbytes)
    assert bits / weights == 4.25


def test_load_hf_and_mxfp4_checkpoint_keep_the_released_bytes(hf_dir, tmp_path):
    from k3jax.convert.checkpoint import hf_to_orbax

    path, stored = hf_dir
    cfg, model = k3jax.load_hf(path, expert_weights="mxfp4")
    assert cfg.runtime.expert_weights == "mxfp4" and model.cfg == cfg
    _check_packed(model, stored)
    ckpt = hf_to_orbax(path, str(tmp_path / "ckpt_mxfp4"), experts="mxfp4")
    cfg2, model2 = k3jax.load_checkpoint(ckpt, overrides=["expert_weights=mxfp4"])
    assert cfg2.runtime.expert_weights == "mxfp4"
    _check_packed(model2, stored)
    # bf16-experts checkpoint: quantized on load; its values are on the MXFP4 grid, so they come back exactly
    # (a group whose largest value rounded down may get a smaller scale: same values, other bytes)
    dense = hf_to_orbax(path, str(tmp_path / "ckpt_bf16"), experts="bf16")
    _, model3 = k3jax.load_checkpoint(dense, expert_weights="mxfp4")
    _check_packed(model3, stored, same_bytes=False)


def greedy_by_full_forward(model, prompts, steps: int, eos_id: int) -> list[list[int]]:
    """Greedy decoding without any cache: each step re-runs the whole right-padded batch (the model is causal, so
    padding after a row's end does not change its logits) and appends each row's argmax at its last token."""
    ids = np.zeros((len(prompts), 32), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    out, done = [[] for _ in prompts], [False] * len(prompts)
    for _ in range(steps):
        step = logits(model, jnp.asarray(ids))
        for i in range(len(prompts)):
            if done[i]:
                continue
            token = int(np.argmax(step[i, lengths[i] - 1]))
            if token == eos_id:
                done[i] = True
                continue
            out[i].append(token)
            ids[i, lengths[i]] = token
            lengths[i] += 1
    return out


@pytest.mark.slow  # ~50 s on 2 cores: the CLI end to end; the packed-expert logits are checked in the default suite
def test_serve_cli_with_mxfp4_experts_matches_dequantized_model(hf_dir, tmp_path):
    """`serve.py --hf_dir --expert_weights=mxfp4` batch mode (cached prefill + decode), greedy, equals greedy
    decoding by full forwards of the NumPy-dequantized model."""
    path, _ = hf_dir
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "serve.py", f"--hf_dir={path}", "--expert_weights=mxfp4",
                        f"--prompts_file={prompts}", f"--out={out}", "--max_new_tokens=6", "--max_len=32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()]
    cfg, model_q = k3jax.load_hf(path, expert_weights="mxfp4")
    want = greedy_by_full_forward(dequantized_twin(model_q), PROMPTS, 6, cfg.eos_token_id)
    assert got == want and all(got)
    r = subprocess.run([sys.executable, "serve.py", "--expert_weights=int4", f"--prompts_file={prompts}",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "expert_weights" in r.stderr


# --------------------------------------------------------------------------------------------------- refusals
def test_training_and_bad_options_refuse_packed_experts(tmp_path):
    from k3jax.layers.moe import LatentMoE
    from k3jax.training.trainer import TrainOptions, build

    cfg = configs.get_config("tiny", WIDTHS + ["expert_weights=mxfp4"])
    with pytest.raises(ConfigError, match="inference-only"):
        cfg.replace(record_routing_stats=True)
    with pytest.raises(ConfigError, match="inference-only"):
        build(cfg, TrainOptions(), mesh=None)  # the trainer turns routing statistics on first
    with pytest.raises(ConfigError, match="expert_weights must be one of"):
        configs.get_config("tiny", ["expert_weights=int4"])
    with pytest.raises(ConfigError, match="divisible by the MXFP4 group of 32"):
        configs.get_config("tiny", ["expert_weights=mxfp4", "moe_intermediate_size=48"])
    with pytest.raises(ConfigError, match="expert_weights must be one of"):
        k3jax.load_checkpoint(str(tmp_path), expert_weights="int4")
    x = jnp.asarray(np.random.RandomState(0).randn(2, 4, cfg.hidden_size), jnp.float32)
    for moe_impl in ("dropless", "dense"):
        layer = LatentMoE(cfg.replace(moe_impl=moe_impl), rngs=nnx.Rngs(0))
        with pytest.raises(InferenceOnlyError, match="inference-only"):
            jax.grad(lambda x, layer=layer: layer(x).sum())(x)
    model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="inference-only"):
        k3jax.save_checkpoint(model, str(tmp_path / "out"))


def test_expert_parallel_packed_experts_equal_single_program_with_expert_and_model_axes():
    """Under an expert mesh axis, and under expert + model axes where 'model' splits the expert width M (packed w1/w3
    [E, M, L/2] split on M, w2 [E, L, M/2] on its packed M columns, scales alike), the packed layer equals its
    single-device result."""
    from k3jax.layers.moe import LatentMoE
    from sharding.expert_parallel import expert_weight_specs
    from sharding.mesh import make_mesh
    from sharding.shard import mesh_context

    cfg = configs.get_config("tiny", WIDTHS + ["expert_weights=mxfp4", "moe_expert_parallel=dropless"])
    layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.RandomState(1).randn(8, 6, cfg.hidden_size), jnp.float32)
    graphdef, state = nnx.split(layer)
    run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    want = np.asarray(run(state, x))
    assert np.isfinite(want).all() and want.std() > 0
    w1, _, w2 = layer.routed_expert_weights()
    for mesh in (make_mesh(2, 4, 1, 1), make_mesh(1, 2, 1, 2, devices=jax.devices()[:4])):
        w13_spec, w2_spec, split_m = expert_weight_specs(w1, w2, mesh)
        assert split_m == (mesh.shape["model"] > 1)
        if split_m:  # the packed bytes are cut along M: w1/w3 rows, w2 packed columns
            assert tuple(w13_spec.packed) == tuple(w13_spec.scales) == ("expert", "model", None)
            assert tuple(w2_spec.packed) == tuple(w2_spec.scales) == ("expert", None, "model")
        with mesh_context(mesh):
            lowered = run.lower(state, x)
            assert "all_to_all" in lowered.as_text()  # the expert-parallel path ran
            got = np.asarray(lowered.compile()(state, x))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(mesh.shape))
