"""Per-key limits: requests and tokens per minute for each API key, over a sliding 60-second window.

A generation request counts against its key's requests per minute (rpm) as soon as its key is checked, before
its prompt is read; one over the limit gets 429 with Retry-After, the seconds until the oldest request in the
window leaves it. Tokens per minute (tpm) counts the prompt tokens of the requests admitted and the tokens
generated for them (counted as each answer ends): a request whose prompt would take the key past its tpm gets
429 once the prompt is read, with Retry-After the seconds until enough of the window's tokens leave it, unless
the window is empty (a prompt larger than the whole minute's budget is not refused forever). Other keys are not
affected. The window lives in the serving process: with one ingress (the default) it is exact.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from runtime.serving.auth import ApiKey
from runtime.serving.metrics import FrontMetrics
from runtime.serving.protocol import APIError

WINDOW_S = 60.0


class _Window:
    """Events (time, amount) of the last WINDOW_S seconds, and their sum."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        if amount:
            self.events.append((now, amount))
            self.total += amount

    def wait_until_below(self, now: float, limit: int) -> float:
        """Seconds until the window's total drops to `limit` or less (or the window empties)."""
        total, leaves = self.total, now
        for when, amount in self.events:
            if total <= limit:
                break
            total, leaves = total - amount, when + WINDOW_S
        return max(0.0, leaves - now)


class KeyQuotas:
    """The windows of every key, by key name (a key renamed in the key file starts afresh)."""

    def __init__(self, metrics: FrontMetrics, clock: Callable[[], float] = time.monotonic):
        self.metrics, self.clock = metrics, clock
        self._requests: dict[str, _Window] = {}
        self._tokens: dict[str, _Window] = {}

    def _windows(self, key: ApiKey) -> tuple[_Window, _Window]:
        now = self.clock()
        requests = self._requests.setdefault(key.name, _Window())
        tokens = self._tokens.setdefault(key.name, _Window())
        requests.expire(now)
        tokens.expire(now)
        return requests, tokens

    def admit_request(self, key: ApiKey | None) -> None:
        """Count a request against its key's rpm; APIError 429 when the key has used it up."""
        if key is None:
            return
        requests, tokens = self._windows(key)
        if key.rpm is not None and requests.total >= key.rpm:
            self._refuse(key, "rpm", f"{key.rpm} requests per minute", requests.wait_until_below(
                self.clock(), key.rpm - 1))
        requests.add(self.clock(), 1)

    def admit_prompt(self, key: ApiKey | None, prompt_tokens: int) -> None:
        """Count an admitted request's prompt tokens; APIError 429 when they would pass the key's tpm."""
        if key is None:
            return
        _, tokens = self._windows(key)
        if key.tpm is not None and tokens.total and tokens.total + prompt_tokens > key.tpm:
            self._refuse(key, "tpm", f"{key.tpm} tokens per minute", tokens.wait_until_below(
                self.clock(), key.tpm - prompt_tokens))
        tokens.add(self.clock(), prompt_tokens)
        self.metrics.key_prompt_tokens.labels(key.name).inc(prompt_tokens)

    def generated(self, key: ApiKey | None, tokens: int) -> None:
        """An answer ended after `tokens` generated tokens."""
        if key is None or not tokens:
            return
        _, window = self._windows(key)
        window.add(self.clock(), tokens)
        self.metrics.key_generation_tokens.labels(key.name).inc(tokens)

    def _refuse(self, key: ApiKey, limit: str, what: str, wait: float) -> None:
        self.metrics.key_rate_limited.labels(key.name, limit).inc()
        retry = max(1, math.ceil(wait))
        raise APIError(429, f"API key {key.name!r} is over its limit of {what}; retry in {retry} s",
                       type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
