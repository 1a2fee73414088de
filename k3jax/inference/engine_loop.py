"""The engine thread: the one place the model runs. Other threads (the HTTP event loop) only submit and cancel.

    loop = EngineLoop(Scheduler(model, num_slots=8, max_len=2048), warm_up=compile_all).start()
    loop.ready.wait()                # set once warm_up (run first, on the engine thread) has returned
    loop.submit(request, on_event)   # on_event(TokenEvent) is called from the engine thread, once per token,
                                     # or on_event(exception) if the request was rejected or the step failed
    loop.cancel(request.request_id)
    loop.stop()                      # cancels what is left (final "cancelled" events) and joins the thread
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import Callable, Hashable

from k3jax.inference.scheduler import Request, Scheduler, TokenEvent

EventCallback = Callable[[TokenEvent | Exception], None]


class EngineLoop:
    """Runs `scheduler.step()` in a daemon thread while there is work; sleeps on its inbox when idle."""

    def __init__(self, scheduler: Scheduler, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
                 warm_up: Callable[[], None] | None = None):
        self.scheduler = scheduler
        self.log = log
        self._warm_up = warm_up
        self.ready = threading.Event()  # warm-up done; requests submitted before wait in the inbox
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[Hashable, EventCallback] = {}
        self._running = threading.Event()  # cleared = paused (tests use it to hold requests in the queue)
        self._running.set()
        self._thread = threading.Thread(target=self._main, name="k3jax-engine", daemon=True)
        self.steps = 0

    # ------------------------------------------------------------------ any thread

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request: Request, on_event: EventCallback) -> None:
        self._inbox.put(("add", request, on_event))

    def cancel(self, request_id: Hashable) -> None:
        self._inbox.put(("cancel", request_id, None))

    def cancel_all(self) -> None:
        self._inbox.put(("cancel_all", None, None))

    def pause(self) -> None:
        """Stops stepping (requests stay queued) until `resume`."""
        self._running.clear()
        self._inbox.put(("wake", None, None))

    def resume(self) -> None:
        self._running.set()
        self._inbox.put(("wake", None, None))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancels every request (their callbacks get "cancelled" events) and joins the thread."""
        self._running.set()
        self._inbox.put(("stop", None, None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        if self._warm_up is not None:
            try:
                self._warm_up()
            except Exception as e:  # the engine cannot serve: the thread ends (alive False, the server says 503)
                self.log(f"warm-up failed: {e!r}\n{traceback.format_exc()}")
                return
        self.ready.set()
        while True:
            idle = not self.scheduler.has_work or not self._running.is_set()
            cmds = [self._inbox.get()] if idle else []  # idle: sleep until a command arrives
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stopping = False
            for kind, arg, cb in cmds:
                if kind == "add":
                    try:
                        self.scheduler.add(arg)
                    except ValueError as e:
                        self._call(cb, e)
                    else:
                        self._callbacks[arg.request_id] = cb
                elif kind == "cancel":
                    self.scheduler.cancel(arg)
                elif kind == "cancel_all":
                    for rid in list(self._callbacks):
                        self.scheduler.cancel(rid)
                elif kind == "stop":
                    stopping = True
            if stopping:
                self._deliver(self.scheduler.reset())
                for rid, cb in list(self._callbacks.items()):  # anything the reset did not report
                    self._call(cb, TokenEvent(rid, None, 0, "cancelled"))
                self._callbacks.clear()
                return
            self._deliver(self.scheduler.drop_cancelled())  # prompt, even while paused
            if not self._running.is_set() or not self.scheduler.has_work:
                continue
            try:
                events = self.scheduler.step()
                self.steps += 1
            except Exception as e:  # a failed device step: fail what is in flight, keep serving
                self.log(f"engine step failed: {e!r}\n{traceback.format_exc()}")
                self.scheduler.reset()
                for cb in self._callbacks.values():
                    self._call(cb, RuntimeError(f"generation failed: {e!r}"))
                self._callbacks.clear()
                continue
            self._deliver(events)

    def _deliver(self, events) -> None:
        for ev in events:
            cb = self._callbacks.get(ev.request_id)
            if cb is None:
                continue
            if ev.finish_reason:
                del self._callbacks[ev.request_id]
            self._call(cb, ev)

    def _call(self, cb: EventCallback, item) -> None:
        try:
            cb(item)
        except Exception as e:  # a callback must never take the engine down
            self.log(f"event callback failed: {e!r}")
