"""Interleaved image-text documents into ArrayRecord shards for multimodal training
(`k3jax.data.multimodal_pipeline`).

  python -m k3jax.data.prepare_multimodal --input 'docs/*.jsonl' --out data/vl --tokenizer byte|HF_DIR \\
      [--patch_size 14 --merge_size 2 --max_image_patches 16384 --placeholder_id ID --num_shards N]
  python -m k3jax.data.prepare_multimodal --demo 64 --out /tmp/vl --patch_size 4 --max_image_patches 64
      (synthetic coloured squares with captions, for a tiny run)

Input: JSONL lines `{"text": "A cat <image> on a mat.", "images": ["cat.npy"]}`: every `<image>` marker
(--image_marker) in the text takes the next image of the list (their numbers must agree); image paths are relative
to the JSONL file. Images: `.npy` uint8 arrays [H, W, 3] or [H, W] (grey); other formats are read with Pillow when
it is installed.

Each image is preprocessed here as the release's processor does (`k3jax.vision.preprocess`: resized within
--max_image_patches patches and --max_side_patches per side, padded to multiples of patch * merge), but kept as
**uint8** (the normalisation (x - 127.5) / 127.5 is exact and runs on the accelerator): 1 byte per channel instead
of 4, and bit-identical to `preprocess_frames` once normalised. Its marker becomes h*w / merge^2 placeholder tokens
(one per merged image token). Text pieces between markers are tokenized separately: [BOS] piece0 <ph>... piece1
... EOS.

Record (one per document; little-endian):
    b"K3MM" | uint32 header length | header JSON {"tokens": L, "grids": [[h, w], ...], "patch_size": p}
    | int32 token ids [L] | uint8 pixels [N, 3, p, p]   (N = sum h*w; per image in raster order, as `patchify`)
Output directory (atomic, as `k3jax.data.prepare`): `data-0000i-of-0000N.array_record` shards (document i in
shard i % N) and `metadata.json` (format "k3jax-multimodal-v1", tokenizer and special ids, placeholder_id,
patch/merge sizes, counts, and `max_document_tokens` / `max_document_patches`, which training checks against
--seq_len + 1 and --max_patches before it starts).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import struct
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from k3jax.atomic import AtomicDir
from k3jax.data import prepare as prep
from k3jax.vision.merge import MEDIA_PLACEHOLDER_ID
from k3jax.vision.preprocess import navit_size, patchify, resize, to_chw

FORMAT = "k3jax-multimodal-v1"
MAGIC = b"K3MM"
IMAGE_MARKER = "<image>"
DEFAULT_MAX_IMAGE_PATCHES = 16384

log = logging.getLogger("k3jax.data.prepare_multimodal")


def image_patches_u8(image: np.ndarray, *, patch_size: int = 14, merge_size: int = 2,
                     max_patches: int = DEFAULT_MAX_IMAGE_PATCHES, max_size_per_side: int = 512
                     ) -> tuple[np.ndarray, tuple[int, int]]:
    """One uint8 image [H, W, 3] (or [H, W]) -> (uint8 patches [h*w, 3, p, p] raster order, (h, w)): the
    processor's resize and padding without the normalisation (`preprocess.preprocess_frames` is
    `normalize(patches)` of the same pixels)."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {image.dtype}")
    chw = to_chw(image)
    _, h, w = chw.shape
    (rh, rw), (ph, pw) = navit_size(h, w, patch_size=patch_size, merge_size=merge_size, max_patches=max_patches,
                                    max_size_per_side=max_size_per_side)
    chw = np.pad(resize(chw, rh, rw), ((0, 0), (0, ph - rh), (0, pw - rw)))
    patches, (_, gh, gw) = patchify(chw[None], patch_size)
    return patches, (gh, gw)


def encode_record(ids: np.ndarray, pixels: np.ndarray, grids_hw: Sequence[tuple[int, int]], patch_size: int) -> bytes:
    """One document as a record (module docstring)."""
    ids = np.asarray(ids, prep.TOKEN_DTYPE)
    pixels = np.asarray(pixels, np.uint8).reshape(-1, 3, patch_size, patch_size)
    n = sum(int(h) * int(w) for h, w in grids_hw)
    if pixels.shape[0] != n:
        raise ValueError(f"{pixels.shape[0]} patches for grids {list(grids_hw)} ({n} patches)")
    header = json.dumps({"tokens": int(ids.size), "grids": [[int(h), int(w)] for h, w in grids_hw],
                         "patch_size": int(patch_size)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + ids.tobytes() + pixels.tobytes()


def decode_record(record: bytes) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A record -> (int32 ids [L], uint8 pixels [N, 3, p, p], grids [(h, w), ...])."""
    if record[:4] != MAGIC:
        raise ValueError(f"not a {FORMAT} record (magic {record[:4]!r})")
    (size,) = struct.unpack("<I", record[4:8])
    header = json.loads(record[8:8 + size])
    start = 8 + size
    stop = start + 4 * header["tokens"]
    ids = np.frombuffer(record[start:stop], prep.TOKEN_DTYPE).astype(np.int32)
    p = header["patch_size"]
    pixels = np.frombuffer(record[stop:], np.uint8).reshape(-1, 3, p, p)
    grids = [(int(h), int(w)) for h, w in header["grids"]]
    if pixels.shape[0] != sum(h * w for h, w in grids):
        raise ValueError(f"record holds {pixels.shape[0]} patches, its grids {grids} need "
                         f"{sum(h * w for h, w in grids)}")
    return ids, pixels, grids


def load_image(path: str) -> np.ndarray:
    """uint8 [H, W, 3] or [H, W] from `.npy`, else through Pillow (RGB)."""
    if path.endswith(".npy"):
        return np.load(path, allow_pickle=False)
    try:
        from PIL import Image
    except ImportError:
        raise prep.DataPrepError(f"{path}: only .npy images can be read without Pillow (pip install pillow)") from None
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def iter_records(files: Sequence[str], *, text_key: str = "text", images_key: str = "images"
                 ) -> Iterator[tuple[str, str, list[str]]]:
    """(where, text, absolute image paths) of every JSONL line."""
    for path in files:
        base = os.path.dirname(os.path.abspath(path))
        for where, record in prep.iter_jsonl(path):
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise prep.DataPrepError(f"{where}: needs a string {text_key!r} field")
            images = record.get(images_key, [])
            if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
                raise prep.DataPrepError(f"{where}: {images_key!r} must be a list of image paths")
            yield where, record[text_key], [p if os.path.isabs(p) else os.path.join(base, p) for p in images]


def document_ids(text: str, image_tokens: Sequence[int], tok: prep.TextTokenizer, placeholder_id: int, *,
                 marker: str = IMAGE_MARKER, where: str = "") -> np.ndarray:
    """[BOS] + pieces of `text` with the k-th `marker` expanded to `image_tokens[k]` placeholders + EOS."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(image_tokens):
        raise prep.DataPrepError(f"{where}: {len(pieces) - 1} {marker!r} marker(s) in the text but "
                                 f"{len(image_tokens)} image(s)")
    out = [np.asarray([tok.bos_id], np.int64)]
    for i, piece in enumerate(pieces):
        body = tok.encode(piece, add_bos=False)[:-1]  # without the EOS encode appends
        if (body == placeholder_id).any():
            raise prep.DataPrepError(f"{where}: the text itself encodes the placeholder id {placeholder_id}")
        out.append(body)
        if i < len(image_tokens):
            out.append(np.full(int(image_tokens[i]), placeholder_id, np.int64))
    out.append(np.asarray([tok.eos_id], np.int64))
    return np.concatenate(out).astype(prep.TOKEN_DTYPE)


DEMO_COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def write_demo_documents(directory: str, count: int, *, seed: int = 0) -> str:
    """Writes `count` synthetic image-text documents (a coloured square on grey, of random size and place, and a
    caption naming its colour and side) as `directory/demo.jsonl` + `.npy` images; returns the JSONL path."""
    rng = np.random.RandomState(seed)
    os.makedirs(directory, exist_ok=True)
    names = sorted(DEMO_COLORS)
    lines = []
    for i in range(count):
        h, w = (int(v) for v in rng.randint(24, 72, size=2))
        image = np.full((h, w, 3), 128, np.uint8)
        color = names[rng.randint(len(names))]
        side = int(rng.randint(8, min(h, w)))
        top, left = int(rng.randint(0, h - side + 1)), int(rng.randint(0, w - side + 1))
        image[top:top + side, left:left + side] = DEMO_COLORS[color]
        path = f"img_{i:05d}.npy"
        np.save(os.path.join(directory, path), image)
        size = "large" if side * side * 3 > h * w else "small"
        text = f"Picture: {IMAGE_MARKER} It shows a {size} {color} square." if i % 3 else \
            f"A {color} square, {size}, is drawn here: {IMAGE_MARKER}"
        lines.append(json.dumps({"text": text, "images": [path]}))
    out = os.path.join(directory, "demo.jsonl")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def _shard_name(i: int, n: int) -> str:
    return f"data-{i:05d}-of-{n:05d}.array_record"


def prepare_multimodal(inputs: str | Sequence[str], out: str, tokenizer: str = "byte", *,
                       placeholder_id: int | None = None, patch_size: int = 14, merge_size: int = 2,
                       max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES, max_side_patches: int = 512,
                       num_shards: int = 1, marker: str = IMAGE_MARKER, overwrite: bool = False) -> dict:
    """Writes the JSONL documents matching `inputs` as multimodal records into `out`; returns the metadata.
    `placeholder_id` defaults to 259 (the first id after the byte tokenizer's specials) for `byte`, else the
    release's `<|media_pad|>` 163605."""
    from array_record.python.array_record_module import ArrayRecordWriter

    files = prep.resolve_inputs(inputs)
    tok = prep.load_text_tokenizer(tokenizer)
    if placeholder_id is None:
        placeholder_id = prep.BYTE_PAD + 1 if tokenizer == "byte" else MEDIA_PLACEHOLDER_ID
    if placeholder_id < 0 or placeholder_id in (tok.bos_id, tok.eos_id, tok.pad_id):
        raise prep.DataPrepError(f"--placeholder_id={placeholder_id} must be >= 0 and differ from BOS/EOS/PAD")
    if num_shards < 1:
        raise prep.DataPrepError(f"--num_shards must be >= 1, got {num_shards}")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"output {os.path.abspath(out)} already exists (pass --overwrite to replace it)")
    merged = merge_size * merge_size
    counts = dict(num_documents=0, num_tokens=0, num_images=0, num_patches=0, max_document_tokens=0,
                  max_document_patches=0)
    shard_docs = [0] * num_shards
    with AtomicDir(out, overwrite) as tmp:
        writers = [ArrayRecordWriter(os.path.join(tmp, _shard_name(i, num_shards)), "group_size:1")
                   for i in range(num_shards)]
        try:
            for where, text, paths in iter_records(files):
                if text.count(marker) != len(paths):
                    raise prep.DataPrepError(f"{where}: {text.count(marker)} {marker!r} marker(s) in the text but "
                                             f"{len(paths)} image(s)")
                patches, grids = [], []
                for path in paths:
                    if not os.path.exists(path):
                        raise prep.DataPrepError(f"{where}: image {path} does not exist")
                    try:
                        px, grid = image_patches_u8(load_image(path), patch_size=patch_size, merge_size=merge_size,
                                                    max_patches=max_image_patches, max_size_per_side=max_side_patches)
                    except ValueError as e:
                        raise prep.DataPrepError(f"{where}: image {path}: {e}") from None
                    patches.append(px)
                    grids.append(grid)
                ids = document_ids(text, [h * w // merged for h, w in grids], tok, placeholder_id, marker=marker,
                                   where=where)
                pixels = (np.concatenate(patches) if patches
                          else np.zeros((0, 3, patch_size, patch_size), np.uint8))
                shard = counts["num_documents"] % num_shards
                writers[shard].write(encode_record(ids, pixels, grids, patch_size))
                shard_docs[shard] += 1
                counts["num_documents"] += 1
                counts["num_tokens"] += int(ids.size)
                counts["num_images"] += len(grids)
                counts["num_patches"] += int(pixels.shape[0])
                counts["max_document_tokens"] = max(counts["max_document_tokens"], int(ids.size))
                counts["max_document_patches"] = max(counts["max_document_patches"], int(pixels.shape[0]))
        finally:
            for w in writers:
                w.close()
        if counts["num_documents"] == 0:
            raise prep.DataPrepError("no documents to write")
        meta = dict(format=FORMAT, **tok.metadata(), placeholder_id=placeholder_id, patch_size=patch_size,
                    merge_size=merge_size, max_image_patches=max_image_patches, max_side_patches=max_side_patches,
                    **counts, shards=[dict(file=_shard_name(i, num_shards), num_documents=n)
                                      for i, n in enumerate(shard_docs)], num_input_files=len(files))
        meta["vocab_size"] = max(tok.vocab_size, placeholder_id + 1)
        with open(os.path.join(tmp, prep.METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2)
    log.info("wrote %d documents (%d images, %d patches, %d tokens) to %s", counts["num_documents"],
             counts["num_images"], counts["num_patches"], counts["num_tokens"], os.path.abspath(out))
    return meta


def read_metadata(data_dir: str) -> dict:
    """The metadata of a multimodal data directory, with a clear error when it is not one."""
    return prep.read_metadata(data_dir, fmt=FORMAT, command="python -m k3jax.data.prepare_multimodal")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.data.prepare_multimodal",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--input", action="append", help="glob of JSONL files; repeatable")
    parser.add_argument("--demo", type=int, default=0,
                        help="instead of --input: N synthetic documents (coloured squares and captions) written "
                             "to OUT.demo-src/ and prepared")
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or an HF directory with tiktoken.model")
    parser.add_argument("--placeholder_id", type=int, default=None,
                        help="image placeholder token id (default: 259 for byte, 163605 otherwise)")
    parser.add_argument("--patch_size", type=int, default=14, help="vision patch size in pixels")
    parser.add_argument("--merge_size", type=int, default=2, help="patches merged per side into one image token")
    parser.add_argument("--max_image_patches", type=int, default=DEFAULT_MAX_IMAGE_PATCHES,
                        help="patch budget per image (larger images are downscaled)")
    parser.add_argument("--max_side_patches", type=int, default=512, help="patches per image side at most")
    parser.add_argument("--image_marker", default=IMAGE_MARKER, help="marker in the text where an image goes")
    parser.add_argument("--num_shards", type=int, default=1, help="number of ArrayRecord shards")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if bool(args.input) == bool(args.demo):
        print("error: pass --input GLOB or --demo N (one of them)", file=sys.stderr)
        return 2
    try:
        inputs = args.input or [write_demo_documents(args.out.rstrip("/") + ".demo-src", args.demo)]
        meta = prepare_multimodal(inputs, args.out, args.tokenizer, placeholder_id=args.placeholder_id,
                                  patch_size=args.patch_size, merge_size=args.merge_size,
                                  max_image_patches=args.max_image_patches, max_side_patches=args.max_side_patches,
                                  num_shards=args.num_shards, marker=args.image_marker, overwrite=args.overwrite)
    except (prep.DataPrepError, FileExistsError, ImportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: meta[k] for k in ("num_documents", "num_images", "num_patches", "num_tokens",
                                           "placeholder_id", "vocab_size")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
