"""Structured outputs against a real server on the shipped SmolLM2 engine, driven by the openai SDK as an
application would: `chat.completions.parse` with a Pydantic model (whole and streamed), vLLM's guided_choice and
guided_regex, constrained and free requests in one batch (the free ones unchanged), and bad grammars refused."""

from __future__ import annotations

import concurrent.futures
import re
from typing import Literal

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from test_server import MODEL, ServerProcess


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


@pytest.fixture(scope="module")
def server(smollm2_default_engine, tmp_path_factory):
    proc = ServerProcess(smollm2_default_engine, tmp_path_factory.mktemp("structured") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Describe Paris as JSON: name, country, population in millions, continent."}]


def test_parse_returns_the_pydantic_object_whole_and_streamed(client):
    parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=80,
                                           temperature=0).choices[0]
    assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, City), parsed.message.content
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=80,
                                        temperature=0) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.parsed == parsed.message.parsed
    sampled = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=80,
                                            temperature=1.0, seed=7, n=3)
    assert all(isinstance(c.message.parsed, City) for c in sampled.choices)


def test_guided_choice_and_regex_beside_free_requests(client):
    free = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content
    question = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    requests = [dict(free), dict(free, messages=question, extra_body={"guided_choice": ["yes", "no"]}),
                dict(free, messages=question, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"}), dict(free)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one batch: constrained and free rows together
        answers = list(pool.map(lambda r: client.chat.completions.create(**r).choices[0].message.content, requests))
    assert answers[0] == answers[3] == alone
    assert answers[1] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answers[2])


@pytest.mark.parametrize("extra, param, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLenght": 5}}}}}},
     "response_format", "'maxLenght' at /properties/name"),  # misspelt: it would be ignored
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", '\\"not\\"'),  # known, but not enforced by llguidance
    ({"guided_grammar": "start: /[a-z]+/ missing_rule"}, "guided_grammar", None),
    ({"guided_regex": "[0-9"}, "guided_regex", None),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", None),
    ({"response_format": {"type": "json_schema"}}, "response_format", None),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(server, client, extra, param, named):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert named is None or named in response.text, response.text
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_and_named_tool_choices_return_calls_that_validate(client):
    import json

    import jsonschema

    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=80, temperature=0).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls, out.message
    for call in out.message.tool_calls:
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           parallel_tool_calls=False, temperature=0).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    streamed = [chunk.choices[0] for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0, stream=True)
        if chunk.choices]
    calls = [c for choice in streamed for c in choice.delta.tool_calls or ()]
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert streamed[-1].finish_reason == "tool_calls"


def test_a_history_with_calls_and_results_is_accepted(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=30, temperature=0).choices[0]
    assert out.message.content and out.message.tool_calls is None and out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(server, extra, param):
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    if "maxLenght" in response.text or "not" in str(extra):  # the keyword named: misspelt, or not enforced
        assert ("'maxLenght' at /properties/name" if "maxLenght" in str(extra) else '["not"]') in response.text


def test_langchain_structured_output_and_bound_tools(server):
    """langchain-openai's ChatOpenAI against Kiln: with_structured_output (json_schema) and bind_tools."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0)
    city = chat.with_structured_output(City, method="json_schema").invoke(MESSAGES[0]["content"])
    assert isinstance(city, City)
    message = chat.bind_tools([WEATHER], tool_choice="required").invoke(ASK[0]["content"])
    assert [call["name"] for call in message.tool_calls] and all(
        call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"} for call in message.tool_calls)
