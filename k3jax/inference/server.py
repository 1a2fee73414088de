"""OpenAI-compatible HTTP server (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health.

The model runs in one engine thread (`EngineLoop` driving a continuous-batching `Scheduler`); handlers validate,
enqueue and await that request's token events. At most `num_slots + max_queue` generations are in flight (running
or waiting for a slot; a request with `n` choices counts n); more get 503. Streaming (`"stream": true`) sends
Server-Sent Events: `data: {chunk}` lines (each choice's with its index) and a final `data: [DONE]`.
Errors are OpenAI-style JSON `{"error": {"message", "type", "param", "code"}}` with 400 (bad JSON, unknown fields,
wrong types, bad sampling parameters, prompt + max_tokens beyond the context), 404 (unknown route or model), 405,
413 (body too large), 503 (queue full, shutting down); access control (`ServerOptions.access`,
k3jax/inference/access.py) answers 401 (API key), 403 (Origin), 415 (Content-Type) and 421 (Host) before any route.
`/health` reports the state (status: "ok", or 503 with "warming up" while the engine compiles at start-up,
"draining", "engine stopped"; in-flight generations, capacity, slots, max_len, the MLA page pool
`pages: {size, total, free}`, and `prefix_cache`: `{enabled: false}` or `PrefixCache.stats()`: block, long_block,
long_threshold, entries, capacity, bytes_used, bytes_limit, hits, misses, tokens_saved); with speculative decoding
`speculative`: draft, num_draft_tokens, max_spec_batch, speculating (whether the next step would), verify_steps,
drafted, accepted, acceptance_rate, mean_accepted_length (tokens per verification), spec_steps, plain_steps and
the acceptance rule's min_accepted_per_step, accepted_per_step_ewma, off_low_acceptance, spec_off_low_acceptance,
probes).
A request whose client closes the connection (streaming or not; found within `DISCONNECT_POLL_S` while it waits
for tokens) is cancelled in the engine at once: its queue entry, slot and pages are freed; the log line says 499.
Shutdown (SIGINT / SIGTERM under `run_server`, or `cleanup()` of a `K3Runner`): drain first, while every
connection is still read: in-flight requests finish for up to `shutdown_grace_s`, and any request that arrives
meanwhile (a new or a kept-alive connection) is answered 503 at once; every response from then on carries
`Connection: close`. Then the rest are cancelled (streams end with finish_reason "cancelled") and the engine stops.
(A plain `web.AppRunner` stops reading kept-alive connections before the app's shutdown hook runs: a request
sent on one then would wait out the grace period and get no answer.)
A body that is not valid JSON, nests too deeply, holds an integer of more digits than Python converts or a string
with a lone surrogate (not UTF-8) gets 400 "invalid_json".
Log-probabilities (`logprobs`, `top_logprobs`; see `openai_api`) come from the engine's events.
Images in chat content (`image_url` parts, data URLs only; `openai_api`, `images`) are decoded in a worker thread
and need a scheduler with a vision tower (`Scheduler.attach_vision`); otherwise 400 "this model has no vision tower".
One log line per request: peer, route, status, id, token counts, finish reason, time to first token, total time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import signal
import sys
import time
import traceback
import uuid
from typing import Callable

import jax
from aiohttp import web

from k3jax.inference import openai_api as api
from k3jax.inference.access import PREFLIGHT_HEADERS, AccessPolicy, cors_headers
from k3jax.inference.chat import ChatTemplate
from k3jax.inference.engine_loop import EngineLoop
from k3jax.inference.images import ImageInput, load_image_url
from k3jax.inference.scheduler import FINISH_CANCELLED, Request, TokenEvent
from sharding.mesh import describe

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.1  # while a request waits for its next token, how often its connection is checked


class ClientGone(ConnectionError):
    """The client closed its connection before the answer was complete."""


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    model_name: str = "k3jax"
    max_queue: int = 64  # requests waiting for a slot beyond the running ones
    default_max_tokens: int = 256  # chat requests without max_tokens: min(this, the rest of the context)
    shutdown_grace_s: float = 10.0
    access: AccessPolicy = AccessPolicy()  # API key, allowed hosts and origins (k3jax/inference/access.py)


class _Track:
    """Per-request bookkeeping for the log line."""

    def __init__(self, request: web.Request):
        self.t0 = time.monotonic()
        self.peer = request.remote or "-"
        self.route = f"{request.method} {request.path}"
        self.rid = "-"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish = "-"
        self.first_token_s: float | None = None
        self.stream = False


class _Choice:
    """One choice of a request: its engine request id, text so far and how it ended (None while it runs)."""

    def __init__(self, rid: str, index: int, tokenizer, stop: list[str]):
        self.rid, self.index = rid, index
        self.text = api.TextAssembler(tokenizer, stop)
        self.finish: str | None = None
        self.engine_done = False  # the engine sent its final event (nothing left to cancel)
        self.logprobs: list[api.LogprobEntry] = []  # tokens' log-probabilities not yet sent

    def take_logprobs(self, final: bool) -> list[api.LogprobEntry]:
        """The pending entries whose text has been sent (all of the text when `final`); a stop string's tokens are
        dropped with their text."""
        end = len(self.text.text) if self.text.stopped else self.text.sent if not final else None
        out = [e for e in self.logprobs if end is None or e.offset < end]
        self.logprobs = [] if final else self.logprobs[len(out):]
        return out


@dataclasses.dataclass
class _Run:
    """A request being answered: its choices by engine request id, and what the response needs."""

    http: web.Request
    track: _Track
    parsed: api.ParsedRequest
    rid: str
    created: int
    events: asyncio.Queue
    choices: dict[str, _Choice]
    chat: bool
    echo: str

    @property
    def ordered(self) -> list[_Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices.values())

    @property
    def finish_summary(self) -> str:
        return ",".join(c.finish or "-" for c in self.ordered)


class K3Server:
    """Holds the engine loop, tokenizer and chat template; `app` is the aiohttp application."""

    def __init__(self, engine: EngineLoop, tokenizer, chat_template: ChatTemplate, options: ServerOptions,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.cfg = self.scheduler.cfg
        self.tokenizer = tokenizer
        self.chat = chat_template
        self.options = options
        self.log = log
        self.in_flight = 0
        self.draining = False
        self.capacity = self.scheduler.num_slots + options.max_queue
        app = web.Application(middlewares=[self._errors, self._access], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_response_prepare.append(self._add_cors)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        self.app = app

    # ------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.alive and self.engine.ready.is_set() and not self.draining
        status = "ok" if ok else ("draining" if self.draining else "engine stopped" if not self.engine.alive
                                  else "warming up")
        body = {"status": status,
                "in_flight": self.in_flight, "capacity": self.capacity, "slots": self.scheduler.num_slots,
                "max_len": self.scheduler.max_len,
                "pages": {"size": self.scheduler.page_size, "total": self.scheduler.num_pages,
                          "free": self.scheduler.num_free_pages}}
        pc = self.scheduler.prefix_cache
        body["prefix_cache"] = pc.stats() if pc is not None else {"enabled": False}
        spec = self.scheduler.speculative_stats()
        if spec is not None:
            body["speculative"] = spec
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": 0, "owned_by": "k3jax",
            "max_model_len": self.scheduler.max_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        track = _Track(request)
        try:
            parsed = api.parse_completion(await self._json(request))
            self._check_model(parsed.model)
            if isinstance(parsed.prompt, str):
                ids = self.tokenizer.encode(parsed.prompt, add_bos=True)
            else:
                ids = parsed.prompt
            echo = "" if not parsed.echo else parsed.prompt if isinstance(parsed.prompt, str) else \
                self.tokenizer.decode(ids)
            return await self._generate(request, track, parsed, ids, parsed.max_tokens, (), chat=False, echo=echo)
        except api.ApiError as e:
            return self._error(track, e)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        track = _Track(request)
        try:
            parsed = api.parse_chat(await self._json(request))
            self._check_model(parsed.model)
            images = await self._images(api.image_parts(parsed.messages))
            try:
                ids = self.chat.encode(parsed.messages, [[self.scheduler.images.placeholder_id] * im.num_tokens
                                                         for im in images])
            except ValueError as e:  # the chat template rejected the conversation
                raise api.ApiError(400, f"chat template: {e}", "messages") from None
            max_tokens = parsed.max_tokens
            if max_tokens is None:
                max_tokens = max(1, min(self.options.default_max_tokens, self.scheduler.max_len - len(ids) + 1))
            return await self._generate(request, track, parsed, ids, max_tokens, self.chat.stop_ids, chat=True,
                                        images=images)
        except api.ApiError as e:
            return self._error(track, e)

    # ------------------------------------------------------------------ generation

    async def _generate(self, http: web.Request, track: _Track, parsed: api.ParsedRequest, ids: list[int],
                        max_tokens: int, extra_eos: tuple[int, ...], chat: bool, echo: str = "",
                        images: tuple = ()) -> web.StreamResponse:
        """Runs `parsed.n` choices of the prompt `ids` (one engine request each) and answers with all of them."""
        n = parsed.n
        track.prompt_tokens, track.stream = len(ids), parsed.stream
        if self.draining:
            raise api.ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")
        if not self.engine.alive:
            raise api.ApiError(503, "the engine is not running", None, "engine_stopped", "server_error")
        if self.in_flight + n > self.capacity:
            raise api.ApiError(503, f"the request queue is full ({self.in_flight} of {self.capacity} generations in "
                               "flight); retry later", None, "queue_full", "server_error")
        keys = [None] * n
        if parsed.sampling.temperature > 0:
            key = seed_key(parsed.seed if parsed.seed is not None else secrets.randbits(64))
            keys = [key] + [jax.random.fold_in(key, i) for i in range(1, n)]
        eos = ([] if self.cfg.eos_token_id is None else [int(self.cfg.eos_token_id)]) + list(extra_eos)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        track.rid = rid
        try:
            req = self.scheduler.validate(Request(rid, ids, max_tokens, parsed.sampling, keys[0], eos,
                                                  logprobs=parsed.logprobs, images=images))
        except ValueError as e:
            code = "context_length_exceeded" if "maximum length" in str(e) else "invalid_value"
            raise api.ApiError(400, str(e), "messages" if chat else "prompt", code) from None
        choices = [_Choice(rid if n == 1 else f"{rid}-{i}", i, self.tokenizer, parsed.stop) for i in range(n)]

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(item):
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        self.in_flight += n
        try:
            for c in choices:
                self.engine.submit(dataclasses.replace(req, request_id=c.rid, key=keys[c.index]), on_event)
            run = _Run(http, track, parsed, rid, int(time.time()), events, {c.rid: c for c in choices}, chat, echo)
            return await (self._stream(run) if parsed.stream else self._collect(run))
        finally:
            self.in_flight -= n
            for c in choices:
                if not c.engine_done:  # stopped by a stop string, the client left, or an error: free its slot
                    self.engine.cancel(c.rid)

    async def _next(self, http: web.Request, events: asyncio.Queue) -> TokenEvent:
        """The request's next event; raises ClientGone as soon as its connection is closed (aiohttp does not cancel
        handlers on disconnect), so the caller cancels it in the engine instead of generating for nobody."""
        while events.empty():
            try:
                item = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                break
            except asyncio.TimeoutError:
                if http.transport is None or http.transport.is_closing():
                    raise ClientGone("the client closed the connection") from None
        else:
            item = events.get_nowait()
        if isinstance(item, Exception):
            raise item
        return item

    async def _advance(self, run: _Run) -> tuple[_Choice, str]:
        """Waits for the next event of a running choice and applies it: (that choice, its new text)."""
        while True:
            ev = await self._next(run.http, run.events)
            choice = run.choices[ev.request_id]
            if ev.finish_reason:
                choice.engine_done = True
            if choice.finish is not None:  # already ended by a stop string: later tokens are dropped
                continue
            delta = ""
            if ev.token is not None:
                if run.track.first_token_s is None:
                    run.track.first_token_s = time.monotonic() - run.track.t0
                run.track.completion_tokens += 1
                delta = choice.text.add(ev.token)
                if ev.logprob is not None:
                    choice.logprobs.append(api.LogprobEntry(choice.text.offsets[-1], ev.token, ev.logprob,
                                                            ev.top_logprobs or ()))
                if choice.text.stopped:
                    choice.finish = "stop"
                    if not choice.engine_done:
                        self.engine.cancel(choice.rid)  # free its slot now, the other choices go on
            if ev.finish_reason and choice.finish is None:
                if ev.finish_reason != FINISH_CANCELLED:
                    delta += choice.text.finish()
                choice.finish = "stop" if choice.text.stopped else ev.finish_reason
            return choice, delta

    async def _collect(self, run: _Run) -> web.Response:
        track = run.track
        while not run.done:
            try:
                choice, _ = await self._advance(run)
            except ClientGone:
                track.finish = "client_disconnected"
                self._log(track, 499)
                return web.Response(status=499)  # nobody reads it; cancelled in _generate's finally
            except ValueError as e:
                return self._error(track, api.ApiError(400, str(e), None))
            except RuntimeError as e:
                return self._error(track, api.ApiError(500, str(e), None, "engine_error", "server_error"))
            if choice.finish == FINISH_CANCELLED:
                track.finish = FINISH_CANCELLED
                return self._error(track, api.ApiError(503, "the request was cancelled (server shutting down)",
                                                       None, "cancelled", "server_error"))
        track.finish = run.finish_summary
        use = api.usage(track.prompt_tokens, track.completion_tokens)
        texts = [(run.echo + c.text.text, c.finish, self._logprobs(run, c.take_logprobs(final=True)))
                 for c in run.ordered]
        body = (api.chat_body if run.chat else api.completion_body)(run.rid, run.created, self.options.model_name,
                                                                    texts, use)
        self._log(track, 200)
        return web.json_response(body)

    async def _stream(self, run: _Run) -> web.StreamResponse:
        track, chat, model = run.track, run.chat, self.options.model_name
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(run.http)

        def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False,
                  logprobs: dict | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                return api.chat_chunk(run.rid, run.created, model, delta, finish, index, logprobs)
            return api.completion_chunk(run.rid, run.created, model, text or "", finish, index, logprobs)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        status = 200
        try:
            for c in run.ordered:
                if chat:
                    await send(chunk(c.index, None, role=True))
                elif run.echo:
                    await send(chunk(c.index, run.echo))
            while not run.done:
                try:
                    choice, delta = await self._advance(run)
                except ClientGone:
                    raise
                except Exception as e:  # engine failure mid-stream: an error event, then [DONE]
                    await send(api.ApiError(500, str(e), None, "engine_error", "server_error").body())
                    track.finish = "error"
                    break
                entries = choice.take_logprobs(final=choice.finish is not None)
                if delta or entries:
                    await send(chunk(choice.index, delta, logprobs=self._logprobs(run, entries)))
                if choice.finish is not None:
                    await send(chunk(choice.index, None if chat else "", choice.finish))
            if track.finish != "error":
                track.finish = run.finish_summary
            if run.parsed.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                await send(api.usage_chunk(run.rid, run.created, model, obj,
                                           api.usage(track.prompt_tokens, track.completion_tokens)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            status, track.finish = 499, "client_disconnected"  # the client went away: cancelled in finally
        self._log(track, status)
        return resp

    # ------------------------------------------------------------------ helpers

    async def _images(self, parts: list[api.ImagePart]) -> tuple[ImageInput, ...]:
        """The request's images decoded and preprocessed for the served vision tower (in a worker thread: the
        event loop keeps streaming); 400 for a text-only model or an image that does not decode."""
        if not parts:
            return ()
        if self.scheduler.images is None:
            raise api.ApiError(400, "this model has no vision tower", "messages", "unsupported_value")
        cfg = self.scheduler.images.cfg
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: tuple(load_image_url(p.url, cfg) for p in parts))
        except ValueError as e:
            raise api.ApiError(400, str(e), "messages", "invalid_image") from None

    def _logprobs(self, run: _Run, entries: list[api.LogprobEntry]) -> dict | None:
        """The response's logprobs object for `entries` (None when the request did not ask for them)."""
        if run.parsed.logprobs is None:
            return None
        def decode(token: int) -> str:
            return self.tokenizer.decode([token])

        return (api.chat_logprobs if run.chat else api.completion_logprobs)(entries, decode)

    async def _json(self, request: web.Request):
        """The parsed body; 400 for anything json.loads or UTF-8 refuse: bad syntax or bytes, nesting past the
        recursion limit, integers of more than sys.get_int_max_str_digits() digits, lone surrogates (\\ud800)."""
        raw = await request.read()
        try:
            body = json.loads(raw)
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # a lone surrogate cannot be encoded
            return body
        except RecursionError:
            raise api.ApiError(400, "the request body is not valid JSON (nested too deeply)", None,
                               "invalid_json") from None
        except (ValueError, UnicodeError) as e:  # JSONDecodeError, int digit limit, surrogates
            raise api.ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.model_name:
            raise api.ApiError(404, f"model {model!r} is not served here (serving {self.options.model_name!r})",
                               "model", "model_not_found")

    def _error(self, track: _Track, e: api.ApiError) -> web.Response:
        self._log(track, e.status, e.message)
        headers = {503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(e.status)
        return web.json_response(e.body(), status=e.status, headers=headers)

    @web.middleware
    async def _access(self, request: web.Request, handler):
        """`AccessPolicy.check` before every route; CORS preflights of allowed origins answered here."""
        policy = self.options.access
        err = policy.check(request)
        if err is not None:
            return self._error(_Track(request), err)
        if request.method == "OPTIONS" and "Origin" in request.headers:
            return web.Response(status=204, headers=PREFLIGHT_HEADERS)
        return await handler(request)

    async def _add_cors(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(cors_headers(self.options.access, request))
        if self.draining:
            response.force_close()  # the connection closes after this response (headers may be prepared already)
            response.headers["Connection"] = "close"

    def _log(self, track: _Track, status: int, error: str | None = None) -> None:
        ttft = "-" if track.first_token_s is None else f"{track.first_token_s * 1e3:.0f}ms"
        line = (f'{track.peer} "{track.route}" {status} id={track.rid} prompt_tokens={track.prompt_tokens} '
                f"completion_tokens={track.completion_tokens} finish={track.finish} stream={track.stream} "
                f"ttft={ttft} total={(time.monotonic() - track.t0) * 1e3:.0f}ms")
        self.log(line + (f" error={error!r}" if error else ""))

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:  # 404 / 405 / 413 from aiohttp itself, as JSON
            if e.status < 400:
                raise
            track = _Track(request)
            return self._error(track, api.ApiError(e.status, e.reason, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log(f"internal error on {request.path}: {e!r}\n{traceback.format_exc()}")
            return web.json_response(api.ApiError(500, "internal server error", None, None, "server_error").body(),
                                     status=500)

    # ------------------------------------------------------------------ lifecycle

    async def _on_shutdown(self, app) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Stops taking requests (503), waits up to shutdown_grace_s for those in flight, cancels the rest.
        Idempotent (a second call finds nothing in flight)."""
        self.draining = True
        deadline = time.monotonic() + self.options.shutdown_grace_s
        if self.in_flight:
            self.log(f"shutting down: waiting up to {self.options.shutdown_grace_s:.0f}s for {self.in_flight} "
                     "request(s)")
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            self.log(f"shutting down: cancelling {self.in_flight} request(s)")
            self.engine.cancel_all()
            deadline = time.monotonic() + 5.0
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    async def _on_cleanup(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        self.log("engine stopped")


def seed_key(seed: int) -> jax.Array:
    """A PRNG key for any integer seed (all 64 bits count: jax.random.key alone keeps only the low 32 here)."""
    seed &= (1 << 64) - 1
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32)


class K3Runner(web.AppRunner):
    """An AppRunner whose `cleanup` drains the server (`K3Server.drain`) before aiohttp stops reading connections,
    so that requests arriving during the grace period get their 503 at once."""

    def __init__(self, server: K3Server, **kwargs):
        super().__init__(server.app, **kwargs)
        self.k3 = server

    async def cleanup(self) -> None:
        if self.server is not None:
            await self.k3.drain()
        await super().cleanup()


async def _serve(server: K3Server, host: str, port: int) -> None:
    runner = K3Runner(server, access_log=None, shutdown_timeout=server.options.shutdown_grace_s + 10)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def run_server(server: K3Server, host: str, port: int) -> None:
    """Serves until SIGINT / SIGTERM, then shuts down gracefully (see the module docstring)."""
    server.engine.start()
    sched = server.scheduler
    pc = sched.prefix_cache
    prefix = "off" if pc is None else (
        f"{pc.block}-token blocks" + (f" (every {pc.long_block} past {pc.threshold})" if pc.long_block else "")
        + (f" in {pc.max_bytes / 2**30:.2f} GiB" if pc.max_bytes else ""))
    devices = "one device" if getattr(sched, "mesh", None) is None else f"mesh {describe(sched.mesh)}"
    warming = "" if server.engine.ready.is_set() else "; warming up: /health says ok when done"
    server.log(f"serving {server.options.model_name!r} on http://{host}:{port} ({sched.num_slots} slots x "
               f"{sched.max_len} tokens, {sched.num_pages} latent pages of {sched.page_size} tokens, queue "
               f"{server.options.max_queue}, prefix cache {prefix}, chat template: "
               f"{server.chat.name}, {devices}{warming})")
    asyncio.run(_serve(server, host, port))
    server.log("server stopped")
