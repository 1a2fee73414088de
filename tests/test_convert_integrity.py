"""Weights are refused when they hold NaN/Inf (conversion, load_hf, serve.py start-up; --allow_nonfinite accepts
them); conversion leaves nothing behind (a killed run's temporary directory, a replaced file) and opens no shard
outside the HF directory; malformed inputs and unwritable outputs end python -m k3jax.convert / train.py with one
`error:` line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import configs
from k3jax.atomic import AtomicDir
from k3jax.convert.checkpoint import NonFiniteError, hf_to_orbax, read_manifest
from k3jax.convert.safetensors_io import CheckpointError
from k3jax.loading import load_checkpoint, load_hf
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = "language_model.model.layers.1.self_attn.o_proj.weight"  # a float tensor of the second layer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "hf"
    write_hf_dir(d, configs.get_config("tiny", ["num_hidden_layers=2", "full_attn_layers=(2,)"]), k3=True, seed=3,
                 a_log_len=128)
    return str(d)


@pytest.fixture
def hf(base, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(base, d)
    return str(d)


def _index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def _write_index(d, idx):
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)


def _poison(d, name=BAD, value=np.nan):
    """Sets one element of tensor `name` to `value` in place (its shard rewritten)."""
    file = os.path.join(d, _index(d)["weight_map"][name])
    tensors = load_file(file)
    arr = tensors[name].copy()
    arr.reshape(-1)[7] = value
    tensors[name] = arr
    save_file(tensors, file)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _one_error_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------------ non-finite


def test_a_nan_tensor_is_refused_by_conversion_naming_it(hf, tmp_path):
    _poison(hf)
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError, match=rf"tensor '{BAD}' in .* holds 1 NaN/Inf value\(s\).*--allow_nonfinite"):
        hf_to_orbax(hf, str(out))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    hf_to_orbax(hf, str(out), allow_nonfinite=True)  # explicitly allowed: converts
    assert (out / "manifest.json").exists()
    # a checkpoint holding them is refused when loaded, too
    with pytest.raises(NonFiniteError, match="o_proj.*NaN/Inf"):
        load_checkpoint(str(out))


def test_convert_cli_exits_2_with_one_error_line_naming_the_nan_tensor(hf, tmp_path):
    _poison(hf, value=np.inf)
    proc = _cli("-m", "k3jax.convert", f"--hf_dir={hf}", f"--out={tmp_path / 'out'}")
    _one_error_line(proc, BAD, "NaN/Inf")
    assert not (tmp_path / "out").exists()


def test_load_hf_refuses_a_nan_tensor_unless_allowed(hf):
    _poison(hf)
    with pytest.raises(NonFiniteError, match=rf"tensor {BAD} \(parameter .*\) holds NaN/Inf"):
        load_hf(hf)
    cfg, model = load_hf(hf, allow_nonfinite=True)
    assert cfg.num_hidden_layers == 2


def test_serve_refuses_to_start_on_nan_weights(hf):
    _poison(hf)
    proc = _cli("serve.py", f"--hf_dir={hf}", "--port=18765", "--slots=1", "--max_len=64")
    _one_error_line(proc, BAD, "NaN/Inf")


# ------------------------------------------------------------------------------------------------ leftovers


def test_a_killed_conversions_temporary_directory_is_removed_by_the_next(hf, tmp_path):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"out.tmp-{int(dead.stdout)}-0123abcd"
    (stale / "params").mkdir(parents=True)
    (stale / "params" / "junk").write_bytes(b"x" * 100)
    live = tmp_path / f"out.tmp-{os.getppid()}-89abcdef"  # a running process's: left alone
    live.mkdir()
    logs = []
    hf_to_orbax(hf, str(out), log=logs.append)
    assert not stale.exists() and live.exists()
    assert any(f"removed {stale}" in m and "interrupted" in m for m in logs), logs
    assert any(f"left {live} in place" in m for m in logs), logs


def test_overwrite_onto_a_file_leaves_no_old_copy(tmp_path):
    out = tmp_path / "out"
    out.write_text("a file in the way")
    with AtomicDir(str(out), overwrite=True) as tmp:
        open(os.path.join(tmp, "manifest.json"), "w").close()
    assert out.is_dir() and sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(out) == ["manifest.json"]


@pytest.mark.parametrize("shard", ["../../../etc/hostname", "/etc/hostname", "sub/../../x.safetensors", "."])
def test_index_shard_names_must_stay_inside_the_hf_directory(hf, tmp_path, shard):
    idx = _index(hf)
    idx["weight_map"][BAD] = shard
    _write_index(hf, idx)
    with pytest.raises(CheckpointError, match=rf"{BAD}.* is assigned to .*not a file name inside the HF directory"):
        hf_to_orbax(hf, str(tmp_path / "out"))


# ------------------------------------------------------------------------------------------------ input errors


@pytest.mark.parametrize("content", ['{"weight_map": ["a"]}', "{\"weight_map\": {\"x\": 3}}", "\x00\x01garbage",
                                     "[]"])
def test_a_malformed_index_is_a_clear_error(hf, tmp_path, content):
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        hf_to_orbax(hf, str(tmp_path / "out"))


def test_convert_cli_malformed_config_and_garbage_manifest_are_one_error_line(hf, tmp_path):
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write('{"text_config": "x"}')
    _one_error_line(_cli("-m", "k3jax.convert", f"--hf_dir={hf}", f"--out={tmp_path / 'a'}"), "config.json")
    ckpt = tmp_path / "ckpt"
    (ckpt / "params").mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "manifest.json").write_bytes(b"\xff\xfe not json")
    _one_error_line(_cli("-m", "k3jax.convert", "--to_hf", f"--checkpoint={ckpt}", f"--out={tmp_path / 'b'}"),
                    "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json: unreadable checkpoint manifest"):
        load_checkpoint(str(ckpt))


def _unwritable(tmp_path):
    """A directory path nothing can be created under: read-only (chmod), or, as root (which ignores
    permissions), a path below a regular file."""
    if os.geteuid() == 0:
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file" / "sub"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


def test_convert_cli_unwritable_output_is_one_error_line(hf, tmp_path):
    parent = _unwritable(tmp_path)
    try:
        _one_error_line(_cli("-m", "k3jax.convert", f"--hf_dir={hf}", f"--out={parent / 'out'}"), str(parent))
    finally:
        parent.chmod(0o755) if parent.is_dir() else None


def test_train_cli_unwritable_workdir_and_garbage_init_checkpoint_are_one_error_line(tmp_path):
    parent = _unwritable(tmp_path)
    common = ("train.py", "--config=tiny", "--set=num_hidden_layers=2", "--set=full_attn_layers=(2,)", "--steps=1",
              "--batch_size=2", "--seq_len=16", "--mesh=1,1,1,1")
    try:
        _one_error_line(_cli(*common, f"--workdir={parent / 'run'}"), str(parent))
    finally:
        parent.chmod(0o755) if parent.is_dir() else None
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{garbage")
    _one_error_line(_cli(*common, f"--init_from={ckpt}"), "manifest.json")


def test_flipped_bytes_in_a_converted_checkpoint_are_refused_on_load(hf, tmp_path):
    out = tmp_path / "out"
    hf_to_orbax(hf, str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["hashes"]) == set(manifest["items"])
    item = out / "params" / "layer_0001"
    data = max((p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    for pos in range(len(raw) // 3, 2 * len(raw) // 3, max(1, len(raw) // 20)):
        raw[pos] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"params/layer_0001: (its arrays differ from the hash recorded in "
                                              r"manifest.json|unreadable checkpoint item)"):
        load_checkpoint(str(out))


def test_a_checkpoint_named_by_a_relative_path_loads_like_by_its_absolute_one(hf, tmp_path, monkeypatch):
    out = tmp_path / "out"
    hf_to_orbax(hf, str(out))
    _, model_abs = load_checkpoint(str(out))
    monkeypatch.chdir(tmp_path / "hf")
    _, model_rel = load_checkpoint(os.path.join("..", "out"))
    a, b = (jax.tree.leaves(nnx.state(m)) for m in (model_abs, model_rel))
    assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def test_a_training_run_given_as_a_checkpoint_is_told_how_to_export_it(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "40"
    for item in ("state", "meta", "data"):
        (step / item).mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"--workdir={tmp_path / 'run'} --export_step=40 --export_to=OUT"):
        read_manifest(str(step))
    with pytest.raises(CheckpointError, match=rf"training run's checkpoint: .* --workdir={tmp_path / 'run'} --exp"):
        read_manifest(str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=r"\(no manifest.json\)$"):  # any other directory: no hint
        read_manifest(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_manifest(str(tmp_path / "nonexistent"))
