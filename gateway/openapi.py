"""Request bodies in the served OpenAPI document, generated from the pydantic models that validate them.

The POST handlers read their bodies themselves (``parse_body``, for OpenAI-style error bodies), so
litestar sees no ``data`` parameter and documents no body. ``RequestBodySchemas`` gives each of
those routes an ``Operation`` class that carries the body's JSON Schema. litestar rebuilds
``components.schemas`` from its own registry, so the models' ``$defs`` are inlined, not referenced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.plugins import ReceiveRoutePlugin
from litestar.routes import BaseRoute, HTTPRoute
from pydantic import BaseModel

from gateway.adapter_routes import AddAdapterBody, LoadLoraAdapterBody, UnloadLoraAdapterBody
from gateway.admin import BucketPatch, LayoutBody
from gateway.config import ModelConfig
from gateway.schemas import ChatCompletionBody, CompletionBody, DetokenizeBody, EmbeddingBody, TokenizeBody

# The body model of each route that reads a body, by (method, full path as litestar registers it).
REQUEST_BODIES: Mapping[tuple[str, str], type[BaseModel]] = {
    ("POST", "/v1/completions"): CompletionBody,
    ("POST", "/v1/chat/completions"): ChatCompletionBody,
    ("POST", "/v1/embeddings"): EmbeddingBody,
    ("POST", "/tokenize"): TokenizeBody,
    ("POST", "/detokenize"): DetokenizeBody,
    ("POST", "/admin/models"): ModelConfig,
    ("PUT", "/admin/models/{model:str}/buckets"): LayoutBody,
    ("PATCH", "/admin/models/{model:str}/buckets/{bucket:str}"): BucketPatch,
    ("POST", "/admin/models/{base:str}/adapters"): AddAdapterBody,
    ("POST", "/v1/load_lora_adapter"): LoadLoraAdapterBody,
    ("POST", "/v1/unload_lora_adapter"): UnloadLoraAdapterBody,
}

# pydantic leaves a constraint on a union (``StrictFloat | StrictInt = Field(ge=0)``) under its
# keyword argument's name; these are its JSON Schema keywords.
_CONSTRAINT_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
# Keywords whose value is one schema, a list of schemas, or a name-to-schema mapping.
_SUBSCHEMA_KEYWORDS = {"items", "additionalProperties", "not"}
_SUBSCHEMA_LIST_KEYWORDS = {"anyOf", "allOf", "oneOf"}
_SUBSCHEMA_MAP_KEYWORDS = {"properties"}
# Schema's field name for each JSON Schema keyword that differs from it ("anyOf" -> "any_of").
_FIELD_NAMES = {f.metadata.get("alias", f.name): f.name for f in fields(Schema)}
# litestar's Schema has no alias for ``exclusive_maximum`` (it would be written in snake case), so
# an exclusive upper bound is documented as an inclusive one; validation stays exclusive.
_FIELD_NAMES["exclusiveMaximum"] = "maximum"


class RequestBodySchemas(ReceiveRoutePlugin):
    """A litestar plugin: documents the JSON body of each route and method named in ``bodies``.

    litestar calls ``receive_route`` as each route is registered, before the schema is built.
    """

    def __init__(self, bodies: Mapping[tuple[str, str], type[BaseModel]] = REQUEST_BODIES) -> None:
        self._bodies = dict(bodies)

    def receive_route(self, route: BaseRoute) -> None:
        """Give each handler of a route and method named in ``bodies`` an operation class with its body."""
        if not isinstance(route, HTTPRoute):
            return
        for handler in route.route_handlers:
            for method in handler.http_methods:
                model = self._bodies.get((method, route.path))
                if model is not None:
                    handler.operation_class = operation_with_body(model)


def operation_with_body(model: type[BaseModel]) -> type[Operation]:
    """An ``Operation`` subclass whose request body is ``model`` as required ``application/json``."""
    body = RequestBody(
        content={"application/json": OpenAPIMediaType(schema=body_schema(model))},
        required=True,
    )

    @dataclass
    class BodyOperation(Operation):
        def __post_init__(self) -> None:
            self.request_body = body

    BodyOperation.__name__ = BodyOperation.__qualname__ = f"{model.__name__}Operation"
    return BodyOperation


def body_schema(model: type[BaseModel]) -> Schema:
    """``model``'s validation JSON Schema as a litestar ``Schema``, with its ``$defs`` inlined.

    Raises:
        ValueError: for a ``$ref`` outside the model's own ``$defs`` or a recursive model.
    """
    raw = model.model_json_schema(ref_template="#/$defs/{model}")
    defs = raw.pop("$defs", {})
    return _to_schema(_inline(raw, defs, ()))


def _inline(value: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    """``value`` with each ``{"$ref": "#/$defs/X", ...}`` replaced by ``X``'s schema plus its siblings."""
    if isinstance(value, list):
        return [_inline(v, defs, seen) for v in value]
    if not isinstance(value, dict):
        return value
    ref = value.get("$ref")
    if ref is None:
        return {k: _inline(v, defs, seen) for k, v in value.items()}
    name = ref.removeprefix("#/$defs/")
    if name not in defs or name in seen:
        raise ValueError(f"cannot inline $ref {ref!r} (unknown or recursive)")
    siblings = {k: v for k, v in value.items() if k != "$ref"}
    return _inline({**defs[name], **siblings}, defs, (*seen, name))


def _to_schema(raw: dict[str, Any]) -> Schema:
    """A JSON Schema object (no ``$ref`` left) as a litestar ``Schema``."""
    kwargs: dict[str, Any] = {}
    for keyword, value in raw.items():
        keyword = _CONSTRAINT_KEYWORDS.get(keyword, keyword)
        if keyword in _SUBSCHEMA_KEYWORDS and isinstance(value, dict):
            value = _to_schema(value)
        elif keyword in _SUBSCHEMA_LIST_KEYWORDS:
            value = [_to_schema(v) for v in value]
        elif keyword in _SUBSCHEMA_MAP_KEYWORDS:
            value = {name: _to_schema(v) for name, v in value.items()}
        elif keyword == "type":
            value = [OpenAPIType(t) for t in value] if isinstance(value, list) else OpenAPIType(value)
        if keyword not in _FIELD_NAMES:
            raise ValueError(f"JSON Schema keyword {keyword!r} has no litestar Schema field")
        kwargs[_FIELD_NAMES[keyword]] = value
    return Schema(**kwargs)

