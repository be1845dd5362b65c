"""/tokenize and /detokenize (vLLM's request and response shapes): what a client counts a prompt's tokens with,
through the same special tokens and chat template the completion endpoints apply. Both take the API key like
every route but /health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from runtime.serving.engine_loop import EngineLoop
from runtime.serving.fields import Integer, documented_as_checked
from runtime.serving.prompts import PromptReader, context_len
from runtime.serving.protocol import APIError, ChatMessage, StrictModel


class TokenizeRequest(StrictModel):
    """A prompt as /v1/completions reads it, or messages as /v1/chat/completions renders them."""

    model_config = ConfigDict(json_schema_extra=documented_as_checked)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[Integer]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model_config = ConfigDict(json_schema_extra=documented_as_checked)

    model: str | None = None
    tokens: list[Integer]


class DetokenizeResponse(BaseModel):
    prompt: str


def add_token_routes(app: FastAPI, models: dict[str, EngineLoop], prompt_reader: Callable[..., PromptReader]) -> None:
    def engine(name: str | None):
        """The model a request names; one served model when it names none. Its engine's tokenizer files are read
        whether or not its engine has loaded."""
        if name is None:
            if len(models) != 1:
                raise APIError(400, f"name the model: this server serves {', '.join(map(repr, models))}",
                               param="model")
            name = next(iter(models))
        if name not in models:
            raise APIError(404, f"model {name!r} is not served here (tiers have no tokenizer of their own)",
                           param="model", code="model_not_found")
        llm = models[name].llm
        if llm is None:
            raise APIError(503, f"model {name!r} is not loaded yet", type="unavailable", headers={"Retry-After": "1"})
        return llm

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        body.check_supported()
        llm = engine(body.model)
        reader = await asyncio.to_thread(prompt_reader, llm)
        if body.messages is not None:  # the template writes the special tokens it wants
            text = await asyncio.to_thread(reader.chat_text, body)
            tokens = await asyncio.to_thread(lambda: llm.tokenizer.encode(text, add_special_tokens=False).ids)
        elif body.add_special_tokens:
            tokens = (await asyncio.to_thread(reader.encode, [body.prompt]))[0]
        else:
            tokens = await asyncio.to_thread(lambda: llm.tokenizer.encode(body.prompt, add_special_tokens=False).ids)
        strs = [llm.tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=context_len(llm), tokens=tokens, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        body.check_supported()
        llm = engine(body.model)
        vocab = llm.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:3]} are not ids of this model's vocabulary (0..{vocab - 1})",
                           param="tokens")
        return DetokenizeResponse(prompt=llm.tokenizer.decode(body.tokens, skip_special_tokens=False))
