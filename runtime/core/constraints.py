"""Constrained decoding: a request's grammar (a JSON schema, a regex, a Lark grammar: llguidance's grammar
specs) decides which tokens each of its positions may take.

llguidance compiles a grammar in milliseconds and computes the allowed tokens of the next position as a bitmask:
measured on a 2-core EPYC with SmolLM2's 49,152 tokens, 2.5 ms to compile a nested JSON schema and a median 17 us
a mask (xgrammar 0.2.9: 6 ms and 2 us, see docs/serving.md for the choice). The engine's tokenizer is converted
for it once, on a background thread when a server starts (about 1 s; else on the first constrained request),
with the engine's EOS ids as the grammar's end.

Each constrained sequence holds a matcher. The sampler masks the row of each constrained sequence before greedy
or sampling (its log-probs are taken after the mask), then feeds the chosen token to the matcher; the engine
ends a sequence whose grammar is complete. Speculative guesses and the cuda backend's device greedy are not
given to constrained sequences.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from runtime._native import _ops
from runtime.ops.checks import threads


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (its message names what is wrong)."""


class Grammars:
    """One engine's grammar compiler: its tokenizer as llguidance reads it, built on first use."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self._tokenizer, self._eos = tokenizer, list(eos_token_ids)
        self._converted = None
        self._lock = threading.Lock()  # the API checks grammars on worker threads

    @property
    def tokenizer(self):
        with self._lock:
            if self._converted is None:
                from llguidance.hf import from_tokenizer
                from transformers import PreTrainedTokenizerFast

                self._converted = from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=self._tokenizer),
                                                 eos_token=self._eos or None)
            return self._converted

    def warm(self) -> None:
        """Convert the tokenizer on a background thread now (servers call it once their engine is up), so the
        first constrained request does not wait for it."""
        threading.Thread(target=lambda: self.tokenizer, name="kiln-grammar-tokenizer", daemon=True).start()

    def check(self, grammar: str) -> None:
        """GrammarError with llguidance's message when `grammar` does not compile for this tokenizer."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error.strip().splitlines()[0])

    def constraint(self, grammar: str) -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.tokenizer.vocab_size)


class Constraint:
    """One sequence's grammar state: what its next token may be, advanced by each token it takes."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def take(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken): the sequence ends here."""
        return self.matcher.is_stopped() or self.matcher.is_error()


# Every keyword of JSON Schema 2020-12 and draft 7, and OpenAPI's: llguidance enforces most and names those it does
# not ("Unimplemented keys"); any other key in a schema would be ignored, so it is refused (vendor "x-" keys aside).
SCHEMA_KEYWORDS = frozenset("""
    $schema $id $ref $defs $anchor $dynamicRef $dynamicAnchor $recursiveRef $recursiveAnchor $vocabulary $comment
    definitions allOf anyOf oneOf not if then else dependentSchemas dependencies prefixItems items additionalItems
    contains properties patternProperties additionalProperties propertyNames unevaluatedItems unevaluatedProperties
    type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength pattern maxItems
    minItems uniqueItems maxContains minContains maxProperties minProperties required dependentRequired title
    description default deprecated readOnly writeOnly examples format contentEncoding contentMediaType contentSchema
    nullable discriminator example xml externalDocs""".split())
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")


def unknown_keyword(schema, at: str = "") -> str | None:
    """'`keyword` at /json/pointer' for the first key of `schema` or a subschema that JSON Schema does not define
    (a misspelt `maxLenght` would otherwise be ignored and the output left unchecked), else None."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS and not key.startswith("x-"):
            return f"'{key}' at {at or '/'}"
        children = []
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            children = [(f"{key}/{name}", sub) for name, sub in value.items()]
        elif key in _SCHEMA_LISTS + ("items",) and isinstance(value, list):
            children = [(f"{key}/{i}", sub) for i, sub in enumerate(value)]
        elif key in _SCHEMA_ONE:
            children = [(key, value)]
        for path, sub in children:
            found = unknown_keyword(sub, f"{at}/{path}")
            if found:
                return found
    return None


# Where JSON allows whitespace, at most one line break and 40 spaces or tabs of indentation, or up to 8 spaces on a
# line. Unbounded whitespace (llguidance's default) lets a small model fill max_tokens with blank lines inside an
# object; this bound keeps pretty-printed JSON. A schema that sets its own (x-guidance whitespace_pattern or
# whitespace_flexible) keeps it.
JSON_WHITESPACE = r"[ \t]{1,8}|\r?\n[ \t]{0,40}"


def bounded_whitespace(schema: dict | bool) -> dict | bool:
    """The schema with JSON_WHITESPACE as its x-guidance whitespace_pattern, unless it sets whitespace itself."""
    if not isinstance(schema, dict):
        return schema if schema is False else {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    options = schema.get("x-guidance")
    options = options if isinstance(options, dict) else {}
    if "whitespace_pattern" in options or "whitespace_flexible" in options:
        return schema
    return {**schema, "x-guidance": {**options, "whitespace_pattern": JSON_WHITESPACE}}


def json_schema_grammar(schema: dict | bool) -> str:
    """llguidance's grammar of a JSON schema, whitespace bounded (bounded_whitespace); GrammarError naming a key
    JSON Schema does not define."""
    import json

    from llguidance import LLMatcher

    unknown = unknown_keyword(schema)
    if unknown:
        raise GrammarError(f"unknown JSON Schema keyword {unknown}")
    return LLMatcher.grammar_from_json_schema(json.dumps(bounded_whitespace(schema)))


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


def lark_grammar(grammar: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(grammar)


@functools.cache
def _executor():
    from llguidance import LLExecutor

    return LLExecutor()


def allowed_bits(constraints: list[Constraint | None]) -> tuple[list[int], np.ndarray | None]:
    """(the rows r with a constraint, int32 [len(rows), words]: bit t % 32 of word t // 32 set where row r's grammar
    allows token t next), computed by llguidance's threads, one row each, outside the GIL; ([], None) if none."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    rows = [r for r, c in enumerate(constraints) if c is not None]
    if not rows:
        return [], None
    bitmask = allocate_token_bitmask(len(rows), constraints[rows[0]].vocab_size)
    if len(rows) == 1:
        fill_next_token_bitmask(constraints[rows[0]].matcher, bitmask, 0)
    else:
        fill_next_token_bitmask_par(_executor(), [(constraints[r].matcher, i) for i, r in enumerate(rows)], bitmask)
    return rows, bitmask


def mask_rows(logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
    """Set to -inf, in place, every logit of row r that constraints[r] does not allow next (None: row left free),
    rows [R, V] float32 on the host. The allowed sets are computed as one bitmask (allowed_bits) and applied in C
    (_ops.mask_rows_bits: about 3 us a row of 49,152, where unpacking the bits to booleans for torch took 70).
    Tokens past the grammar's vocabulary (a padded embedding) are refused; a grammar in error allows nothing: the
    engine ends its sequence."""
    rows, bitmask = allowed_bits(constraints)
    if not rows:
        return
    target = logits if logits.is_contiguous() else logits.contiguous()
    _ops.mask_rows_bits(target.numpy(), np.array(rows, dtype=np.int64), bitmask, logits.shape[1], bitmask.shape[1],
                        threads())
    if target is not logits:
        logits.copy_(target)
