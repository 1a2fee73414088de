"""Tokenize text into ArrayRecord shards for the Grain loader (`k3jax.data.pipeline`).

  python -m k3jax.data.prepare --input 'corpus/**/*.jsonl' --out data/web --tokenizer byte|HF_DIR [--num_shards 8]

Inputs: files matching the glob(s), in sorted order. `.jsonl` files hold one document per line (`{"text": ...}`,
field name set by --text_key; blank lines are skipped); any other file is one document (its whole content).

Output directory (written as `OUT.tmp-<pid>-<rand>` and renamed when complete, so OUT is either absent or whole):
  data-00000-of-0000N.array_record   one record per document: little-endian int32 ids, [BOS] + text + EOS;
                                     document i goes to shard i % N
  metadata.json                      format, tokenizer, vocab_size, special ids, document/token counts, shards

Tokenizers: `byte` (UTF-8 bytes 0..255, specials BOS=256 EOS=257 PAD=258 as in the tiny configs), or an HF
directory holding `tiktoken.model` (+ `config.json` for vocab_size and special ids, K3's when absent), loaded by
`k3jax.data.tokenizer`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from k3jax.atomic import AtomicDir, os_error
from k3jax.config import ModelConfig
from k3jax.data.text import ByteTokenizer
from k3jax.data.tokenizer import TiktokenTokenizer

FORMAT = "k3jax-tokens-v1"
METADATA_FILE = "metadata.json"
TOKEN_DTYPE = np.dtype("<i4")
# The tiny configs' byte-level special ids (configs/small.py); vocab 259 is the least that holds them.
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258

log = logging.getLogger("k3jax.data.prepare")


class DataPrepError(ValueError):
    """Bad input for data preparation (no files, empty document, unknown tokenizer, malformed JSONL...)."""


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A tokenizer (ByteTokenizer or TiktokenTokenizer) and what the metadata records about it."""

    tokenizer: Any
    name: str  # "byte" or the HF directory
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str | bytes, *, add_bos: bool) -> np.ndarray:
        """int32 ids: [BOS] + tokens(text) + EOS."""
        if isinstance(self.tokenizer, ByteTokenizer):  # fast path, same ids as ByteTokenizer.encode
            data = text.encode("utf-8") if isinstance(text, str) else text
            body = np.frombuffer(data, np.uint8)
            head = [self.bos_id] if add_bos else []
            return np.concatenate([np.asarray(head, TOKEN_DTYPE), body.astype(TOKEN_DTYPE),
                                   np.asarray([self.eos_id], TOKEN_DTYPE)])
        ids = self.tokenizer.encode(text, add_bos=add_bos, add_eos=False)
        return np.asarray(ids + [self.eos_id], TOKEN_DTYPE)

    def metadata(self) -> dict:
        return dict(tokenizer=self.name, vocab_size=self.vocab_size, bos_id=self.bos_id, eos_id=self.eos_id,
                    pad_id=self.pad_id)


def byte_tokenizer(bos_id: int = BYTE_BOS, eos_id: int = BYTE_EOS, pad_id: int = BYTE_PAD) -> TextTokenizer:
    vocab = max(bos_id, eos_id, pad_id) + 1
    return TextTokenizer(ByteTokenizer(bos_id, eos_id, pad_id, vocab), "byte", vocab, bos_id, eos_id, pad_id)


def _hf_special_ids(directory: str):
    """A ModelConfig carrying the HF directory's vocab_size and special ids (K3 defaults for what it omits)."""
    cfg_path = os.path.join(directory, "config.json")
    fields = {}
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            hf = json.load(f)
        text_cfg = hf.get("text_config") or hf
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(text_cfg.get(key), int):
                fields[key] = text_cfg[key]
    return ModelConfig().replace(**fields)


def load_text_tokenizer(spec: str, *, eos_id: int | None = None) -> TextTokenizer:
    """`byte`, or an HF directory with `tiktoken.model`. `eos_id` overrides the id appended to each document."""
    if spec == "byte":
        tok = byte_tokenizer()
    elif os.path.isdir(spec):
        if not os.path.exists(os.path.join(spec, "tiktoken.model")):
            raise DataPrepError(f"tokenizer directory {spec!r} has no tiktoken.model (use --tokenizer byte for "
                                f"byte-level tokens)")
        cfg = _hf_special_ids(spec)
        tok = TextTokenizer(TiktokenTokenizer(spec, cfg), os.path.abspath(spec), cfg.vocab_size,
                            cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    else:
        raise DataPrepError(f"unknown tokenizer {spec!r}: expected 'byte' or an HF directory containing "
                            f"tiktoken.model")
    if eos_id is not None:
        if not 0 <= eos_id < tok.vocab_size:
            raise DataPrepError(f"--eos_id={eos_id} is outside the tokenizer's vocabulary [0, {tok.vocab_size})")
        tok = dataclasses.replace(tok, eos_id=eos_id)
    return tok


def resolve_inputs(patterns: Sequence[str]) -> list[str]:
    """Files matching any glob (`**` recursive), sorted, deduplicated; an error names patterns matching nothing."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files, empty = set(), []
    for pattern in patterns:
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matched:
            empty.append(pattern)
        files.update(matched)
    if empty:
        raise DataPrepError(f"no files match --input {', '.join(repr(p) for p in empty)}")
    return sorted(files)


def iter_jsonl(path: str, bytes_read: list[int] | None = None) -> Iterator[tuple[str, object]]:
    """(`path:line`, parsed value) of every non-blank line of a JSONL file; invalid JSON is a `DataPrepError`."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if bytes_read is not None:
                bytes_read[0] += len(raw)
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataPrepError(f"{where}: not valid UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataPrepError(f"{where}: invalid JSON ({e})") from None


def iter_documents(files: Sequence[str], *, text_key: str = "text",
                   bytes_read: list[int] | None = None) -> Iterator[tuple[str, str | bytes]]:
    """(where, document) for every document: `path:line` for JSONL lines (str), `path` for whole files (bytes).
    `bytes_read` ([0]): its element counts the input bytes of the documents yielded so far (progress)."""
    for path in files:
        if path.endswith(".jsonl"):
            for where, record in iter_jsonl(path, bytes_read):
                if not isinstance(record, dict) or text_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataPrepError(f"{where}: no {text_key!r} field (got {keys})")
                if not isinstance(record[text_key], str):
                    raise DataPrepError(f"{where}: {text_key!r} is {type(record[text_key]).__name__}, "
                                        f"expected a string")
                yield where, record[text_key]
        else:
            with open(path, "rb") as f:
                doc = f.read()
            if bytes_read is not None:
                bytes_read[0] += len(doc)
            yield path, doc


def _as_text(where: str, doc: str | bytes, tok: TextTokenizer) -> str | bytes:
    if isinstance(doc, bytes) and not isinstance(tok.tokenizer, ByteTokenizer):
        try:
            return doc.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataPrepError(f"{where}: not valid UTF-8 ({e})") from None
    return doc


def _shard_name(i: int, n: int) -> str:
    return f"data-{i:05d}-of-{n:05d}.array_record"


def _tokenize_in_order(docs: Iterable[tuple[str, str | bytes]], tok: TextTokenizer, add_bos: bool,
                       num_threads: int, chunk: int = 64) -> Iterator[tuple[str, np.ndarray]]:
    """Tokenizes documents with a thread pool (tiktoken releases the GIL), yielding in input order."""

    def encode(item):
        where, doc = item
        return where, tok.encode(_as_text(where, doc, tok), add_bos=add_bos)

    if num_threads <= 1:
        yield from map(encode, docs)
        return
    with ThreadPoolExecutor(num_threads) as pool:
        batch = []
        for item in docs:
            batch.append(item)
            if len(batch) == chunk:
                yield from pool.map(encode, batch)
                batch = []
        yield from pool.map(encode, batch)


def write_documents(docs: Iterable[tuple[str, str | bytes]], out: str, tok: TextTokenizer, *, num_shards: int = 1,
                    add_bos: bool = True, skip_empty: bool = False, overwrite: bool = False, num_threads: int = 4,
                    extra_metadata: dict | None = None, log_every_s: float = 10.0,
                    progress: Callable[[], float] | None = None) -> dict:
    """Tokenizes `(where, text)` documents into `out` (atomically); returns the metadata written. `progress`: the
    fraction of the input read so far, for the progress lines' remaining time."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise DataPrepError(f"--num_shards must be >= 1, got {num_shards}")
    num_docs = num_tokens = num_skipped = max_len = 0
    shard_docs = [0] * num_shards
    start = last_log = time.perf_counter()
    with AtomicDir(out, overwrite) as tmp:
        writers = [ArrayRecordWriter(os.path.join(tmp, _shard_name(i, num_shards)), "group_size:1")
                   for i in range(num_shards)]
        try:
            for where, ids in _tokenize_in_order(docs, tok, add_bos, num_threads):
                if len(ids) == int(add_bos) + 1:  # nothing between BOS and EOS
                    if skip_empty:
                        num_skipped += 1
                        continue
                    raise DataPrepError(f"{where}: empty document (pass --skip_empty to drop empty documents)")
                bad = (ids < 0) | (ids >= tok.vocab_size)
                if bad.any():
                    raise DataPrepError(f"{where}: token id {int(ids[bad][0])} outside vocabulary "
                                        f"[0, {tok.vocab_size})")
                shard = num_docs % num_shards
                writers[shard].write(ids.astype(TOKEN_DTYPE, copy=False).tobytes())
                shard_docs[shard] += 1
                num_docs += 1
                num_tokens += len(ids)
                max_len = max(max_len, len(ids))
                now = time.perf_counter()
                if now - last_log >= log_every_s:
                    done = progress() if progress is not None else 0.0
                    eta = (f", {100 * done:.0f}% of the input, ETA {(now - start) * (1 - done) / done / 60:.1f} min"
                           if done > 0 else "")
                    log.info("%s documents, %s tokens (%.0f tokens/s)%s", f"{num_docs:,}", f"{num_tokens:,}",
                             num_tokens / (now - start), eta)
                    last_log = now
        finally:
            for w in writers:
                w.close()
        if num_docs == 0:
            files = (extra_metadata or {}).get("num_input_files", "?")
            raise DataPrepError(f"no documents in the {files} input file(s) ({num_skipped} empty documents "
                                f"skipped)")
        metadata = dict(format=FORMAT, **tok.metadata(), add_bos=add_bos, dtype="int32",
                        num_documents=num_docs, num_tokens=num_tokens, max_document_tokens=max_len,
                        skipped_empty_documents=num_skipped,
                        shards=[dict(file=_shard_name(i, num_shards), num_documents=n)
                                for i, n in enumerate(shard_docs)],
                        **(extra_metadata or {}))
        with open(os.path.join(tmp, METADATA_FILE), "w") as f:
            json.dump(metadata, f, indent=2)
    log.info("wrote %s documents, %s tokens in %d shards to %s (%.1fs)", f"{num_docs:,}", f"{num_tokens:,}",
             num_shards, os.path.abspath(out), time.perf_counter() - start)
    return metadata


def prepare(inputs: str | Sequence[str], out: str, tokenizer: str = "byte", *, num_shards: int = 1,
            eos_id: int | None = None, add_bos: bool = True, text_key: str = "text", skip_empty: bool = False,
            overwrite: bool = False, num_threads: int = 4, log_every_s: float = 10.0) -> dict:
    """Tokenizes the files matching `inputs` into ArrayRecord shards in `out`; returns the metadata; a progress line
    (documents, tokens, share of the input bytes read, remaining time) every `log_every_s` seconds.

    Every check that needs no tokenizing (globs, tokenizer, output path) runs before anything is written."""
    files = resolve_inputs(inputs)
    tok = load_text_tokenizer(tokenizer, eos_id=eos_id)
    if num_shards < 1:
        raise DataPrepError(f"--num_shards must be >= 1, got {num_shards}")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"output {os.path.abspath(out)} already exists (pass --overwrite to replace it)")
    log.info("tokenizing %d files with tokenizer=%s (vocab %d) into %d shards", len(files), tok.name,
             tok.vocab_size, num_shards)
    total = max(1, sum(os.path.getsize(f) for f in files))
    read = [0]
    return write_documents(iter_documents(files, text_key=text_key, bytes_read=read), out, tok,
                           num_shards=num_shards, add_bos=add_bos, skip_empty=skip_empty, overwrite=overwrite,
                           num_threads=num_threads, extra_metadata=dict(num_input_files=len(files)),
                           progress=lambda: min(1.0, read[0] / total), log_every_s=log_every_s)


def read_metadata(data_dir: str, *, fmt: str = FORMAT, command: str = "python -m k3jax.data.prepare") -> dict:
    """The metadata of a directory prepared by `command` (format `fmt`), with a clear error when it is not one."""
    path = os.path.join(data_dir, METADATA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{data_dir} is not a prepared data directory (no {METADATA_FILE}); create one "
                                f"with `{command} --input GLOB --out {data_dir}`")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != fmt:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {fmt!r} (data from `{command}`)")
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, action="append",
                        help="glob of input files (.jsonl: one {'text': ...} per line; others: one document per "
                             "file); repeatable")
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or an HF directory with tiktoken.model")
    parser.add_argument("--num_shards", type=int, default=1, help="number of ArrayRecord shards")
    parser.add_argument("--eos_id", type=int, default=None, help="id appended to every document (default: the "
                                                                 "tokenizer's EOS)")
    parser.add_argument("--no_bos", action="store_true", help="do not prepend BOS to documents")
    parser.add_argument("--text_key", default="text", help="JSONL field holding the text")
    parser.add_argument("--skip_empty", action="store_true", help="drop empty documents instead of failing")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--num_threads", type=int, default=4, help="tokenizer threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        meta = prepare(args.input, args.out, args.tokenizer, num_shards=args.num_shards, eos_id=args.eos_id,
                       add_bos=not args.no_bos, text_key=args.text_key, skip_empty=args.skip_empty,
                       overwrite=args.overwrite, num_threads=args.num_threads)
    except (DataPrepError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unreadable input, an unwritable --out (read-only, full disk, a file as parent)
        print(f"error: {os_error(e)}", file=sys.stderr)
        return 2
    print(json.dumps({k: meta[k] for k in ("num_documents", "num_tokens", "vocab_size", "tokenizer")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
