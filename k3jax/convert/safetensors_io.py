"""Streaming safetensors I/O: validated headers, one-tensor-at-a-time reads, and a planned shard writer.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data buffer; offsets
are relative to the buffer start. We parse the header ourselves so a truncated or inconsistent file is reported
(file and tensor named) before anything is converted, and read each tensor with one positioned read into a fresh
buffer (no memory map: page-cache pages of a mapped 1.5 TB checkpoint would count against the process).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32), "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


class CheckpointError(ValueError):
    """Bad HF input (missing/unexpected tensor, shape, dtype, truncated file, config disagreement)."""


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise CheckpointError(f"dtype {dtype} has no safetensors name")
    return _NAMES[dtype]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # absolute path
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parses and validates one file's header against its size: every tensor's byte range must lie in the file,
    match dtype × shape, and ranges must not overlap. Raises CheckpointError naming the file (and tensor)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header length {n}, file "
                                      f"size {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"missing safetensors file {path}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    ranges = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b, e) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {meta!r}") from None
        if dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dt!r}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if not 0 <= b <= e or e - b != want:
            raise CheckpointError(f"{path}: tensor {name!r} byte range [{b}, {e}) does not hold {dt}{list(shape)} "
                                  f"({want} bytes)")
        if base + e > size:
            raise CheckpointError(f"{path}: truncated file: tensor {name!r} ends at byte {base + e} but the file "
                                  f"has {size} bytes")
        ranges.append((b, e, name))
        out[name] = TensorInfo(name, os.path.abspath(path), dt, shape, base + b, e - b)
    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in the data buffer")
    return out


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One positioned read of exactly this tensor's bytes into a fresh array."""
    buf = np.empty(info.nbytes, np.uint8)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.begin)
        view, got = memoryview(buf), 0
        while got < info.nbytes:
            k = f.readinto(view[got:])
            if not k:
                raise CheckpointError(f"{info.file}: truncated while reading tensor {info.name!r}")
            got += k
    return buf.view(DTYPES[info.dtype]).reshape(info.shape)


def index_directory(hf_dir: str) -> dict[str, TensorInfo]:
    """All tensors of an HF directory: `model.safetensors.index.json` (every shard it names must exist and hold
    exactly the tensors the index assigns to it) or, without an index, every `*.safetensors` file."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    tensors: dict[str, TensorInfo] = {}
    if os.path.exists(index_path):
        try:
            with open(index_path, "rb") as f:
                weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _inside(file):
                raise CheckpointError(f"{index_path}: tensor {name!r} is assigned to {file!r}, not a file name "
                                      f"inside the HF directory")
            by_file.setdefault(file, []).append(name)
        missing = sorted(f for f in by_file if not os.path.exists(os.path.join(hf_dir, f)))
        if missing:
            raise CheckpointError(f"missing shard(s) {missing} listed in {index_path} (they hold e.g. "
                                  f"{by_file[missing[0]][0]!r})")
        for file, names in sorted(by_file.items()):
            path = os.path.join(hf_dir, file)
            header = read_header(path)
            absent = sorted(set(names) - set(header))
            if absent:
                raise CheckpointError(f"{path}: tensor(s) {absent[:5]} are assigned to this shard by the index but "
                                      f"are not in it")
            extra = sorted(set(header) - set(names))
            if extra:
                raise CheckpointError(f"{path}: tensor(s) {extra[:5]} are in this shard but not in the index")
            tensors.update(header)
        return tensors
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir}: no model.safetensors.index.json and no *.safetensors files")
    for file in files:
        for name, info in read_header(os.path.join(hf_dir, file)).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {info.file}")
            tensors[name] = info
    return tensors


def _inside(file: str) -> bool:
    """Whether an index's shard name stays inside the directory (relative, no `..`; symlinked shards, as in the HF
    hub cache, are fine: only the name is checked)."""
    norm = os.path.normpath(file)
    return bool(file) and not os.path.isabs(file) and norm not in (".", "..") and not norm.startswith(".." + os.sep) \
        and "\x00" not in file


# ------------------------------------------------------------------------------------------------ writing


def plan_shards(entries: Iterable[tuple[str, np.dtype, tuple[int, ...]]], max_shard_bytes: int):
    """Splits (name, dtype, shape) entries, in order, into shards of at most `max_shard_bytes` (a bigger tensor
    gets a shard of its own)."""
    shards, cur, cur_bytes = [], [], 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if cur and cur_bytes + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, np.dtype(dtype), tuple(shape)))
        cur_bytes += nbytes
    if cur:
        shards.append(cur)
    return shards


def write_shard(path: str, entries, arrays: Iterator[np.ndarray], metadata: dict | None = None) -> None:
    """Writes one safetensors file: the header from the planned `entries`, then each array from `arrays` (same
    order), checked against its entry. Only one array is held at a time."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, dtype, shape), arr in zip(entries, arrays, strict=True):
            arr = np.asarray(arr)
            if arr.dtype != dtype or tuple(arr.shape) != shape:
                raise AssertionError(f"{name}: planned {dtype}{list(shape)}, got {arr.dtype}{list(arr.shape)}")
            f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
