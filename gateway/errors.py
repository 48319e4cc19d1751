"""Gateway errors and their OpenAI-style HTTP form.

Only the gateway maps errors to status codes, in one place (:func:`to_api_error`). The body is
OpenAI's shape: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from litestar.exceptions import HTTPException

from buckets.errors import (
    BucketClosedError, BucketError, DeadlineExceededError, DeadlineUnmeetableError, QueueFullError,
    SliceUnavailableError, WorkerCrashedError,
)
from models.errors import ModelError

# Union members show up in pydantic's error locations as their type's name ("str",
# "list[str]"); they are not request fields, so a ``param`` leaves them out.
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool"})
# A config's batcher is a union tagged by its ``kind``; the tag shows up in error locations too.
BATCHER_KIND_TAGS = frozenset({"dynamic", "continuous"})


class ConfigError(Exception):
    """The config file is unreadable or invalid; the message names the field and value.

    Args:
        message: what is wrong, starting with the config path where there is one.
        param: that config path (e.g. ``slices.0.memory_budget_bytes``), for API errors.
        code: a machine-readable reason (e.g. ``memory_budget_exceeded``), for API errors.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class APIError(Exception):
    """An error answered to an API client.

    Args:
        status_code: HTTP status.
        message: human-readable reason.
        type: OpenAI error type (``invalid_request_error``, ``not_found_error``, ...).
        param: the request field at fault, if any.
        code: a short machine-readable code, if any.
        headers: extra response headers (``Retry-After`` on a 429).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str) -> APIError:
    """404 for a model the gateway does not serve."""
    return APIError(404, f"The model '{name}' does not exist", "not_found_error", "model", "model_not_found")


def queue_full(model: str, bucket: str, exc: QueueFullError) -> APIError:
    """429 ``rate_limit_error`` with ``Retry-After`` in whole seconds: ``queue_full``, or
    ``queue_wait_exceeds_timeout`` when the queue's expected wait is past the request's timeout."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, DeadlineUnmeetableError):
        message = f"Bucket '{bucket}' of '{model}' cannot start the request in time: {exc.reason}"
        return APIError(429, message, "rate_limit_error", code="queue_wait_exceeds_timeout", headers=headers)
    message = (
        f"The queue of bucket '{bucket}' of '{model}' is full: {exc.reason}; retry after {exc.retry_after_s} s"
    )
    return APIError(429, message, "rate_limit_error", code="queue_full", headers=headers)


def deadline_exceeded(waited_s: float) -> APIError:
    """504 ``timeout``: the request's deadline passed before it produced anything."""
    return APIError(
        504, f"The request timed out after {waited_s:.2f} s, before its first token", "timeout_error", code="timeout"
    )


def model_unavailable(name: str, retry_after_s: int) -> APIError:
    """503 ``model_unavailable`` with ``Retry-After``: the model is draining or unloaded."""
    return APIError(
        503,
        f"The model '{name}' is draining or unloaded and takes no new requests; retry after {retry_after_s} s",
        "service_unavailable_error",
        param="model",
        code="model_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def model_load_failed(name: str, reason: str, retry_after_s: int) -> APIError:
    """503 ``model_load_failed`` with ``Retry-After``: loading the model on demand failed; the
    next request after ``retry_after_s`` tries again."""
    return APIError(
        503, f"The model '{name}' failed to load: {reason}; retry after {retry_after_s} s",
        "service_unavailable_error", param="model", code="model_load_failed", headers={"Retry-After": str(retry_after_s)},
    )


def insufficient_memory(name: str, needed: str, retry_after_s: int) -> APIError:
    """503 ``insufficient_memory`` with ``Retry-After``: the model cannot be loaded now, as the
    models that hold the memory are pinned or loading (``needed`` says what is short)."""
    return APIError(
        503, f"Not enough memory to load the model '{name}' now: {needed}; retry after {retry_after_s} s",
        "service_unavailable_error", param="model", code="insufficient_memory", headers={"Retry-After": str(retry_after_s)},
    )


def model_too_large(name: str, needed_bytes: int, budget_bytes: int, budget: str) -> APIError:
    """503 ``model_too_large``: the model alone needs more than a memory budget holds."""
    return APIError(
        503, f"The model '{name}' needs {needed_bytes} bytes (weights and KV pools), over {budget} of {budget_bytes} bytes",
        "service_unavailable_error", param="model", code="model_too_large",
    )


def load_queue_full(name: str, max_waiters: int, retry_after_s: int) -> APIError:
    """429 ``queue_full`` with ``Retry-After``: ``max_waiters`` requests already wait for the
    model to load."""
    return APIError(
        429, f"{max_waiters} requests already wait for the model '{name}' to load; retry after {retry_after_s} s",
        "rate_limit_error", param="model", code="queue_full", headers={"Retry-After": str(retry_after_s)},
    )


def rate_limited(tenant: str, limit: str, retry_after_s: float, rate_limit_headers: dict[str, str]) -> APIError:
    """429 ``rate_limit_exceeded`` (OpenAI's code for a key over its rate limit): ``tenant``'s
    ``limit`` (``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent_requests``) is
    reached on this gateway. ``Retry-After`` in whole seconds, ``retry-after-ms`` (which OpenAI
    sends and its client prefers) and the ``x-ratelimit-*`` headers go with it."""
    retry_after_ms = max(1, math.ceil(round(retry_after_s * 1000, 6)))
    headers = {
        "Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))), "retry-after-ms": str(retry_after_ms),
        **rate_limit_headers,
    }
    message = f"Rate limit reached for '{tenant}' on {limit} on this gateway; retry after {retry_after_ms / 1000:.3f} s"
    return APIError(429, message, "rate_limit_error", param=None, code="rate_limit_exceeded", headers=headers)


# Seconds a client is asked to wait after its slice's worker process died (it is restarting).
WORKER_RETRY_AFTER_S = 5


def slice_unavailable(model: str, bucket: str, exc: SliceUnavailableError) -> APIError:
    """503 ``slice_unavailable`` with ``Retry-After``: the worker process of the bucket's slice is
    (re)starting."""
    return APIError(
        503,
        f"Bucket '{bucket}' of '{model}' is not serving: {exc.reason}; retry after {exc.retry_after_s} s",
        "service_unavailable_error",
        code="slice_unavailable",
        headers={"Retry-After": str(exc.retry_after_s)},
    )


def worker_crashed(error: WorkerCrashedError) -> APIError:
    """503 ``worker_crashed`` with ``Retry-After``: the worker process running the request died
    (the gateway restarts it)."""
    return APIError(
        503,
        f"The request failed: {error}; retry after {WORKER_RETRY_AFTER_S} s",
        "service_unavailable_error",
        code="worker_crashed",
        headers={"Retry-After": str(WORKER_RETRY_AFTER_S)},
    )


def validation_error(exc: ValidationError, status_code: int = 400) -> APIError:
    """400 for a request body that fails validation; ``param`` is the dotted path of the field at
    fault (see :func:`_deepest_error`)."""
    param, message = _deepest_error(exc, _UNION_MEMBER_TAGS)
    return APIError(status_code, f"{param}: {message}" if param else message, "invalid_request_error", param or None)


def config_validation_error(exc: ValidationError, field_path: Callable[[str], str] | None = None) -> APIError:
    """422 ``invalid_config`` for an admin change that fails validation as a config; ``param`` is
    the field's path in the config (``models.0.buckets.1.batcher.max_num_seqs``), with the
    batcher's ``kind`` tag left out, and ``field_path`` maps it when ``exc`` validated a part
    of the config (a PATCH body's knob name) rather than the whole."""
    param, message = _deepest_error(exc, _UNION_MEMBER_TAGS | BATCHER_KIND_TAGS)
    if field_path is not None:
        param = field_path(param)
    return APIError(422, f"{param}: {message}" if param else message, "invalid_request_error", param or None, "invalid_config")


def _deepest_error(exc: ValidationError, tags: frozenset[str]) -> tuple[str, str]:
    """``(param, message)`` of the one of pydantic's errors with the deepest path, so a list item
    that fails every member of a union names the item (``input.1``) rather than the union
    (``input``). A model-level validator words its message ``relative.path: reason`` (as the
    config's do); that path is appended to the model's own."""
    errors = exc.errors()
    paths = [error_param(err, tags) for err in errors]
    index = max(range(len(errors)), key=lambda i: len(paths[i].split(".")) if paths[i] else 0)
    message = errors[index]["msg"].removeprefix("Value error, ")
    param = paths[index]
    relative = re.match(r"^([\w.]+): ", message) if errors[index]["type"] == "value_error" else None
    if relative:
        param = ".".join(p for p in (param, relative.group(1)) if p)
        message = message[relative.end():]
    return param, message


def error_param(err: ErrorDetails, tags: frozenset[str] = _UNION_MEMBER_TAGS) -> str:
    """``("messages", 2, "role")`` -> ``"messages.2.role"``, union member (and other ``tags``) left out."""
    parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in tags or "[" in p))]
    return ".".join(parts)


# Codes for litestar's own HTTP errors, in OpenAI's style.
_HTTP_ERROR_CODES = {413: "request_too_large"}


def to_api_error(exc: Exception, model: str = "", bucket: str = "", waited_s: float = 0.0) -> APIError:
    """The HTTP form of an error: the one place domain errors become status codes.

    Args:
        exc: an :class:`APIError` (returned as it is), a ``buckets/`` error, a ``models/`` error,
            a :class:`ConfigError`, a pydantic ``ValidationError`` or one of litestar's HTTP errors.
        model, bucket: names for the message, where the error came from a bucket.
        waited_s: seconds since the request arrived, for a timeout's message.
    Returns:
        429 with ``Retry-After`` for a full queue or an unmeetable deadline; 503 with
        ``Retry-After`` for a restarting slice, a crashed worker or a replaced bucket; 504 for a
        deadline that passed; 422 for an invalid config change; 400 for a body that fails
        validation; 500 ``request failed`` for a failed batch and for any other exception (the
        error a model's forward raised); litestar's status for its own errors.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full(model, bucket, exc)
    if isinstance(exc, SliceUnavailableError):
        return slice_unavailable(model, bucket, exc)
    if isinstance(exc, WorkerCrashedError):
        return worker_crashed(exc)
    if isinstance(exc, DeadlineExceededError):
        return deadline_exceeded(waited_s)
    if isinstance(exc, BucketClosedError):
        return model_unavailable(model, 1)
    if isinstance(exc, ConfigError):
        return APIError(422, str(exc), "invalid_request_error", exc.param, exc.code or "invalid_config")
    if isinstance(exc, ModelError):
        return APIError(422, str(exc), "invalid_request_error", code="invalid_model_source")
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind, code=_HTTP_ERROR_CODES.get(exc.status_code), headers=exc.headers)
    return APIError(500, f"request failed: {exc}", "server_error")


def is_domain_error(exc: Exception) -> bool:
    """Whether :func:`to_api_error` knows ``exc``; any other exception reaching the edge is a bug."""
    return isinstance(exc, (APIError, BucketError, ConfigError, ModelError, ValidationError, HTTPException))
