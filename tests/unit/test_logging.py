"""gateway.logging: third-party libraries are kept to warnings below DEBUG (their own loggers
and what they log on the root logger), pass at DEBUG, and our own records always pass."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

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


def test_building_the_app_leaves_our_root_handler_and_level_in_place() -> None:
    """litestar's default logging config would swap the root handler (and its third-party
    filter) for its own queue handler at INFO."""
    from gateway.app import create_app
    from gateway.config import parse_config
    from tests.unit.test_config import make_config_data

    configure_logging("warning")
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    create_app(parse_config(make_config_data()))
    assert (list(root.handlers), root.level) == before
    assert any(h.name == HANDLER_NAME for h in root.handlers)


@pytest.mark.parametrize(("verbose", "has_gates"), [(None, False), ("", True), ("true", True), ("1", True), ("false", False), ("0", False)])
def test_health_verbose_bare_or_true_adds_the_gates(verbose: str | None, has_gates: bool) -> None:
    import asyncio
    from types import SimpleNamespace

    from gateway.app import health

    engine = SimpleNamespace(models={})
    residency = SimpleNamespace(loading=lambda: ["loading-model"])
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(engine=engine, residency=residency)))
    body = asyncio.run(health.fn(request=request, verbose=verbose))
    assert body["status"] == "ok" and ("gates" in body) is has_gates
    assert body.get("loading") == (["loading-model"] if has_gates else None)


class RecordingStream:
    """A stderr stand-in that keeps each ``write`` call's text."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        return None


def test_each_event_is_one_write_with_its_newline(monkeypatch: pytest.MonkeyPatch, restored_logging: None) -> None:
    # Two writes (the line, then its newline) let another thread's line land between them,
    # which is how a JSON line and uvicorn's "Application startup complete" once came out joined.
    stream = RecordingStream()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("INFO")
    try:
        structlog.get_logger("sluice.test").info("one_line", n=1)
    finally:
        structlog.reset_defaults()
        monkeypatch.undo()
        configure_logging("INFO")
    assert len(stream.writes) == 1 and stream.writes[0].endswith("}\n") and '"event": "one_line"' in stream.writes[0]
