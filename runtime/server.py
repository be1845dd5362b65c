"""`engine-run serve`: an OpenAI-compatible HTTP server in front of a thread that owns the LLMEngine.

HTTP handlers (asyncio) never touch the engine's queues: they render the chat template and
tokenize, then send add/abort commands through a thread-safe queue to the engine thread, which
applies them between steps and steps while there is work. Each step's outputs come back in one
loop.call_soon_threadsafe into per-request asyncio queues, so a slow client only lengthens its own
queue and never holds a step back.

SIGTERM drains: new requests get 503, running ones finish (those still running after
drain_timeout seconds are aborted), then uvicorn shuts down and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, ContextManager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.chat import ChatTemplateError
from runtime.engine import LLMEngine, RequestOutput
from runtime.engine_format import EngineError
from runtime.metrics import ServerMetrics
from runtime.protocol import (
    MAX_CHOICES, APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse, Delta, ModelCard, ModelList,
    Usage, chat_logprobs, completion_logprobs, validation_error,
)
from runtime.sampling import SamplingParams

log = logging.getLogger("kiln.server")

ABORTED = object()  # put on a request's queue when the server ends it (drain timeout)
_STOP = object()


@dataclass
class _Add:
    requests: list[tuple[str, list[int], SamplingParams]]  # (request id, prompt ids, params), one per choice
    arrival: float                                          # time.monotonic() when the HTTP request came in
    done: Callable[[APIError | None], None]                 # called by the engine thread once added (or refused)


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

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]], arrival: float) -> asyncio.Queue:
        """Queue requests that share one output queue; Overloaded, or APIError when the engine refuses them."""
        with self._lock:
            if self._num_pending + self._num_waiting + len(requests) > self.max_waiting:
                raise Overloaded()
            self._num_pending += len(requests)
        outputs: asyncio.Queue = asyncio.Queue()
        ids = [rid for rid, _, _ in requests]
        self._streams.update(dict.fromkeys(ids, outputs))
        added = self._loop.create_future()
        self._commands.put(_Add(requests, arrival, lambda error: self._loop.call_soon_threadsafe(
            _settle, added, error)))
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
                llm.add_request(prompt, params, request_id=rid)
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


# ---------------------------------------------------------------------------------------------- HTTP

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected; its requests were aborted."""


class _Run:
    """One HTTP request's engine requests (one per choice) and the queue their outputs arrive on."""

    def __init__(self, engine: EngineLoop, request_ids: list[str], outputs: asyncio.Queue):
        self.engine = engine
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self._outputs = outputs

    async def outputs(self, request: Request | None = None):
        """(choice index, output) as they come; given the request, raises _ClientGone once its client left."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while self.unfinished:
            if request is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise _ClientGone()
            try:
                out = await asyncio.wait_for(self._outputs.get(), DISCONNECT_POLL_S if request else None)
            except TimeoutError:
                continue
            if out is ABORTED:
                self.unfinished.clear()
                raise APIError(503, "the server shut down before this request finished", type="unavailable")
            if out.finished:
                self.unfinished.discard(out.request_id)
                if out.finish_reason == "error":
                    raise APIError(500, f"generation failed: {out.error}", type="server_error")
            yield self.index[out.request_id], out

    async def final_outputs(self, request: Request) -> list[RequestOutput]:
        final = {}
        try:
            async for i, out in self.outputs(request):
                if out.finished:
                    final[i] = out
        finally:
            self.close()
        return [final[i] for i in range(len(self.index))]

    def close(self) -> None:
        """Abort what is still running (the client left, or a sibling choice failed)."""
        self.engine.abort(list(self.unfinished))


class _EventStream(StreamingResponse):
    """Server-sent events whose run is closed however the response ends (a client that left included)."""

    def __init__(self, events, run: _Run):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _events(run: _Run, first: list[str], chunk_for, usage_for=None):
    """SSE: `first`, then chunk_for(index, output, tokens sent before) per output, usage_for(finals), [DONE]."""
    for event in first:
        yield event
    sent = [0] * len(run.index)
    last: list[RequestOutput | None] = [None] * len(run.index)
    try:
        async for i, out in run.outputs():
            event = chunk_for(i, out, sent[i])
            sent[i], last[i] = len(out.token_ids), out
            if event:
                yield event
        if usage_for is not None:
            yield usage_for(last)
    except APIError as exc:
        yield _sse(exc.body())
    yield "data: [DONE]\n\n"


def create_app(engine: EngineLoop, model_name: str | None = None) -> FastAPI:
    """The HTTP API; `engine` must be started (EngineLoop.start) on the loop that serves the app."""
    app = FastAPI(title="Kiln", summary="OpenAI-compatible server for a Kiln engine")
    app.state.draining = False
    started = int(time.time())
    metrics = engine.metrics

    def served_model_name() -> str:
        return model_name or engine.llm.engine.manifest.model_name

    app.state.served_model_name = served_model_name

    def context_len(llm: LLMEngine) -> int:
        return min(llm.limits.max_seq_len, llm.num_blocks * llm.block_size)

    def admit(body) -> LLMEngine:
        if app.state.draining:
            raise APIError(503, "the server is shutting down", type="unavailable")
        if not engine.ready:
            raise APIError(503, "the engine is not loaded yet; retry when /health answers 200", type="unavailable",
                           headers={"Retry-After": "1"})
        if body.model != served_model_name():
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{served_model_name()!r}", param="model", code="model_not_found")
        body.check_supported()
        return engine.llm

    async def start(llm: LLMEngine, body, prompts: list[list[int]], max_tokens: int | None,
                    logprobs: bool, prefix: str, arrival: float) -> _Run:
        """Submit body.n choices per prompt (choice index = prompt index * n + i)."""
        requests = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                try:
                    params = SamplingParams(
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        top_k=-1 if body.top_k is None else body.top_k,
                        seed=None if body.seed is None else body.seed + i,
                        max_tokens=max_tokens if max_tokens is not None else max(1, context_len(llm) - len(ids)),
                        stop=body.stop_strings(), logprobs=logprobs)
                except ValueError as exc:
                    raise APIError(400, str(exc)) from None
                requests.append((f"{prefix}-{p * body.n + i}", ids, params))
        if len(requests) > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} is over {MAX_CHOICES} choices", param="n")
        try:
            outputs = await engine.submit(requests, arrival)
        except Overloaded:
            raise APIError(429, f"the server is at capacity ({engine.max_waiting} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        return _Run(engine, [rid for rid, _, _ in requests], outputs)

    def token_texts(llm: LLMEngine, ids: list[int]) -> list[str]:
        return [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def usage(prompt_lens: list[int], n: int, finals: list[RequestOutput]) -> Usage:
        completion = sum(len(o.token_ids) for o in finals if o is not None)
        cached = sum(o.num_cached_tokens for o in finals[::n] if o is not None)
        return Usage(prompt_tokens=sum(prompt_lens), completion_tokens=completion,
                     total_tokens=sum(prompt_lens) + completion, prompt_tokens_details={"cached_tokens": cached})

    # ------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.http_errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_error(list(exc.errors()), exc.body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{exc.detail}: {exc.__cause__}" if exc.__cause__ else str(exc.detail)  # e.g. bad UTF-8
        return await api_error(request, APIError(exc.status_code, message, type=kind))

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 type="server_error"))

    # ------------------------------------------------------------------ endpoints

    @app.get("/health")
    async def health() -> JSONResponse:
        status = ("draining" if app.state.draining else "ok" if engine.ready
                  else "failed" if engine.failure is not None else "loading")
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        if not engine.ready:
            raise APIError(503, "the engine is not loaded yet", type="unavailable", headers={"Retry-After": "1"})
        return ModelList(data=[ModelCard(id=served_model_name(), created=started, max_model_len=context_len(
            engine.llm))])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        llm = admit(body)
        prompts = [llm.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served_model_name()
        logprobs = body.logprobs is not None
        run = await start(llm, body, prompts, body.max_tokens, logprobs, rid, arrival)
        prompt_lens = [len(p) for p in prompts]

        def choice(i: int, out: RequestOutput, sent: int, text: str) -> CompletionChoice:
            lp = None
            if logprobs:
                lp = completion_logprobs(token_texts(llm, out.token_ids[sent:]), out.logprobs[sent:],
                                         len(out.text) - len(text))
            return CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=out.finish_reason)

        if body.stream:
            def chunk_for(i, out, sent):
                if out.delta or out.finished or logprobs:
                    return _sse(CompletionResponse(id=rid, created=created, model=name,
                                                   choices=[choice(i, out, sent, out.delta)]))

            def usage_for(finals):
                return _sse(CompletionResponse(id=rid, created=created, model=name, choices=[],
                                               usage=usage(prompt_lens, body.n, finals)))

            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(_events(run, [], chunk_for, usage_for if include_usage else None), run)
        finals = await run.final_outputs(request)
        return CompletionResponse(id=rid, created=created, model=name,
                                  choices=[choice(i, o, 0, o.text) for i, o in enumerate(finals)],
                                  usage=usage(prompt_lens, body.n, finals))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        llm = admit(body)
        try:
            prompt = llm.apply_chat_template([m.for_template() for m in body.messages], body.add_generation_prompt)
        except ChatTemplateError as exc:
            message = str(exc) if "chat template" in str(exc) else f"the chat template refused the messages: {exc}"
            raise APIError(400, message, param="messages", code="chat_template_error") from None
        ids = llm.encode(prompt)
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served_model_name()
        run = await start(llm, body, [ids], body.completion_limit(), body.logprobs, rid, arrival)

        def logprobs(out: RequestOutput, sent: int):
            return chat_logprobs(token_texts(llm, out.token_ids[sent:]), out.logprobs[sent:]) if body.logprobs \
                else None

        if body.stream:
            def chunk(choices, usage_info=None) -> str:
                return _sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=choices,
                                                usage=usage_info))

            def chunk_for(i, out, sent):
                if out.delta or out.finished or body.logprobs:
                    return chunk([ChatChunkChoice(index=i, delta=Delta(content=out.delta),
                                                  logprobs=logprobs(out, sent), finish_reason=out.finish_reason)])

            first = [chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                            for i in range(body.n)])]
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            usage_for = (lambda finals: chunk([], usage([len(ids)], body.n, finals))) if include_usage else None
            return _EventStream(_events(run, first, chunk_for, usage_for), run)
        finals = await run.final_outputs(request)
        return ChatCompletionResponse(
            id=rid, created=created, model=name, usage=usage([len(ids)], body.n, finals),
            choices=[ChatChoice(index=i, message=AssistantMessage(content=o.text), logprobs=logprobs(o, 0),
                                finish_reason=o.finish_reason) for i, o in enumerate(finals)])

    return app


# ---------------------------------------------------------------------------------------------- process

class _DrainingServer(uvicorn.Server):
    """uvicorn, except that signals drain first and the exit code stays 0.

    on_signal(sig, repeat) schedules the drain; a third signal stops at once, whatever is running.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int, bool], None]):
        super().__init__(config)
        self._on_signal = on_signal
        self._num_signals = 0

    def handle_exit(self, sig: int, frame) -> None:  # a signal handler: only flag and schedule
        self._num_signals += 1
        if self._num_signals > 2:
            self.force_exit = self.should_exit = True
        else:
            self._on_signal(sig, self._num_signals > 1)


def serve(open_engine: Callable[[], ContextManager[LLMEngine]], *, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int = 64, drain_timeout: float = 30.0, model_name: str | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (or the engine fails); returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    engine = EngineLoop(open_engine, max_waiting)
    app = create_app(engine, model_name)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="off")

    async def drain(timeout: float) -> None:
        app.state.draining = True
        log.info("draining %d request(s) for up to %gs", engine.num_unfinished, timeout)
        deadline = time.monotonic() + timeout
        while engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_unfinished:
            log.warning("drain timeout: aborting %d request(s)", engine.num_unfinished)
            engine.abort_all()
            await asyncio.sleep(0.1)  # let the handlers answer
        server.should_exit = True

    def on_signal(sig: int, repeat: bool) -> None:  # SIGTERM drains; SIGINT or a second signal aborts all now
        timeout = drain_timeout if sig == signal.SIGTERM and not repeat else 0.0
        loop.call_soon_threadsafe(lambda: loop.create_task(drain(timeout)))

    server = _DrainingServer(config, on_signal)

    def on_ready() -> None:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        name = app.state.served_model_name()
        print(f"Kiln is serving {name} at http://{shown}:{port}/v1  (metrics: /metrics, health: /health)\n"
              f"Try:\n  curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)

    def on_exit() -> None:
        server.should_exit = True  # the engine thread ended: nothing left to serve

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        engine.start(loop, on_ready, on_exit)
        try:
            await server.serve()
        finally:
            await asyncio.to_thread(engine.stop)

    loop: asyncio.AbstractEventLoop
    asyncio.run(main())
    if engine.failure is not None:
        raise engine.failure
    return 0
