"""Incremental detokenization with stop strings.

Text is decoded from all output tokens each time (byte-level BPE decodes a prefix of tokens to
a prefix of the text), and only the new suffix is released. Text ending in U+FFFD (an incomplete
multi-byte character) is held back until the character completes, so a stream never splits one.
While stop strings are set, the last ``max(len(stop)) - 1`` characters are also held back, so a
stop string is never released before it is recognised; it is cut from the final text.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into released text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer.
        stop: stop strings; the first one found ends generation and is not returned.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._released = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._released]

    def update(self, output_token_ids: list[int], is_last: bool) -> str:
        """Decode the outputs so far; return the newly released text.

        Sets :attr:`stopped` when a stop string appears (the text is cut before it). With
        ``is_last`` the remaining held-back text is released.
        """
        text = self._tokenizer.decode(
            output_token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        if self._stop:
            search_from = max(0, self._released - self._hold_chars)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
        self._text = text
        end = len(text)
        if not (is_last or self.stopped):
            # Strip an incomplete character first, so it cannot use up a held-back slot.
            while end > self._released and text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
            end -= self._hold_chars
        if end <= self._released:
            return ""
        delta = text[self._released : end]
        self._released = end
        return delta
