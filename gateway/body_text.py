"""The string type of request bodies: strictly a string, and valid Unicode."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, StrictStr


def _encodable(text: str) -> str:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or encoder takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"String contains an invalid Unicode code point at position {exc.start}") from None
    return text


# A string field: strictly a string, and valid Unicode (no lone surrogates).
Text = Annotated[StrictStr, AfterValidator(_encodable)]
