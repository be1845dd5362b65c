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


def json_schema_grammar(schema: dict | bool) -> str:
    import json

    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema))


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


def mask_rows(logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
    """Set to -inf, in place, every logit of row r that constraints[r] does not allow next (None: row left free),
    rows [R, V] float32 on the host. The allowed sets are computed as one bitmask, unpacked to booleans and
    applied to the constrained rows together (about 50 us a row of 49,152; llguidance's numpy kernel took 300). A
    grammar in error allows nothing: the engine ends its sequence."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    rows = [r for r, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    bitmask = allocate_token_bitmask(len(rows), constraints[rows[0]].vocab_size)
    if len(rows) == 1:
        fill_next_token_bitmask(constraints[rows[0]].matcher, bitmask, 0)
    else:  # llguidance's own threads, one row each, outside the GIL
        fill_next_token_bitmask_par(_executor(), [(constraints[r].matcher, i) for i, r in enumerate(rows)], bitmask)
    vocab = logits.shape[1]
    allowed = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(np.bool_))
    if allowed.shape[1] >= vocab:
        refused = allowed[:, :vocab].logical_not()
    else:  # logits past the grammar's vocabulary (a padded embedding): refused
        refused = torch.ones(len(rows), vocab, dtype=torch.bool)
        refused[:, :allowed.shape[1]] = allowed.logical_not()
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(refused, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(refused, float("-inf")))
