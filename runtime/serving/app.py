"""The server app: FastAPI wiring (API keys, body size limit, errors, /health, /metrics, the OpenAI routes over
every model and tier) and the process that serves a fleet's engines from threads of its own and drains on
SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable, ContextManager, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core.engine import LLMEngine
from runtime.serving.api import ClientGone, add_openai_routes
from runtime.serving.auth import ApiKeys, RequireApiKey, loopback
from runtime.serving.engine_loop import EngineLoop
from runtime.serving.fleet import TierSpec
from runtime.serving.limits import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimit
from runtime.serving.metrics import FrontMetrics
from runtime.serving.openapi import document_errors
from runtime.serving.protocol import APIError, validation_error
from runtime.serving.quotas import KeyQuotas

log = logging.getLogger("kiln.server")


def create_app(models: dict[str, EngineLoop], tiers: Sequence[TierSpec] = (),
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, keys: ApiKeys | None = None,
               metrics_open: bool = False) -> FastAPI:
    """The HTTP API over `models` (model name -> an EngineLoop started on the loop that serves the app, or a
    replica_pool.ReplicaPool) and `tiers` (fleet.TierSpec). keys: the API keys /v1 (and, unless metrics_open,
    /metrics) require (runtime/serving/auth.py), with their limits (quotas.py); None or none configured: open."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if not models:
        raise ValueError("create_app: no model to serve")
    app = FastAPI(title="Kiln", summary="OpenAI-compatible server for Kiln engines")
    app.state.draining = False
    metrics = FrontMetrics({name: pool.metrics for name, pool in models.items()})
    app.state.metrics = metrics
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes,
                       on_refused=lambda: metrics.http_errors.labels("413").inc())
    if keys is not None:  # added last, so it runs first: a refused request's body is never read
        app.add_middleware(RequireApiKey, keys=keys, metrics_open=metrics_open,
                           on_refused=lambda: metrics.http_errors.labels("401").inc())

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
        return await api_error(request, APIError(exc.status_code, message, type=kind, headers=exc.headers))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 type="server_error"))

    # ------------------------------------------------------------------ endpoints

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 "ok" when every model serves; "degraded" (still 200) when some serve and the others' engines
        failed; 503 while loading, draining, or when none serves."""
        states = {name: ("ok" if pool.ready else "failed" if pool.failure is not None else "loading")
                  for name, pool in models.items()}
        values = set(states.values())
        status = ("draining" if app.state.draining else "ok" if values == {"ok"} else "loading" if "loading" in values
                  else "degraded" if "ok" in values else "failed")
        return JSONResponse({"status": status, "models": states},
                            status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    add_openai_routes(app, models, {tier.name: tier for tier in tiers}, metrics, KeyQuotas(metrics))
    document_errors(app, lambda: [pool.llm.tokenizer.get_vocab_size(with_added_tokens=True) if pool.llm else None
                                  for pool in models.values()])
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


def serve(engines: dict[str, Callable[[], ContextManager[LLMEngine]]], *, tiers: Sequence[TierSpec] = (),
          host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 64, drain_timeout: float = 30.0,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, keys: ApiKeys | None = None,
          metrics_open: bool = False) -> int:
    """Serve `engines` (model name -> how to open its LLMEngine), each on an engine thread of its own, until
    SIGTERM/SIGINT, or until every engine has ended; returns the exit code (an engine that failed raises its
    error once the server has stopped). SIGHUP reads the API key file again."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if keys is not None and keys.enabled:
        log.info("API keys: %d accepted", len(keys.keys))
    elif not loopback(host):
        log.warning("listening on %s with no API key: anyone who reaches this port can use the model "
                    "(--api-key, --api-key-file or KILN_API_KEY)", host)
    loops = {name: EngineLoop(open_engine, max_waiting) for name, open_engine in engines.items()}
    app = create_app(loops, tiers, max_request_bytes, keys, metrics_open)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="off")

    def unfinished() -> int:
        return sum(engine.num_unfinished for engine in loops.values())

    async def drain(timeout: float) -> None:
        app.state.draining = True
        log.info("draining %d request(s) for up to %gs", unfinished(), timeout)
        deadline = time.monotonic() + timeout
        while unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if unfinished():
            log.warning("drain timeout: aborting %d request(s)", unfinished())
            for engine in loops.values():
                engine.abort_all()
            await asyncio.sleep(0.1)  # let the handlers answer
        server.should_exit = True

    def on_signal(sig: int, repeat: bool) -> None:  # SIGTERM drains; SIGINT or a second signal aborts all now
        timeout = drain_timeout if sig == signal.SIGTERM and not repeat else 0.0
        loop.call_soon_threadsafe(lambda: loop.create_task(drain(timeout)))

    server = _DrainingServer(config, on_signal)
    settled: set[str] = set()

    def on_settled(name: str) -> None:  # an engine serves, or failed to start: once all have, say what serves
        if name in settled:
            return
        settled.add(name)
        if len(settled) < len(loops):
            return
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        serving = [name for name, engine in loops.items() if engine.ready]
        if not serving:
            return
        names = serving + [tier.name + " (tier)" for tier in tiers]
        print(f"Kiln is serving {', '.join(names)} at http://{shown}:{port}/v1  (metrics: /metrics, health: "
              f"/health)\nTry:\n  curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{serving[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)

    def on_exit(name: str) -> None:
        on_settled(name)
        if server.should_exit:  # shutting down
            return
        if not any(engine.ready for engine in loops.values()):
            server.should_exit = True  # no engine thread left: nothing to serve
        else:
            log.error("model %r stopped serving (%s); the other models go on", name, loops[name].failure)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        if keys is not None and keys.key_file is not None:
            loop.add_signal_handler(signal.SIGHUP, keys.reload)
        for name, engine in loops.items():
            engine.start(loop, lambda name=name: loop.call_soon_threadsafe(on_settled, name),
                         lambda name=name: loop.call_soon_threadsafe(on_exit, name))
        try:
            await server.serve()
        finally:
            await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in loops.values()))

    loop: asyncio.AbstractEventLoop
    asyncio.run(main())
    failure = next((engine.failure for engine in loops.values() if engine.failure is not None), None)
    if failure is not None:
        raise failure
    return 0
