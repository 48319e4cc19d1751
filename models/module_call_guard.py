"""torch.fx traces kept apart from module calls on other threads.

While a torch.fx ``Tracer`` traces, it patches ``torch.nn.Module.__call__`` for the whole
process (``torch/fx/_symbolic_trace.py``, ``_Patcher``), so a module called on any other
thread goes through the tracer's ``call_module``. make_fx's tracer (what AOTAutograd runs in a
torch.compile) only forwards such a call, which is harmless; fx's own ``Tracer.call_module``
asks ``path_of_module`` of it and raises ``NameError: module is not installed as a submodule``
for a module outside the traced root. Inductor runs one such trace per process, at its first
code generation (``torch/_inductor/loop_body.py``, ``InterpreterShim._dummy_gm``), and an
ONNX export or ``torch.fx.symbolic_trace`` run others. A torch.compile in the gateway while a
slice serves (building a gate's winner after the start) failed a SmolLM2 decode step that way.

So the runners' forwards hold :data:`GUARD` shared (:meth:`ModuleCallGuard.module_calls`, a
counter under a lock: about a microsecond a forward), and a trace by a tracer whose
``call_module`` is fx's own holds it exclusively: ``torch.fx.Tracer.trace`` is wrapped once,
when this module is imported. Such traces are short (Inductor's took under a millisecond of a
21 s compile), so serving waits that long at most; make_fx's traces (3.5 s of that compile)
are not held back. A trace on a thread that is itself inside a forward (a compiled backend
compiling in its first call) waits for the other threads' forwards only; one that cannot get
the guard within ``WAIT_S`` (two such threads tracing at once) goes ahead and logs
``trace_guard_timeout``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import structlog
import torch.fx

log = structlog.get_logger(__name__)

WAIT_S = 10.0
F = TypeVar("F", bound=Callable[..., Any])


class ModuleCallGuard:
    """A readers-writer guard that prefers writers: module calls share it, fx traces own it."""

    def __init__(self, wait_s: float = WAIT_S):
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._num_calling = 0  # threads inside module_calls, each counted once
        self._tracer: int | None = None  # the thread that holds it exclusively
        self._num_waiting_tracers = 0
        self._local = threading.local()

    @contextlib.contextmanager
    def module_calls(self) -> Iterator[None]:
        """Hold the guard shared while the calling thread runs modules (reentrant)."""
        depth = getattr(self._local, "depth", 0)
        counted = depth == 0 and self._tracer != threading.get_ident()
        if counted:
            with self._cond:
                while self._tracer is not None or self._num_waiting_tracers:
                    self._cond.wait()
                self._num_calling += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if counted:
                with self._cond:
                    self._num_calling -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Hold the guard exclusively while the calling thread traces (reentrant): no other
        thread is inside :meth:`module_calls` meanwhile."""
        me = threading.get_ident()
        if self._tracer == me:
            yield
            return
        own = 1 if getattr(self._local, "depth", 0) else 0  # its own forward, counted (it was not tracing then)
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            self._num_waiting_tracers += 1
            try:
                while self._tracer is not None or self._num_calling > own:
                    left_s = deadline - time.monotonic()
                    if left_s <= 0:
                        log.warning("trace_guard_timeout", waited_s=self.wait_s, num_calling=self._num_calling)
                        break
                    self._cond.wait(left_s)
                else:
                    self._tracer = me
            finally:
                self._num_waiting_tracers -= 1
        try:
            yield
        finally:
            with self._cond:
                if self._tracer == me:
                    self._tracer = None
                self._cond.notify_all()


GUARD = ModuleCallGuard()


def module_calls(fn: F) -> F:
    """Decorate a method whose body runs modules: it holds :data:`GUARD` shared."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with GUARD.module_calls():
            return fn(*args, **kwargs)

    return guarded  # type: ignore[return-value]


def _install() -> None:
    """Wrap ``torch.fx.Tracer.trace`` once: a tracer with fx's own ``call_module`` traces under
    :meth:`ModuleCallGuard.tracing`."""
    trace = torch.fx.Tracer.trace
    if getattr(trace, "_sluice_guarded", False):
        return
    base_call_module = torch.fx.Tracer.call_module

    def guarded_trace(self: torch.fx.Tracer, *args: Any, **kwargs: Any) -> Any:
        if type(self).call_module is not base_call_module:
            return trace(self, *args, **kwargs)
        with GUARD.tracing():
            return trace(self, *args, **kwargs)

    guarded_trace._sluice_guarded = True  # type: ignore[attr-defined]
    guarded_trace.__wrapped__ = trace  # type: ignore[attr-defined]
    torch.fx.Tracer.trace = guarded_trace  # type: ignore[method-assign]


_install()
