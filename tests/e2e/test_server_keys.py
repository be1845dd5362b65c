"""API keys on `engine-run serve` as a real process: the openai client and raw httpx with right, wrong, missing
and revoked keys; the key file read again on SIGHUP while a stream runs; /health open; /metrics behind a key unless
--metrics-open; the warning for a server that listens beyond loopback with no key."""

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai import OpenAI
from test_server import MODEL, REPO, ServerProcess


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "serve-keys")


def chat(url: str, key: str, **options):
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.0, **options)


def test_keys_guard_every_v1_route_and_metrics_but_not_health(engine_dir, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nfile-key-1\n\nfile-key-2\n")
    server = ServerProcess(engine_dir, tmp_path / "server.log", "--api-key", "flag-key", "--api-key-file",
                           str(key_file))
    try:
        for key in ("flag-key", "file-key-1", "file-key-2"):
            assert chat(server.url, key).choices[0].finish_reason == "length"
        requests_before = server_requests(server, "flag-key")
        with pytest.raises(openai.AuthenticationError) as wrong:
            chat(server.url, "not-a-key")
        assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/completions", "/metrics"):
            missing = httpx.post(f"{server.url}{path}", json={"model": MODEL, "prompt": "x"}) if "compl" in path \
                else httpx.get(f"{server.url}{path}")
            assert missing.status_code == 401, path
            assert missing.json()["error"]["type"] == "invalid_request_error"
        basic = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic flag-key"})
        assert basic.status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        # refused requests never reached the engine; the 401s are counted
        assert server_requests(server, "flag-key") == requests_before
        metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer flag-key"}).text
        assert 'kiln_http_errors_total{status="401"}' in metrics
    finally:
        server.stop()
    log = server.log()
    assert "flag-key" not in log and "file-key" not in log and "API keys: 3 accepted" in log


def server_requests(server: ServerProcess, key: str) -> float:
    """The prompt tokens the engine accepted (a refused request adds none)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kiln_prompt_tokens_total"))


def test_sighup_reloads_the_key_file_without_dropping_a_stream(engine_dir, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("old-key\n")
    server = ServerProcess(engine_dir, tmp_path / "server.log", "--api-key-file", str(key_file), "--metrics-open")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="old-key", max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=48, temperature=0.0, stream=True)
        first = next(iter(stream))
        key_file.write_text("new-key\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while server.log().count("API keys: 1 accepted") < 2 and time.monotonic() < deadline:  # start, then reload
            time.sleep(0.1)
        assert server.log().count("API keys: 1 accepted") == 2
        with pytest.raises(openai.AuthenticationError):  # revoked
            chat(server.url, "old-key")
        assert chat(server.url, "new-key").choices[0].message.content is not None
        chunks = [first, *stream]  # the stream begun with the revoked key runs to its end
        assert chunks[-1].choices[0].finish_reason == "length"
        assert httpx.get(f"{server.url}/metrics").status_code == 200  # --metrics-open
    finally:
        server.stop()


def test_a_server_beyond_loopback_without_a_key_warns_and_a_bad_key_file_is_refused(engine_dir, tmp_path):
    missing = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", str(engine_dir), "--api-key-file",
                              str(tmp_path / "absent.txt")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "--api-key-file" in missing.stderr and "unreadable" in missing.stderr
    server = ServerProcess(engine_dir, tmp_path / "server.log", "--host", "0.0.0.0")
    try:
        assert chat(server.url, "anything").choices  # no key configured: open
    finally:
        server.stop()
    assert "listening on 0.0.0.0 with no API key" in server.log()
