"""RequestSizeLimit: a request body over the server's limit gets 413 before it is read (ASGI middleware)."""

from __future__ import annotations

import json
from typing import Callable

from runtime.serving.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


class RequestSizeLimit:
    """Answers 413, in the OpenAI error shape, for a request body of more than max_bytes.

    A Content-Length over the limit is refused before any of the body is read. A body without one
    (chunked) is read here, counting, and refused as soon as it passes the limit, else handed on
    whole. uvicorn reads and drops the rest of a refused body without closing the connection, so a
    client that sends its whole body before reading the answer (httpx, requests) gets the 413, not
    a connection reset.
    """

    def __init__(self, app, max_bytes: int, on_refused: Callable[[], None] = lambda: None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                return await self._refuse(send, length)
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees that too
                break
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._refuse(send, None)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": bytes(body), "more_body": False}
                break
        replayed = [message]

        async def replay():
            return replayed.pop() if replayed else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, length: int | None) -> None:
        """Answer 413; length is the body's Content-Length, None for a chunked body."""
        self.on_refused()
        size = f"{length} bytes, " if length is not None else ""
        error = APIError(413, f"the request body is {size}over this server's limit of {self.max_bytes} bytes "
                              f"(engine-run serve --max-request-bytes)", code="request_too_large")
        content = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]})
        await send({"type": "http.response.body", "body": content})


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)  # the HTTP server (h11) refuses a malformed one before the app runs
    return None
