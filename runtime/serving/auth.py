"""API keys: bearer authentication on the OpenAI routes (ASGI middleware), keys from flags, a file and the environment.

With any key configured, every /v1 request needs `Authorization: Bearer <key>` naming one of them (compared in
constant time, against every key); /metrics too unless the server was told to leave it open; /health always
answers. A missing or wrong key gets 401 in OpenAI's error shape before the request reaches the engine. The key
file (one key a line; blank lines and # comments skipped) is read again on SIGHUP: a new key works, a removed one
stops working, streams already running go on. Keys are never logged: the server logs only how many there are.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from pathlib import Path
from typing import Callable

from runtime.serving.protocol import APIError

ENV_KEY = "KILN_API_KEY"
log = logging.getLogger("kiln.server")


class KeyFileError(ValueError):
    """A key file that cannot be read or holds no key."""


class ApiKeys:
    """The keys a server accepts: --api-key values, KILN_API_KEY, and a key file that reload() reads again."""

    def __init__(self, keys: list[str] | None = None, key_file: Path | None = None, environ: dict | None = None):
        environ = os.environ if environ is None else environ
        self.fixed = [k for k in (keys or []) if k] + ([environ[ENV_KEY]] if environ.get(ENV_KEY) else [])
        self.key_file = Path(key_file) if key_file is not None else None
        self.keys: tuple[bytes, ...] = ()
        self.reload(strict=True)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def reload(self, strict: bool = False) -> None:
        """Read the key file again. A file that cannot be read keeps the keys in use (strict: raise instead)."""
        from_file: list[str] = []
        if self.key_file is not None:
            try:
                lines = self.key_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                if strict:
                    raise KeyFileError(f"--api-key-file {self.key_file}: unreadable ({exc})") from None
                log.warning("API key file %s unreadable (%s): the keys in use stay", self.key_file, exc)
                return
            from_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
            if not from_file and strict and not self.fixed:
                raise KeyFileError(f"--api-key-file {self.key_file}: holds no key")
        self.keys = tuple(k.encode() for k in dict.fromkeys(self.fixed + from_file))
        if not strict:  # a reload (the server logs the first count once its logging is set up)
            log.info("API keys: %d accepted", len(self.keys))

    def accepts(self, presented: bytes) -> bool:
        """Whether `presented` is one of the keys; every key is compared, each in constant time."""
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(key, presented)
        return found


class RequireApiKey:
    """ASGI middleware: 401 for a /v1 (and, unless metrics_open, /metrics) request without an accepted bearer key."""

    def __init__(self, app, keys: ApiKeys, metrics_open: bool = False, on_refused: Callable[[], None] = lambda: None):
        self.app, self.keys, self.metrics_open, self.on_refused = app, keys, metrics_open, on_refused

    def guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (path == "/metrics" and not self.metrics_open)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or not self.guarded(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, presented = (header or b"").partition(b" ")
        if header is None:
            return await self._refuse(send, "no API key: send the header Authorization: Bearer <key>")
        if scheme.lower() != b"bearer" or not self.keys.accepts(presented.strip()):
            return await self._refuse(send, "invalid API key")
        return await self.app(scope, receive, send)

    async def _refuse(self, send, message: str) -> None:
        self.on_refused()
        content = json.dumps(APIError(401, message, code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content)),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": content})


def loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
