"""The OpenAI API's request and response bodies (the subset Kiln serves), and its error shape.

Requests are validated strictly (no "0.5" for a number, no 1 for a bool). A field this server
does not implement is refused when it is set to anything that would change the output, rather
than silently ignored; fields that change nothing (user, metadata, ...) are accepted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.core.constraints import json_schema_grammar, lark_grammar, regex_grammar
from runtime.serving.fields import (
    EMPTY_VALUES,
    IGNORED_FIELDS,
    Count,
    Integer,
    TopLogprobs,
    documented_as_checked,
    integer,
)

MAX_CHOICES = 128  # prompts x n of one request

class APIError(Exception):
    """An HTTP error answered in the OpenAI shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict], body: Any) -> APIError:
    """A 400 for pydantic/FastAPI validation errors, naming the first bad field as `param`."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _field_path(first["loc"], body)
    same = list(dict.fromkeys(e["msg"] for e in errors if _field_path(e["loc"], body) == param))
    message = f"{param or 'request body'}: {' or '.join(same)}"
    others = sum(1 for e in errors if _field_path(e["loc"], body) != param)
    if others:
        message += f" (and {others} more error(s))"
    return APIError(400, message, param=param)


def _field_path(loc: tuple, body: Any) -> str | None:
    """The dotted field path of an error's loc ("messages.0.role"), without union-member tags ("prompt.str")."""
    parts, node = [], body
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(node, dict) and isinstance(part, str):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            break
        parts.append(str(part))
    return ".".join(parts) or None


# ---------------------------------------------------------------------------------------------- requests

class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def check_supported(self) -> None:
        """APIError 400 for an unknown field set to a value that would change the output."""
        for name, value in (self.model_extra or {}).items():
            if name not in IGNORED_FIELDS and value not in EMPTY_VALUES:
                raise APIError(400, f"`{name}` is not supported by this server; leave it out", param=name)


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(StrictModel):
    model_config = ConfigDict(json_schema_extra=documented_as_checked)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: integer(ge=1, le=MAX_CHOICES) = 1
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: Integer | None = None  # any integer: reduced modulo 2^63 (request_params.sampling_params)
    stop: str | list[str] | None = None
    max_tokens: Count | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Extensions, as in vLLM (what benchmark clients send): see runtime.core.sampling.SamplingParams.
    top_k: Integer | None = None
    ignore_eos: bool = False
    min_tokens: integer(ge=0) = 0
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[Integer] | None = None
    logit_bias: dict[str, float] | None = None
    best_of: Count | None = None
    response_format: ResponseFormat | None = None
    # Structured outputs beyond response_format, as in vLLM: a regex, one of some strings, a Lark grammar.
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculative: bool = True  # false: this request decodes without speculative guesses (Kiln's own)

    def grammar_fields(self) -> list[str]:
        """The fields that constrain the output (one at most is accepted)."""
        asked = [name for name in ("guided_regex", "guided_choice", "guided_grammar") if getattr(self, name)]
        if self.response_format is not None and self.response_format.type != "text":
            asked.append("response_format")
        return asked

    def grammar(self) -> tuple[str, str] | None:
        """(the llguidance grammar its outputs must follow, the field that asked for it), or None when free."""
        asked, fmt = self.grammar_fields(), self.response_format
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)}: give one way to constrain the output", param=asked[1])
        if not asked:
            return None
        if asked[0] == "guided_regex":
            return regex_grammar(self.guided_regex), "guided_regex"
        if asked[0] == "guided_choice":
            return regex_grammar("|".join(map(re.escape, self.guided_choice))), "guided_choice"
        if asked[0] == "guided_grammar":
            return lark_grammar(self.guided_grammar), "guided_grammar"
        if fmt.type == "json_object":
            return json_schema_grammar({"type": "object"}), "response_format"
        if fmt.json_schema is None:
            raise APIError(400, "response_format: json_schema needs its `json_schema` object (name, schema)",
                           param="response_format")
        return json_schema_grammar(fmt.json_schema.schema_), "response_format"

    def check_supported(self) -> None:
        super().check_supported()
        if self.min_tokens and self.stop:
            raise APIError(400, "min_tokens cannot be combined with stop strings here: a stop string ends the "
                                "output even before min_tokens", param="min_tokens")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of ({self.best_of}) must equal n ({self.n}): every choice generated is "
                                "returned", param="best_of")
        self.token_bias()

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its token ids as integers (OpenAI sends them as JSON object keys)."""
        try:
            return {int(token): value for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:3]}",
                           param="logit_bias") from None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_SamplingRequest):
    prompt: str | list[Integer] | list[str] | list[list[Integer]]
    max_tokens: Count | None = 16  # None: up to the engine's context
    logprobs: TopLogprobs | None = None
    echo: bool = False

    @property
    def top_logprobs(self) -> int:
        return self.logprobs or 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.stream:
            raise APIError(400, "echo with stream is not supported; ask for the whole response", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per entry of a batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return list(prompt)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's calls, in the history
    tool_call_id: str | None = None            # a tool message: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template sees it: content as one string, extra fields kept."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class FunctionSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True  # an extension, as in vLLM
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise APIError(400, "tools: two tools have one name", param="tools")
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise APIError(400, f"tool_choice names {named!r}, which is not among the tools given "
                                f"({', '.join(names) or 'none'})", param="tool_choice")
        if self.tool_choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        if self.forced_tool() is not False and self.grammar_fields():
            raise APIError(400, "tool_choice forces a call: it cannot be combined with response_format or guided_*",
                           param="tool_choice")

    @property
    def tools_in_use(self) -> list[dict]:
        """The tools the model is shown ([] for none, or tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tool(self) -> str | None | bool:
        """False: the model may answer without a call; None: it must call some tool; a name: that one."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None if self.tool_choice == "required" and self.tools else False

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------------- responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []  # the `logprobs` most likely tokens of each position, and its own
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


TokenText = Callable[[int], str]  # a token id -> its text


Alternatives = list[tuple[tuple[int, float], ...] | None]  # per position: (token id, log-prob), most likely first


def completion_logprobs(tokens: list[str], logprobs: list[float], text_offset: int, text_of: TokenText,
                        alternatives: Alternatives | None = None) -> CompletionLogprobs:
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    alternatives = alternatives or [()] * len(tokens)
    top = [None if lp is None else {**{text_of(i): v for i, v in alts or ()}, t: lp}
           for t, lp, alts in zip(tokens, logprobs, alternatives)]
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


def chat_logprobs(tokens: list[str], logprobs: list[float], text_of: TokenText,
                  alternatives: Alternatives | None = None) -> ChoiceLogprobs:
    def shown(alts) -> list[TopLogprob]:
        return [TopLogprob(token=(text := text_of(i)), logprob=v, bytes=list(text.encode())) for i, v in alts or ()]

    alternatives = alternatives or [()] * len(tokens)
    return ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=shown(alts))
                                   for t, lp, alts in zip(tokens, logprobs, alternatives)])


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
