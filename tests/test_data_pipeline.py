"""Data pipeline: `k3jax.data.prepare` writes exactly the tokens of each document; the Grain loader's packed batches
equal an independent token-loop packing of the same documents, keep every document whole and in order (also when
shuffled or cut across rows), restore exactly from a JSON or Orbax-saved iterator state; bad input fails clearly and
leaves nothing behind."""

from __future__ import annotations

import base64
import json
import logging
import os

import numpy as np
import pytest

from k3jax.data import pipeline, prepare
from tests.helpers import default_dataset

BOS, EOS, PAD = 256, 257, 258
SEQ_LEN, BATCH = 16, 3


# ------------------------------------------------------------------------------------------------ fixtures


def _write_corpus(root) -> list[bytes]:
    """A few small files; returns the documents' raw bytes in the order prepare reads them (sorted paths)."""
    root.mkdir()
    (root / "a.txt").write_bytes("héllo wörld\n".encode())
    (root / "b.jsonl").write_text("\n".join([json.dumps({"text": "first"}), "", json.dumps({"text": "x"}),
                                             json.dumps({"text": "üñí — code"})]) + "\n")
    long_doc = bytes(range(32, 127)) * 2  # 190 bytes: spans many rows of SEQ_LEN
    (root / "c.txt").write_bytes(long_doc)
    (root / "d.jsonl").write_text(json.dumps({"text": "ab", "id": 3}) + "\n")
    return ["héllo wörld\n".encode(), b"first", b"x", "üñí — code".encode(), long_doc, b"ab"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    docs = _write_corpus(root / "in")
    meta = prepare.prepare(str(root / "in" / "*"), str(root / "out"), "byte", num_shards=2)
    tokens = [[BOS] + list(d) + [EOS] for d in docs]  # the byte tokenizer's definition, written out
    return dict(dir=str(root / "out"), meta=meta, tokens=tokens)


def _collect(it, n=None):
    """Up to n batches (all when n is None) as numpy copies; consumes exactly what it returns."""
    out = []
    while n is None or len(out) < n:
        try:
            batch = next(it)
        except StopIteration:
            break
        out.append({k: np.array(v) for k, v in batch.items()})
    return out


def _reference_packing(docs: list[list[int]], batch_size: int, seq_len: int, pad: int) -> list[dict]:
    """Straightforward packing: a stream of (input, next token, document, position) over the documents in order,
    cut every seq_len; segments numbered by first appearance in a row; last row and last batch padded."""
    stream = [(d[i], d[i + 1], n, i) for n, d in enumerate(docs) for i in range(len(d) - 1)]
    rows = [stream[s:s + seq_len] for s in range(0, len(stream), seq_len)]
    rows += [[]] * (-len(rows) % batch_size)
    batches = []
    for b in range(0, len(rows), batch_size):
        batch = {k: np.zeros((batch_size, seq_len), np.int32) for k in pipeline.BATCH_KEYS}
        batch["input_ids"][:] = pad
        batch["targets"][:] = pad
        for r, row in enumerate(rows[b:b + batch_size]):
            segment_of = {}
            for t, (tok, nxt, doc, pos) in enumerate(row):
                segment_of.setdefault(doc, len(segment_of) + 1)
                batch["input_ids"][r, t], batch["targets"][r, t] = tok, nxt
                batch["segment_ids"][r, t], batch["positions"][r, t] = segment_of[doc], pos
        batch["loss_mask"] = (batch["segment_ids"] > 0).astype(np.float32)
        batches.append(batch)
    return batches


def _documents_from_batches(batches: list[dict]) -> list[list[int]]:
    """Rebuilds whole documents from packed rows, checking the within-row invariants on the way."""
    docs, current = [], None
    for batch in batches:
        for r in range(batch["input_ids"].shape[0]):
            seg, pos = batch["segment_ids"][r], batch["positions"][r]
            ids, tgt, mask = batch["input_ids"][r], batch["targets"][r], batch["loss_mask"][r]
            np.testing.assert_array_equal(mask, seg > 0)
            assert np.all(ids[seg == 0] == PAD) and np.all(pos[seg == 0] == 0)
            valid = np.flatnonzero(seg > 0)
            assert valid.size == 0 or valid[-1] == valid.size - 1, "padding only at the end of a row"
            ids_in_row = sorted(set(seg[valid].tolist()))
            assert ids_in_row == list(range(1, len(ids_in_row) + 1)), f"segment ids {ids_in_row} not 1..n"
            for s in ids_in_row:
                where = np.flatnonzero(seg == s)
                assert np.all(np.diff(where) == 1), "a segment is contiguous"
                piece_pos = pos[where]
                np.testing.assert_array_equal(piece_pos, piece_pos[0] + np.arange(len(where)))
                np.testing.assert_array_equal(tgt[where[:-1]], ids[where[1:]])  # next token within the piece
                if piece_pos[0] == 0:  # a document starts
                    if current is not None:
                        docs.append(current)
                    current = []
                else:  # continuation of the document cut at the end of the previous row
                    assert current is not None and len(current) - 1 == piece_pos[0], "continuation out of order"
                    current.pop()  # the previous piece's final target is this piece's first input
                current += ids[where].tolist() + [int(tgt[where[-1]])]
    if current is not None:
        docs.append(current)
    return docs


# ------------------------------------------------------------------------------------------------ prepare


def test_prepare_records_decode_to_exact_tokens(corpus):
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    meta, tokens = corpus["meta"], corpus["tokens"]
    assert meta["num_documents"] == len(tokens) and meta["num_tokens"] == sum(map(len, tokens))
    assert (meta["vocab_size"], meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (259, BOS, EOS, PAD)
    assert prepare.read_metadata(corpus["dir"]) == meta
    assert [s["num_documents"] for s in meta["shards"]] == [3, 3]
    for s, shard in enumerate(meta["shards"]):  # round robin: document i in shard i % 2
        source = ArrayRecordDataSource([os.path.join(corpus["dir"], shard["file"])])
        stored = [np.frombuffer(source[i], "<i4").tolist() for i in range(len(source))]
        assert stored == tokens[s::2]
    from k3jax.data.text import ByteTokenizer

    text_tok = ByteTokenizer(BOS, EOS, PAD, 384)  # the training loop's tokenizer gives the same ids
    assert text_tok.encode("héllo wörld\n", add_bos=True, add_eos=True) == tokens[0]


def test_prepare_with_tiktoken_directory(tmp_path):
    pytest.importorskip("tiktoken")
    hf = tmp_path / "hf"
    hf.mkdir()
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    (hf / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"300": {"content": "[BOS]"}, "301": {"content": "[EOS]"}}}))
    (hf / "config.json").write_text(json.dumps(
        {"text_config": {"vocab_size": 320, "bos_token_id": 300, "eos_token_id": 301, "pad_token_id": 319}}))
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hello hello"}) + "\n")
    meta = prepare.prepare(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), str(hf), eos_id=302)
    assert (meta["vocab_size"], meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (320, 300, 302, 319)
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    source = ArrayRecordDataSource([str(tmp_path / "out" / meta["shards"][0]["file"])])
    # "hello" is the merged token 259; " hello" is a space (32) then 259
    assert np.frombuffer(source[0], "<i4").tolist() == [300, 259, 32, 259, 302]


def _assert_bad_input_leaves_nothing(tmp_path, match, **kwargs):
    before = set(os.listdir(tmp_path))
    with pytest.raises((prepare.DataPrepError, FileExistsError), match=match):
        prepare.prepare(out=str(tmp_path / "out"), **kwargs)
    assert set(os.listdir(tmp_path)) == before, "no output or temporary directory may remain"


def test_bad_inputs_fail_clearly_and_leave_no_output(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    _assert_bad_input_leaves_nothing(tmp_path, "no files match", inputs=str(tmp_path / "*.parquet"))
    _assert_bad_input_leaves_nothing(tmp_path, "unknown tokenizer 'gpt9'", inputs=str(tmp_path / "ok.txt"),
                                     tokenizer="gpt9")
    _assert_bad_input_leaves_nothing(tmp_path, "has no tiktoken.model", inputs=str(tmp_path / "ok.txt"),
                                     tokenizer=str(tmp_path))
    _assert_bad_input_leaves_nothing(tmp_path, r"empty\.txt: empty document", inputs=str(tmp_path / "*.txt"))
    _assert_bad_input_leaves_nothing(tmp_path, r"bad\.jsonl:2: no 'text' field \(got \['body'\]\)",
                                     inputs=str(tmp_path / "bad.jsonl"))
    _assert_bad_input_leaves_nothing(tmp_path, r"broken\.jsonl:1: invalid JSON", inputs=str(tmp_path / "broken.*"))
    _assert_bad_input_leaves_nothing(tmp_path, "outside the tokenizer's vocabulary", inputs=str(tmp_path / "ok.txt"),
                                     eos_id=259)
    meta = prepare.prepare(str(tmp_path / "*.txt"), str(tmp_path / "out"), skip_empty=True)
    assert meta["num_documents"] == 1 and meta["skipped_empty_documents"] == 1
    _assert_bad_input_leaves_nothing(tmp_path, "already exists", inputs=str(tmp_path / "ok.txt"))


def test_cli_reports_errors_and_writes_output(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("fine")
    assert prepare.main(["--input", str(tmp_path / "nothing*"), "--out", str(tmp_path / "o")]) == 2
    assert "error: no files match" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert prepare.main(["--input", str(tmp_path / "*.txt"), "--out", str(tmp_path / "o"), "--num_shards", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] == len("fine") + 2
    with pytest.raises(ValueError, match=r"vocab_size=259\), larger than the model's vocab_size=200"):
        pipeline.make_dataset(str(tmp_path / "o"), batch_size=1, seq_len=4, shard_index=0, shard_count=1,
                              vocab_size=200)
    with pytest.raises(FileNotFoundError, match="not a prepared data directory"):
        pipeline.make_dataset(str(tmp_path), batch_size=1, seq_len=4, shard_index=0, shard_count=1)


def test_cli_bad_bytes_or_unwritable_output_is_one_error_line(tmp_path, capsys, caplog):
    (tmp_path / "ok.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "afile").write_text("")
    for inputs, out, message in [
            ("latin1.jsonl", "o1", "latin1.jsonl:2: not valid UTF-8"),
            ("ok.jsonl", "afile/o2", "afile/o2.tmp-"),  # the parent is a file: Not a directory
            ("empty.jsonl", "o3", "no documents in the 1 input file(s)")]:
        assert prepare.main(["--input", str(tmp_path / inputs), "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], err
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=prepare.log.name):
        assert prepare.main(["--input", str(tmp_path / "ok.jsonl"), "--out", str(tmp_path / "o4"),
                             "--num_shards=0"]) == 2
    assert "--num_shards must be >= 1" in capsys.readouterr().err and "tokenizing" not in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty.jsonl", "latin1.jsonl", "ok.jsonl"]


def test_progress_lines_give_the_share_of_the_input_read_and_the_remaining_time(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n{"text": "four"}\n')
    with caplog.at_level(logging.INFO, logger=prepare.log.name):
        prepare.prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), num_threads=1, log_every_s=0)
    lines = [r.getMessage() for r in caplog.records if "% of the input" in r.getMessage()]
    assert len(lines) == 4 and "4 documents" in lines[-1] and "100% of the input, ETA 0.0 min" in lines[-1], lines
    assert "1 documents" in lines[0] and "24% of the input, ETA" in lines[0], lines  # 16 of the file's 66 bytes


# ------------------------------------------------------------------------------------------------ loader


def test_packed_batches_equal_straightforward_packing(corpus):
    got = _collect(pipeline.make_dataset(corpus["dir"], batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False,
                                         num_epochs=1, shard_index=0, shard_count=1))
    want = _reference_packing(corpus["tokens"], BATCH, SEQ_LEN, PAD)
    assert len(got) == len(want)
    shapes = pipeline.batch_shapes(BATCH, SEQ_LEN)  # what the trainer compiles the step for ahead
    for g, w in zip(got, want):
        assert set(g) == set(pipeline.BATCH_KEYS)
        assert {k: (v.shape, v.dtype) for k, v in g.items()} == shapes
        for key in pipeline.BATCH_KEYS:
            assert g[key].shape == (BATCH, SEQ_LEN) and g[key].dtype == w[key].dtype, key
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
    assert _documents_from_batches(got) == corpus["tokens"]


def test_shuffled_epochs_keep_every_document_whole_and_in_order(corpus):
    batches = _collect(pipeline.make_dataset(corpus["dir"], batch_size=2, seq_len=8, shuffle=True, seed=7,
                                             num_epochs=2, shard_index=0, shard_count=1))
    docs = _documents_from_batches(batches)
    n = len(corpus["tokens"])
    first, second = docs[:n], docs[n:]
    assert sorted(first) == sorted(corpus["tokens"]) and sorted(second) == sorted(corpus["tokens"])
    assert first != corpus["tokens"] and first != second  # shuffled, and differently in each epoch


def test_process_shards_are_disjoint_equal_shares(corpus):
    shares = [_documents_from_batches(_collect(pipeline.make_dataset(
        corpus["dir"], batch_size=2, seq_len=8, seed=1, num_epochs=1, shard_index=i, shard_count=2)))
        for i in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(corpus["tokens"])
    assert len(shares[0]) == len(shares[1]) == 3
    with pytest.raises(ValueError, match="fewer than shard_count=7"):
        pipeline.make_dataset(corpus["dir"], batch_size=1, seq_len=4, shard_index=0, shard_count=7)


def test_iterator_state_json_round_trip_gives_identical_batches(corpus):
    kwargs = dict(batch_size=2, seq_len=8, seed=3, shard_index=0, shard_count=1)  # endless, shuffled
    reference = _collect(pipeline.make_dataset(corpus["dir"], **kwargs), 40)
    for k in (0, 1, 5, 17, 29):  # states with and without a document cut in flight
        it = pipeline.make_dataset(corpus["dir"], **kwargs)
        _collect(it, k)
        state = json.loads(json.dumps(it.get_state()))
        restored = pipeline.make_dataset(corpus["dir"], **kwargs)
        restored.set_state(state)
        for want, got in zip(reference[k:], _collect(restored, 40 - k)):
            for key in pipeline.BATCH_KEYS:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"after {k} batches: {key}")


def test_orbax_checkpoint_manager_saves_and_restores_iterator(corpus, tmp_path):
    import orbax.checkpoint as ocp

    kwargs = dict(batch_size=2, seq_len=8, seed=5, shard_index=0, shard_count=1)
    it = pipeline.make_dataset(corpus["dir"], **kwargs)
    _collect(it, 3)
    manager = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.arange(4.0)}),
                                            data=pipeline.checkpoint_save_args(it)))
    manager.wait_until_finished()
    want = _collect(it, 4)
    fresh = pipeline.make_dataset(corpus["dir"], **kwargs)
    restored = manager.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore({"w": np.zeros(4)}),
                                                          data=pipeline.checkpoint_restore_args(fresh)))
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0))
    for w, g in zip(want, _collect(fresh, 4)):
        np.testing.assert_array_equal(g["input_ids"], w["input_ids"])
        np.testing.assert_array_equal(g["targets"], w["targets"])
    manager.close()


def test_default_dataset_prepares_stdlib_corpus_once(tmp_path):
    from k3jax.data.text import stdlib_corpus

    kwargs = dict(batch_size=2, seq_len=32, cache_root=str(tmp_path), max_bytes=1 << 15, shuffle=False,
                  shard_index=0, shard_count=1)
    batch = next(default_dataset(**kwargs))
    (cache,) = os.listdir(tmp_path)
    meta_mtime = os.path.getmtime(tmp_path / cache / "metadata.json")
    first_doc = next(d for d in stdlib_corpus(max_bytes=1 << 15) if d)
    assert batch["input_ids"][0].tolist() == [BOS] + list(first_doc[:31])
    assert batch["targets"][0].tolist() == list(first_doc[:32])
    next(default_dataset(**kwargs))
    assert os.listdir(tmp_path) == [cache] and os.path.getmtime(tmp_path / cache / "metadata.json") == meta_mtime


@pytest.mark.slow
def test_multiprocess_prefetch_state_round_trip(corpus):
    kwargs = dict(batch_size=2, seq_len=8, seed=3, worker_count=2, shard_index=0, shard_count=1)
    it = pipeline.make_dataset(corpus["dir"], **kwargs)
    reference = _collect(it, 12)
    it.close()
    it = pipeline.make_dataset(corpus["dir"], **kwargs)
    _collect(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    restored = pipeline.make_dataset(corpus["dir"], **kwargs)
    restored.set_state(state)
    got = _collect(restored, 7)
    restored.close()
    for want, g in zip(reference[5:], got):
        np.testing.assert_array_equal(g["input_ids"], want["input_ids"])
