"""Speculative decoding in the continuous-batching scheduler and the server: greedy tokens equal the plain
scheduler's for requests arriving at different steps, accepting different counts per step and finishing at
different times (max_tokens, EOS); speculation switches itself off above `max_spec_batch` running sequences and
while the accepted drafts do not pay (re-probing later); `/health` reports the counters; serve.py's flag errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import numpy as np
import pytest
from flax import nnx

from k3jax.eagle3 import Eagle3Layer
from k3jax.inference.drafts import CallbackDraft, MTPDraft
from k3jax.inference.eagle3_draft import Eagle3Draft
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.spec_scheduler import SpeculativeScheduler, break_even_accepted, make_draft
from k3jax.inference.spec_slots import TRACE_COUNTS
from k3jax.mtp import MTPLayer
from tests.test_inference_cache import tiny_model
from tests.test_server import NAME, ROOT, TIMEOUT, _free_port, post, serving

K = 3
SHAPE = dict(num_slots=3, max_len=48)
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4], [256, 7, 7, 7, 9, 11],
           [256, 99, 98, 97, 96, 95]]
MAX_TOKENS = [14, 5, 17, 9, 11]
ARRIVALS = [0, 0, 1, 3, 4]


@pytest.fixture(scope="module")
def model():
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def plain(model):
    """The plain scheduler's greedy output per request (no EOS), the reference."""
    sched = Scheduler(model, **SHAPE)
    return sched, sched.generate(_requests(), ARRIVALS)


@pytest.fixture(scope="module")
def draft():
    """One host draft (so one compile) for every test: each sets `draft.fn`."""
    return CallbackDraft(lambda *a: None, K)


def _requests(eos=()):
    return [Request(i, p, m, eos_ids=list(eos)) for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]


def oracle(references: list[list[int]], corrupt_at: list[int | None]):
    """A draft proposing each reference continuation, looked up by (tokens generated, last token); reference i's
    drafts are wrong at index corrupt_at[i] (None: never), so it accepts that many tokens per step (unknown keys
    propose token 0)."""
    table = {}
    for toks, c in zip(references, corrupt_at):
        for g in range(1, len(toks) + 1):
            cont = (toks + [0] * K)[g:g + K]
            if c is not None and c < K:
                cont[c] = (cont[c] + 1) % 300
            table[(g, toks[g - 1])] = cont

    def fn(last_b, out_bn, num_generated_b):
        return np.asarray([table.get((int(g), int(t)), [0] * K) for t, g in zip(last_b, num_generated_b)])

    return fn


def test_greedy_tokens_equal_plain_with_different_acceptance_and_finish_times(model, plain, draft):
    _, want = plain
    refs = [want[i][0] for i in range(len(PROMPTS))]
    draft.fn = oracle(refs, [None, 0, 1, 2, None])
    sched = SpeculativeScheduler(model, draft, **SHAPE)
    got = sched.generate(_requests(), ARRIVALS)
    assert got == want
    traces = TRACE_COUNTS["spec_decode"]
    stats = sched.speculative_stats()
    assert 0 < stats["accepted"] < stats["drafted"] and stats["plain_steps"] == 0
    assert 1 < stats["mean_accepted_length"] <= K + 1
    assert stats["spec_steps"] < sum(MAX_TOKENS) // 2  # several tokens per step

    # a random draft (nothing accepted) is exact too; an EOS in the middle of a verified chunk ends the request
    draft.fn = lambda last_b, out_bn, g: np.random.RandomState(int(g.sum())).randint(0, 300, (len(last_b), K))
    eos = refs[2][6]
    want_eos = Scheduler(model, **SHAPE).generate(_requests([eos]), ARRIVALS)
    assert want_eos[2] == (refs[2][:refs[2].index(eos)], "stop")
    for fn in (draft.fn, oracle(refs, [None] * 5)):
        draft.fn = fn
        assert SpeculativeScheduler(model, draft, **SHAPE).generate(_requests([eos]), ARRIVALS) == want_eos
    assert TRACE_COUNTS["spec_decode"] == traces  # one program for every scheduler and draft function


def test_speculation_switches_off_above_max_spec_batch(model, plain, draft):
    _, want = plain
    draft.fn = oracle([want[i][0] for i in range(len(PROMPTS))], [None] * 5)
    sched = SpeculativeScheduler(model, draft, max_spec_batch=1, **SHAPE)
    steps = []
    orig = sched._decode_running

    def spy():
        steps.append((sched.num_running, sched.speculating))
        return orig()

    sched._decode_running = spy
    assert sched.generate(_requests(), ARRIVALS) == want
    assert {s for n, s in steps if n > 1} == {False} and {s for n, s in steps if n == 1} == {True}
    stats = sched.speculative_stats()
    assert stats["plain_steps"] == sum(n > 1 for n, _ in steps) and stats["spec_steps"] == sum(n == 1 for n, _ in
                                                                                                   steps)
    with pytest.raises(ValueError, match="max_spec_batch must be >= 0"):
        SpeculativeScheduler(model, draft, max_spec_batch=-1, **SHAPE)
    with pytest.raises(ValueError, match="must be a jax.sharding.Mesh"):
        SpeculativeScheduler(model, draft, mesh=object(), **SHAPE)


def _random_draft(last_b, out_bn, g):
    return np.random.RandomState(int(g.sum())).randint(0, 300, (len(last_b), K))


def _spied(sched, on_step=None) -> list[bool]:
    """Records, per decode step, whether it ran speculatively (`on_step(sched)` first, when given)."""
    flags, orig = [], sched._decode_running

    def spy():
        if on_step is not None:
            on_step(sched)
        flags.append(sched.speculating)
        return orig()

    sched._decode_running = spy
    return flags


LONG = [Request(i, p, 30, eos_ids=[]) for i, p in enumerate(PROMPTS[:2])]


def test_low_acceptance_switches_speculation_off_after_the_window_and_reprobes_with_tokens_equal_plain(model,
                                                                                                         draft):
    want = Scheduler(model, **SHAPE).generate(LONG)
    draft.fn = _random_draft  # ~nothing accepted: below the default break-even of 0.4·k = 1.2
    sched = SpeculativeScheduler(model, draft, spec_window=4, probe_every=8, **SHAPE)
    flags = _spied(sched)
    assert sched.generate(LONG) == want
    pattern = ([True] * 4 + [False] * 8) * 3
    assert flags == pattern[:len(flags)] and len(flags) > 16  # window, off, probe, off, ...
    stats = sched.speculative_stats()
    assert stats["min_accepted_per_step"] == pytest.approx(0.4 * K) and stats["accepted_per_step_ewma"] < 1.2
    assert stats["spec_off_low_acceptance"] == flags.count(False) == stats["plain_steps"]
    assert stats["spec_steps"] == flags.count(True) and stats["probes"] >= 1

    # the same draft with the rule off (min_accepted_per_step=0) speculates throughout, still exact
    sched = SpeculativeScheduler(model, draft, spec_window=4, probe_every=8, min_accepted_per_step=0, **SHAPE)
    flags = _spied(sched)
    assert sched.generate(LONG) == want and all(flags)
    with pytest.raises(ValueError, match="spec_window must be >= 1"):
        SpeculativeScheduler(model, draft, spec_window=0, **SHAPE)


def test_a_draft_that_gets_good_is_used_again_after_a_probe_and_an_oracle_keeps_speculating(model, draft):
    want = Scheduler(model, **SHAPE).generate(LONG)
    good = oracle([want[r.request_id][0] for r in LONG], [None, None])
    draft.fn = good
    sched = SpeculativeScheduler(model, draft, spec_window=4, probe_every=8, **SHAPE)
    flags = _spied(sched)
    assert sched.generate(LONG) == want and all(flags) and len(flags) > 4
    assert sched.speculative_stats()["accepted_per_step_ewma"] > 1.2

    def improve(s):  # random until the rule switches speculation off, then the oracle
        if s.gate.off:
            draft.fn = good

    draft.fn = _random_draft
    sched = SpeculativeScheduler(model, draft, spec_window=4, probe_every=8, **SHAPE)
    flags = _spied(sched, improve)
    assert sched.generate(LONG) == want
    assert flags[:12] == [True] * 4 + [False] * 8 and all(flags[12:]) and len(flags) > 16
    stats = sched.speculative_stats()
    assert stats["probes"] == 1 and not stats["off_low_acceptance"] and stats["accepted_per_step_ewma"] > 1.2


def test_break_even_accepted_is_the_step_time_ratio_less_one():
    assert break_even_accepted(0.004, 0.007) == pytest.approx(0.75)
    assert break_even_accepted(0.0043, 0.021) == pytest.approx(0.021 / 0.0043 - 1)  # > K: never pays
    assert break_even_accepted(0.008, 0.007, decode_steps=2) == pytest.approx(0.75)  # a plain call of 2 steps
    assert break_even_accepted(0.004, 0.003) == 0.0  # speculation never slower: never switched off
    with pytest.raises(ValueError, match="step times must be > 0"):
        break_even_accepted(0.0, 0.001)


def _timed(sched, plain_s: float, spec_s: float) -> None:
    """A fake clock: each plain decode step takes `plain_s`, each speculative one `spec_s`."""
    clock, step = [0.0], sched._decode_step

    def timed_step():
        speculative = sched.speculating
        out = step()
        clock[0] += spec_s if speculative else plain_s
        return out

    sched._decode_step, sched._clock = timed_step, lambda: clock[0]


@pytest.mark.parametrize("spec_s, pays", [(0.004, True),  # the other side of the break-even: slow suite
                                          pytest.param(0.010, False, marks=pytest.mark.slow)])
def test_calibrate_sets_the_measured_break_even_and_speculation_runs_only_where_it_pays(model, draft, spec_s,
                                                                                        pays):
    want = Scheduler(model, **SHAPE).generate(LONG)
    draft.fn = oracle([want[r.request_id][0] for r in LONG], [None, None])  # accepts all K: 3 > any break-even < 3
    sched = SpeculativeScheduler(model, draft, spec_window=4, probe_every=8, **SHAPE)
    _timed(sched, 0.002, spec_s)
    cal = sched.calibrate(steps=3)
    assert cal == {"plain_step_ms": 2.0, "spec_step_ms": spec_s * 1e3, "break_even": round(spec_s / 0.002 - 1, 3),
                   "min_accepted_per_step": pytest.approx(spec_s / 0.002 - 1), "source": "measured"}
    stats = sched.speculative_stats()
    assert not sched.has_work and stats["verify_steps"] == stats["spec_steps"] == stats["plain_steps"] == 0
    assert stats["pays"] is pays and stats["break_even_source"] == "measured"
    flags = _spied(sched)
    assert sched.generate(LONG) == want and flags and all(f is pays for f in flags)

    # a given break-even is kept (the measurement is still reported)
    sched = SpeculativeScheduler(model, draft, min_accepted_per_step=0.5, **SHAPE)
    _timed(sched, 0.002, spec_s)
    assert sched.calibrate(steps=2)["min_accepted_per_step"] == 0.5 and sched.break_even_source == "given"
    with pytest.raises(ValueError, match="steps must be >= 1"):
        sched.calibrate(steps=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_mtp_and_eagle3_drafts_in_the_scheduler_equal_plain_on_k3_layout(kind):
    """Drafts with per-slot state (gathered / scattered on admission) and, for EAGLE-3, the target's AttnRes block
    features, on the K3 layout (`tiny`: AttnRes blocks, scanned units)."""
    model = tiny_model("tiny")
    want = Scheduler(model, **SHAPE).generate(_requests(), ARRIVALS)
    if kind == "mtp":
        draft = MTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), 2)
    else:
        draft = Eagle3Draft(Eagle3Layer(model.cfg, rngs=nnx.Rngs(1)), 2)
    sched = SpeculativeScheduler(model, draft, **SHAPE)
    assert sched.generate(_requests(), ARRIVALS) == want
    assert sched.speculative_stats()["verify_steps"] > 0


def test_server_with_speculation_answers_like_plain_and_reports_acceptance(model, plain, draft, tokenizer):
    sched_plain, _ = plain
    eos = [model.cfg.eos_token_id]
    want = sched_plain.generate([Request(i, p, m, eos_ids=eos) for i, (p, m) in enumerate(zip(PROMPTS,
                                                                                              MAX_TOKENS))])
    draft.fn = oracle([want[i][0] for i in range(len(PROMPTS))], [None, 0, 1, 2, None])
    sched = SpeculativeScheduler(model, draft, draft_name="oracle", **SHAPE)

    async def go():
        async with serving(sched, tokenizer, max_queue=8) as (server, client, logs, _):
            results = await asyncio.gather(*[
                post(client, "/v1/completions", {"prompt": p, "max_tokens": m, "temperature": 0})
                for p, m in zip(PROMPTS, MAX_TOKENS)])
            async with client.get("/health") as r:
                return results, await r.json()

    results, health = asyncio.run(go())
    for i, (status, body) in enumerate(results):
        assert status == 200
        assert body["choices"][0]["text"] == tokenizer.decode(want[i][0])
        assert body["usage"]["completion_tokens"] == len(want[i][0])
    spec = health["speculative"]
    assert spec["draft"] == "oracle" and spec["num_draft_tokens"] == K and spec["max_spec_batch"] == 32
    assert 0 < spec["accepted"] < spec["drafted"] == K * spec["verify_steps"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted"] / spec["verify_steps"])


@pytest.mark.slow  # ~15 s of serve.py subprocesses; serve.py's flag checking runs by default in tests/test_server.py
def test_serve_cli_speculative_flag_errors(model):
    with pytest.raises(ValueError, match="unknown draft kind 'medusa'"):
        make_draft("medusa", 2, model, None, print)
    with pytest.raises(ValueError, match="needs --draft=PATH"):
        make_draft("eagle3", 2, model, None, print)
    for flags, msg in ((["--speculative=mtp", "--num_draft_tokens=0"], "--num_draft_tokens must be >= 1"),
                       (["--draft=/nonexistent"], "--draft needs --speculative"),
                       (["--speculative=eagle3"], "--speculative=eagle3 needs --draft=PATH")):
        r = subprocess.run([sys.executable, "serve.py", "--config=tiny", "--port=8000", *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


@pytest.mark.slow
def test_serve_cli_speculative_mtp_serves_and_reports():
    """`python serve.py --speculative=mtp` end to end: warm-up compiles the speculative and plain steps, /health
    carries the counters after a completion, SIGTERM exits 0."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "serve.py", f"--config={NAME}", f"--port={port}", "--slots=2",
                             "--max_len=64", "--prefix_block=0", "--warm_up=shortest", "--speculative=mtp",
                             "--num_draft_tokens=2", "--speculative_max_batch=4", "--speculative_min_accepted=0"],
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async def go():
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
                for _ in range(2400):
                    try:
                        async with client.get("/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.25)
                done = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "temperature": 0})
                async with client.get("/health") as r:
                    return done, await r.json()

        (status, body), health = asyncio.run(go())
        assert status == 200 and body["usage"]["completion_tokens"] <= 6
        spec = health["speculative"]
        assert (spec["draft"], spec["num_draft_tokens"], spec["max_spec_batch"]) == ("mtp", 2, 4)
        assert spec["verify_steps"] > 0 and spec["drafted"] == 2 * spec["verify_steps"] and spec["plain_steps"] == 0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "MTP draft is RANDOMLY INITIALISED" in err and "plain greedy decode step (speculation off)" in err
    assert "speculation calibrated" in err and "(given break-even" in err
