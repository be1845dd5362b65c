"""API keys: bearer authentication on the OpenAI routes (ASGI middleware), keys from flags, a file and the environment.

With any key configured, every /v1 request needs `Authorization: Bearer <key>` naming one of them (compared in
constant time, against every key); /metrics too unless the server was told to leave it open; /health always
answers. A missing or wrong key gets 401 in OpenAI's error shape before the request reaches the engine. The key
file (one key a line; blank lines and # comments skipped) is read again on SIGHUP: a new key works, a removed one
stops working, streams already running go on. Keys are never logged: the server logs only how many there are.

A key's line (or --api-key value) may add its name and limits after it: `KEY name=alice rpm=60 tpm=20000`. The
name labels the key's usage in /metrics (default: `key-` and 8 hex digits of the key's SHA-256, which does not
give the key away); rpm and tpm, requests and tokens per minute (quotas.py), default to the server's
--key-rpm / --key-tpm; 0 is no limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    """A key file that cannot be read, holds no key, or has a line it cannot read."""


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """An accepted key: the secret, the name it is shown under, its limits per minute (None: unlimited)."""

    secret: bytes = dataclasses.field(repr=False)
    name: str
    rpm: int | None = None
    tpm: int | None = None


def parse_key(line: str, rpm: int | None = None, tpm: int | None = None) -> ApiKey:
    """`KEY [name=N] [rpm=R] [tpm=T]`; rpm and tpm default to the given ones. The error never shows the key."""
    secret, *fields = line.split()
    values: dict[str, str] = {}
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or name not in ("name", "rpm", "tpm") or not value:
            raise KeyFileError(f"a key's options are name=, rpm= and tpm=; got {name!r}")
        values[name] = value
    limits = {"rpm": rpm, "tpm": tpm}
    for limit in ("rpm", "tpm"):
        if limit in values:
            if not values[limit].isdigit():
                raise KeyFileError(f"{limit}= takes a whole number per minute (0: no limit), got {values[limit]!r}")
            limits[limit] = int(values[limit])
    default_name = "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]
    return ApiKey(secret.encode(), values.get("name", default_name), limits["rpm"] or None, limits["tpm"] or None)


class ApiKeys:
    """The keys a server accepts: --api-key values, KILN_API_KEY, and a key file that reload() reads again."""

    def __init__(self, keys: list[str] | None = None, key_file: Path | None = None, environ: dict | None = None,
                 rpm: int | None = None, tpm: int | None = None):
        environ = os.environ if environ is None else environ
        self.rpm, self.tpm = rpm, tpm  # the limits of a key that names none
        lines = [k for k in (keys or []) if k.strip()] + ([environ[ENV_KEY]] if environ.get(ENV_KEY) else [])
        try:
            self.fixed = [parse_key(line, rpm, tpm) for line in lines]
        except KeyFileError as exc:
            raise KeyFileError(f"--api-key: {exc}") from None
        self.key_file = Path(key_file).absolute() if key_file is not None else None  # read from any cwd
        self.keys: tuple[ApiKey, ...] = ()
        self.reload(strict=True)

    @property
    def enabled(self) -> bool:
        """Whether keys are required (a key file emptied by a reload leaves none accepted, not the server open)."""
        return bool(self.fixed) or self.key_file is not None

    def reload(self, strict: bool = False) -> None:
        """Read the key file again. A file that cannot be read keeps the keys in use (strict: raise instead)."""
        from_file: list[ApiKey] = []
        if self.key_file is not None:
            try:
                lines = self.key_file.read_text(encoding="utf-8").splitlines()
                numbered = [(n, line.strip()) for n, line in enumerate(lines, 1)
                            if line.strip() and not line.strip().startswith("#")]
                for n, line in numbered:
                    try:
                        from_file.append(parse_key(line, self.rpm, self.tpm))
                    except KeyFileError as exc:
                        raise KeyFileError(f"line {n}: {exc}") from None
            except (OSError, UnicodeDecodeError, KeyFileError) as exc:
                if strict:
                    raise KeyFileError(f"--api-key-file {self.key_file}: unreadable ({exc})") from None
                log.warning("API key file %s unreadable (%s): the keys in use stay", self.key_file, exc)
                return
            if not from_file and strict and not self.fixed:
                raise KeyFileError(f"--api-key-file {self.key_file}: holds no key")
        self.keys = tuple({k.secret: k for k in self.fixed + from_file}.values())
        if not strict:  # a reload (the server logs the first count once its logging is set up)
            log.info("API keys: %d accepted", len(self.keys))

    def accepts(self, presented: bytes) -> ApiKey | None:
        """The key `presented` is, if any; every key is compared, each in constant time."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.secret, presented):
                found = key
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
        key = self.keys.accepts(presented.strip()) if scheme.lower() == b"bearer" else None
        if key is None:
            return await self._refuse(send, "invalid API key")
        scope.setdefault("state", {})["api_key"] = key  # request.state.api_key: per-key limits and usage
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
