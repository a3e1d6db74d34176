"""The engine loop: one thread owns the engine and the scheduler, so that steps never race with each other.
Requests and aborts come in through an inbox that is read between steps; each request's tokens go out through the
callback it was submitted with: a plain callable, called in the engine thread, or a `LoopSink` of an asyncio event
loop (the server's), to which each step's items go in one hand-over, made once the next step is queued on the
device (or the loop has nothing left to run), so that streaming them overlaps that step. If a step raises, the loop
stops for good: every request in flight gets the error, later submissions are refused, and `error` says what
happened."""

import asyncio
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TextIO

from pegainfer.errors import PegainferError, RequestError
from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.scheduler import Scheduler

Put = Callable[[TokenOutput | Exception], None]
IDLE_POLL_S = 0.0005  # a step with nothing runnable yet waits this long (or for a request) before the next try


@dataclass(frozen=True)
class LoopSink:
    """A sink that runs on an asyncio event loop. All of a step's items for one loop go over in one
    call_soon_threadsafe: one wake-up of the loop a step, not one (and a GIL hand-over) per request."""
    loop: asyncio.AbstractEventLoop
    put: Put


Sink = Put | LoopSink


def hand_over(deliveries: list[tuple[Sink, TokenOutput | Exception]]) -> None:
    """Calls plain sinks here; passes the items of loop sinks to their loops, one call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Put, TokenOutput | Exception]]] = {}
    for sink, item in deliveries:
        if isinstance(sink, LoopSink):
            by_loop.setdefault(sink.loop, []).append((sink.put, item))
        else:
            sink(item)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def _put_all(batch: list[tuple[Put, TokenOutput | Exception]]) -> None:
    for put, item in batch:
        put(item)


class EngineDead(PegainferError):
    """The engine failed; no request can be served any more."""


class EngineLoop:
    def __init__(self, scheduler: Scheduler, thread_init: Callable[[], None] | None = None,
                 trace: TextIO | None = None) -> None:
        """`thread_init` runs first in the engine thread: a GPU engine makes its CUDA context current there (a
        context is current per thread, and the engine was built in another one). `trace` gets a JSON line per
        step (what ran, the engine's time, the loop's own time around it), to tell a slow step from a slow loop."""
        self.scheduler = scheduler
        self._thread_init = thread_init
        self._trace = trace
        self._last_end = 0.0
        self.error: BaseException | None = None
        self._wake = threading.Condition()
        self._inbox: list[tuple] = []
        self._sinks: dict[str, Sink] = {}
        self._held: list[TokenOutput] = []  # the last step's tokens, handed over when the next step is launched
        self._stopping = False
        self._failure: BaseException | None = None  # fail()'s, raised in the engine thread
        self._thread = threading.Thread(target=self._run, name="pegainfer-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        """Queues a request; `sink` gets its TokenOutputs in order, or one exception (RequestError, EngineDead),
        in the engine thread, or on its event loop for a LoopSink."""
        with self._wake:
            if self.error is not None:
                raise self._dead()
            self._inbox.append(("add", request, sink))
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Runs `fn` in the engine thread between steps (what changes the scheduler's or engine's state from
        outside: loading a LoRA adapter); its result or exception comes back through the future."""
        future: Future = Future()
        with self._wake:
            if self.error is not None:
                raise self._dead()
            self._inbox.append(("call", fn, future))
            self._wake.notify()
        return future

    def fail(self, error: BaseException) -> None:
        """Stops the loop with `error`, from any thread (a worker rank that died between steps): the requests in
        flight get it, as if a step had raised it."""
        with self._wake:
            self._failure = error
            self._wake.notify()

    def _run(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            while True:
                with self._wake:
                    idle = not (self._inbox or self._stopping or self._failure or self.scheduler.has_work())
                if idle:
                    self._hand_over_held()  # no step will launch soon: the last step's tokens go now
                with self._wake:
                    while not (self._inbox or self._stopping or self._failure or self.scheduler.has_work()):
                        self._wake.wait()
                    if self._failure is not None:
                        raise self._failure
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                for item in inbox:
                    self._apply(item)
                began, last = time.monotonic(), self.scheduler.last_step
                outputs = self.scheduler.step(launched=self._hand_over_held)
                self._hand_over_held()  # a step that launched nothing
                if self.scheduler.in_flight:  # the next step is queued already (async scheduling): stream them now
                    self._deliver(outputs)
                else:
                    self._held = outputs
                if self.scheduler.last_step is last and not outputs and not self.scheduler.in_flight:
                    # nothing runnable yet (host blocks landing)
                    with self._wake:
                        self._wake.wait(IDLE_POLL_S)
                if self._trace is not None and self.scheduler.last_step is not None:
                    self._write_trace(began, time.monotonic())
        except BaseException as error:  # noqa: BLE001  whatever broke the engine, every waiter must hear of it
            with self._wake:
                self.error = error
                pending = [item[2] for item in self._inbox if item[0] == "add"]
                for item in self._inbox:
                    if item[0] == "call":
                        item[2].set_exception(self._dead())
                self._inbox = []
            dead = self._dead()
            hand_over([(sink, dead) for sink in [*self._sinks.values(), *pending]])
            self._sinks.clear()

    def _hand_over_held(self) -> None:
        """A step's tokens go to their requests once the next step is queued on the device: the event loop then
        streams them while the GPU runs, instead of taking the GIL from the engine thread as it prepares that
        step."""
        held, self._held = self._held, []
        self._deliver(held)

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        deliveries = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finish_reason is not None:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                deliveries.append((sink, output))
        hand_over(deliveries)

    def _write_trace(self, began: float, ended: float) -> None:
        """`schedule` and `after` are the loop's own seconds before and after the engine's `seconds` (`after`:
        the scheduler's bookkeeping and the hand-over to the requests); `gap` is since the last step ended (waiting
        for work, reading the inbox)."""
        record = self.scheduler.last_step
        self.scheduler.last_step = None
        line = {"start": round(record.start, 6), "seconds": round(record.seconds, 6), "seqs": record.seqs,
                "tokens": record.tokens, "prefill_tokens": record.prefill_tokens, "outputs": record.outputs,
                "schedule": round(record.start - began, 6), "after": round(ended - record.start - record.seconds, 6),
                "gap": round(began - self._last_end, 6) if self._last_end else None,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}
        self._last_end = ended
        self._trace.write(json.dumps(line) + "\n")
        self._trace.flush()

    def _apply(self, item: tuple) -> None:
        if item[0] == "call":
            _, fn, future = item
            try:
                future.set_result(fn())
            except Exception as error:  # noqa: BLE001  the caller's to handle
                future.set_exception(error)
            return
        if item[0] == "abort":
            self.scheduler.abort(item[1])
            self._sinks.pop(item[1], None)
            return
        _, request, sink = item
        try:
            self.scheduler.add(request)
        except RequestError as error:
            hand_over([(sink, error)])
            return
        self._sinks[request.request_id] = sink

    def _dead(self) -> EngineDead:
        return EngineDead(f"the engine has failed: {type(self.error).__name__}: {self.error}")
