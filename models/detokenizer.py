"""Incremental detokenization with read/prefix offsets, and stop strings.

Each update decodes a window of a few tokens, not the whole output, so the cost per token does
not grow with the output's length (vLLM's ``detokenize_incrementally``, TGI's ``decode_token``).
Two token offsets into the output: ``read_offset``, up to where the text is confirmed, and
``prefix_offset``, where the window starts (the previous ``read_offset``, so the window holds the
last confirmed token(s) as context for tokenizers whose decode of a slice depends on what comes
before). The new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``; when it ends in
U+FFFD (an incomplete multi-byte character) the offsets stay, the window grows by the next
token, and the character is released once it completes, so a stream never splits one.

While stop strings are set, the last ``max(len(stop)) - 1`` characters are also held back, so a
stop string is never released before it is recognised; it is cut from the final text. The text
released over a whole stream equals ``tokenizer.decode(ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)`` of the whole output (cut at the first stop string found
after some token), for tokenizers whose decode concatenates at character boundaries, such as
byte-level BPE.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into released text deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (only ``decode`` is called).
        stop: stop strings; the first one found ends generation and is not returned.
        min_tokens: stop strings count only when they end in the text of a token after the
            first ``min_tokens`` (vLLM's rule, its PR 22014).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._min_tokens = min_tokens
        # Characters of output text (confirmed or not) once ``min_tokens`` tokens were out.
        self._min_tokens_chars = 0
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        # Confirmed text (of tokens < read_offset) from character ``_text_start`` of the output on:
        # the unreleased part plus up to ``_hold_chars`` released characters a stop string may start in.
        self._text = ""
        self._text_start = 0
        self._num_released_chars = 0
        self._released: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    def update(self, output_token_ids: list[int], is_last: bool) -> str:
        """Take the outputs so far (the same growing list each call); return the newly released text.

        Sets :attr:`stopped` when a stop string appears (the text is cut before it). With
        ``is_last`` the remaining held-back text is released, an incomplete character included.
        Once stopped, further calls return ``""``.
        """
        if self.stopped:
            return ""
        unconfirmed = self._decode_new(output_token_ids)  # may first extend the confirmed text
        text = self._text + unconfirmed
        released = self._num_released_chars - self._text_start
        if len(output_token_ids) <= self._min_tokens:
            self._min_tokens_chars = self._text_start + len(text)
        elif self._stop:
            search_from = max(0, released - self._hold_chars)
            floor = self._min_tokens_chars - self._text_start + 1  # a stop must end past it
            hits = [i for i in (text.find(s, max(search_from, floor - len(s))) for s in self._stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
        if is_last or self.stopped:
            end = len(text)
        else:  # strip an incomplete character first, so it cannot use up a held-back slot
            end = len(text.rstrip(REPLACEMENT_CHAR)) - self._hold_chars
        if end <= released:
            return ""
        delta = text[released:end]
        self._num_released_chars += len(delta)
        self._released.append(delta)
        self._trim()
        return delta

    def _decode_new(self, output_token_ids: list[int]) -> str:
        """Decode the window; confirm its new text (advance the offsets) when it ends on a whole
        character and return ``""``, else return the unconfirmed new text (ending in U+FFFD)."""
        num_tokens = len(output_token_ids)
        if num_tokens == self._read_offset:
            return ""
        prefix_text = self._decode(output_token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(output_token_ids[self._prefix_offset :])
        new_text = window_text[len(prefix_text) :]
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) < len(prefix_text):
            return new_text
        self._text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, num_tokens
        return ""

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def _trim(self) -> None:
        """Forget confirmed text before the last ``_hold_chars`` released characters."""
        keep_from = min(self._num_released_chars - self._hold_chars, self._text_start + len(self._text))
        if keep_from > self._text_start:
            self._text = self._text[keep_from - self._text_start :]
            self._text_start = keep_from
