"""PromptReader: a request's prompts as token ids, with prompts that cannot fit refused before the work.

Rendering a chat template and tokenizing take time in proportion to the text (seconds for a
megabyte), so the handlers call these methods on a worker thread, and tokenizing goes through
encode_batch, which releases the GIL: the event loop keeps answering meanwhile. A prompt that cannot
fit the context is refused first: token ids by their count, text by its length when every character
of a text is sure to land in a token whose vocabulary string is at least as long (then a text of c
characters is at least c / max_token_chars tokens).
"""

from __future__ import annotations

import json

from runtime.core.chat import ChatTemplateError
from runtime.core.engine import LLMEngine
from runtime.serving.protocol import MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest
from runtime.serving.tools import takes_tools, template_messages

# Pre-tokenizers that split a text without dropping any of it (Whitespace, Bert drop spaces).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def context_len(llm: LLMEngine) -> int:
    """The longest sequence the engine runs (the replicas' ingress serves from a stand-in, ModelFrontend in
    serving/replicas.py, that has a replica's figure)."""
    return llm.context_len


class PromptReader:
    """Turns requests into prompt token ids for one engine (thread-safe: it holds no state per request)."""

    def __init__(self, llm: LLMEngine):
        self.llm = llm
        self.context_len = context_len(llm)
        vocab = llm.tokenizer.get_vocab(with_added_tokens=True)
        self.max_token_chars = (max(map(len, vocab)) if every_character_lands_in_a_token(
            json.loads(llm.tokenizer.to_str())) else None)  # None: text is only measured by tokenizing it

    def completion_prompts(self, body: CompletionRequest, max_tokens: int | None) -> list[list[int]]:
        prompts = body.prompts()
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} is over {MAX_CHOICES} choices", param="n")
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:  # by its length, before tokenizing it
            self.check_fits(text, max_tokens, "prompt")
        encoded = iter(self.encode(texts))
        ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        for prompt_ids in ids:
            self.check_fits(prompt_ids, max_tokens, "prompt")
        return ids

    def chat_prompts(self, body: ChatCompletionRequest, max_tokens: int | None) -> list[list[int]]:
        prompt = self.chat_text(body)
        self.check_fits(prompt, max_tokens, "messages")
        ids = self.encode([prompt])
        self.check_fits(ids[0], max_tokens, "messages")
        return ids

    def chat_text(self, body) -> str:
        """body.messages rendered by the model's chat template (body.add_generation_prompt: with the assistant's
        opening); a template that refuses them is a 400."""
        template = str(self.llm.tokenizer_config.get("chat_template") or "")
        messages = [m.for_template() for m in body.messages]
        tools = getattr(body, "tools_in_use", [])
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = template_messages(messages, tools, template)
        try:
            return self.llm.apply_chat_template(messages, body.add_generation_prompt,
                                                tools if tools and takes_tools(template) else None)
        except ChatTemplateError as exc:
            message = str(exc) if "chat template" in str(exc) else f"the chat template refused the messages: {exc}"
            raise APIError(400, message, param="messages", code="chat_template_error") from None

    def check_fits(self, prompt: str | list[int], max_tokens: int | None, param: str) -> None:
        """APIError 400 if the prompt cannot fit the context with max_tokens (at least 1) after it."""
        generated = f"max_tokens ({max_tokens})" if max_tokens is not None else "at least 1 token to generate"
        room = max_tokens or 1
        if isinstance(prompt, str):
            if self.max_token_chars is None:
                return
            num_tokens = -(-len(prompt) // self.max_token_chars)
            what = (f"{param} is {len(prompt)} characters, so at least {num_tokens} tokens (this tokenizer's "
                    f"longest token is {self.max_token_chars} characters)")
        else:
            num_tokens = len(prompt)
            what = f"{param} is {num_tokens} tokens"  # token ids given, or the text tokenized
        if num_tokens + room > self.context_len:
            raise APIError(400, f"{what}; with {generated} that is over the context length of {self.context_len} "
                                f"tokens", param=param, code="context_length_exceeded")

    def encode(self, texts: list[str]) -> list[list[int]]:
        """As LLMEngine.encode, for each text (encode_batch: the GIL is released while it runs)."""
        if not texts:
            return []
        special = self.llm.special_tokens
        return [special.apply(e.ids) for e in self.llm.tokenizer.encode_batch(texts, add_special_tokens=False)]


def every_character_lands_in_a_token(config: dict) -> bool:
    """Whether the tokenizer (its tokenizer.json) puts each character of a text into a token whose
    vocabulary string is at least as long as the text it covers: a BPE model with no normalizer that
    can shorten the text, no pre-tokenizer that drops some, no run of unknown characters fused into
    one token, and no added token that swallows the whitespace beside it."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return False
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or ()):
        return False
    for normalizer in _parts(config.get("normalizer"), "normalizers"):
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content", "")
        never_shortens = normalizer["type"] == "Prepend" or (
            normalizer["type"] == "Replace" and "String" in pattern and len(content) >= len(pattern["String"]))
        if not never_shortens:
            return False
    return all(p["type"] in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
               for p in _parts(config.get("pre_tokenizer"), "pretokenizers"))


def _parts(component: dict | None, key: str) -> list[dict]:
    """The steps of a normalizer or pre-tokenizer, a Sequence flattened; [] for none."""
    if component is None:
        return []
    if component["type"] == "Sequence":
        return [part for child in component[key] for part in _parts(child, key)]
    return [component]
