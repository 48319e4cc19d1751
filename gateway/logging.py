"""structlog set-up: JSON lines on stderr, one event per finished request; third-party
libraries kept to warnings and errors unless the level is ``DEBUG``.

Our own events go through structlog straight to stderr. The standard ``logging`` tree carries
only what libraries log (ONNX Runtime's quantizer, onnx_ir and onnxscript during an export,
torch, transformers, httpx ...): below ``DEBUG`` their loggers are set to ``WARNING``, and the
root handler drops anything under ``WARNING`` that is not ours, which also catches libraries
that log on the root logger itself (``logging.info(...)``, as onnxruntime's quantizer does).
"""

from __future__ import annotations

import logging
import sys

import structlog

from buckets.request import Request

# Libraries that log at INFO while a gateway starts or serves (their child loggers follow).
QUIET_LIBRARIES = (
    "onnxruntime", "onnx", "onnx_ir", "onnxscript", "torch", "transformers", "huggingface_hub",
    "httpx", "httpcore", "urllib3", "filelock", "asyncio", "uvicorn.access", "multipart",
)
# The root handler configure_logging adds (found again by this name when called twice).
HANDLER_NAME = "sluice-stderr"
# Our packages: their standard-library records pass at any configured level.
OWN_PACKAGES = ("gateway", "buckets", "models", "policies", "bench", "sluice")


class ThirdPartyFilter(logging.Filter):
    """Passes records at ``WARNING`` or above, and records of :data:`OWN_PACKAGES`; drops the
    rest (a library's INFO and DEBUG lines). Attached to the root handler below ``DEBUG``."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is written."""
        if record.levelno >= logging.WARNING:
            return True
        return record.name.partition(".")[0] in OWN_PACKAGES


def configure_logging(level: str = "INFO") -> None:
    """Render every log event as one JSON line with an ISO timestamp and level, at ``level``
    (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``); below ``DEBUG``, third-party libraries
    log ``WARNING`` and above only. Safe to call again (a worker process, a test): the root
    handler is ours, added once, and its filter follows the latest level."""
    level = level.upper()
    is_debug = logging.getLevelName(level) == logging.DEBUG
    root = logging.getLogger()
    root.setLevel(level)
    handler = next((h for h in root.handlers if h.get_name() == HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    for old in [f for f in handler.filters if isinstance(f, ThirdPartyFilter)]:
        handler.removeFilter(old)
    if not is_debug:
        handler.addFilter(ThirdPartyFilter())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.NOTSET if is_debug else logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        # One write per event, the newline included: print() writes the line and its newline
        # separately, and another thread's log line (uvicorn's, say) could land between them.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def log_request_finished(model: str, request: Request, completion_tokens: int, outcome: str) -> None:
    """Log a request's timeline once, in milliseconds since its arrival, with its tenant and priority."""
    arrival = request.timeline.get("arrival", 0.0)
    timeline_ms = {k: round((v - arrival) * 1000, 3) for k, v in request.timeline.items()}
    structlog.get_logger("sluice.request").info(
        "request_finished",
        request_id=request.request_id,
        model=model,
        bucket=request.info.get("bucket"),
        tenant=request.tenant,
        priority=request.priority,
        outcome=outcome,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=completion_tokens,
        timeline_ms=timeline_ms,
        batches=[{"id": b, "index": i} for b, i in request.batches[:8]],
        num_batches=len(request.batches),
    )
