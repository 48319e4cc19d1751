"""Reading tool calls out of a choice's generated text, whole or as it streams.

The formats, by who defined them:

- ``GENERIC``: llama.cpp server's generic format (common/chat.cpp), one JSON object,
  ``{"tool_calls": [...]}``, ``{"tool_call": {...}}`` or ``{"response": "..."}``;
- ``CALL_LIST``: vLLM's ``tool_choice: required`` output, a JSON array of ``{"name", "parameters"}``;
- ``ARGUMENTS``: vLLM's named-function output, the arguments object alone;
- ``HERMES``: vLLM's ``hermes`` parser (hermes_tool_parser.py), ``<tool_call>{"name",
  "arguments"}</tool_call>`` blocks after optional text;
- ``LLAMA3_JSON``: vLLM's ``llama3_json`` parser, JSON objects with ``name`` and ``parameters`` (or
  ``arguments``), separated by ``;``, optionally after ``<|python_tag|>``.

A call is kept only when its name is one of the request's tools and its arguments are a JSON
object; otherwise the whole text comes back as content, never a broken ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class CallFormat(Enum):
    """How a choice's text holds its tool calls (``TEXT``: it holds none; it is the content)."""

    TEXT = "text"
    GENERIC = "generic"
    CALL_LIST = "call_list"
    ARGUMENTS = "arguments"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text (of an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """What a choice said: its ``content`` (``""``: none) and its tool calls, in order."""

    content: str
    calls: tuple[ParsedCall, ...] = ()


class _NotACall(ValueError):
    """The text is not a well-formed call of the request's tools."""


def _call(item: Any, names: frozenset[str], arguments_keys: tuple[str, ...]) -> ParsedCall:
    """``item`` (decoded JSON) as a call: a known ``name`` and an object under one of ``arguments_keys``."""
    if not isinstance(item, dict) or item.get("name") not in names:
        raise _NotACall("not a call of a known function")
    arguments = next((item[k] for k in arguments_keys if k in item), None)
    if not isinstance(arguments, dict):
        raise _NotACall("the arguments are not a JSON object")
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise _NotACall("not JSON") from None


def _generic(text: str, names: frozenset[str]) -> ParsedOutput:
    value = _json(text)
    if isinstance(value, dict) and isinstance(value.get("response"), str) and len(value) == 1:
        return ParsedOutput(value["response"])
    if isinstance(value, dict) and "tool_call" in value:
        return ParsedOutput("", (_call(value["tool_call"], names, ("arguments",)),))
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list) and value["tool_calls"]:
        return ParsedOutput("", tuple(_call(item, names, ("arguments",)) for item in value["tool_calls"]))
    raise _NotACall("neither a tool call nor a response")


def _call_list(text: str, names: frozenset[str]) -> ParsedOutput:
    value = _json(text)
    if not isinstance(value, list) or not value:
        raise _NotACall("not a list of calls")
    return ParsedOutput("", tuple(_call(item, names, ("parameters", "arguments")) for item in value))


HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text from the first ``<tool_call>`` on: its blocks (the last may lack its end tag, as
    vLLM accepts); text between and after them, stripped, is content."""
    calls = tuple(_call(_json(block.strip()), names, ("arguments",)) for block in _HERMES_BLOCK.findall(text))
    return ParsedOutput(_HERMES_BLOCK.sub("", text).strip(), calls)


PYTHON_TAG = "<|python_tag|>"


def _llama3_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """``;``-separated JSON objects (vLLM's llama3_json parser reads them with ``raw_decode``)."""
    decoder = json.JSONDecoder()
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = []
    while rest:
        try:
            item, end = decoder.raw_decode(rest)
        except ValueError:
            raise _NotACall("not JSON") from None
        calls.append(_call(item, names, ("parameters", "arguments")))
        rest = rest[end:].strip().removeprefix(";").strip()
    if not calls:
        raise _NotACall("no call")
    return ParsedOutput("", tuple(calls))


_PARSERS: dict[CallFormat, Callable[[str, frozenset[str]], ParsedOutput]] = {
    CallFormat.GENERIC: _generic,
    CallFormat.CALL_LIST: _call_list,
    CallFormat.HERMES: _hermes,
    CallFormat.LLAMA3_JSON: _llama3_json,
}


def parse_calls(text: str, fmt: CallFormat, names: frozenset[str], function_name: str | None = None) -> ParsedOutput:
    """The calls ``text`` holds in ``fmt`` (``names``: the request's functions; ``function_name``:
    the named function of ``ARGUMENTS``); the text as content when it holds no well-formed call."""
    if fmt is CallFormat.TEXT:
        return ParsedOutput(text)
    try:
        if fmt is CallFormat.ARGUMENTS:
            assert function_name is not None, "the ARGUMENTS format reads a named function's arguments"
            return ParsedOutput("", (_call({"name": function_name, "arguments": _json(text)}, names, ("arguments",)),))
        return _PARSERS[fmt](text, names)
    except _NotACall:
        return ParsedOutput(text)


class ToolCallReader:
    """One choice's tool calls read as its text streams: :meth:`feed` passes on the text that
    can only be content, :meth:`finish` reads the text held back.

    ``HERMES`` passes text until a ``<tool_call>`` begins (holding back a tail that may be the
    start of the tag) and holds everything from the tag on; ``LLAMA3_JSON`` holds a text that
    begins with ``{`` or ``<|python_tag|>`` and passes any other; the JSON formats hold it all.

    Args:
        fmt: the format of the choice's text.
        names: the request's function names.
        function_name: the named function, for ``ARGUMENTS``.
    """

    def __init__(self, fmt: CallFormat, names: frozenset[str], function_name: str | None = None):
        self.fmt = fmt
        self._names = names
        self._function_name = function_name
        self._held = ""
        self._is_holding_all = fmt in (CallFormat.GENERIC, CallFormat.CALL_LIST, CallFormat.ARGUMENTS)

    @property
    def held_text(self) -> str:
        """The text fed and not passed on yet."""
        return self._held

    def feed(self, text: str) -> str:
        """Take the next ``text`` of the choice; returns what of it (and of what was held) is content for sure."""
        self._held += text
        if self._is_holding_all or self.fmt is CallFormat.TEXT:
            out, self._held = ("", self._held) if self._is_holding_all else (self._held, "")
            return out
        if self.fmt is CallFormat.LLAMA3_JSON:
            return self._feed_llama3()
        return self._feed_hermes()

    def _feed_llama3(self) -> str:
        start = self._held.lstrip()
        if not start:
            return ""
        if start.startswith("{") or start.startswith(PYTHON_TAG):
            self._is_holding_all = True
            return ""
        if PYTHON_TAG.startswith(start):
            return ""  # may still become the tag
        self.fmt, out, self._held = CallFormat.TEXT, self._held, ""
        return out

    def _feed_hermes(self) -> str:
        at = self._held.find(HERMES_START)
        if at >= 0:
            self._is_holding_all = True
            out, self._held = self._held[:at], self._held[at:]
            return out
        keep = next((n for n in range(len(HERMES_START) - 1, 0, -1) if self._held.endswith(HERMES_START[:n])), 0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> ParsedOutput:
        """The held text read for calls (the choice has ended): its calls, or itself as content."""
        held, self._held = self._held, ""
        if not held:
            return ParsedOutput("")
        return parse_calls(held, self.fmt, self._names, self._function_name)

    def read_whole(self, text: str) -> ParsedOutput:
        """The calls of a whole ``text`` (a response that does not stream), the text passed before them as content."""
        passed = self.feed(text)
        rest = self.finish()
        return ParsedOutput(passed + rest.content, rest.calls)
