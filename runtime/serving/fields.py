"""The field types of request bodies: integers as JSON Schema reads them, and the rule for fields a body carries
that the server does not define (protocol.StrictModel.check_supported), as the OpenAPI document states it."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from runtime.core.sampling import MAX_TOP_LOGPROBS

# Accepted and ignored: they label a request but do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


def _integral(value):
    """JSON's integers include 2.0 (JSON Schema's `integer`): a float without a fraction is read as its int, where
    pydantic's strict mode would refuse it; strings stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An int field of a request (bounds: Field's ge / le), integral floats read as ints (_integral)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Integer = integer()
Count = integer(ge=1)                                 # max_tokens and the like
TopLogprobs = integer(ge=0, le=MAX_TOP_LOGPROBS)

# What an unknown field may hold and still be accepted (as absent): clients send some defaults of fields they know.
EMPTY_VALUES = (None, False, 0, "", [], {})


def documented_as_checked(schema: dict) -> None:
    """A request body's JSON schema as its check_supported reads it: IGNORED_FIELDS hold anything, any other field
    the model does not declare only an empty value (objects inside a body keep their extra fields)."""
    properties = schema.setdefault("properties", {})
    for name in sorted(IGNORED_FIELDS):
        properties.setdefault(name, {"description": "accepted and ignored"})
    schema["additionalProperties"] = {"enum": list(EMPTY_VALUES)}
