"""Chat templates: the engine's Jinja2 template rendered in a sandbox, as Hugging Face does."""

from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, broken, or refused the messages."""


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render_chat(tokenizer_config: dict, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The template's text for the messages (tools: the request's, for a template that renders them)."""
    source = tokenizer_config.get("chat_template")
    if not source:
        raise ChatTemplateError("this engine has no chat template; send a plain completion instead")
    try:
        return _compile(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=tokenizer_config.get("bos_token") or "", eos_token=tokenizer_config.get("eos_token") or "")
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
