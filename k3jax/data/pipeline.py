"""Grain input pipeline: prepared ArrayRecord documents -> shuffled, process-sharded, packed `[B, T]` batches.

    ArrayRecordDataSource -> slice (this process's share of documents) -> shuffle (reshuffled every epoch)
    -> repeat -> split each document into (input, next-token target, position) -> to_iter_dataset (threaded reads)
    -> ConcatThenSplitIterDataset (Grain's packing: concatenate documents, cut every T tokens; long documents are
       split across rows) -> batch -> batch dict -> [mp_prefetch]

Each document [t0 .. tL-1] (BOS .. EOS as written by `k3jax.data.prepare`) becomes L-1 (input, target) pairs
(t_i, t_i+1) BEFORE packing, so every target is the next token of the same document, also where a document is cut
between rows. Batch dict (numpy):
    input_ids   int32[B, T]   token ids (pad_id on padding)
    targets     int32[B, T]   next token within the same document (pad_id on padding)
    segment_ids int32[B, T]   1, 2, ... per document piece within a row; 0 = padding
    positions   int32[B, T]   position of the input token within its document (continues across a cut); 0 on padding
    loss_mask   f32[B, T]     1 where there is a target (segment_ids > 0), 0 on padding
Since no position pairs tokens of two documents, the mask is 0 only on padding, which appears only at the end of a
finite stream (`num_epochs`): with `num_epochs=None` every batch is full.

`split` reads one document split of the directory: "all", "train" (all but every 100th document) or "heldout"
(every 100th: the held-out data of `train.py --eval_every`, k3jax/training/evaluate.py).

The iterator is a `grain.DatasetIterator`: `get_state()` is a JSON-able dict and `set_state(state)` on a fresh
iterator from the same arguments continues with exactly the same batches. With Orbax, save it alongside other items
through `checkpoint_save_args` / `checkpoint_restore_args` (Grain's own Orbax handler).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
from typing import Any

import grain
import numpy as np
from etils import epath

from k3jax.data import prepare as prep
from k3jax.data.text import stdlib_corpus

log = logging.getLogger("k3jax.data.pipeline")

BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")
# Document splits of a prepared directory: "heldout" is every HELD_OUT_EVERY-th document (prepare order, indices
# E-1, 2E-1, ...: spread over the whole corpus, the same for every seed), "train" the others, "all" every document.
SPLITS = ("all", "train", "heldout")
HELD_OUT_EVERY = 100


def _document_pairs(record: bytes) -> dict[str, np.ndarray]:
    """One stored document -> its (input, next-token target, position) sequences, length L - 1."""
    doc = np.frombuffer(record, dtype=prep.TOKEN_DTYPE).astype(np.int32)
    return {"input_ids": doc[:-1], "targets": doc[1:], "positions": np.arange(len(doc) - 1, dtype=np.int32)}


def _to_batch(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Grain's packed features -> the batch dict (padding filled with pad_id, mask from segment ids)."""
    segment_ids = packed["input_ids_segment_ids"].astype(np.int32)
    valid = segment_ids > 0
    return {
        "input_ids": np.where(valid, packed["input_ids"], pad_id).astype(np.int32),
        "targets": np.where(valid, packed["targets"], pad_id).astype(np.int32),
        "segment_ids": segment_ids,
        "positions": np.where(valid, packed["positions"], 0).astype(np.int32),
        "loss_mask": valid.astype(np.float32),
    }


def batch_shapes(batch_size: int, seq_len: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of every array of a batch `_to_batch` makes (what the step is compiled for ahead)."""
    return {k: ((batch_size, seq_len), np.dtype(np.float32 if k == "loss_mask" else np.int32)) for k in BATCH_KEYS}


class _ShardInterleavedSource(grain.sources.RandomAccessDataSource):
    """Documents in the order `prepare` read them: document i is record i // N of shard i % N."""

    def __init__(self, data_dir: str, shards: list[dict]):
        self._counts = [s["num_documents"] for s in shards]
        self._offsets = np.concatenate([[0], np.cumsum(self._counts)[:-1]]).astype(int).tolist()
        self._source = grain.sources.ArrayRecordDataSource(
            [os.path.join(data_dir, s["file"]) for s in shards if s["num_documents"] > 0])
        if len(self._source) != sum(self._counts):
            raise ValueError(f"{data_dir}: shards hold {len(self._source)} documents but metadata says "
                             f"{sum(self._counts)}")

    def __len__(self) -> int:
        return len(self._source)

    def _global_index(self, i: int) -> int:
        shard, local = i % len(self._counts), i // len(self._counts)
        return self._offsets[shard] + local

    def __getitem__(self, i) -> bytes:
        return self._source[self._global_index(int(i))]

    def __getitems__(self, indices) -> list[bytes]:
        return self._source.__getitems__([self._global_index(int(i)) for i in indices])


class _SplitSource(grain.sources.RandomAccessDataSource):
    """The documents of one split ("train" or "heldout", see SPLITS) of a source, in the source's order."""

    def __init__(self, source: grain.sources.RandomAccessDataSource, split: str):
        self._source, self._held_out = source, split == "heldout"
        held = len(source) // HELD_OUT_EVERY
        self._len = held if self._held_out else len(source) - held

    def __len__(self) -> int:
        return self._len

    def _index(self, i: int) -> int:
        e = HELD_OUT_EVERY
        return i * e + e - 1 if self._held_out else i + i // (e - 1)  # train: skip every e-th index

    def __getitem__(self, i) -> bytes:
        return self._source[self._index(int(i))]

    def __getitems__(self, indices) -> list[bytes]:
        return self._source.__getitems__([self._index(int(i)) for i in indices])


def split_size(num_documents: int, split: str) -> int:
    """How many of `num_documents` documents a split holds."""
    held = num_documents // HELD_OUT_EVERY
    return {"all": num_documents, "train": num_documents - held, "heldout": held}[split]


class _JsonStateIterator(grain.DatasetIterator):
    """Passes through; `set_state` accepts a JSON round-tripped state. grain 0.2.18's concat-then-split compares its
    "no remainder" slice sentinel `(-1, -1)` with `!=`, so the `[-1, -1]` lists that JSON gives back were taken as a
    remainder and restoring skipped a document. Slices are turned back into tuples here."""

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["remainder_slices"] = {k: tuple(v) for k, v in state["remainder_slices"].items()}
        self._parent.set_state(state)


class _PackDataset(grain.IterDataset):
    """Grain's ConcatThenSplitIterDataset over (input_ids, targets, positions), with JSON-safe state."""

    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(parent)
        self._packed = grain.experimental.ConcatThenSplitIterDataset(
            parent, length_struct={"input_ids": seq_len, "targets": seq_len, "positions": seq_len})

    def __iter__(self) -> grain.DatasetIterator:
        return _JsonStateIterator(self._packed.__iter__())


def read_metadata(data_dir: str) -> dict:
    """`prepare.read_metadata` for a local directory; a remote one (`gs://bucket/dir`, any `scheme://`) is read
    through `etils.epath`. The ArrayRecord shards of a remote directory are opened by ArrayRecord's own file layer,
    which is handed the `gs://` paths as they are (where that layer cannot reach the bucket, mount it, e.g. with
    gcsfuse, and pass the local mount path)."""
    if "://" not in str(data_dir):
        return prep.read_metadata(data_dir)
    path = epath.Path(data_dir) / prep.METADATA_FILE
    if not path.exists():
        raise FileNotFoundError(f"{data_dir} is not a prepared data directory (no {prep.METADATA_FILE})")
    meta = json.loads(path.read_text())
    if meta.get("format") != prep.FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {prep.FORMAT!r}")
    return meta


def _process_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if shard_index is None and shard_count is None:
        options = grain.sharding.ShardByJaxProcess()
        return options.shard_index, options.shard_count
    if shard_index is None or shard_count is None:
        raise ValueError("pass both shard_index and shard_count, or neither (then jax.process_index/count)")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    return shard_index, shard_count


def build_dataset(data_dir: str, *, batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                  num_epochs: int | None = None, worker_count: int = 0, shard_index: int | None = None,
                  shard_count: int | None = None, vocab_size: int | None = None,
                  read_threads: int = 4, split: str = "all") -> grain.IterDataset:
    """The Grain `IterDataset` behind `make_dataset` (same arguments)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got batch_size={batch_size} seq_len={seq_len}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (repeat forever), got {num_epochs}")
    meta = read_metadata(data_dir)
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise ValueError(f"{data_dir} was tokenized with {meta['tokenizer']!r} (vocab_size={meta['vocab_size']}), "
                         f"larger than the model's vocab_size={vocab_size}")
    shard_index, shard_count = _process_shard(shard_index, shard_count)
    source = _ShardInterleavedSource(data_dir, meta["shards"])
    if split != "all":
        source = _SplitSource(source, split)
    ds = grain.MapDataset.source(source)
    if shard_count > len(ds):
        what = "documents" if split == "all" else f"documents in its {split!r} split"
        raise ValueError(f"{data_dir} has {len(ds)} {what}, fewer than shard_count={shard_count} shards")
    # contiguous, equal-size shares (drop_remainder) so every process sees the same number of documents per epoch
    per_shard = len(ds) // shard_count
    ds = ds[shard_index * per_shard:(shard_index + 1) * per_shard]
    if shuffle:
        ds = ds.shuffle(seed=seed)  # before repeat: a different permutation every epoch
    ds = ds.repeat(num_epochs).map(_document_pairs)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64))
    it_ds = _PackDataset(it_ds, seq_len)
    # pad a short final batch (finite epochs) instead of dropping it: shapes stay static
    it_ds = it_ds.batch(batch_size, batch_fn=functools.partial(grain.experimental.batch_and_pad,
                                                               batch_size=batch_size))
    it_ds = it_ds.map(functools.partial(_to_batch, pad_id=int(meta["pad_id"])))
    if worker_count > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags (parsed already under app.run)
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count, per_worker_buffer_size=2))
    return it_ds


def make_dataset(data_dir: str, *, batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None, worker_count: int = 0, shard_index: int | None = None,
                 shard_count: int | None = None, vocab_size: int | None = None,
                 split: str = "all") -> grain.DatasetIterator:
    """A checkpointable iterator of packed batch dicts (see the module docstring) from a prepared `data_dir`.

    `num_epochs=None` repeats forever. `shard_index/shard_count` default to `jax.process_index()/process_count()`;
    each process reads a disjoint, equal-size share of the documents and yields its own `batch_size` rows.
    `vocab_size` (the model's), when given, is checked against the tokenizer's recorded in the metadata.
    `worker_count > 0` packs and batches in that many processes (deterministic for a fixed count; a different count
    gives a different order, so restore with the count the state was saved with). `split` reads one document split
    (SPLITS: "train" leaves out the held-out documents that "heldout" reads). Call `.close()` when done."""
    return iter(build_dataset(data_dir, batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle=shuffle,
                              num_epochs=num_epochs, worker_count=worker_count, shard_index=shard_index,
                              shard_count=shard_count, vocab_size=vocab_size, split=split))


def checkpoint_save_args(iterator: grain.DatasetIterator):
    """Orbax args that save `iterator`'s state (one JSON file per process) as an item of a CheckpointManager:
    `manager.save(step, args=ocp.args.Composite(state=..., data=checkpoint_save_args(it)))`."""
    return grain.checkpoint.CheckpointSave(iterator)


def checkpoint_restore_args(iterator: grain.DatasetIterator):
    """Orbax args that restore into `iterator` (a fresh one from the same `make_dataset` arguments), in place:
    `manager.restore(step, args=ocp.args.Composite(state=..., data=checkpoint_restore_args(it)))`."""
    return grain.checkpoint.CheckpointRestore(iterator)


def default_data_dir(cache_root: str | None = None, *, max_bytes: int = 8 << 20, bos_id: int = prep.BYTE_BOS,
                     eos_id: int = prep.BYTE_EOS, pad_id: int = prep.BYTE_PAD) -> str:
    """Prepares the embedded standard-library corpus (`k3jax.data.text.stdlib_corpus`, byte tokens) once into a
    cache directory keyed by the Python version and the arguments; returns its path."""
    key = hashlib.sha1(repr((sys.version, sysconfig.get_paths()["stdlib"], max_bytes, bos_id, eos_id, pad_id,
                             prep.FORMAT)).encode()).hexdigest()[:12]
    root = cache_root or os.path.join(tempfile.gettempdir(), "k3jax_data")
    out = os.path.join(root, f"stdlib-byte-{key}")
    if os.path.exists(os.path.join(out, prep.METADATA_FILE)):
        return out
    os.makedirs(root, exist_ok=True)
    docs = stdlib_corpus(max_bytes=max_bytes)
    log.info("preparing the embedded corpus (%d stdlib files) into %s", len(docs), out)
    try:
        prep.write_documents(((f"stdlib[{i}]", d) for i, d in enumerate(docs)), out,
                             prep.byte_tokenizer(bos_id, eos_id, pad_id), skip_empty=True, num_threads=1,
                             extra_metadata=dict(source="python stdlib", max_bytes=max_bytes))
    except FileExistsError:  # another process prepared it at the same time
        prep.read_metadata(out)
    return out
