"""runtime/format/special_tokens.py: what a tokenizer puts around a raw text, read as transformers reads it."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from runtime.format.special_tokens import SpecialTokens, from_flags, from_tokenizer

VOCAB = {"<bos>": 0, "<eos>": 1, "[CLS]": 2, "[SEP]": 3, "Kiln": 4, "a": 5, "b": 6}


def tokenizer(post_processor=None) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>", "<eos>", "[CLS]", "[SEP]"])
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


CONFIG = {"bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}}


@pytest.mark.parametrize("post_processor, expected", [
    (processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)]), SpecialTokens((0,))),
    (processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 0), ("<eos>", 1)]),
     SpecialTokens((0,), (1,))),
    (processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2)), SpecialTokens((2,), (3,))),
    (processors.Sequence([processors.ByteLevel(trim_offsets=False),
                          processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])]),
     SpecialTokens((0,))),
    (processors.ByteLevel(trim_offsets=False), SpecialTokens()),
])
def test_a_post_processor_is_the_rule_whatever_the_config_says(post_processor, expected):
    # transformers 5 drops tokenizer_config's flags when a tokenizer.json is there: its post-processor rules
    for flags in ({}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}):
        assert from_tokenizer({**CONFIG, **flags}, tokenizer(post_processor)) == expected


@pytest.mark.parametrize("flags, expected", [
    ({}, SpecialTokens()),
    ({"add_bos_token": True}, SpecialTokens((0,))),
    ({"add_bos_token": True, "add_eos_token": True}, SpecialTokens((0,), (1,))),
    ({"add_eos_token": True}, SpecialTokens((), (1,))),
])
def test_without_a_post_processor_the_config_flags_decide(flags, expected):
    assert from_tokenizer({**CONFIG, **flags}, tokenizer()) == expected


def test_a_flag_whose_token_the_model_lacks_adds_nothing():
    assert from_flags(tokenizer(), True, True, None, "<missing>") == SpecialTokens()
    assert from_flags(tokenizer(), True, False, 0, None) == SpecialTokens((0,))


def test_apply_adds_each_token_once():
    rule = SpecialTokens((0,), (1,))
    assert rule.apply([4, 5]) == [0, 4, 5, 1]
    assert rule.apply([0, 4, 5]) == [0, 4, 5, 1]      # a chat template that wrote the BOS: not a second one
    assert rule.apply([0, 4, 1]) == [0, 4, 1]
    assert rule.apply([]) == [0, 1]                  # an empty text is the special tokens alone
    assert SpecialTokens().apply([4, 5]) == [4, 5]


def test_the_rule_round_trips_through_the_manifest_form():
    rule = SpecialTokens((0,), (1,))
    assert SpecialTokens.from_dict(rule.to_dict()) == rule
    assert SpecialTokens.from_dict({}) == SpecialTokens()
