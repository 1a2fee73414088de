"""Generation engine, sampling functions and serve.py batch mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.inference import sampling
from k3jax.inference.batch import BatchOptions, read_prompts, run_batch
from k3jax.inference.engine import Engine, SamplingParams, bucket
from tests.test_inference_cache import tiny_model

NAME = "tiny_kimi_linear"  # engine logic is config-independent; the cache tests cover the K3 layout (tiny)
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4]]
MIXED = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, top_p=0.9)]


@pytest.fixture(scope="module")
def greedy_engine():
    return Engine(tiny_model(NAME))


@pytest.fixture(scope="module")
def mixed_engine():
    return Engine(tiny_model(NAME))


def test_greedy_deterministic_and_decode_compiles_once(greedy_engine):
    e = greedy_engine
    r1 = e.generate(PROMPTS, 12, eos_id=-1)
    assert [len(r.tokens) for r in r1] == [12, 12, 12] and all(r.finish_reason == "length" for r in r1)
    assert e.trace_counts == {"prefill": 1, "decode": 1}
    r2 = e.generate(PROMPTS, 12, eos_id=-1)
    assert [r.tokens for r in r1] == [r.tokens for r in r2]
    # other prompts in the same length bucket, other (per-sequence) lengths: no recompilation
    r3 = e.generate([[256, 3] * 6, [256], [256, 9, 9]], [16, 3, 7], eos_id=-1)
    assert [len(r.tokens) for r in r3] == [16, 3, 7]
    assert e.trace_counts == {"prefill": 1, "decode": 1}


def test_per_sequence_eos(greedy_engine):
    e = greedy_engine
    ref = e.generate(PROMPTS, 12, eos_id=-1)
    stop = ref[0].tokens[4]  # make the 5th token of sequence 0 an EOS
    got = e.generate(PROMPTS, 12, eos_id=stop)
    first = ref[0].tokens.index(stop)
    assert got[0].tokens == ref[0].tokens[:first] and got[0].finish_reason == "stop"
    for r, g in zip(ref[1:], got[1:]):  # the others run on (unless they hit the same id)
        n = r.tokens.index(stop) if stop in r.tokens else len(r.tokens)
        assert g.tokens == r.tokens[:n]
        assert g.finish_reason == ("stop" if n < len(r.tokens) else "length")
    assert e.trace_counts == {"prefill": 1, "decode": 1}


@pytest.mark.slow
def test_batch_equals_alone_with_sampling(mixed_engine, greedy_engine):
    e = mixed_engine
    keys = [jax.random.key(i) for i in range(3)]
    batch = e.generate(PROMPTS, 10, MIXED, eos_id=-1, key=keys)
    assert [r.tokens for r in batch] == [r.tokens for r in e.generate(PROMPTS, 10, MIXED, eos_id=-1, key=keys)]
    for p, sp, k, r in list(zip(PROMPTS, MIXED, keys, batch))[1:]:  # the sampled rows, each alone
        assert e.generate([p], 10, sp, eos_id=-1, key=[k])[0].tokens == r.tokens
    # the greedy row equals the greedy-only fast path; another key changes the sampled rows only
    assert batch[0].tokens == greedy_engine.generate(PROMPTS, 10, eos_id=-1)[0].tokens
    other = e.generate(PROMPTS, 10, MIXED, eos_id=-1, key=[jax.random.key(7 + i) for i in range(3)])
    assert other[0].tokens == batch[0].tokens and other[1].tokens != batch[1].tokens
    assert e.trace_counts == {"prefill": 2, "decode": 2}  # batch 3 and batch 1


def test_generate_errors(greedy_engine):
    e = greedy_engine
    with pytest.raises(ValueError, match="PRNG key"):
        e.generate(PROMPTS, 4, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="at least one token"):
        e.generate([[]], 4)
    with pytest.raises(ValueError, match="top_p"):
        e.generate(PROMPTS, 4, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.generate(PROMPTS, 0)
    with pytest.raises(ValueError, match="cache capacity"):
        Engine(tiny_model(NAME), max_len=8).generate([[1] * 6], 5)
    assert bucket(1, 16) == 16 and bucket(17, 16) == 32 and bucket(64, 16) == 64


def test_sampling_filters():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(4, 50), jnp.float32)
    order = np.argsort(-np.asarray(logits), axis=-1)
    ones, zeros = jnp.ones(4), jnp.zeros(4)
    # top_k = 3: exactly the 3 largest survive
    f = np.asarray(sampling.filter_logits(logits, ones, jnp.full(4, 3), ones))
    for i in range(4):
        assert set(np.flatnonzero(np.isfinite(f[i]))) == set(order[i, :3])
    # top_p: the smallest prefix of the sorted distribution reaching p
    p = 0.5
    f = np.asarray(sampling.filter_logits(logits, ones, zeros.astype(jnp.int32), jnp.full(4, p)))
    probs = np.asarray(jax.nn.softmax(logits))
    for i in range(4):
        cum = np.cumsum(probs[i, order[i]])
        n = int(np.searchsorted(cum, p) + 1)
        assert set(np.flatnonzero(np.isfinite(f[i]))) == set(order[i, :n])
    keys = jax.random.split(jax.random.key(0), 4)
    # temperature 0 -> argmax; top_k 1 -> argmax; a tiny top_p -> argmax
    np.testing.assert_array_equal(sampling.sample(logits, keys, zeros, zeros.astype(jnp.int32), ones), order[:, 0])
    np.testing.assert_array_equal(sampling.sample(logits, keys, ones, jnp.ones(4, jnp.int32), ones), order[:, 0])
    np.testing.assert_array_equal(sampling.sample(logits, keys, ones, zeros.astype(jnp.int32), jnp.full(4, 1e-6)),
                                  order[:, 0])
    # draws follow softmax(logits / T) restricted to the top-k set
    many = jax.random.split(jax.random.key(1), 4000)
    row = jnp.broadcast_to(logits[0], (4000, 50))
    t = jnp.full(4000, 2.0)
    draws = np.asarray(sampling.sample(row, many, t, jnp.full(4000, 4, jnp.int32), jnp.ones(4000)))
    top4 = order[0, :4]
    assert set(draws) <= set(top4)
    expect = np.asarray(jax.nn.softmax(logits[0, top4] / 2.0))
    freq = np.array([(draws == j).mean() for j in top4])
    np.testing.assert_allclose(freq, expect, atol=0.03)


def test_serve_batch_mode(tmp_path, greedy_engine):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "id": "a"}\n\n{"prompt_ids": [256, 1, 2]}\n{"prompt": "é"}\n')
    out = tmp_path / "out.jsonl"
    opts = BatchOptions(config=NAME, prompts_file=str(prompts), out=str(out), max_new_tokens=6, batch_size=3)
    recs = run_batch(opts, log=lambda m: None, engine=greedy_engine)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == recs and [r["index"] for r in recs] == [0, 1, 2] and recs[0]["id"] == "a"
    assert recs[0]["prompt_tokens"] == 10 and recs[2]["prompt_tokens"] == 3  # BOS + bytes ("é" is 2 bytes)
    assert all(r["completion_tokens"] == len(r["completion_ids"]) <= 6 for r in recs)
    assert greedy_engine.trace_counts == {"prefill": 1, "decode": 1}

    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert [p["prompt"] for p in read_prompts(str(txt))] == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    for content, match in [("", "no prompts"), ("{oops\n", "p.jsonl:1|bad.jsonl:1: not valid JSON"),
                           ('{"prompt": "a", "max_tokens": 3}\n', "unknown field"),
                           ('{"prompt_ids": []}\n', "non-empty list")]:
        bad.write_text(content)
        with pytest.raises(ValueError, match=match):
            read_prompts(str(bad))
    with pytest.raises(ValueError, match="maximum length 8"):
        run_batch(BatchOptions(config=NAME, prompts_file=str(txt), out=str(out), max_new_tokens=6, max_len=8),
                  log=lambda m: None, engine=greedy_engine)
    with pytest.raises(ValueError, match="not found"):
        read_prompts(str(tmp_path / "missing.txt"))


def test_batch_out_in_a_missing_directory_is_refused_before_generating(tmp_path):
    (tmp_path / "p.txt").write_text("hi\n")
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path / "afile" / "o.jsonl", "is not an existing directory"),
                         (tmp_path / "nodir" / "o.jsonl", "is not an existing directory"),
                         (tmp_path, "is a directory")):
        with pytest.raises(ValueError, match=message):  # validated first: no model loaded, nothing generated
            run_batch(BatchOptions(config=NAME, prompts_file=str(tmp_path / "p.txt"), out=str(out)),
                      log=lambda m: None)
    greedy = Engine(tiny_model(NAME))
    run_batch(BatchOptions(config=NAME, prompts_file=str(tmp_path / "p.txt"), out=str(tmp_path / "o.jsonl"),
                           max_new_tokens=2, max_len=8), log=lambda m: None, engine=greedy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "o.jsonl", "p.txt"]  # no temporary file left


def test_serve_cli_bad_flags(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("hi\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = lambda *a: subprocess.run([sys.executable, os.path.join(root, "serve.py"), *a], cwd=root,
                                    capture_output=True, text=True, timeout=120)
    r = run("--config=tinyy", f"--prompts_file={txt}", f"--out={tmp_path / 'o.jsonl'}")
    assert r.returncode == 2 and "unknown config 'tinyy'" in r.stderr
    empty = tmp_path / "e.txt"
    empty.write_text("\n")
    r = run("--config=tiny", f"--prompts_file={empty}", f"--out={tmp_path / 'o.jsonl'}")
    assert r.returncode == 2 and "no prompts" in r.stderr


def test_serve_cli_prints_no_orbax_info_lines_loading_a_checkpoint(tmp_path):
    """serve.py --checkpoint: the load leaves stderr to serve.py's own lines (Orbax logs an INFO line per array);
    here the checkpoint loads, then --speculative=mtp stops with one error line (it holds no MTP layer)."""
    k3jax.save_checkpoint(tiny_model(NAME), str(tmp_path / "ckpt"))
    (tmp_path / "p.txt").write_text("hi\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "serve.py", f"--checkpoint={tmp_path / 'ckpt'}", "--speculative=mtp",
                        f"--prompts_file={tmp_path / 'p.txt'}", f"--out={tmp_path / 'o.jsonl'}"], cwd=root,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2 and "holds no MTP layer" in r.stderr, r.stderr[-2000:]
    info = [line for line in r.stderr.splitlines() if line[:1] == "I" and line[1:5].isdigit()]
    assert not info, info[:3]
