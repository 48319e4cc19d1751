"""Gateway errors and their OpenAI-style HTTP form.

Only the gateway maps errors to status codes. The body is OpenAI's shape:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations


class ConfigError(Exception):
    """The config file is unreadable or invalid; the message names the field and value."""


class APIError(Exception):
    """An error answered to an API client.

    Args:
        status_code: HTTP status.
        message: human-readable reason.
        type: OpenAI error type (``invalid_request_error``, ``not_found_error``, ...).
        param: the request field at fault, if any.
        code: a short machine-readable code, if any.
    """

    def __init__(self, status_code: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str) -> APIError:
    """404 for a model the gateway does not serve."""
    return APIError(404, f"The model '{name}' does not exist", "not_found_error", "model", "model_not_found")
