"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level tokenizers split multi-byte characters across tokens; decoding a partial
character gives U+FFFD. Like vLLM's prefix/read offsets: decode a short window of
already-emitted tokens plus the new ones and emit only the text past the window, once it
no longer ends in U+FFFD."""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"
_WINDOW = 5  # tokens of context before the read offset, so merges across tokens decode right


class IncrementalDetokenizer:
    """Feed token ids as they arrive; get back only complete new text."""

    def __init__(self, decode: Decode, prompt_tail: list[int] | None = None) -> None:
        self._decode = decode
        self.token_ids: list[int] = list(prompt_tail or [])[-_WINDOW:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (maybe "")."""
        self.token_ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what is left, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return ""
        new_text = full_text[len(prefix_text):]
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _WINDOW)
        # keep the buffer short: drop tokens nobody will decode again
        if self.prefix_offset > 4 * _WINDOW:
            del self.token_ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return new_text
