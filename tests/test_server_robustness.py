"""The server frees the work of clients that leave (non-streaming too: slot, pages and queue entry at once), also under
a load of mixed normal and disconnecting clients; it compiles every program at start-up (warm-up) and says "ok" on
/health only afterwards. Loopback only, tiny model, bounded requests and timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from k3jax.inference.chat import load_chat_template
from k3jax.inference.engine_loop import EngineLoop
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.server import K3Server, ServerOptions
from k3jax.inference.slot_steps import TRACE_COUNTS
from k3jax.inference.warmup import prompt_lengths, warm_up
from tests.test_inference_cache import tiny_model
from tests.test_server import NAME, P2, TIMEOUT, post, serving

LONG = {"prompt": P2, "max_tokens": 38, "temperature": 0}  # 26 + 38 - 1 = 63 positions of the 64


@pytest.fixture(scope="module")
def scheduler():
    """Every program compiled up front (`warm_up`, as the server does): the timing bounds below must not depend on
    which test ran first (a disconnect right after admission otherwise waits for a first decode step's or prompt
    bucket's compile, ~2 s on 2 cores)."""
    s = Scheduler(tiny_model(NAME), num_slots=2, max_len=64)
    warm_up(s, lambda msg: None)
    return s


@contextlib.contextmanager
def slow_steps(scheduler, seconds: float):
    """Every engine step takes at least `seconds` (a generation long enough to leave in the middle of)."""
    step = scheduler.step

    def slow():
        time.sleep(seconds)
        return step()

    scheduler.step = slow
    try:
        yield
    finally:
        del scheduler.step


async def wait_until(cond, timeout: float) -> float | None:
    """Seconds until cond() held (polled every 10 ms), None if it did not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(0.01)
    return None


async def raw_request(port: int, body: dict):
    """A POST on a plain socket (the test closes it whenever it likes); returns the writer."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    return writer


def idle(server) -> bool:
    s = server.scheduler
    return server.in_flight == 0 and not s.has_work and s.num_free_pages == s.num_pages


def test_greedy_long_request_runs_to_its_length(scheduler, tokenizer):
    """The disconnect tests below rely on LONG generating all its tokens (no early EOS)."""
    toks, finish = scheduler.generate([Request("r", tokenizer.encode(P2), LONG["max_tokens"])])["r"]
    assert finish == "length" and len(toks) == LONG["max_tokens"]


def test_non_streaming_client_that_disconnects_frees_its_slot_pages_and_queue_entry(scheduler, tokenizer):
    async def go():
        async with serving(scheduler, tokenizer) as (server, client, logs, runner):
            port = runner.addresses[0][1]
            engine = server.engine
            with slow_steps(scheduler, 0.05):
                writer = await raw_request(port, LONG)
                assert await wait_until(lambda: scheduler.num_running == 1, 30) is not None
                engine.pause()  # the request holds its slot and pages; only a cancel can free them now
                writer.close()
                slot_freed = await wait_until(lambda: scheduler.num_running == 0 and idle(server), 3)

                writer = await raw_request(port, LONG)  # still paused: it waits in the queue
                assert await wait_until(lambda: scheduler.num_waiting == 1, 30) is not None
                writer.close()
                queue_freed = await wait_until(lambda: idle(server), 3)
                engine.resume()
                status, body = await post(client, "/v1/completions", {**LONG, "max_tokens": 3})
            return slot_freed, queue_freed, status, logs

    slot_freed, queue_freed, status, logs = asyncio.run(go())
    assert slot_freed is not None and slot_freed < 1.0, slot_freed
    assert queue_freed is not None and queue_freed < 1.0, queue_freed
    assert status == 200
    assert sum(" 499 " in m and "finish=client_disconnected stream=False" in m for m in logs) == 2


def test_client_timeouts_with_two_retries_leave_no_generation_running(scheduler, tokenizer):
    """As the `openai` client does with timeout=0.5 and max_retries=2: three attempts, each abandoned."""
    async def go():
        async with serving(scheduler, tokenizer) as (server, client, logs, _):
            with slow_steps(scheduler, 0.1):  # one attempt would generate for ~4 s
                attempts = 0
                for _ in range(3):
                    attempts += 1
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with client.post("/v1/completions", json=LONG,
                                               timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                            await r.read()
                        break
                freed = await wait_until(lambda: idle(server), 1.0)
            return attempts, freed

    attempts, freed = asyncio.run(go())
    assert attempts == 3
    assert freed is not None, "abandoned attempts were still generating 1 s after the last timeout"


def test_mixed_load_with_disconnecting_clients_leaks_no_slot(scheduler, tokenizer):
    """12 clients (half streaming) send long requests and leave at random times: within 1 s of the last one leaving
    every slot, page and queue entry is free. Then 12 patient and 12 more leaving clients at once: the patient ones
    get the scheduler's own greedy output, and afterwards nothing is held."""
    want = tokenizer.decode(scheduler.generate([Request("r", tokenizer.encode(P2), 6)])["r"][0])
    rng = random.Random(0)

    async def patient(client):
        return await post(client, "/v1/completions", {**LONG, "max_tokens": 6})

    async def leaving(port, stream: bool):
        writer = await raw_request(port, {**LONG, "stream": stream})
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        writer.close()

    async def go():
        async with serving(scheduler, tokenizer, max_queue=32) as (server, client, logs, runner):
            port = runner.addresses[0][1]
            with slow_steps(scheduler, 0.02):  # all 12 leavers' tokens would take ~5 s on the 2 slots
                await asyncio.wait_for(asyncio.gather(*[leaving(port, i % 2 == 0) for i in range(12)]), 60)
                freed_after_leaving = await wait_until(lambda: idle(server), 1.0)
                jobs = [patient(client) if i % 2 else leaving(port, stream=i % 4 == 0) for i in range(24)]
                results = await asyncio.wait_for(asyncio.gather(*jobs), 120)
                freed_at_end = await wait_until(lambda: idle(server), 2.0)
            return freed_after_leaving, [r for r in results if r is not None], freed_at_end

    freed_after_leaving, answers, freed_at_end = asyncio.run(go())
    assert freed_after_leaving is not None, "abandoned requests still held slots, pages or queue entries after 1 s"
    assert len(answers) == 12 and all(st == 200 and b["choices"][0]["text"] == want for st, b in answers)
    assert freed_at_end is not None, "slots, pages or queue entries still held after the mixed load"


def test_health_says_warming_up_until_the_engine_has_compiled_and_early_requests_wait(scheduler, tokenizer):
    release = threading.Event()
    logs: list[str] = []

    async def go():
        engine = EngineLoop(scheduler, logs.append, warm_up=lambda: release.wait(60)).start()
        server = K3Server(engine, tokenizer, load_chat_template(tokenizer, None), ServerOptions(model_name="tiny"),
                          log=logs.append)
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout=TIMEOUT) as c:
                async with c.get("/health") as r:
                    before = r.status, (await r.json())["status"]
                early = asyncio.create_task(post(c, "/v1/completions", {**LONG, "max_tokens": 3}))
                await asyncio.sleep(0.3)
                waited = not early.done()
                release.set()
                answer = await asyncio.wait_for(early, 60)
                async with c.get("/health") as r:
                    after = r.status, (await r.json())["status"]
            return before, waited, answer[0], after
        finally:
            release.set()
            await runner.cleanup()

    before, waited, status, after = asyncio.run(go())
    assert before == (503, "warming up") and waited and status == 200 and after == (200, "ok")


def test_after_warm_up_no_prompt_length_or_sampling_compiles(scheduler, tokenizer):
    """Prompts in every prefill bucket (1, 17 and 40 tokens: buckets 16, 32, 64 of max_len 64), greedy and sampled,
    and one with logprobs, through the server after `warm_up`: no program is traced again."""
    logs: list[str] = []
    warm_up(scheduler, logs.append)
    assert prompt_lengths(scheduler) == [1, 17, 33]
    assert sum("warm-up" in m and "compiled" in m for m in logs) == 3 + 3 and "warm-up done" in logs[-1]
    traces = dict(TRACE_COUNTS)
    bodies = [{"prompt": [7] * n, "max_tokens": 3, "temperature": t, "seed": 1} for n in (1, 17, 40)
              for t in (0, 1.0)] + [{"prompt": [7] * 17, "max_tokens": 3, "temperature": 0, "logprobs": 2}]

    async def go():
        async with serving(scheduler, tokenizer) as (_, client, _, _):
            return [await post(client, "/v1/completions", b) for b in bodies]

    assert [st for st, _ in asyncio.run(go())] == [200] * len(bodies)
    assert dict(TRACE_COUNTS) == traces, "a request compiled a program after warm-up"
    quick: list[str] = []
    warm_up(scheduler, quick.append, every_bucket=False)  # serve.py --warm_up=shortest: 1 prefill + 3 decode steps
    assert [m.split(":")[0] for m in quick if "compiled" in m] == [f"warm-up {i}/4" for i in range(1, 5)]


async def read_response(reader) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body) of one HTTP/1.1 response with a Content-Length."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
    return int(lines[0].split()[1]), headers, await reader.readexactly(int(headers.get("content-length", 0)))


def test_request_on_a_kept_alive_connection_during_drain_gets_503_and_connection_close_at_once(scheduler,
                                                                                             tokenizer):
    """A long request keeps the server draining (grace 8 s); a request sent then on an idle kept-alive connection
    is answered 503 with Connection: close within a second (it used to wait out the grace period, unanswered)."""
    short = json.dumps({"prompt": "x", "max_tokens": 1, "temperature": 0}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(short), short))

    async def go():
        async with serving(scheduler, tokenizer, shutdown_grace_s=8) as (server, client, _, runner):
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            writer.write(raw)
            first = await read_response(reader)  # the connection stays open (keep-alive)
            with slow_steps(scheduler, 0.05):
                long = asyncio.create_task(post(client, "/v1/completions", LONG))
                assert await wait_until(lambda: server.scheduler.num_running, 20) is not None
                cleanup = asyncio.create_task(runner.cleanup())
                await wait_until(lambda: server.draining, 5)
                t0 = time.monotonic()
                writer.write(raw)
                try:
                    during = await asyncio.wait_for(read_response(reader), 3)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                    during = (repr(e), {}, b"")
                waited = time.monotonic() - t0
                await cleanup
                long_status, long_body = await long
            writer.close()
            return first, during, waited, (long_status, long_body)

    first, (status, headers, body), waited, long_status = asyncio.run(go())
    assert first[0] == 200 and first[1].get("connection", "keep-alive").lower() != "close"
    assert status == 503 and headers.get("connection", "").lower() == "close", (status, headers)
    assert json.loads(body)["error"]["code"] == "shutting_down" and waited < 1.0
    assert long_status[0] == 200, long_status  # the in-flight request finished within the grace period
