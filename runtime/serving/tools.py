"""Tool calling: a request's `tools` shown to the model, `tool_choice` enforced, and its calls read back.

A model family writes its calls its own way, and its chat template says which:
- `hermes` (Qwen2.5, Hermes, and the fallback): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- `mistral`: `[TOOL_CALLS]` and a JSON list of {"name", "arguments"};
- `llama3` (Llama 3.1+): one JSON object {"name", "parameters"}, after `<|python_tag|>` or alone.
A template that takes tools renders them itself (`tools` in its context). One that does not (SmolLM2's) gets
them in the system message with the hermes format's instructions (FALLBACK_PROMPT), and the history's tool calls
and results written as that format's text. `tool_choice` "required" or a named function constrains the output to
calls of the given tools (their parameters' schemas included) through the grammar of structured outputs; "auto"
lets the model choose and reads the calls back from its text; "none" renders no tools.
"""

from __future__ import annotations

import json
import re
import uuid

from runtime.core.constraints import bounded_whitespace, lark_grammar

FALLBACK_PROMPT = ("You can call these functions (JSON schemas of their parameters):\n<tools>\n{tools}\n</tools>\n"
                   "To call one, answer with <tool_call>{{\"name\": <function name>, \"arguments\": <JSON object>}}"
                   "</tool_call>, one block per call, and nothing else.")


def tool_format(template: str) -> str:
    """hermes, mistral or llama3: how calls are written for this chat template (hermes when it shows none)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def takes_tools(template: str) -> bool:
    return "tools" in template


def template_messages(messages: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """The messages as the template renders them: for a template without tool support, the tools go into the
    system message and the history's calls and results become hermes text."""
    if takes_tools(template):
        return messages
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}\n"
                      "</tool_call>" for c in calls]
            message["content"] = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        out.append(message)
    if tools:
        shown = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{shown}")
        else:
            out.insert(0, {"role": "system", "content": shown})
    return out


def _arguments(call: dict):
    arguments = call["function"].get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def call_grammar(tools: list[dict], name: str | None, parallel: bool, fmt: str) -> str:
    """A grammar whose sentences are calls of `tools` (only `name` when given), several when parallel."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": t["function"]["name"]},
                             key: t["function"].get("parameters") or {"type": "object"}}} for t in chosen]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "mistral":
        listed = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return lark_grammar(f'start: "[TOOL_CALLS]" %json {json.dumps(bounded_whitespace(listed))}\n')
    one = bounded_whitespace(one)
    if fmt == "llama3":
        return lark_grammar(f"start: %json {json.dumps(one)}\n")
    repeat = ' ("\\n" call)*' if parallel else ""
    return lark_grammar(f'start: call{repeat}\ncall: "<tool_call>\\n" %json {json.dumps(one)} "\\n</tool_call>"\n')


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_calls(text: str, fmt: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the text without its calls, or None when nothing else is left; the calls of known tools in OpenAI's shape)
    read from a finished output. Text that does not parse as calls stays text."""
    found: list[dict] = []
    rest = text
    if fmt == "hermes":
        for block in _HERMES.findall(text):
            found.extend(_loads(block))
        rest = _HERMES.sub("", text)
    elif fmt == "mistral" and "[TOOL_CALLS]" in text:
        rest, _, listed = text.partition("[TOOL_CALLS]")
        found = _loads(listed)
    elif fmt == "llama3":
        body = text.split("<|python_tag|>", 1)[-1]
        found = _loads(body)
        rest = "" if found else text
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", c.get("parameters", {})))}}
             for c in found if isinstance(c, dict) and c.get("name") in names]
    if not calls:
        return text, []
    rest = rest.strip()
    return rest or None, calls


def _loads(text: str) -> list:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return []
    return value if isinstance(value, list) else [value]
