"""Multimodal training and loading: interleaved image-text records through ArrayRecord + Grain, the static-shape
row encoding of the vision tower against the packed-layout tower, the text-only loss (image placeholder targets
masked) against a NumPy reference on the same logits, a frozen vs a trainable tower under one optimizer step, and
a vision-language checkpoint saved and loaded back to identical logits."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.data import prepare as prep
from k3jax.data import prepare_multimodal as pm
from k3jax.data.multimodal_pipeline import batch_shapes, build_multimodal_dataset, check_fits
from k3jax.loading import load_vision_language_model, save_checkpoint, save_vision_language_model
from k3jax.model import K3Model
from k3jax.training import multimodal as mmt
from k3jax.training import trainer
from k3jax.vision import K3VisionLanguageModel, VisionConfig, VisionModel
from k3jax.vision.preprocess import normalize, preprocess_frames
from k3jax.vision.rows import encode_rows, patch_features
from sharding.mesh import make_mesh

TEXT = ["num_hidden_layers=2", "full_attn_layers=(2,)"]  # a KDA and an MLA layer, dense and MoE FFNs
SMALL = ["num_hidden_layers=1", "full_attn_layers=(1,)"]  # one MLA layer: the loss and update checks compile fast
PLACEHOLDER = prep.BYTE_PAD + 1  # 259: prepare_multimodal's default for the byte tokenizer
SEQ, PATCHES, PATCH = 128, 256, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """12 synthetic documents (one image each, a caption before or after it) prepared with 4-pixel patches."""
    root = tmp_path_factory.mktemp("mm")
    src = pm.write_demo_documents(str(root / "src"), 12, seed=1)
    out = str(root / "prepared")
    pm.prepare_multimodal(src, out, patch_size=PATCH, max_image_patches=64, num_shards=2)
    return src, out


def _batches(out, n=1, **kw):
    cfg = mmt.named_vision_config("tiny")
    it = iter(build_multimodal_dataset(out, cfg, batch_size=2, seq_len=SEQ, max_patches=PATCHES, shuffle=False,
                                       **kw))
    return it, [next(it) for _ in range(n)]


def test_a_record_round_trips_through_array_record_and_grain(data):
    src, out = data
    meta = pm.read_metadata(out)
    assert meta["placeholder_id"] == PLACEHOLDER and meta["num_documents"] == 12
    # stored pixels are the processor's, bit-exact once normalised; the marker became h*w/4 placeholders
    import grain

    files = [os.path.join(out, s["file"]) for s in meta["shards"]]
    records = grain.sources.ArrayRecordDataSource(files)
    with open(src) as f:
        docs = [json.loads(line) for line in f]
    shard_order = [i for s in range(2) for i in range(s, 12, 2)]  # document i went to shard i % 2
    for k, i in enumerate(shard_order):
        ids, pixels, grids = pm.decode_record(records[k])
        image = np.load(os.path.join(os.path.dirname(src), docs[i]["images"][0]))
        want, (_, gh, gw) = preprocess_frames(image, patch_size=PATCH, max_patches=64)
        np.testing.assert_array_equal(normalize(pixels), want)  # [N, 3, p, p]: channels broadcast
        assert grids == [(gh, gw)] and int((ids == PLACEHOLDER).sum()) == gh * gw // 4
        assert ids[0] == prep.BYTE_BOS and ids[-1] == prep.BYTE_EOS
        text = bytes(int(t) for t in ids[1:-1] if t != PLACEHOLDER).decode()
        assert text == docs[i]["text"].replace(pm.IMAGE_MARKER, "")
    # packed rows: each row's placeholders are exactly its images' merged tokens; placeholder targets masked
    it, (b0, b1) = _batches(out, 2)
    shapes = batch_shapes(mmt.named_vision_config("tiny"), batch_size=2, seq_len=SEQ, max_patches=PATCHES)
    for b in (b0, b1):
        assert b["pixels"].shape == (2, PATCHES, 3 * PATCH * PATCH) and b["pixels"].dtype == np.uint8
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == shapes  # what the trainer compiles ahead for
        for row in range(2):
            valid = int((b["patch_segment_ids"][row] >= 0).sum())
            assert valid and int((b["input_ids"][row] == PLACEHOLDER).sum()) == valid // 4
        placeholder_targets = b["targets"] == PLACEHOLDER
        assert placeholder_targets.any() and not b["loss_mask"][placeholder_targets].any()
        np.testing.assert_array_equal(b["loss_mask"] > 0, (b["segment_ids"] > 0) & ~placeholder_targets)
    # the iterator state is JSON and restores to the same next batch
    state = json.loads(json.dumps(it.get_state()))
    want = next(it)
    fresh, _ = _batches(out, 0)
    fresh.set_state(state)
    got = next(fresh)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("mode", ["bilinear", pytest.param("bicubic", marks=pytest.mark.slow)])  # ~20 s each
def test_row_encoding_equals_the_packed_layout_tower(mode):
    """encode_rows (static shapes, per-patch arrays, merge-block order, padding) gives the tokens of
    VisionModel.encode (per-image static grids, checked against transformers in test_vision_tower.py)."""
    cfg = VisionConfig(patch_size=2, init_pos_emb_height=5, init_pos_emb_width=7, vt_num_attention_heads=2,
                       vt_num_hidden_layers=2, vt_hidden_size=16, vt_intermediate_size=32, qkv_hidden_size=16,
                       mm_hidden_size=16, text_hidden_size=24, pos_emb_interpolation_mode=mode)
    vision = VisionModel(cfg, rngs=nnx.Rngs(0), attn_block_q=None)
    rng = np.random.RandomState(0)
    rows = [[(4, 6), (2, 2)], [(8, 4)]]  # grids below and above the 5 x 7 table, two images in row 0
    p = 48
    inputs = {k: np.zeros((2, p) + s, d) for k, s, d in (
        ("pixels", (12,), np.uint8), ("seg", (), np.int32), ("rc", (2,), np.int32),
        ("index", (4 if mode == "bilinear" else 16,), np.int32), ("weight", (4 if mode == "bilinear" else 16,),
                                                                   np.float32))}
    inputs["seg"][:] = -1
    want = []
    for r, grids in enumerate(rows):
        raster = rng.randint(0, 256, (sum(h * w for h, w in grids), 12)).astype(np.uint8)
        want.append(np.asarray(vision.encode(jnp.asarray((raster.astype(np.float32) - 127.5) / 127.5),
                                             [(1, h, w) for h, w in grids])))
        f = patch_features(grids, cfg)
        n = raster.shape[0]
        for key, value in (("pixels", raster[f["order"]]), ("seg", f["patch_image"]), ("rc", f["patch_rc"]),
                           ("index", f["patch_pos_index"]), ("weight", f["patch_pos_weight"])):
            inputs[key][r, :n] = value
    got = np.asarray(encode_rows(vision, *(jnp.asarray(inputs[k]) for k in ("pixels", "seg", "rc", "index",
                                                                            "weight"))))
    for r in range(2):
        m = want[r].shape[0]
        np.testing.assert_allclose(got[r, :m], want[r], rtol=0, atol=2e-6 * np.abs(want[r]).max())


def _options(out, **kw):
    return trainer.TrainOptions(vision_config="tiny", data=out, batch_size=2, seq_len=SEQ, max_patches=PATCHES,
                                mtp=False, optimizer="adamw", steps=10, **kw)


def test_loss_masks_image_placeholder_positions(data):
    """The trainer's LM loss equals a NumPy cross-entropy over the same logits with its own mask (segment > 0 and
    the target not an image placeholder): image positions do not count."""
    _, out = data
    cfg = configs.get_config("tiny", SMALL)
    trainable, _ = trainer.make_trainable(cfg, _options(out))
    batch = {k: jnp.asarray(v) for k, v in _batches(out)[1][0].items()}

    @nnx.jit
    def run(t, b):
        loss, metrics = trainer.loss_fn(t, b, 0.0)
        return loss, t.model.logits(mmt.hidden_states(t, b))

    loss, logits = (np.asarray(x, np.float64) for x in run(trainable, batch))
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = np.asarray(batch["targets"])
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    text = (np.asarray(batch["segment_ids"]) > 0) & (targets != PLACEHOLDER)
    np.testing.assert_allclose(loss, (nll * text).sum() / text.sum(), rtol=2e-6)
    with_images = np.asarray(batch["segment_ids"]) > 0
    assert abs((nll * with_images).sum() / with_images.sum() - loss) > 1e-3  # the mask matters on this batch


@pytest.mark.slow  # ~45 s on 2 cores (two training compiles); the loss-mask test runs the multimodal trainer
def test_frozen_tower_gets_no_update_and_a_trainable_one_changes(data):
    _, out = data
    batch = _batches(out)[1][0]
    mesh = make_mesh(devices=jax.devices()[:1])
    for trainable_tower in (False, True):
        cfg = trainer.training_config("tiny", SMALL + [f"vision_trainable={trainable_tower}"])
        t, optimizer, step, _ = trainer.build(cfg, _options(out), mesh)
        vision_before = jax.tree.map(np.asarray, nnx.state(t.vision, nnx.Param))
        text_before = jax.tree.map(np.asarray, nnx.state(t.model, nnx.Param))
        opt_paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState))]
        assert any("vision" in p for p in opt_paths) == trainable_tower
        for _ in range(2):  # the first step's learning rate is 0 (warmup)
            loss, _ = step(t, optimizer, batch)
            assert np.isfinite(float(loss))
        vision_changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)),
                                                      vision_before, nnx.state(t.vision, nnx.Param)))
        text_changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)),
                                                    text_before, nnx.state(t.model, nnx.Param)))
        assert any(text_changed)
        if trainable_tower:
            assert sum(vision_changed) >= len(vision_changed) - 1  # every tower parameter moves
        else:
            assert not any(vision_changed)


def _tiny_vlm(seed=0):
    cfg = configs.get_config("tiny", TEXT)
    vcfg = mmt.named_vision_config("tiny")
    model = nnx.jit(lambda: K3VisionLanguageModel(K3Model(cfg, rngs=nnx.Rngs(seed)),  # jitted init: one compile
                                                  VisionModel(vcfg, rngs=nnx.Rngs(seed + 1)),
                                                  placeholder_id=PLACEHOLDER))()
    return cfg, model


@pytest.mark.slow  # ~45 s on 2 cores; tests/test_convert_vision.py round-trips the tower's tensors by default
def test_vision_language_checkpoint_round_trips_to_identical_logits(tmp_path):
    cfg, model = _tiny_vlm()
    path = save_vision_language_model(model, str(tmp_path / "vlm"))
    loaded_cfg, loaded = load_vision_language_model(path)
    assert loaded.placeholder_id == PLACEHOLDER and loaded.vision.cfg == model.vision.cfg
    grids = [(1, 4, 6), (1, 2, 2)]  # 6 + 1 image tokens
    ids = np.random.RandomState(0).randint(0, 256, (1, 20)).astype(np.int32)
    ids[0, 3:9] = PLACEHOLDER
    ids[0, 15] = PLACEHOLDER
    pixels = jnp.asarray(np.random.RandomState(1).uniform(-1, 1, (28, 3, PATCH, PATCH)), jnp.float32)

    layout = model.layout(grids)
    graphdef = nnx.split(model)[0]
    forward = jax.jit(lambda state, i, p: nnx.merge(graphdef, state)(i, p, layout))  # one compile for both

    def logits(m):
        return np.asarray(forward(jax.device_put(nnx.split(m)[1], jax.devices()[0]), jnp.asarray(ids), pixels))

    np.testing.assert_array_equal(logits(loaded), logits(model))
    # with a mesh: every vision parameter placed in its sharding, values unchanged
    mesh = make_mesh(data=2, model=2, devices=jax.devices()[:4])
    _, placed = load_vision_language_model(path, mesh=mesh, placeholder_id=PLACEHOLDER + 1)
    assert placed.placeholder_id == PLACEHOLDER + 1
    for (path_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model.vision, nnx.Param)),
                                  nnx.to_flat_state(nnx.state(placed.vision, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()))
        assert b.get_value().sharding.mesh.shape == mesh.shape, path_
    # training's --init_from copies the tower into a run's VisionModel (kept in its placement)
    fresh = VisionModel(mmt.named_vision_config("tiny"), rngs=nnx.Rngs(7))
    assert mmt.init_vision(fresh, path)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(fresh, nnx.Param)),
                 jax.tree.map(np.asarray, nnx.state(model.vision, nnx.Param)))
    # a text-only checkpoint is refused with a clear error
    save_checkpoint(model.language_model, str(tmp_path / "text"))
    with pytest.raises(CheckpointError, match="holds no vision tower"):
        load_vision_language_model(str(tmp_path / "text"))
    assert loaded_cfg == cfg


def test_bad_multimodal_input_is_refused_with_one_line(data, tmp_path):
    src, out = data
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "two <image> markers <image>", "images": ["x.npy"]}) + "\n")
    with pytest.raises(prep.DataPrepError, match="2 '<image>' marker"):
        pm.prepare_multimodal(str(bad), str(tmp_path / "o"))
    meta = pm.read_metadata(out)
    cfg = mmt.named_vision_config("tiny")
    with pytest.raises(ValueError, match="raise --max_patches"):
        check_fits(meta, cfg, seq_len=SEQ, max_patches=8)
    with pytest.raises(ValueError, match="raise --seq_len"):
        check_fits(meta, cfg, seq_len=8, max_patches=PATCHES)
    assert pm.main(["--input", src, "--out", out]) == 2  # exists: error line, exit 2


@pytest.mark.slow
def test_train_runs_saves_and_resumes_on_multimodal_data(data, tmp_path, monkeypatch):
    """trainer.train on the multimodal data: 2 steps with a checkpoint, then a resume to step 3 (the Grain
    first-fit packing state saved per data-parallel shard and restored). The steps run on the executable compiled
    before allocation (`trainer.compile_ahead`, multimodal batch shapes): the real step's jit never traces."""
    _, out = data
    cfg = trainer.training_config("tiny", TEXT)
    kw = dict(vision_config="tiny", data=out, batch_size=2, seq_len=SEQ, max_patches=PATCHES, mtp=False,
              workdir=str(tmp_path / "w"), checkpoint_every=2, log_every=1, mesh="1,1,1,1")
    steps, real_build = [], trainer.build
    monkeypatch.setattr(trainer, "build", lambda *a, **k: steps.append(real_build(*a, **k)) or steps[-1])
    losses = trainer.train(cfg, trainer.TrainOptions(steps=2, **kw), log_fn=lambda m: None)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert len(steps) == 2 and steps[-1][2].jitted._cache_size() == 0
    more = trainer.train(cfg, trainer.TrainOptions(steps=3, **kw), log_fn=lambda m: None)
    assert len(more) == 1 and np.isfinite(more[0])


@pytest.mark.slow
def test_sharded_multimodal_steps_equal_one_device(data):
    """Three Muon steps with the tower's parameters sharded by their vision_* logical axes on a (data 2, model 2)
    mesh give the losses and tower weights of one device."""
    _, out = data
    it = iter(build_multimodal_dataset(out, mmt.named_vision_config("tiny"), batch_size=4, seq_len=SEQ,
                                       max_patches=PATCHES, shuffle=False))
    batch = next(it)
    cfg = trainer.training_config("tiny", SMALL)
    opts = trainer.TrainOptions(vision_config="tiny", data=out, batch_size=4, seq_len=SEQ, max_patches=PATCHES,
                                mtp=False, steps=10)
    results = []
    for mesh in (make_mesh(devices=jax.devices()[:1]), make_mesh(data=2, model=2, devices=jax.devices()[:4])):
        t, optimizer, step, _ = trainer.build(cfg, opts, mesh)
        losses = [float(step(t, optimizer, batch)[0]) for _ in range(3)]
        results.append((losses, jax.tree.map(np.asarray, nnx.state(t.vision, nnx.Param))))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), results[1][1], results[0][1])
