"""The rule for request fields: each field OpenAI documents for an endpoint is implemented,
refused, or ignored.

A *refused* field present in a body is a 400 (``unsupported_parameter``, ``param`` naming it)
unless its value is ``null`` or a value that asks for what Sluice does anyway (``n: 1``,
``frequency_penalty: 0``: :data:`NEUTRAL_VALUES`). An *ignored* field cannot change the result
(``user``, ``metadata``) and is accepted unread. A field outside OpenAI's spec is ignored too,
as OpenAI-compatible servers do (clients send extras). The README's field table is
:func:`field_table`'s output, and a unit test keeps the two equal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from gateway.errors import APIError, invalid_request


class FieldStatus(str, Enum):
    """What Sluice does with a field of a request body."""

    IMPLEMENTED = "implemented"
    REFUSED = "refused"
    IGNORED = "ignored"


# Values of a refused field that ask for Sluice's behaviour without it: accepted as if absent
# (SDKs and frameworks send some of them by default, e.g. LangChain's ``n: 1``).
NEUTRAL_VALUES: Mapping[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "logit_bias": ({},),
    "stop_token_ids": ([],),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "modalities": (["text"],),
    "response_format": ({"type": "text"},),
}


def is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` of the refused field ``name`` is ``null`` or one of its neutral values;
    a number matches a number of equal value (``0`` and ``0.0``), never a boolean."""
    if value is None:
        return True
    for neutral in NEUTRAL_VALUES.get(name, ()):
        numbers = all(type(v) in (int, float) for v in (value, neutral))
        if (numbers or type(value) is type(neutral)) and value == neutral:
            return True
    return False


def check_refused(data: Mapping[str, Any], refused: frozenset[str]) -> None:
    """Raise for the first field of ``refused`` that ``data`` (a parsed JSON body) sets.

    Raises:
        APIError: 400 ``unsupported_parameter`` with ``param`` the field's name.
    """
    for name in sorted(refused):
        if name in data and not is_neutral(name, data[name]):
            raise unsupported_parameter(name)


def unsupported_parameter(name: str) -> APIError:
    """400 for a field Sluice does not implement (``param``: its name)."""
    return invalid_request(
        f"Sluice does not implement the parameter '{name}'; leave it out (or null)",
        param=name,
        code="unsupported_parameter",
    )


def field_statuses(
    openai_fields: Sequence[str], model_fields: Sequence[str], refused: frozenset[str], ignored: frozenset[str]
) -> dict[str, FieldStatus]:
    """Each field an endpoint knows (OpenAI's, then Sluice's own and vLLM's extensions) and its
    status: refused or ignored as listed, else implemented when the body model has it.

    Raises:
        ValueError: a field is both refused and ignored, or an OpenAI field is in none of the
            three (every field OpenAI documents must have a status).
    """
    if refused & ignored:
        raise ValueError(f"fields both refused and ignored: {sorted(refused & ignored)}")
    statuses: dict[str, FieldStatus] = {}
    for name in [*openai_fields, *model_fields, *sorted(refused), *sorted(ignored)]:
        if name in refused:
            statuses[name] = FieldStatus.REFUSED
        elif name in ignored:
            statuses[name] = FieldStatus.IGNORED
        elif name in model_fields:
            statuses[name] = FieldStatus.IMPLEMENTED
        else:
            raise ValueError(f"OpenAI's field '{name}' has no status")
    return statuses


def field_table(
    endpoints: Mapping[str, Mapping[str, FieldStatus]], openai_fields: frozenset[str], notes: Mapping[str, str]
) -> str:
    """A Markdown table: one row per field of any endpoint, one column per endpoint (``—``: not
    a field there), and the field's note, followed for a refused field by the values accepted
    as if absent; a field outside ``openai_fields`` is marked as an extension."""
    names: list[str] = []
    for statuses in endpoints.values():
        names += [n for n in statuses if n not in names]
    names.sort(key=lambda n: (n not in openai_fields, n))
    lines = [
        "| field | " + " | ".join(f"`{e}`" for e in endpoints) + " | notes |",
        "| --- | " + " | ".join("---" for _ in endpoints) + " | --- |",
    ]
    for name in names:
        label = f"`{name}`" if name in openai_fields else f"`{name}` (extension)"
        cells = [statuses[name].value if name in statuses else "—" for statuses in endpoints.values()]
        note = notes.get(name, "")
        if FieldStatus.REFUSED.value in cells and name in NEUTRAL_VALUES:
            accepted = ", ".join(f"`{json.dumps(v)}`" for v in NEUTRAL_VALUES[name])
            note = f"{note}; accepted as absent: {accepted}" if note else f"accepted as absent: {accepted}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)
