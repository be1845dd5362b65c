"""`engine-run serve` under requests too big to serve: bodies over --max-request-bytes, prompts over the context.

Each is refused (413 or 400, in the OpenAI error shape) without stalling the server: /health keeps
answering within 100 ms and a running stream keeps streaming, measured from threads of their own.
"""

import json
import random
import threading
import time

import httpx
import pytest
from tokenizers import Tokenizer

from conftest import tiny_tokenizer_json
from runtime.serving.prompts import every_character_lands_in_a_token
from test_server import MODEL, ServerProcess

LIMIT = 1_500_000  # --max-request-bytes (the default is 1 MiB)
BIG = 20 * 1000 * 1000
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "serve-limits")


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    proc = ServerProcess(engine_dir, tmp_path_factory.mktemp("server") / "server.log", "--max-request-bytes",
                         str(LIMIT))
    yield proc
    assert proc.stop() == 0, proc.log()


class HealthProbe(threading.Thread):
    """GET /health every 20 ms on one connection, recording (sent at, seconds to answer) of each."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.answers: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._done.is_set():
                sent = time.monotonic()
                try:
                    status = http.get(f"{self.url}/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                else:
                    self.answers.append((sent, time.monotonic() - sent))
                    if status != 200:
                        self.failures.append(f"status {status}")
                time.sleep(0.02)

    def stop(self) -> None:
        self._done.set()
        self.join()


class Stream(threading.Thread):
    """A streaming completion that ignores EOS, recording when each of its events arrived."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.arrivals: list[float] = []
        self.events: list[str] = []

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Kiln bakes", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.arrivals.append(time.monotonic())
                    self.events.append(line[len("data: "):])


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param), error
    return error["message"]


def test_a_20_mb_body_gets_413_while_health_answers_and_a_stream_keeps_streaming(server):
    body = b'{"model": "tiny", "prompt": "' + b"x" * BIG + b'"}'
    refused_413 = server.metric('kiln_http_errors_total{status="413"}')
    stream = Stream(server.url, max_tokens=2000)
    stream.start()
    while len(stream.arrivals) < 3:
        assert stream.is_alive(), stream.events
        time.sleep(0.01)
    probe = HealthProbe(server.url)
    probe.start()
    time.sleep(0.1)
    start = time.monotonic()
    with_length = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=60)
    chunked = httpx.post(f"{server.url}/v1/completions", headers=JSON, timeout=60,
                         content=(body[i:i + 65536] for i in range(0, len(body), 65536)))  # no Content-Length
    end = time.monotonic()
    time.sleep(0.1)
    probe.stop()
    stream.join(60)

    assert f"is {len(body)} bytes" in assert_error(with_length, 413, code="request_too_large")
    assert f"limit of {LIMIT} bytes" in assert_error(chunked, 413, code="request_too_large")
    assert server.metric('kiln_http_errors_total{status="413"}') == refused_413 + 2
    during = [seconds for sent, seconds in probe.answers if start <= sent <= end]
    assert not probe.failures and len(during) >= 2, (probe.failures, probe.answers, end - start)
    assert max(seconds for _, seconds in probe.answers) < 0.1, probe.answers
    # The stream ran all along and was never held up: tokens before, during and after the big requests.
    assert stream.arrivals[0] < start and any(start < t < end for t in stream.arrivals) and stream.arrivals[-1] > end
    gaps = [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:])]
    assert max(gaps) < 1.0, gaps  # a token every few ms; reading the 20 MB body on the event loop took 20 s
    assert stream.events[-1] == "[DONE]" and json.loads(stream.events[-2])["usage"]["completion_tokens"] == 2000


def test_the_limit_is_on_the_bytes_sent(server):
    def body_of(size: int) -> bytes:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        return body + b" " * (size - len(body))  # JSON allows trailing whitespace

    at_limit = httpx.post(f"{server.url}/v1/completions", content=body_of(LIMIT), headers=JSON, timeout=30)
    over = httpx.post(f"{server.url}/v1/completions", content=body_of(LIMIT + 1), headers=JSON, timeout=30)
    assert at_limit.status_code == 200, at_limit.text
    assert f"{LIMIT + 1} bytes" in assert_error(over, 413, code="request_too_large")


def test_a_prompt_far_over_the_context_is_refused_fast_before_tokenizing(server):
    """Bodies just under the limit: text that would take seconds to tokenize, token ids, chat messages."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choice(words) for _ in range(LIMIT // 5))[:LIMIT - 100]
    ids = [7] * ((LIMIT - 100) // 3)  # "7, " each
    requests = [
        ("completions", {"model": MODEL, "prompt": text}, "prompt", "characters, so at least"),
        ("completions", {"model": MODEL, "prompt": ids, "max_tokens": 4}, "prompt", f"is {len(ids)} tokens"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}, "messages",
         "characters, so at least"),
    ]
    for path, body, param, detail in requests:
        content = json.dumps(body).encode()
        assert LIMIT - 200 < len(content) <= LIMIT
        start = time.monotonic()
        response = httpx.post(f"{server.url}/v1/{path}", content=content, headers=JSON, timeout=60)
        elapsed = time.monotonic() - start
        message = assert_error(response, 400, code="context_length_exceeded", param=param)
        assert detail in message and "context length of 2048 tokens" in message, message
        assert elapsed < 1.0, (path, elapsed)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_text_is_measured_by_its_length_only_where_no_character_can_vanish():
    """The bound (a text of c characters is at least c / longest-token tokens) holds for byte-level BPE, the
    tokenizer of Llama-family models; a pre-tokenizer that drops whitespace would break it, so it is not used."""
    byte_level = json.loads(tiny_tokenizer_json(320))
    assert every_character_lands_in_a_token(byte_level)
    llama2_style = {**byte_level, "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"},
                    "normalizer": {"type": "Sequence", "normalizers": [
                        {"type": "Prepend", "prepend": "\u2581"},
                        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}}
    assert every_character_lands_in_a_token(llama2_style)

    whitespace = {**byte_level, "pre_tokenizer": {"type": "Whitespace"}}
    longest = max(map(len, Tokenizer.from_str(json.dumps(whitespace)).get_vocab(with_added_tokens=True)))
    spaced = "a" + " " * 1000 + "b"
    assert len(Tokenizer.from_str(json.dumps(whitespace)).encode(spaced).ids) < len(spaced) / longest
    assert not every_character_lands_in_a_token(whitespace)
    for breaks_it in ({"normalizer": {"type": "NFC"}},
                      {"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
                      {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
                      {"model": {**byte_level["model"], "type": "WordPiece"}},
                      {"model": {**byte_level["model"], "unk_token": "<unk>", "fuse_unk": True}},
                      {"added_tokens": [{**byte_level["added_tokens"][0], "lstrip": True}]}):
        assert not every_character_lands_in_a_token({**byte_level, **breaks_it}), breaks_it
