"""Several engines behind one endpoint (`engine-run serve --fleet`), as real server processes driven by the openai
client and raw httpx: each request answered by the engine it names (checked against each engine's own greedy
answers), /v1/models, 404 for an unknown model, API keys with their per-key limits (429 for one key while the
others are served), the key file reloaded without dropping a stream, per-model and per-key metrics, and tiers
that escalate from a cheap model to a stronger one by confidence, prompt length or header."""

import asyncio
import signal
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from test_server import ServerProcess, metric_value

from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

VOCAB = 320


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_qwen2_dir, build_tiny_engine):
    """Two engines of different families (and the same tokenizer): llama and qwen."""
    return {"llama": build_tiny_engine(tiny_llama_dir, "fleet-llama"),
            "qwen": build_tiny_engine(tiny_qwen2_dir, "fleet-qwen")}


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def offline_answers(engine, batch: list[list[int]], max_tokens: int) -> list[str]:
    llm = LLMEngine.from_dir(engine, EngineOptions(kv_cache_gib=0.02))
    return [o.text for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                               ignore_eos=True))]


def write_fleet(path, engines, *, replicas: int = 1, tiers: str = "") -> str:
    path.write_text(f"""
[[models]]
name = "llama"
engine = "{engines['llama']}"
replicas = {replicas}

[[models]]
name = "qwen"
engine = "{engines['qwen']}"
{tiers}""")
    return str(path)


def complete(url: str, key: str | None, model: str, prompt, max_tokens: int = 8, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(extra.pop("headers", {}))
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})


def metrics(url: str, key: str) -> str:
    return httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text


# ------------------------------------------------------------------------------ two engines, one on replicas

@pytest.fixture(scope="module")
def fleet_server(engines, tmp_path_factory):
    """llama on 2 Ray Serve replicas, qwen on one; keys: alice (no limit), bob (3 requests a minute), carol."""
    tmp = tmp_path_factory.mktemp("fleet")
    keys = tmp / "keys.txt"
    keys.write_text("alice-secret name=alice\nbob-secret name=bob rpm=3\ncarol-secret name=carol\n")
    server = ServerProcess(None, tmp / "server.log", "--fleet", write_fleet(tmp / "fleet.toml", engines, replicas=2),
                           "--api-key-file", str(keys), ready_s=180)
    server.key_file = keys
    yield server
    assert server.stop() == 0, server.log()


def test_each_request_is_answered_by_the_engine_it_names(fleet_server, engines):
    batch = prompts(6, seed=21)
    expected = {name: offline_answers(engine, batch, 8) for name, engine in engines.items()}
    assert expected["llama"] != expected["qwen"]  # the check below can tell the engines apart
    client = OpenAI(base_url=f"{fleet_server.url}/v1", api_key="alice-secret", max_retries=0, timeout=120)
    assert {m.id for m in client.models.list().data} == {"llama", "qwen"}

    async def run_all():
        async with httpx.AsyncClient(base_url=fleet_server.url, timeout=120,
                                     headers={"Authorization": "Bearer alice-secret"}) as http:
            calls = [http.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})
                     for p in batch for name in ("llama", "qwen")]
            return await asyncio.gather(*calls)

    answers = asyncio.run(run_all())
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers]
    got = {"llama": [r.json()["choices"][0]["text"] for r in answers[0::2]],
           "qwen": [r.json()["choices"][0]["text"] for r in answers[1::2]]}
    assert got == expected
    assert {r.json()["model"] for r in answers[0::2]} == {"llama"}
    streamed = client.completions.create(model="qwen", prompt=batch[0], max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected["qwen"][0]

    unknown = complete(fleet_server.url, "alice-secret", "gpt-4", batch[0])
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "'llama', 'qwen'" in unknown.json()["error"]["message"]
    text = metrics(fleet_server.url, "alice-secret")
    assert metric_value(text, 'kiln_generation_tokens_total{model="llama"}') >= 6 * 8
    assert metric_value(text, 'kiln_generation_tokens_total{model="qwen"}') >= 7 * 8
    assert metric_value(text, 'kiln_replicas{model="llama"}') == 2 and metric_value(
        text, 'kiln_replicas{model="qwen"}') == 1
    assert metric_value(text, 'kiln_key_requests_total{key="alice",model="qwen"}') >= 7


def test_bad_keys_never_reach_an_engine(fleet_server):
    before = metric_value(metrics(fleet_server.url, "alice-secret"), "kiln_prompt_tokens_total")
    for key in (None, "not-a-key", "alice-secre"):
        for model in ("llama", "qwen"):
            refused = complete(fleet_server.url, key, model, [5, 6, 7])
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{fleet_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    text = metrics(fleet_server.url, "alice-secret")
    assert metric_value(text, "kiln_prompt_tokens_total") == before
    assert metric_value(text, 'kiln_http_errors_total{status="401"}') >= 7


def test_a_key_over_its_limit_gets_429_while_others_are_served(fleet_server):
    answers = [complete(fleet_server.url, "bob-secret", "llama", [9, 10, 11], max_tokens=2) for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 3
    over = complete(fleet_server.url, "bob-secret", "qwen", [9, 10, 11], max_tokens=2)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(over.headers["Retry-After"]) <= 60 and "bob" in over.json()["error"]["message"]
    assert complete(fleet_server.url, "alice-secret", "llama", [9, 10, 11], max_tokens=2).status_code == 200
    text = metrics(fleet_server.url, "alice-secret")
    assert metric_value(text, 'kiln_key_rate_limited_total{key="bob",limit="rpm"}') == 1
    assert metric_value(text, 'kiln_key_requests_total{key="bob"}') == 3
    assert metric_value(text, 'kiln_key_generation_tokens_total{key="bob"}') == 6


def test_reloading_the_key_file_revokes_without_dropping_streams(fleet_server):
    client = OpenAI(base_url=f"{fleet_server.url}/v1", api_key="carol-secret", max_retries=0, timeout=120)
    stream = client.completions.create(model="llama", prompt=[3, 4, 5], max_tokens=60, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    fleet_server.key_file.write_text("alice-secret name=alice\ndave-secret name=dave\n")
    fleet_server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while complete(fleet_server.url, "dave-secret", "qwen", [3], max_tokens=1).status_code != 200:
        assert time.monotonic() < deadline, fleet_server.log()[-2000:]
        time.sleep(0.2)
    chunks += list(stream)  # the stream begun with carol's key runs to its end
    assert chunks[-1].usage.completion_tokens == 60
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert complete(fleet_server.url, "carol-secret", "llama", [3]).status_code == 401


# ------------------------------------------------------------------------------ tiers, from this process

def test_tiers_escalate_by_confidence_prompt_length_and_header(engines, tmp_path):
    """qwen is the cheap model and llama the strong one. "never" keeps every answer on qwen (its threshold is
    far below any mean log-probability), "always" moves every answer to llama (no token's log-probability
    reaches 0), "short" moves prompts over 8 tokens; the answer is the answering model's own, streamed or not."""
    tiers = """
[tiers.never]
models = ["qwen", "llama"]
min_mean_logprob = -1000.0

[tiers.always]
models = ["qwen", "llama"]
probe_tokens = 3
min_mean_logprob = 0.0
confidence = "min"

[tiers.short]
models = ["qwen", "llama"]
min_mean_logprob = -1000.0
max_prompt_tokens = 8
"""
    batch = [[5, 6, 7], list(range(10, 30))]  # 3 and 20 tokens
    expected = {name: offline_answers(engine, batch, 8) for name, engine in engines.items()}
    server = ServerProcess(None, tmp_path / "tiers.log", "--fleet", write_fleet(tmp_path / "fleet.toml", engines,
                                                                                 tiers=tiers),
                           "--api-key", "k name=k tpm=150")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"llama", "qwen", "never", "always", "short"}
        for tier, answered_by in (("never", ["qwen", "qwen"]), ("always", ["llama", "llama"]),
                                  ("short", ["qwen", "llama"])):
            for prompt, model, want in zip(batch, answered_by, (expected[m] for m in answered_by)):
                answer = client.completions.create(model=tier, prompt=prompt, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
                assert answer.model == model and answer.choices[0].text == want[batch.index(prompt)], tier
        streamed = client.completions.create(model="always", prompt=batch[0], max_tokens=8, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        chunks = list(streamed)
        assert {c.model for c in chunks} == {"llama"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["llama"][0]
        forced = complete(server.url, "k", "never", batch[0], headers={"X-Kiln-Tier": "llama"})
        assert forced.status_code == 200 and forced.json()["model"] == "llama"
        assert complete(server.url, "k", "never", batch[0], headers={"X-Kiln-Tier": "gpt"}).status_code == 400
        text = metrics(server.url, "k")
        assert metric_value(text, 'kiln_tier_escalations_total{tier="always",reason="confidence"}') == 3
        assert metric_value(text, 'kiln_tier_escalations_total{tier="short",reason="prompt_length"}') == 1
        assert metric_value(text, 'kiln_tier_escalations_total{tier="never",reason="header"}') == 1
        assert metric_value(text, 'kiln_tier_requests_total{tier="never",model="qwen"}') == 2
        assert metric_value(text, 'kiln_tier_requests_total{tier="short",model="llama"}') == 1
        # tokens per minute: 150 for this key; the window holds the requests above (8 answers of 8 tokens
        # and 75 prompt tokens), so a 20-token prompt is refused until they leave it
        over = complete(server.url, "k", "qwen", batch[1])
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        assert "tokens per minute" in over.json()["error"]["message"] and int(over.headers["Retry-After"]) >= 1
        assert metric_value(metrics(server.url, "k"), 'kiln_key_rate_limited_total{key="k",limit="tpm"}') == 1
    finally:
        assert server.stop() == 0, server.log()


def test_a_tier_passes_over_a_model_that_is_not_serving(engines):
    """In-process (ASGI): the tier's cheap model never loaded (its engine thread not started), so a tier
    request goes to the strong model, counted as escalated for "unavailable"; the cheap model itself answers
    503, and /health says which model is not serving."""
    import contextlib

    from runtime.serving.app import create_app
    from runtime.serving.engine_loop import EngineLoop
    from runtime.serving.fleet import TierSpec

    llm = LLMEngine.from_dir(engines["llama"], EngineOptions(kv_cache_gib=0.02))
    strong = EngineLoop(lambda: contextlib.nullcontext(llm), max_waiting=8)
    cheap = EngineLoop(lambda: contextlib.nullcontext(llm), max_waiting=8)  # never started: "loading"
    app = create_app({"qwen": cheap, "llama": strong}, [TierSpec("auto", ("qwen", "llama"), min_mean_logprob=-1000)])
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as http:
            strong.start(asyncio.get_running_loop())
            while not strong.ready:
                await asyncio.sleep(0.01)
            tiered = await http.post("/v1/completions", json={**body, "model": "auto"})
            direct = await http.post("/v1/completions", json={**body, "model": "qwen"})
            health = await http.get("/health")
            text = (await http.get("/metrics")).text
        await asyncio.to_thread(strong.stop)
        return tiered, direct, health, text

    tiered, direct, health, text = asyncio.run(scenario())
    expected = offline_answers(engines["llama"], [[5, 6, 7]], 8)[0]
    assert tiered.status_code == 200 and tiered.json()["model"] == "llama"
    assert tiered.json()["choices"][0]["text"] == expected
    assert direct.status_code == 503 and "not loaded yet" in direct.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["models"] == {"qwen": "loading", "llama": "ok"}
    assert metric_value(text, 'kiln_tier_escalations_total{tier="auto",model="qwen",reason="unavailable"}') == 1
