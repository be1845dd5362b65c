"""A request's SamplingParams: generation_config.json's defaults where the request leaves a field out, the
request's own value otherwise, and a value the engine refuses as a 400 naming the field."""

from types import SimpleNamespace

import pytest

from runtime.core.sampling import generation_defaults
from runtime.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from runtime.serving.request_params import sampling_params

QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "bos_token_id": 1, "eos_token_id": [2, 3]}


def llm(generation_config: dict):
    return SimpleNamespace(generation_config=generation_config, eos_token_ids=(2,))


def test_the_models_defaults_fill_what_the_request_leaves_out():
    assert generation_defaults(QWEN) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    params = sampling_params(CompletionRequest(model="m", prompt="hi", top_p=0.5), llm(QWEN), 0, 16, False, 0)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.5, 20, 1.05)
    plain = sampling_params(CompletionRequest(model="m", prompt="hi"), llm({}), 0, 16, False, 0)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, -1, 0.0)


def test_request_fields_reach_the_params():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], temperature=0.0, seed=7,
                                 logprobs=True, top_logprobs=4, logit_bias={"5": -2.5}, stop_token_ids=[9],
                                 min_p=0.2)
    params = sampling_params(body, llm(QWEN), 2, 8, True, body.top_logprobs)
    assert params.temperature == 0.0 and params.seed == 9 and params.top_logprobs == 4
    assert params.logit_bias == ((5, -2.5),) and params.stop_token_ids == (9,) and params.min_p == 0.2


def test_a_value_the_engine_refuses_is_a_400_naming_the_field():
    with pytest.raises(APIError) as info:
        sampling_params(CompletionRequest(model="m", prompt="hi", logit_bias={"5": 150.0}), llm({}), 0, 16, False, 0)
    assert info.value.status == 400 and info.value.param == "logit_bias"
