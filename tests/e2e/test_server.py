"""`engine-run serve` as a real process on 127.0.0.1, driven by the official openai client and raw httpx."""

import asyncio
import contextlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that binds now, drawn below Linux's ephemeral range (32768 and up by default): a port the kernel
    picked (bind to 0) can be handed again to any process's next outgoing or ephemeral socket before the server
    binds it, and Ray Serve's many processes take such ports while a replica server starts."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767")


def metric_value(text: str, series: str) -> float:
    """The sum of the Prometheus text's samples named like `series` that carry its labels (0 if none)."""
    name, _, labels = series.partition("{")
    wanted = set(re.findall(r'\w+="[^"]*"', labels))
    total = 0.0
    for line in text.splitlines():
        sample_name, _, rest = line.partition("{") if "{" in line.split(" ")[0] else (line.split(" ")[0], "", "")
        if line.startswith("#") or sample_name != name:
            continue
        if wanted <= set(re.findall(r'\w+="[^"]*"', rest.rpartition("}")[0])):
            total += float(line.split()[-1])
    return total


class ServerProcess:
    """`python -m runtime.cli serve` on a free port, ready once /health answers 200."""

    def __init__(self, engine_dir: Path | None, log_path: Path, *args: str, ready_s: float = 90):
        """engine_dir: served as MODEL; None: args name what to serve (--fleet)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        served = [str(engine_dir), "--model-name", MODEL] if engine_dir is not None else []
        command = [sys.executable, "-m", "runtime.cli", "serve", *served, "--port", str(self.port),
                   "--kv-cache-gib", "0.02", "--threads", "1", *args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"server did not come up:\n{self.log()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        return False

    def log(self) -> str:
        return self.log_path.read_text()

    def metric(self, series: str, **headers) -> float:
        """A series' value, `name` or `name{label="value",...}`, summed over the series that have those labels
        (so `kiln_num_requests_running` adds up every model's)."""
        return metric_value(httpx.get(f"{self.url}/metrics", headers=headers).text, series)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "serve-tiny")


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    proc = ServerProcess(engine_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def offline(engine_dir):
    return LLMEngine.from_dir(engine_dir, EngineOptions(kv_cache_gib=0.02))


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(llm: LLMEngine, prompts: list[str], max_tokens: int):
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "models": {MODEL: "ok"}}


def test_completions_match_offline_generation(client, offline):
    prompt = "The quick brown fox"
    ref = greedy(offline, [prompt], 12)[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason == "length"
    assert out.usage.prompt_tokens == len(offline.encode(prompt)) and out.usage.completion_tokens == 12
    assert len(out.choices[0].logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in out.choices[0].logprobs.token_logprobs)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    sampled = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=7, n=2)
               for _ in range(2)]
    assert [c.index for c in sampled[0].choices] == [0, 1]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]  # same seed, same text


def test_chat_with_and_without_streaming(client, offline):
    messages = [{"role": "user", "content": "Hello! How are you?"}]
    ref = greedy(offline, [offline.apply_chat_template(messages)], 10)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                         logprobs=True)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert len(choice.logprobs.content) == out.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def early_eos(create, num_tokens, max_tokens: int, **request) -> tuple[int, int]:
    """(seed, tokens) of a sampled output that ends on EOS well before max_tokens: requests of n=32 seeds (choice
    i of a request with seed s samples as seed s + i) until one does. The tiny model stops early for about one
    seed in 25, so a batch of 32 can miss."""
    for first in range(0, 256, 32):
        out = create(model=MODEL, max_tokens=max_tokens, temperature=1.0, seed=first, n=32, **request)
        for choice in out.choices:
            if choice.finish_reason == "stop" and num_tokens(choice) < max_tokens // 2:
                return first + choice.index, num_tokens(choice)
    pytest.fail("no seed in 0..255 stops early")


def test_ignore_eos_and_min_tokens_generate_max_tokens(client):
    prompt = "Hello there"
    seed, length = early_eos(client.completions.create, lambda c: len(c.logprobs.tokens), 60, prompt=prompt,
                             logprobs=0)
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=seed,
                                        logprobs=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == length
    for extension in ({"ignore_eos": True}, {"min_tokens": 60}):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=seed,
                                        extra_body=extension)
        assert out.usage.completion_tokens == 60 and out.choices[0].finish_reason == "length", extension
    # min_tokens holds back EOS only until then: the same tokens up to the EOS, at least min_tokens in all.
    held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=seed,
                                     logprobs=0, extra_body={"min_tokens": length + 3})
    assert held.usage.completion_tokens >= length + 3
    assert held.choices[0].logprobs.tokens[:length - 1] == stopped.choices[0].logprobs.tokens[:length - 1]

    messages = [{"role": "user", "content": prompt}]
    seed, length = early_eos(client.chat.completions.create, lambda c: len(c.logprobs.content), 40,
                             messages=messages, logprobs=True)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=40, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40 and out.choices[0].finish_reason == "length"


def test_top_k_one_is_greedy(client):
    greedy_text = client.completions.create(model=MODEL, prompt="Kiln", max_tokens=16, temperature=0).choices[0].text
    sampled = client.completions.create(model=MODEL, prompt="Kiln", max_tokens=16, temperature=1.0, seed=3, n=4)
    top_1 = client.completions.create(model=MODEL, prompt="Kiln", max_tokens=16, temperature=1.0, seed=3, n=4,
                                      extra_body={"top_k": 1})
    assert all(c.text == greedy_text for c in top_1.choices)
    assert any(c.text != greedy_text for c in sampled.choices)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 2.0}, {"presence_penalty": -2.0}])
def test_penalties_change_the_output_as_offline(client, offline, penalty):
    prompt = "The quick brown fox"
    plain = greedy(offline, [prompt], 40)[0]
    ref = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, **penalty))[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=penalty)
    assert out.choices[0].text == ref.text != plain.text
    if next(iter(penalty.values())) > 0:  # no token twice (greedy repeats them)
        assert len(set(ref.token_ids)) == 40 > len(set(plain.token_ids))
    else:
        assert len(set(ref.token_ids)) < len(set(plain.token_ids))


def test_chat_logprobs_with_top_logprobs_zero(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=0, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in content)


def test_top_logprobs_on_chat_and_completions_streamed_or_not(client, offline):
    """Greedy: the chosen token is each position's most likely, so it heads its alternatives, with the same value;
    the values are those of the offline engine's log_softmax."""
    request = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=5, **request)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    streamed = [entry for chunk in client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=5, stream=True, **request)
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]

    out = client.completions.create(prompt="The quick brown fox", logprobs=3, **request).choices[0].logprobs
    ref = offline.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                   top_logprobs=3))[0]
    assert out.token_logprobs == pytest.approx([float(lp) for lp in ref.logprobs], abs=1e-5)
    text_of = lambda i: offline.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    for token, top, lp, alts in zip(out.tokens, out.top_logprobs, ref.logprobs, ref.top_logprobs):
        assert len(alts) == 3  # and the texts of two ids may be one key
        assert top == pytest.approx({**{text_of(i): v for i, v in alts}, token: lp}, abs=1e-5)


def test_logit_bias_stop_token_ids_and_min_p(client, offline):
    forced = offline.encode(" bread")[-1]
    request = dict(model=MODEL, prompt="Kiln bakes", max_tokens=5, temperature=0)
    out = client.completions.create(logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}, **request)
    assert out.choices[0].text == offline.tokenizer.decode([forced] * 5)
    stopped = client.completions.create(logit_bias={str(forced): 100}, extra_body={"stop_token_ids": [forced]},
                                        **request)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    sampled = client.completions.create(**dict(request, temperature=1.0), seed=5, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == client.completions.create(**request).choices[0].text  # min_p 1 = greedy


def test_tokenize_detokenize_and_one_model(server, client, offline):
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"}).json()
    assert tokens["tokens"] == offline.encode("The quick brown fox") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == client.models.retrieve(MODEL).max_model_len
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": "The quick brown fox", "add_special_tokens": False,
                                                      "return_token_strs": True}).json()
    assert len(bare["token_strs"]) == bare["count"] <= tokens["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"]
    assert text == "The quick brown fox"
    messages = [{"role": "user", "content": "Hi there"}]
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert counted == client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    missing = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for body in ({"prompt": "x", "messages": messages}, {"model": "gpt-4", "prompt": "x"}):
        assert httpx.post(f"{server.url}/tokenize", json=body).status_code in (400, 404)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]}).json()["error"]["param"] == "tokens"


def test_echo_returns_every_prompt_tokens_logprob_cached_prefix_or_not(server, client, offline):
    """What lm-evaluation-harness's local-completions scores a continuation with: echo, logprobs 1, max_tokens 1."""
    ids = offline.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ref = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    answers = [client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
               for _ in range(2)]  # the second finds the prompt in the prefix cache, and computes it again
    for out in answers:
        choice = out.choices[0]
        lp = choice.logprobs
        assert choice.text == offline.tokenizer.decode(ids, skip_special_tokens=False) + ref.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
        assert all(top[token] == value for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                     lp.top_logprobs[1:]))
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    plain = client.completions.create(model=MODEL, prompt="Kiln bakes", max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith("Kiln bakes") and plain.choices[0].logprobs is None


def test_sixty_four_concurrent_streams_finish_and_match_offline(server, offline):
    prompts = [f"Request {i}: " + "the quick brown fox " * (i % 7) for i in range(64)]

    async def stream(api: AsyncOpenAI, prompt: str) -> tuple[str, str]:
        text, reason = "", None
        async for chunk in await api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                        stream=True):
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run_all():
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as api:
            return await asyncio.gather(*(stream(api, p) for p in prompts))

    results = asyncio.run(run_all())
    expected = [(o.text, o.finish_reason) for o in greedy(offline, prompts, 16)]
    assert results == expected
    assert server.metric("kiln_num_requests_running") == 0
    assert server.metric("kiln_time_to_first_token_seconds_count") >= 64
    assert server.metric("kiln_inter_token_latency_seconds_count") >= 64 * 10
    assert server.metric("kiln_generation_tokens_total") >= 64 * 16 and server.metric("kiln_prompt_tokens_total") > 0
    assert 0 <= server.metric("kiln_prefix_cache_hit_rate") <= 1


def test_client_disconnect_aborts_and_frees_blocks(server):
    aborted = server.metric('kiln_requests_finished_total{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "Kiln bakes", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data:")) >= 3
    deadline = time.monotonic() + 10
    while server.metric("kiln_num_requests_running") or server.metric("kiln_kv_cache_usage_ratio"):
        assert time.monotonic() < deadline, "the disconnected request kept running"
        time.sleep(0.1)
    assert server.metric('kiln_requests_finished_total{finish_reason="abort"}') == aborted + 1


MALFORMED = [
    ("completions", b"{not json", None),
    ("completions", b'{"model": "tiny", "prompt": "caf\xff\xfe"}', None),
    ("completions", b"[1, 2]", None),
    ("completions", {"model": MODEL, "prompt": 5}, "prompt"),
    ("completions", {"model": MODEL}, "prompt"),
    ("completions", {"prompt": "hi"}, "model"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, None),
    ("completions", {"model": MODEL, "prompt": "hi " * 2100, "max_tokens": 4}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, None),
    ("completions", {"model": MODEL, "prompt": ""}, None),
    ("completions", {"model": MODEL, "prompt": [10**6]}, None),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"model": MODEL, "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "min_tokens": 2, "stop": ["."]}, "min_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "frobnicate": True}, "frobnicate"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    for path, body, param in MALFORMED:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{server.url}/v1/{path}", content=content,
                              headers={"Content-Type": "application/json"}, timeout=30)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
        assert error["type"] == "invalid_request_error", (body, error)
        if param is not None:
            assert error["param"] == param, (body, error)
    assert httpx.get(f"{server.url}/v1/nothing-here").json()["error"]["type"] == "invalid_request_error"
    assert server.metric("kiln_kv_cache_usage_ratio") == 0
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_the_server_answers_as_its_openapi_document_says(server, client, tmp_path):
    """schemathesis (its CLI, every check, a fixed seed) against /openapi.json: requests the document allows are
    served, those it refuses are 400s, every status and content type answered is documented, none is a 500."""
    st = Path(sys.executable).with_name("st")  # schemathesis, a test dependency
    run = subprocess.run([str(st), "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", "25",
                          "--seed", "1", "--request-timeout", "60", "--generation-database", "none"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "8/8" in run.stdout  # every operation tested
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_overload_answers_429_with_retry_after(engine_dir, tmp_path):
    server = ServerProcess(engine_dir, tmp_path / "server.log", "--max-waiting", "1", "--max-batch-size", "1")
    body = {"model": MODEL, "prompt": "Kiln bakes", "max_tokens": 40, "temperature": 0}

    async def fire():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

    try:
        responses = asyncio.run(fire())
        refused = [r for r in responses if r.status_code == 429]
        assert refused and any(r.status_code == 200 for r in responses), [r.status_code for r in responses]
        assert all(r.status_code in (200, 429) for r in responses)
        assert refused[0].headers["Retry-After"] and set(refused[0].json()["error"]) >= {"message", "type"}
    finally:
        assert server.stop() == 0, server.log()


def test_sigterm_drains_running_requests_then_exits_zero(engine_dir, tmp_path):
    server = ServerProcess(engine_dir, tmp_path / "server.log", "--drain-timeout", "60")
    body = {"model": MODEL, "prompt": "Kiln bakes", "max_tokens": 300, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{server.url}/health").status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            late = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert late.status_code == 503 and late.json()["error"]["message"]
            events = [line[len("data: "):] for line in lines if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
        assert server.proc.wait(30) == 0, server.log()
    finally:
        server.stop()


def test_failures_answer_for_that_request_only(engine_dir):
    """In-process (ASGI) on the real engine: /health is 503 until it is loaded; a failing step is a 500 and a
    template error a 400, for that request only."""
    from runtime.serving.app import create_app
    from runtime.serving.engine_loop import EngineLoop

    llm = LLMEngine.from_dir(engine_dir, EngineOptions(kv_cache_gib=0.02))
    llm.tokenizer_config = {**llm.tokenizer_config, "chat_template": "{{ raise_exception('roles must alternate') }}"}
    execute, failures = llm.executor.execute, [RuntimeError("injected kernel failure")]

    def flaky_execute(meta):
        if failures:
            raise failures.pop()
        return execute(meta)

    llm.executor.execute = flaky_execute
    engine = EngineLoop(lambda: contextlib.nullcontext(llm), max_waiting=8)
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 3}

    async def scenario():
        transport = httpx.ASGITransport(app=create_app({MODEL: engine}))
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as http:
            loading = await http.get("/health")
            engine.start(asyncio.get_running_loop())
            while not engine.ready:
                await asyncio.sleep(0.01)
            failed = await http.post("/v1/completions", json=completion)
            template = await http.post("/v1/chat/completions",
                                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            fine = await http.post("/v1/completions", json=completion)
        await asyncio.to_thread(engine.stop)
        return loading, failed, template, fine

    loading, failed, template, fine = asyncio.run(scenario())
    assert loading.status_code == 503 and loading.json() == {"status": "loading", "models": {MODEL: "loading"}}
    assert failed.status_code == 500 and "injected kernel failure" in failed.json()["error"]["message"]
    assert template.status_code == 400 and "roles must alternate" in template.json()["error"]["message"]
    assert template.json()["error"]["code"] == "chat_template_error"
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"
