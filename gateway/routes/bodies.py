"""Reading and checking the bodies of the OpenAI routes: JSON parsing with the field rule, the
token budgets, deadlines, priorities, input counts, token ids and sampling parameters."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from litestar import Request
from pydantic import BaseModel, ValidationError

from gateway.access_log import note
from gateway.config import ModelConfig
from gateway.engine import ServedModel
from gateway.errors import invalid_request, validation_error
from gateway.router import Router
from gateway.schemas import ChatCompletionBody, CompletionBody, EmbeddingBody, EndpointBody
from gateway.tenants import Tenant
from models.step_io import SamplingParams
from policies.deadlines import TimeoutOverCapError, resolve_timeout_s

BodyT = TypeVar("BodyT", bound=BaseModel)


async def parse_body(request: Request[Any, Any, Any], schema: type[BodyT]) -> BodyT:
    """Parse and validate a JSON body (whatever its declared content type).

    Raises:
        APIError: 400 for malformed JSON (too deeply nested or with too many digits included),
            a field the endpoint refuses (``unsupported_parameter``, see :mod:`gateway.fields`)
            or a field that fails validation (``param`` names it, as a dotted path);
            413 (from litestar) for a body over ``max_request_body_bytes``.
    """
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise invalid_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object", code="invalid_json")
    if isinstance(data.get("model"), str):
        note(request.scope, model=data["model"])  # for the access log, a body that fails validation included
    if issubclass(schema, EndpointBody):
        schema.check_refused(data)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def resolve_max_tokens(served: ServedModel, requested: int | None, default: int, param: str) -> int:
    """The generation budget of one request: ``requested``, else ``default`` clipped to the cap.

    Raises:
        APIError: 400 naming ``param`` when ``requested`` exceeds the model's ``max_tokens_cap``.
    """
    cap = served.config.max_tokens_cap
    if requested is None:
        return default if cap is None else min(default, cap)
    if cap is not None and requested > cap:
        raise invalid_request(
            f"{param} is {requested}, over the cap of {cap} tokens for the model '{served.config.name}'",
            param=param,
            code="max_tokens_exceeded",
        )
    return requested


def resolve_deadline_s(model: ModelConfig, requested_s: float | None, arrival_s: float) -> float | None:
    """The request's deadline (``time.monotonic()`` seconds; ``None``: none) from its body's
    ``timeout`` and the model's ``default_timeout_s`` and ``max_timeout_s`` (``model``: its
    config, known before it is loaded: a load's wait counts against the deadline).

    Raises:
        APIError: 400 (``timeout``, ``timeout_exceeded``) over the model's cap.
    """
    try:
        timeout_s = resolve_timeout_s(requested_s, model.default_timeout_s, model.max_timeout_s)
    except TimeoutOverCapError as exc:
        raise invalid_request(f"{exc} for the model '{model.name}'", param="timeout", code="timeout_exceeded") from None
    return None if timeout_s is None else arrival_s + timeout_s


def check_priority(router: Router, priority: int) -> None:
    """Raises APIError 400 (``priority``) outside the configured ``[min_priority, max_priority]``."""
    low, high = router.engine.config.min_priority, router.engine.config.max_priority
    if not low <= priority <= high:
        raise invalid_request(
            f"priority is {priority}; it must lie in [{low}, {high}] (lower is more urgent)",
            param="priority",
            code="priority_out_of_range",
        )


def resolve_priority(router: Router, tenant: Tenant, body: CompletionBody | ChatCompletionBody | EmbeddingBody) -> int:
    """The request's priority: the body's when it names one (``null`` names none), else the
    tenant's default (:attr:`Tenant.priority`; without one 0, or the tenant's ``max_priority``
    when 0 is more urgent than it may ask).

    Raises:
        APIError: 400 (``priority``) outside the configured range (``priority_out_of_range``)
            or more urgent (lower) than the tenant's ``max_priority`` (``priority_not_allowed``).
    """
    if "priority" not in body.model_fields_set:
        if tenant.priority is not None:
            return tenant.priority
        return 0 if tenant.max_priority is None else max(0, tenant.max_priority)
    check_priority(router, body.priority)
    if tenant.max_priority is not None and body.priority < tenant.max_priority:
        raise invalid_request(
            f"priority is {body.priority}; this API key's requests may ask {tenant.max_priority} at the most urgent "
            "(lower is more urgent)",
            param="priority",
            code="priority_not_allowed",
        )
    return body.priority


def check_num_inputs(served: ServedModel, num_inputs: int) -> None:
    """Raises APIError 400 (``input``) when an embeddings request has more inputs than allowed."""
    limit = served.config.max_embedding_inputs
    if num_inputs > limit:
        raise invalid_request(
            f"input has {num_inputs} items; the model '{served.config.name}' takes at most {limit}",
            param="input",
            code="too_many_inputs",
        )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Raises APIError 400 (``param.<position>``, ``invalid_token_id``) for an id outside
    ``[0, vocab_size)``."""
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"token id {token_id} is outside the vocabulary of {vocab_size} tokens",
                param=f"{param}.{position}",
                code="invalid_token_id",
            )


def sampling_params(served: ServedModel, body: CompletionBody | ChatCompletionBody) -> SamplingParams:
    """The request's :class:`SamplingParams`; a ``null`` processor field is its default (off).

    Raises:
        APIError: 400 naming ``logit_bias.<id>`` when a key is outside the model's vocabulary.
    """
    vocab_size = served.loaded.model_config.vocab_size
    for key in body.logit_bias or {}:
        if int(key) >= vocab_size:
            raise invalid_request(
                f"logit_bias has the token id {key}, outside the vocabulary of the model "
                f"'{served.config.name}' (ids 0 to {vocab_size - 1})",
                param=f"logit_bias.{key}",
            )
    logit_bias = body.logit_bias_pairs()
    return SamplingParams(
        temperature=float(body.temperature), top_p=float(body.top_p), top_k=body.top_k, seed=body.seed,
        frequency_penalty=float(body.frequency_penalty or 0.0),
        presence_penalty=float(body.presence_penalty or 0.0),
        repetition_penalty=float(1.0 if body.repetition_penalty is None else body.repetition_penalty),
        min_p=float(body.min_p or 0.0),
        logit_bias=logit_bias,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens or 0,
    )

