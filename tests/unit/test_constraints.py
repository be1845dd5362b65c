"""Grammars on a small byte-level tokenizer made here: the mask lets through exactly what the grammar allows,
a complete grammar is `done`, a grammar that does not compile is a GrammarError with llguidance's reason, and the
sampler keeps a constrained row inside its grammar at any temperature while a free row beside it is untouched."""

import json

import numpy as np
import pytest
import torch

from runtime._native import _ops
from runtime.core.constraints import (
    GrammarError,
    Grammars,
    json_schema_grammar,
    mask_rows,
    regex_grammar,
    unknown_keyword,
)
from runtime.core.sampler import Sampler
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence

EOS = 0  # the grammars fixture's end of sequence (tests/conftest.py)


def test_the_mask_allows_what_the_grammar_allows(grammars):
    constraint = grammars.constraint(regex_grammar("[0-9]{3}-[0-9]{2}"))
    vocab = grammars._tokenizer.get_vocab_size()
    logits = torch.zeros(2, vocab)
    mask_rows(logits, [constraint, None])
    allowed = [t for t in range(vocab) if logits[0, t] == 0]
    texts = [grammars._tokenizer.decode([t]) for t in allowed]
    assert allowed and all(text and text[0].isdigit() and set(text) <= set("0123456789-") for text in texts)
    assert bool((logits[1] == 0).all())  # the free row is untouched
    for token in grammars._tokenizer.encode("123-45").ids:
        assert not constraint.done
        constraint.take(token)
    constraint.take(EOS)
    assert constraint.done


@pytest.mark.parametrize("vocab", [70, 96, 130])
def test_the_c_mask_refuses_each_clear_bit_and_what_lies_past_the_mask(vocab):
    """_ops.mask_rows_bits against the bits read one by one: masks of 3 words (96 tokens) over rows narrower,
    as wide and wider than them; words all set, all clear and mixed; rows not named are left alone."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(2, 3), dtype=np.int64).astype(np.int32)
    bits[0, 0], bits[1, 1] = -1, 0
    rows = np.array([3, 1], dtype=np.int64)
    want = logits.copy()
    for i, r in enumerate(rows):
        for v in range(vocab):
            if v >= 96 or not (int(bits[i, v // 32]) >> (v % 32)) & 1:
                want[r, v] = -np.inf
    _ops.mask_rows_bits(logits, rows, bits, vocab, 3, 2)
    np.testing.assert_array_equal(logits, want)
    with pytest.raises(ValueError, match="within R"):
        _ops.mask_rows_bits(logits, np.array([4], dtype=np.int64), bits[:1].copy(), vocab, 3, 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_row_follows_its_schema_beside_a_free_one(grammars, temperature):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=64, grammar=json_schema_grammar(schema))
    seq, free = Sequence("c", [1], params), Sequence("f", [1], SamplingParams(temperature=0.0, max_tokens=64))
    seq.constraint = grammars.constraint(params.grammar)
    vocab = grammars._tokenizer.get_vocab_size()
    generator = torch.Generator().manual_seed(0)
    out = []
    while not seq.constraint.done and len(out) < 64:
        logits = torch.randn(2, vocab, generator=generator)
        tokens, _ = Sampler().sample(logits, [seq, free])
        assert tokens[1] == int(logits[1].argmax())  # the free row chose as it would alone
        seq.append_token(tokens[0])
        out.append(tokens[0])
    assert seq.constraint.done  # the closing brace completes it: nothing but EOS could follow
    text = grammars._tokenizer.decode([t for t in out if t != EOS])
    assert set(json.loads(text)) == {"n"} and json.loads(text)["n"] in range(100)


@pytest.mark.parametrize("grammar, reason", [
    (json_schema_grammar({"type": "objectx"}), "objectx"),
    (json_schema_grammar({"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_a_grammar_that_does_not_compile_says_why(grammars, grammar, reason):
    with pytest.raises(GrammarError, match=reason):
        grammars.check(grammar)


@pytest.mark.parametrize("schema, found", [
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3, "x-ui": "wide"}}}, None),
    ({"$defs": {"P": {"type": "integer", "minimun": 0}}, "$ref": "#/$defs/P"}, "'minimun' at /$defs/P"),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object", "requird": ["a"]}]}},
     "'requird' at /items/anyOf/1"),
    ({"enum": [{"anything": 1}], "default": {"goes": 2}, "title": "t"}, None),  # values, not schemas
])
def test_a_key_json_schema_does_not_define_is_named_with_where_it_is(schema, found):
    assert unknown_keyword(schema) == found
    if found:
        with pytest.raises(GrammarError, match=found.replace("$", r"\$")):
            json_schema_grammar(schema)


def _accepts(grammars: Grammars, grammar: str, text: str) -> bool:
    constraint = grammars.constraint(grammar)
    for token in grammars._tokenizer.encode(text).ids:
        constraint.take(token)
    constraint.take(EOS)
    return constraint.done and not constraint.matcher.is_error()


@pytest.mark.parametrize("schema, blank_lines_allowed", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "x-guidance": {"whitespace_flexible": True}}, True),
])
def test_json_whitespace_is_bounded_unless_the_schema_sets_its_own(grammars, schema, blank_lines_allowed):
    """A small model can fill max_tokens with blank lines where JSON allows whitespace: by default one line break
    and its indentation per place (pretty-printed JSON still passes); a schema's own x-guidance setting wins."""
    grammar = json_schema_grammar(schema)
    assert _accepts(grammars, grammar, '{\n  "a": 1\n}') and _accepts(grammars, grammar, '{"a": 1}')
    assert _accepts(grammars, grammar, '{\n\n\n  "a": 1}') == blank_lines_allowed
    assert _accepts(grammars, grammar, '{"a":' + " " * 12 + "1}") == blank_lines_allowed
