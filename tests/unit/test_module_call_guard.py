"""The guard between torch.fx traces and module calls on other threads
(:mod:`models.module_call_guard`): without it, a module called on another thread while fx's own
tracer traces raises ``NameError``; with it, the trace waits for the forwards in progress and
the forwards wait for the trace, and make_fx's tracer is not held back."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.fx

from models.module_call_guard import GUARD, ModuleCallGuard
from tests.e2e.conftest import wait_for

TIMEOUT_S = 30


def run_in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except Exception as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def traced_while(inside: threading.Event, leave: threading.Event, trace: Any) -> torch.fx.GraphModule:
    """fx's own tracer on a function that, while being traced, lets another thread call a module."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        assert leave.wait(TIMEOUT_S)
        return x + 1

    return trace(torch.fx.Tracer(), fn)


def test_without_the_guard_a_module_called_during_an_fx_trace_fails() -> None:
    inside, leave = threading.Event(), threading.Event()
    unguarded = torch.fx.Tracer.trace.__wrapped__  # type: ignore[attr-defined]
    thread, _ = run_in_thread(lambda: traced_while(inside, leave, unguarded))
    assert inside.wait(TIMEOUT_S)
    try:
        with pytest.raises(NameError, match="not installed as a submodule"):
            torch.nn.Linear(2, 2)(torch.zeros(1, 2))
    finally:
        leave.set()
        thread.join(TIMEOUT_S)


def test_a_trace_waits_for_the_forwards_in_progress_and_new_forwards_wait_for_it() -> None:
    inside, leave = threading.Event(), threading.Event()
    linear = torch.nn.Linear(2, 2)
    with GUARD.module_calls():
        thread, traced = run_in_thread(lambda: traced_while(inside, leave, torch.fx.Tracer.trace))
        wait_for(lambda: GUARD._num_waiting_tracers == 1, TIMEOUT_S, "the trace waits for the forward")
        assert not inside.is_set()
        linear(torch.zeros(1, 2))  # no trace is on: the call is the module's own
    assert inside.wait(TIMEOUT_S)  # the forward is over: the trace runs
    entered = threading.Event()

    def forward() -> None:
        with GUARD.module_calls():
            entered.set()

    waiting = threading.Thread(target=forward, daemon=True)
    waiting.start()
    assert not entered.wait(0.2)  # a new forward waits while the trace holds the guard
    leave.set()
    thread.join(TIMEOUT_S)
    assert entered.wait(TIMEOUT_S)  # and runs once it is over
    waiting.join(TIMEOUT_S)
    assert "error" not in traced and isinstance(traced["value"], torch.fx.Graph)
    assert GUARD._num_calling == 0 and GUARD._tracer is None


def test_a_make_fx_trace_does_not_wait_for_forwards() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    with GUARD.module_calls():
        thread, traced = run_in_thread(lambda: make_fx(lambda x: x * 2)(torch.ones(2)))
        thread.join(TIMEOUT_S)
    assert isinstance(traced["value"], torch.fx.GraphModule)


def test_a_trace_inside_its_own_forward_waits_only_for_the_others() -> None:
    guard = ModuleCallGuard()
    with guard.module_calls():
        with guard.tracing():
            assert guard._tracer == threading.get_ident()
    assert guard._tracer is None and guard._num_calling == 0


def test_a_trace_that_cannot_get_the_guard_goes_ahead_after_the_wait() -> None:
    guard = ModuleCallGuard(wait_s=0.05)
    holder_in, holder_out = threading.Event(), threading.Event()

    def hold() -> None:
        with guard.module_calls():
            holder_in.set()
            assert holder_out.wait(TIMEOUT_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holder_in.wait(TIMEOUT_S)
    with guard.tracing():
        assert guard._tracer is None  # not held: it went ahead
    holder_out.set()
    holder.join(TIMEOUT_S)
    assert guard._num_calling == 0 and guard._num_waiting_tracers == 0
