"""A request's SamplingParams: the body's fields, with the model's generation_config.json defaults (temperature,
top_p, top_k, min_p, repetition_penalty, as its authors tuned them) for those the request leaves out, as vLLM and
transformers apply them. A value the engine refuses is a 400 naming the field."""

from __future__ import annotations

import asyncio

from runtime.core.constraints import GrammarError
from runtime.core.sampling import GENERATION_DEFAULTS, SamplingParams, generation_defaults
from runtime.serving.protocol import APIError
from runtime.serving.tools import call_grammar, tool_format


def sampling_params(body, llm, choice: int, max_tokens: int, logprobs: bool, top_logprobs: int,
                    prompt_logprobs: int | None = None, grammar: str | None = None) -> SamplingParams:
    """The params of choice `choice` (its seed is the request's + choice, modulo 2^63: any integer is a seed, and
    every backend holds it in an int64) of a completion or chat request."""
    given = generation_defaults(getattr(llm, "generation_config", {}))

    def field(name: str):
        value = getattr(body, name)
        return value if value is not None else given.get(name, GENERATION_DEFAULTS[name])

    try:
        return SamplingParams(
            temperature=field("temperature"), top_p=field("top_p"), top_k=field("top_k"), min_p=field("min_p"),
            repetition_penalty=field("repetition_penalty"),
            seed=None if body.seed is None else (body.seed + choice) % 2**63, max_tokens=max_tokens,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, eos_token_ids=llm.eos_token_ids,
            stop_token_ids=tuple(body.stop_token_ids or ()), logit_bias=body.token_bias(),
            speculative=body.speculative, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, stop=body.stop_strings(), logprobs=logprobs,
            top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar)
    except ValueError as exc:  # the message starts with the field's name
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name if name in type(body).model_fields else None) from None


async def checked_grammar(body, llm) -> str | None:
    """The request's grammar (protocol's grammar()), compiled once for the engine's tokenizer on a worker thread
    (the first converts the tokenizer, about a second); one that does not compile is a 400 naming its field."""
    forced = body.forced_tool() if hasattr(body, "forced_tool") else False
    if forced is not False:  # tool_choice "required" or a named function: calls only
        fmt = tool_format(str(llm.tokenizer_config.get("chat_template") or ""))
        grammar, field = call_grammar(body.tools_in_use, forced, body.parallel_tool_calls is not False, fmt), "tools"
    else:
        try:
            asked = body.grammar()
        except GrammarError as exc:  # a schema's unknown keyword
            raise APIError(400, f"response_format: {exc}", param="response_format") from None
        if asked is None:
            return None
        grammar, field = asked
    try:
        await asyncio.to_thread(llm.grammars.check, grammar)
    except GrammarError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None
    return grammar
