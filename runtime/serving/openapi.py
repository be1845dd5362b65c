"""The server's OpenAPI document as the server answers: errors in OpenAI's shape with the statuses each route can
give (FastAPI documents a 422 that Kiln never sends: a bad body is a 400), /metrics as Prometheus text, and
/tokenize's body as one of a prompt or messages. Checked by schemathesis in tests/e2e/test_openapi.py."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
WHY = {400: "the request is malformed or asks for what the engine refuses (param names the field)",
       401: "no accepted API key (when the server has keys)", 404: "no such model here",
       413: "the body is over the server's limit", 429: "at capacity, or the key's quota is used up (Retry-After)",
       500: "an internal error (the server keeps serving)", 503: "loading, draining, or the model's engine failed"}
# The statuses a route can answer besides 200, by method; /health answers 503 itself.
STATUSES = {"get": (401, 404, 500, 503), "post": (400, 401, 404, 413, 429, 500, 503)}
ONE_OF_PROMPT_OR_MESSAGES = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                             {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]


def document_errors(app: FastAPI, vocab_sizes: Callable[[], list[int | None]]) -> None:
    """Replace app.openapi with a builder of the document described above. vocab_sizes(): each served model's
    vocabulary, None while it loads: /detokenize's ids are bounded by the largest, and the document is kept once
    every model has loaded."""

    def build() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = ERROR_SCHEMA
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, operations in doc["paths"].items():
            for method, operation in operations.items():
                responses = operation["responses"]
                responses.pop("422", None)
                for status in (503,) if path == "/health" else STATUSES.get(method, ()):
                    responses[str(status)] = {"description": WHY[status], **error}
        doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        if "TokenizeRequest" in components:
            components["TokenizeRequest"]["oneOf"] = ONE_OF_PROMPT_OR_MESSAGES
        sizes = vocab_sizes()
        if "DetokenizeRequest" in components:
            ids = components["DetokenizeRequest"]["properties"]["tokens"]["items"]
            ids["minimum"] = 0
            if sizes and None not in sizes:
                ids["maximum"] = max(sizes) - 1
        if sizes and None not in sizes:
            app.openapi_schema = doc
        return doc

    app.openapi = build
