"""The MTP layer (`k3jax.mtp.MTPLayer`) from where conversion and export put it: the `mtp` item of a k3jax
checkpoint (`save_checkpoint(..., mtp=)` or `python -m k3jax.convert` of an HF directory that has one) or the
DeepSeek-style `model.layers.{N}.*` tensors of an HF directory (`--to_hf`; names in `k3jax.convert.mtp_names`)."""

from __future__ import annotations

import os

from k3jax.convert.checkpoint import K3_PREFIX, read_manifest, restore_item
from k3jax.convert.hf_names import MissingTensorError
from k3jax.convert.mtp_names import MTP_ITEM, hf_mtp_tensors, load_mtp_hf_weights
from k3jax.convert.safetensors_io import index_directory, read_tensor
from k3jax.mtp import MTPLayer


def load_mtp_weights(mtp: MTPLayer, path: str) -> None:
    """Fills `mtp` in place from `path`: a k3jax checkpoint (manifest.json: its `mtp` item, checked against its
    hash) or an HF directory (its MTP tensors, after the release prefix for K3-format directories). Raises
    MissingTensorError naming what is missing."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        meta = read_manifest(path)[0].get("hf", {}).get("mtp")
        if not meta:
            raise MissingTensorError(f"{path}: the k3jax checkpoint holds no MTP layer (write one with "
                                     "k3jax.save_checkpoint(model, out, mtp=layer), or convert an HF directory "
                                     "that has model.layers.{num_hidden_layers}.*)")
        load_mtp_hf_weights(mtp, restore_item(os.path.join(path, "params", MTP_ITEM), meta.get("hash")))
        return
    index = index_directory(path)
    prefix = K3_PREFIX if any(k.startswith(K3_PREFIX) for k in index) else ""
    found = hf_mtp_tensors(index, mtp.cfg, prefix)

    def get(name):
        if name not in found:
            raise MissingTensorError(f"{path}: no MTP tensor {prefix + name!r} (DeepSeek-style MTP names, "
                                     "model.layers.{num_hidden_layers}.*)")
        return read_tensor(found[name])

    load_mtp_hf_weights(mtp, get)
