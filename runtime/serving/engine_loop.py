"""EngineLoop: the thread that owns the LLMEngine, fed add/abort commands and stepping while there is work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

from runtime.backends.activations import describe
from runtime.core.engine import LLMEngine, RequestOutput
from runtime.core.sampling import SamplingParams
from runtime.format.engine_format import EngineError
from runtime.serving.metrics import ServerMetrics
from runtime.serving.protocol import APIError

log = logging.getLogger("kiln.server")

ABORTED = object()  # put on a request's queue when the server ends it (drain timeout)
_STOP = object()


@dataclass
class _Add:
    requests: list[tuple[str, list[int], SamplingParams]]  # (request id, prompt ids, params), one per choice
    arrival: float                                          # time.monotonic() when the HTTP request came in
    done: Callable[[APIError | None], None]                 # called by the engine thread once added (or refused)
    hand_off: bool = False               # prefill only: each request ends at its first token with its K/V
    handoffs: dict | None = None         # request id -> KVHandoff: decode from another engine's prefill


class Overloaded(Exception):
    """The waiting queue is full."""


class EngineLoop:
    """The thread that opens and owns the LLMEngine, and the asyncio-side handles to talk to it.

    submit/abort/abort_all run on the event loop; everything named _engine_* runs on the engine thread.
    """

    def __init__(self, open_engine: Callable[[], ContextManager[LLMEngine]], max_waiting: int,
                 metrics: ServerMetrics | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self.llm: LLMEngine | None = None
        self.ready = False
        self.failure: Exception | None = None  # what ended the engine thread, if anything did
        self._open_engine = open_engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_pending = 0  # requests sent to the engine thread and not yet added (under _lock)
        self._num_waiting = 0  # the engine's waiting queue after its last command or step (under _lock)
        self._streams: dict[str, asyncio.Queue] = {}  # unfinished request id -> its output queue (event loop)
        self._timing: dict[str, list[float]] = {}     # request id -> [arrival, last token time] (engine thread)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ event loop side

    def start(self, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None] = lambda: None,
              on_exit: Callable[[], None] = lambda: None) -> None:
        """Open the engine on a new thread; on_ready once it serves, on_exit when the thread ends."""
        self._loop = loop
        self._thread = threading.Thread(target=self._engine_main, args=(on_ready, on_exit), name="kiln-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, close the engine and join its thread (blocking)."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]], arrival: float,
                     hand_off: bool = False, handoffs: dict | None = None, whole: bool = False) -> asyncio.Queue:
        """Queue requests that share one output queue; Overloaded, or APIError when the engine refuses them.
        hand_off and handoffs: disaggregated serving (LLMEngine.add_request(hand_off=True), add_prefilled). whole
        (the client reads final outputs only) matters to ReplicaPool, which may start such requests again on another
        replica; one engine has nowhere else to."""
        with self._lock:
            if self._num_pending + self._num_waiting + len(requests) > self.max_waiting:
                raise Overloaded()
            self._num_pending += len(requests)
        outputs: asyncio.Queue = asyncio.Queue()
        ids = [rid for rid, _, _ in requests]
        self._streams.update(dict.fromkeys(ids, outputs))
        added = self._loop.create_future()
        self._commands.put(_Add(requests, arrival, lambda error: self._loop.call_soon_threadsafe(
            _settle, added, error), hand_off, handoffs))
        try:
            error = await added
        except asyncio.CancelledError:  # the client left while the engine was adding: abort after the add
            self.abort(ids)
            raise
        if error is not None:
            for rid in ids:
                self._streams.pop(rid, None)
            raise error
        return outputs

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests and free their blocks (no-op for finished ones); no more outputs reach their queue."""
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if live:
            self._commands.put(("abort", live))

    def abort_all(self) -> None:
        """End every request now; each waiting handler gets ABORTED on its queue."""
        for outputs in set(self._streams.values()):
            outputs.put_nowait(ABORTED)
        self.abort(list(self._streams))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finished:
                    del self._streams[out.request_id]

    # ------------------------------------------------------------------ engine thread

    def _engine_main(self, on_ready, on_exit) -> None:
        try:
            with self._open_engine() as llm:
                self.llm = llm
                llm.grammars.warm()  # structured outputs' tokenizer, ready before the first such request
                if line := describe(llm.engine):
                    log.info("%s: %s", llm.engine.manifest.model_name, line)
                self.ready = True
                on_ready()
                self._engine_serve(llm)
        except Exception as exc:
            if not isinstance(exc, (EngineError, OSError, ValueError)):  # a user error needs no traceback
                log.exception("the engine thread failed")
            self.failure = exc
        finally:
            self.ready = False
            on_exit()

    def _engine_serve(self, llm: LLMEngine) -> None:
        while True:
            commands = [self._commands.get()] if not llm.has_unfinished() else []  # sleep while idle
            with contextlib.suppress(queue.Empty):
                while True:
                    commands.append(self._commands.get_nowait())
            for command in commands:
                if command is _STOP:
                    for rid in list(self._timing):
                        llm.abort(rid)
                    return
                if isinstance(command, _Add):
                    self._engine_add(llm, command)
                else:
                    for rid in command[1]:
                        if self._timing.pop(rid, None) is not None and llm.abort(rid):
                            self.metrics.requests_finished.labels("abort").inc()
            outputs = self._engine_step(llm) if llm.has_unfinished() else []
            stats = llm.stats()
            with self._lock:
                self._num_waiting = stats.num_waiting
            self.metrics.update(stats)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _engine_add(self, llm: LLMEngine, command: _Add) -> None:
        added, error = [], None
        try:
            for rid, prompt, params in command.requests:
                if command.handoffs is not None:
                    llm.add_prefilled(command.handoffs[rid], params, request_id=rid)
                else:
                    llm.add_request(prompt, params, request_id=rid, hand_off=command.hand_off)
                added.append(rid)
        except ValueError as exc:  # refused before taking any KV blocks
            error = APIError(400, re.sub(r"^request '[^']*': ", "", str(exc)))
        except Exception as exc:
            log.exception("add_request failed")
            error = APIError(500, f"could not queue the request: {type(exc).__name__}: {exc}", type="server_error")
        if error is not None:
            for rid in added:
                llm.abort(rid)
        else:
            for rid in added:
                self._timing[rid] = [command.arrival, 0.0]
        with self._lock:
            self._num_pending -= len(command.requests)
            self._num_waiting = llm.stats().num_waiting
        command.done(error)

    def _engine_step(self, llm: LLMEngine) -> list[RequestOutput]:
        try:
            outputs = llm.step()  # a failing batch already ends as "error" outputs for its own requests
        except Exception as exc:  # anything else ends every request; the server goes on unless the engine is lost
            log.exception("engine step failed; ending all %d request(s)", len(self._timing))
            outputs = []
            for rid in list(self._timing):
                llm.abort(rid)
                outputs.append(RequestOutput(rid, "", "", [], True, "error", 0, 0,
                                             error=f"{type(exc).__name__}: {exc}"))
            if getattr(exc, "fatal", False):  # e.g. a rank died: answer everyone, then end the thread (and server)
                self._loop.call_soon_threadsafe(self._deliver, outputs)
                raise
        now = time.monotonic()
        for out in outputs:
            timing = self._timing.get(out.request_id)
            if timing is None:
                continue
            if out.finish_reason != "error":
                arrival, last = timing
                if last == 0.0:
                    self.metrics.time_to_first_token.observe(now - arrival)
                else:
                    self.metrics.inter_token_latency.observe(now - last)
                timing[1] = now
            if out.finished:
                del self._timing[out.request_id]
                self.metrics.requests_finished.labels(out.finish_reason).inc()
        return outputs


def _settle(future: asyncio.Future, error: APIError | None) -> None:
    if not future.done():
        future.set_result(error)
