"""Thirty JSON schemas of the shapes applications ask for (records, nested objects, arrays with bounds, enums,
anyOf, string formats and patterns), each with the request that asks for it: benchmarks/structured.py's load."""

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(properties: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }


def short(n: int = 40) -> dict:
    return {"type": "string", "maxLength": n}


ADDRESS = obj(
    {
        "street": short(),
        "city": short(),
        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["FR", "DE", "ES", "IT", "US", "GB"]},
    }
)
MONEY = obj({"amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]}})

SCHEMAS = [
    ("a person", obj({"name": short(), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"name": short(), "country": short(), "population": {"type": "integer", "minimum": 0}})),
    (
        "a book",
        obj(
            {
                "title": short(60),
                "author": short(),
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
            }
        ),
    ),
    ("a postal address", ADDRESS),
    (
        "a customer with an address",
        obj(
            {
                "id": {"type": "string", "format": "uuid"},
                "name": short(),
                "email": {"type": "string", "format": "email"},
                "address": ADDRESS,
            }
        ),
    ),
    (
        "an order of up to three items",
        obj(
            {
                "order_id": I,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": obj(
                        {"sku": short(12), "quantity": {"type": "integer", "minimum": 1, "maximum": 9}, "price": MONEY}
                    ),
                },
                "paid": B,
            }
        ),
    ),
    (
        "a calendar event",
        obj(
            {
                "title": short(),
                "date": {"type": "string", "format": "date"},
                "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "attendees": {"type": "array", "items": short(30), "maxItems": 4},
            }
        ),
    ),
    (
        "a weather report",
        obj(
            {
                "city": short(),
                "temperature_c": N,
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                "wind_kmh": {"type": "number", "minimum": 0, "maximum": 300},
            }
        ),
    ),
    (
        "a product",
        obj(
            {
                "name": short(),
                "price": MONEY,
                "in_stock": B,
                "tags": {"type": "array", "items": short(16), "maxItems": 5},
            }
        ),
    ),
    (
        "a movie review",
        obj(
            {
                "movie": short(),
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "summary": short(120),
                "recommend": B,
            }
        ),
    ),
    (
        "a todo list",
        obj(
            {
                "owner": short(),
                "tasks": {
                    "type": "array",
                    "maxItems": 4,
                    "items": obj({"task": short(60), "done": B, "priority": {"enum": ["low", "medium", "high"]}}),
                },
            }
        ),
    ),
    (
        "a payment that is a card or a bank transfer",
        obj(
            {
                "amount": MONEY,
                "method": {
                    "anyOf": [
                        obj({"kind": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                        obj(
                            {
                                "kind": {"const": "transfer"},
                                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"},
                            }
                        ),
                    ]
                },
            }
        ),
    ),
    (
        "a sentiment classification",
        obj(
            {
                "text": short(100),
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    (
        "named entities of a sentence",
        obj(
            {
                "entities": {
                    "type": "array",
                    "maxItems": 5,
                    "items": obj({"text": short(40), "label": {"enum": ["PERSON", "ORG", "PLACE", "DATE"]}}),
                }
            }
        ),
    ),
    (
        "a recipe",
        obj(
            {
                "name": short(),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {"type": "array", "minItems": 1, "maxItems": 5, "items": short(40)},
                "vegetarian": B,
            }
        ),
    ),
    (
        "a flight booking",
        obj(
            {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "class": {"enum": ["economy", "business", "first"]},
            }
        ),
    ),
    (
        "a log entry",
        obj(
            {
                "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
                "message": short(80),
                "timestamp": {"type": "string", "format": "date-time"},
                "code": {"type": ["integer", "null"]},
            }
        ),
    ),
    (
        "a GitHub issue",
        obj(
            {
                "title": short(80),
                "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question"]}, "maxItems": 3},
                "assignee": {"anyOf": [short(30), {"type": "null"}]},
            }
        ),
    ),
    (
        "a user profile with settings",
        obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "settings": obj(
                    {"theme": {"enum": ["light", "dark"]}, "notifications": B, "language": {"enum": ["en", "fr", "de"]}}
                ),
            }
        ),
    ),
    ("a point in 3D", obj({"x": N, "y": N, "z": N})),
    (
        "a rectangle",
        obj(
            {
                "width": {"type": "number", "exclusiveMinimum": 0},
                "height": {"type": "number", "exclusiveMinimum": 0},
                "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            }
        ),
    ),
    (
        "an invoice",
        obj(
            {
                "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": obj({"description": short(40), "total": MONEY}),
                },
                "due": {"type": "string", "format": "date"},
            }
        ),
    ),
    (
        "a chess move",
        obj(
            {
                "piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]},
                "from": {"type": "string", "pattern": "^[a-h][1-8]$"},
                "to": {"type": "string", "pattern": "^[a-h][1-8]$"},
            }
        ),
    ),
    (
        "a quiz question",
        obj(
            {
                "question": short(100),
                "choices": {"type": "array", "minItems": 4, "maxItems": 4, "items": short(30)},
                "answer": {"type": "integer", "minimum": 0, "maximum": 3},
            }
        ),
    ),
    (
        "an employee",
        obj(
            {
                "name": short(),
                "department": {"enum": ["sales", "engineering", "support", "finance"]},
                "salary": MONEY,
                "manager": {"anyOf": [short(), {"type": "null"}]},
            }
        ),
    ),
    (
        "a server health check",
        obj(
            {
                "host": {"type": "string", "format": "hostname"},
                "up": B,
                "latency_ms": {"type": "number", "minimum": 0},
                "checks": {"type": "array", "maxItems": 3, "items": obj({"name": short(20), "ok": B})},
            }
        ),
    ),
    (
        "a tweet",
        obj(
            {
                "text": short(140),
                "hashtags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^#[A-Za-z]{1,20}$"},
                    "maxItems": 3,
                },
                "likes": {"type": "integer", "minimum": 0},
            }
        ),
    ),
    (
        "a car",
        obj(
            {
                "make": short(20),
                "model": short(20),
                "year": {"type": "integer", "minimum": 1950, "maximum": 2027},
                "fuel": {"enum": ["petrol", "diesel", "electric", "hybrid"]},
            }
        ),
    ),
    (
        "a translation",
        obj(
            {
                "source_language": {"enum": ["en", "fr", "de", "es"]},
                "target_language": {"enum": ["en", "fr", "de", "es"]},
                "text": short(80),
                "translation": short(80),
            }
        ),
    ),
    (
        "a meeting summary",
        obj(
            {
                "topic": short(60),
                "decisions": {"type": "array", "maxItems": 3, "items": short(60)},
                "next_meeting": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
            }
        ),
    ),
]
