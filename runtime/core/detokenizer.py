"""Incremental detokenisation with stop strings: text deltas that are always whole UTF-8 characters."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what the tokenizer yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    A token that ends inside a multi-byte character decodes to U+FFFD; its text is held back until
    the character completes. Text that could be the start of a stop string is held back too, so a
    stream never shows part of a stop string it later removes.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""          # all decoded text (stop strings cut off once matched)
        self.emitted = 0        # characters of self.text already returned as deltas
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Feed the full output so far; returns the new text that may be shown now."""
        if not self.stopped:
            self._decode(token_ids, final)
            self._find_stop()
        safe = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        delta = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted += len(delta)
        return delta

    def _decode(self, ids: list[int], final: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        full = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _find_stop(self) -> None:
        if not self.stop:
            return
        window_start = max(0, self.emitted - max(map(len, self.stop)))
        hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
