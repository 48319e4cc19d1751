"""structlog set-up: JSON lines on stderr, one event per finished request."""

from __future__ import annotations

import logging
import sys

import structlog

from buckets.request import Request


def configure_logging(level: str = "INFO") -> None:
    """Render every log event as one JSON line with an ISO timestamp and level."""
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def log_request_finished(model: str, request: Request, completion_tokens: int, outcome: str) -> None:
    """Log a request's timeline once, in milliseconds since its arrival."""
    arrival = request.timeline.get("arrival", 0.0)
    timeline_ms = {k: round((v - arrival) * 1000, 3) for k, v in request.timeline.items()}
    structlog.get_logger("sluice.request").info(
        "request_finished",
        request_id=request.request_id,
        model=model,
        bucket=request.info.get("bucket"),
        outcome=outcome,
        prompt_tokens=request.num_prompt_tokens,
        completion_tokens=completion_tokens,
        timeline_ms=timeline_ms,
        batches=[{"id": b, "index": i} for b, i in request.batches[:8]],
        num_batches=len(request.batches),
    )
