"""gateway.logging: third-party libraries are kept to warnings below DEBUG (their own loggers
and what they log on the root logger), pass at DEBUG, and our own records always pass."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from gateway.logging import HANDLER_NAME, QUIET_LIBRARIES, ThirdPartyFilter, configure_logging


@pytest.fixture()
def restored_logging() -> Iterator[None]:
    """Put the root logger and the quieted libraries back as they were after the test."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    levels = {name: logging.getLogger(name).level for name in QUIET_LIBRARIES}
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)


def our_handler() -> logging.Handler:
    return next(h for h in logging.getLogger().handlers if h.get_name() == HANDLER_NAME)


def record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "a line", None, None)


def passes(handler: logging.Handler, name: str, level: int) -> bool:
    """Whether a record of ``name`` at ``level`` reaching the root handler is written."""
    return logging.getLogger(name).isEnabledFor(level) and bool(handler.filter(record(name, level)))


@pytest.mark.usefixtures("restored_logging")
def test_at_info_libraries_log_warnings_only_and_ours_pass() -> None:
    configure_logging("info")
    handler = our_handler()
    assert logging.getLogger("onnxruntime.quantization.onnx_quantizer").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("onnx_ir.passes").getEffectiveLevel() == logging.WARNING
    for name in ("onnx_ir.passes", "onnxscript", "torch.onnx", "transformers.modeling_utils", "httpx"):
        assert not passes(handler, name, logging.INFO), name
        assert passes(handler, name, logging.WARNING), name
    assert not handler.filter(record("root", logging.INFO))  # onnxruntime's quantizer logs on root
    assert passes(handler, "models.paged_attention", logging.INFO)
    assert passes(handler, "gateway.engine", logging.INFO)


@pytest.mark.usefixtures("restored_logging")
def test_at_debug_everything_passes_and_a_second_call_reuses_the_handler() -> None:
    configure_logging("INFO")
    configure_logging("DEBUG")
    handlers = [h for h in logging.getLogger().handlers if h.get_name() == HANDLER_NAME]
    assert len(handlers) == 1 and not any(isinstance(f, ThirdPartyFilter) for f in handlers[0].filters)
    assert logging.getLogger("onnxruntime.quantization").getEffectiveLevel() == logging.DEBUG
    assert passes(handlers[0], "onnx_ir.passes", logging.INFO) and handlers[0].filter(record("root", logging.DEBUG))
    configure_logging("INFO")
    assert sum(isinstance(f, ThirdPartyFilter) for f in our_handler().filters) == 1
