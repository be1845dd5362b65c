"""What differs between /v1/completions and /v1/chat/completions: how each reads its request's prompts and shapes
its answers (whole responses, stream chunks, log-probabilities, echo); api.py serves both through one path."""

from __future__ import annotations

from pydantic import BaseModel

from runtime.core.engine import LLMEngine, RequestOutput
from runtime.serving.prompts import PromptReader
from runtime.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    ToolCall,
    ToolCallDelta,
    Usage,
    chat_logprobs,
    completion_logprobs,
)
from runtime.serving.tools import parse_calls, tool_format


class Answer:
    """How one endpoint reads its request and shapes its answers; `sent` counts the tokens streamed before."""

    id_prefix: str
    prompt_logprobs: int | None = None  # what each request's SamplingParams.prompt_logprobs is

    def __init__(self, llm: LLMEngine, body, rid: str, created: int, model: str):
        self.llm, self.body, self.rid, self.created, self.model = llm, body, rid, created, model

    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token], skip_special_tokens=False)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.token_text(t) for t in ids]


class CompletionAnswer(Answer):
    id_prefix = "cmpl"

    def prompts(self, reader: PromptReader) -> list[list[int]]:
        self.prompt_ids = reader.completion_prompts(self.body, self.max_tokens)
        return self.prompt_ids

    @property
    def max_tokens(self) -> int | None:
        return self.body.max_tokens

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs: each prompt token's log-prob (and the `logprobs` most likely of its position)."""
        return self.body.logprobs if self.body.echo else None

    @property
    def logprobs(self) -> bool:
        return self.body.logprobs is not None

    @property
    def top_logprobs(self) -> int:
        return self.body.logprobs or 0

    def _choice(self, i: int, out: RequestOutput, sent: int, text: str) -> CompletionChoice:
        """Choice i's text (and log-probs) from its `sent`-th token on; echo puts the prompt before its first."""
        echoed, lp = "", None
        if self.body.echo:
            prompt = self.body.prompts()[i // self.body.n]
            ids = self.prompt_ids[i // self.body.n]
            echoed = prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(ids, skip_special_tokens=False)
        if self.logprobs:
            lp = completion_logprobs(self.token_texts(out.token_ids[sent:]), out.logprobs[sent:],
                                     len(echoed) + len(out.text) - len(text), self.token_text,
                                     (out.top_logprobs or [])[sent:])
            if echoed and sent == 0:
                before = completion_logprobs(self.token_texts(ids), out.prompt_logprobs, 0, self.token_text,
                                             out.prompt_top_logprobs)
                before.top_logprobs[0] = None  # the first token has no position before it
                lp = CompletionLogprobs(**{k: getattr(before, k) + getattr(lp, k)
                                           for k in CompletionLogprobs.model_fields})
        return CompletionChoice(index=i, text=echoed + text if sent == 0 else text, logprobs=lp,
                                finish_reason=out.finish_reason)

    def first_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, i: int, out: RequestOutput, sent: int) -> BaseModel:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                  choices=[self._choice(i, out, sent, out.delta)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, finals: list[RequestOutput], usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, usage=usage,
                                  choices=[self._choice(i, o, 0, o.text) for i, o in enumerate(finals)])


class ChatAnswer(Answer):
    id_prefix = "chatcmpl"

    @property
    def tools(self) -> list[dict]:
        return self.body.tools_in_use

    def _message(self, out: RequestOutput) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool calls, finish reason) of a finished output: its calls read back when tools are in use."""
        if not self.tools:
            return out.text, None, out.finish_reason
        fmt = tool_format(str(self.llm.tokenizer_config.get("chat_template") or ""))
        content, calls = parse_calls(out.text, fmt, {t["function"]["name"] for t in self.tools})
        if not calls:
            return out.text, None, out.finish_reason
        return content, [ToolCall(**c) for c in calls], "tool_calls"

    def prompts(self, reader: PromptReader) -> list[list[int]]:
        return reader.chat_prompts(self.body, self.max_tokens)

    @property
    def max_tokens(self) -> int | None:
        return self.body.completion_limit()

    @property
    def logprobs(self) -> bool:
        return self.body.logprobs

    @property
    def top_logprobs(self) -> int:
        return self.body.top_logprobs or 0

    def _logprobs(self, out: RequestOutput, sent: int):
        if not self.logprobs:
            return None
        return chat_logprobs(self.token_texts(out.token_ids[sent:]), out.logprobs[sent:], self.token_text,
                             (out.top_logprobs or [])[sent:])

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> BaseModel:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def first_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                             for i in range(self.body.n)])]

    def chunk(self, i: int, out: RequestOutput, sent: int) -> BaseModel | None:
        if self.tools:  # calls are read from the whole text: held back until it is finished, then sent at once
            if not out.finished:
                return None
            content, calls, reason = self._message(out)
            deltas = None if calls is None else [ToolCallDelta(index=k, id=c.id, function=c.function)
                                                 for k, c in enumerate(calls)]
            return self._chunk([ChatChunkChoice(index=i, delta=Delta(content=content, tool_calls=deltas),
                                                logprobs=self._logprobs(out, 0), finish_reason=reason)])
        return self._chunk([ChatChunkChoice(index=i, delta=Delta(content=out.delta), logprobs=self._logprobs(out, sent),
                                            finish_reason=out.finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def response(self, finals: list[RequestOutput], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(
            id=self.rid, created=self.created, model=self.model, usage=usage,
            choices=[self._choice(i, o) for i, o in enumerate(finals)])

    def _choice(self, i: int, out: RequestOutput) -> ChatChoice:
        content, calls, reason = self._message(out)
        return ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls),
                          logprobs=self._logprobs(out, 0), finish_reason=reason)
