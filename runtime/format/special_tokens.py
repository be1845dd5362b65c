"""The special tokens a model's tokenizer puts around a raw text (BOS before it, EOS after it, where it does).

Kiln tokenizes text without the tokenizer's own post-processing and applies this rule itself, the same
way in every entry point (the offline API, `engine-run generate` and `bench`, both OpenAI routes, and
the build's calibration and accuracy measures), so that a model trained with BOS always gets it and
never gets it twice: a text whose tokens already start with the prefix (a chat template that writes
`{{ bos_token }}`, or a prompt that spells it) is not given a second one, nor a second suffix.

Where the rule comes from, as transformers reads it:
- a Hugging Face directory: what tokenizer.json's post-processor adds around a single text; for a
  tokenizer.json without one, `add_bos_token` / `add_eos_token` in tokenizer_config.json (checkpoints
  save both consistently; where they disagree transformers 5 follows the post-processor);
- a GGUF file: `tokenizer.ggml.add_bos_token` / `add_eos_token`, which builder/sources/gguf_source.py writes into
  the engine's tokenizer_config.json and, when the file has them, the post-processor it rebuilds.
The build records it in the manifest (`model.special_tokens`); an engine built before that reads it from
its own tokenizer files the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

# A text every tokenizer encodes to at least one token, to see what its post-processor adds around it.
_PROBE = "Kiln"


@dataclass(frozen=True)
class SpecialTokens:
    prefix: tuple[int, ...] = ()   # added before a text's tokens (BOS)
    suffix: tuple[int, ...] = ()   # added after them (EOS, for tokenizers that append it)

    def apply(self, ids: list[int]) -> list[int]:
        """A raw text's token ids with the prefix and suffix added, each unless the ids already have it."""
        head = [] if self.prefix and ids[:len(self.prefix)] == list(self.prefix) else list(self.prefix)
        tail = [] if self.suffix and ids[len(ids) - len(self.suffix):] == list(self.suffix) else list(self.suffix)
        return head + list(ids) + tail

    def to_dict(self) -> dict:
        return {"prefix": list(self.prefix), "suffix": list(self.suffix)}

    @staticmethod
    def from_dict(doc: dict) -> SpecialTokens:
        return SpecialTokens(tuple(int(i) for i in doc.get("prefix", ())), tuple(int(i) for i in doc.get("suffix", ())))


def from_tokenizer(tokenizer_config: dict, tokenizer) -> SpecialTokens:
    """The rule of a Hugging Face tokenizer: what tokenizer.json's post-processor adds around a single text,
    when it has one (transformers 5 reads it so, whatever tokenizer_config.json says); else
    tokenizer_config.json's add_bos_token / add_eos_token (a missing one is false)."""
    if tokenizer.post_processor is None:
        return from_flags(tokenizer, bool(tokenizer_config.get("add_bos_token")),
                          bool(tokenizer_config.get("add_eos_token")),
                          _token_text(tokenizer_config.get("bos_token")), _token_text(tokenizer_config.get("eos_token")))
    plain = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return SpecialTokens(tuple(full[:start]), tuple(full[start + len(plain):]))
    raise ValueError("the tokenizer's post-processor changes a text's own tokens; Kiln cannot tell what it adds")


def from_flags(tokenizer, add_bos: bool, add_eos: bool, bos: str | int | None, eos: str | int | None) -> SpecialTokens:
    """The rule from add_bos / add_eos and the BOS / EOS tokens (their text or id); a flag whose token the
    model lacks adds nothing, as in transformers."""
    def token_id(token):
        return token if isinstance(token, int) or token is None else tokenizer.token_to_id(token)

    bos_id, eos_id = token_id(bos), token_id(eos)
    return SpecialTokens((bos_id,) if add_bos and bos_id is not None else (),
                         (eos_id,) if add_eos and eos_id is not None else ())


def _token_text(token) -> str | None:
    """A tokenizer_config special token: a string, or a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token
