"""Token log-probabilities: the scheduler's equal a float64 log-softmax of the model's logits for the same prefix
(teacher-forced full forward), greedy tokens do not change when they are asked for, and the server returns them in
the OpenAI formats (completions' legacy lists, chat's content entries), streamed and not, for every choice."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.inference.engine import SamplingParams
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.slot_steps import MAX_TOP_LOGPROBS
from tests.test_inference_cache import tiny_model
from tests.test_server import CHAT, NAME, P1, post, serving, stream

PROMPT = [1, 40, 41, 42, 43, 44, 45]
TOL = 2e-3  # the cached decode path against the full forward, both f32


@pytest.fixture(scope="module")
def scheduler():
    return Scheduler(tiny_model(NAME), num_slots=2, max_len=64)


def reference_logprobs(ids: list[int], n_prompt: int) -> np.ndarray:
    """float64 log-softmax of the full forward's logits at the positions that predict ids[n_prompt:]: [n, vocab]."""
    logits = np.asarray(tiny_model(NAME)(jnp.asarray([ids], jnp.int32)).astype(jnp.float32), np.float64)[0]
    rows = logits[n_prompt - 1:len(ids) - 1]
    m = rows.max(-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(-1, keepdims=True))


def events_of(scheduler, request: Request):
    scheduler.add(request)
    return [ev for ev in scheduler.events() if ev.token is not None]


@pytest.mark.slow
def test_scheduler_logprobs_equal_a_float64_log_softmax_of_the_teacher_forced_logits(scheduler):
    greedy = events_of(scheduler, Request("g", PROMPT, 6, eos_ids=[], logprobs=5))
    plain = events_of(scheduler, Request("p", PROMPT, 6, eos_ids=[]))
    assert [e.token for e in greedy] == [e.token for e in plain]  # asking for logprobs changes no greedy token
    assert all(e.logprob is None and e.top_logprobs is None for e in plain)
    ref = reference_logprobs(PROMPT + [e.token for e in greedy], len(PROMPT))
    for i, e in enumerate(greedy):
        ids, vals = zip(*e.top_logprobs)
        assert len(ids) == 5 and list(vals) == sorted(vals, reverse=True)
        assert ids[0] == e.token and vals[0] == e.logprob  # greedy: the chosen token is the most likely
        np.testing.assert_allclose(e.logprob, ref[i, e.token], atol=TOL)
        np.testing.assert_allclose(vals, ref[i, list(ids)], atol=TOL)
        np.testing.assert_allclose(vals, np.sort(ref[i])[::-1][:5], atol=TOL)  # the 5 most likely
    # sampled at temperature 2: the reported distribution is the model's own (before temperature)
    sampled = events_of(scheduler, Request("s", PROMPT, 6, SamplingParams(temperature=2.0), jax.random.key(3),
                                           eos_ids=[], logprobs=0))
    ref = reference_logprobs(PROMPT + [e.token for e in sampled], len(PROMPT))
    assert all(e.top_logprobs == () for e in sampled)
    np.testing.assert_allclose([e.logprob for e in sampled], [ref[i, e.token] for i, e in enumerate(sampled)],
                               atol=TOL)


def test_scheduler_rejects_more_alternatives_than_computed(scheduler):
    with pytest.raises(ValueError, match="logprobs"):
        scheduler.validate(Request("x", PROMPT, 2, logprobs=MAX_TOP_LOGPROBS + 1))


def test_server_returns_logprobs_in_the_openai_formats_streamed_and_not(scheduler, tokenizer):
    comp = {"prompt": P1, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}

    async def go():
        async with serving(scheduler, tokenizer) as (_, client, _, _):
            return (await post(client, "/v1/completions", comp), await stream(client, "/v1/completions", comp),
                    await post(client, "/v1/chat/completions", chat),
                    await stream(client, "/v1/chat/completions", chat),
                    await post(client, "/v1/completions", {**comp, "n": 2, "temperature": 1.0, "seed": 5}))

    (st, body), (chunks, done), (cst, cbody), (cchunks, cdone), (nst, nbody) = asyncio.run(go())
    assert st == cst == nst == 200 and done and cdone
    want = events_of(scheduler, Request("w", tokenizer.encode(P1, add_bos=True), 5,
                                        eos_ids=[scheduler.cfg.eos_token_id], logprobs=3))
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [tokenizer.decode([e.token]) for e in want]
    np.testing.assert_allclose(lp["token_logprobs"], [e.logprob for e in want], atol=1e-6)
    assert [len(d) for d in lp["top_logprobs"]] == [len({tokenizer.decode([t]) for t, _ in e.top_logprobs})
                                                    for e in want]
    text = body["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(o <= len(text) for o in lp["text_offset"])
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in lp:  # the chunks' entries, concatenated, are the non-streamed ones
        assert sum((s[key] for s in streamed), []) == lp[key], key
    content = cbody["choices"][0]["logprobs"]["content"]
    assert len(content) == cbody["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["bytes"] == list(e["token"].encode()) and e["top_logprobs"][0]["logprob"] == e["logprob"]
    assert sum((c["choices"][0]["logprobs"]["content"] for c in cchunks if c["choices"]
                and c["choices"][0]["logprobs"]), []) == content
    assert [len(c["logprobs"]["tokens"]) for c in nbody["choices"]] == [5, 5]
