"""Carrying a request's events from a worker thread to the event loop, and interrupting the wait
when the request's deadline passes or its client hangs up.

A deadline that passes while a request generates is the core's to end: its next step drops the
sequence and sends a last event with ``finish_reason: "timeout"`` and the text held back for stop
strings (:meth:`buckets.output.OutputProcessor.process`). The edge's deadline is then only a
backstop, ``DEADLINE_BACKSTOP_S`` later, for a core whose step runs long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from buckets.request import Request, RequestEvent

# Seconds after a generating request's deadline the edge interrupts its wait itself, when the
# core's own timeout event (due at its next step) has not come: a step on a loaded CPU takes
# well under this, so the backstop fires only for a core that is stuck or far behind.
DEADLINE_BACKSTOP_S = 1.0


class InterruptReason(Enum):
    """Why the wait for a request's events ended on the event loop's side."""

    TIMEOUT = "timeout"  # the request's deadline passed
    DISCONNECTED = "disconnected"  # the client hung up


@dataclass(frozen=True)
class Interrupt:
    """The wait for a request's events ended on the event loop's side; the core request has
    been cancelled."""

    reason: InterruptReason


ChannelItem = RequestEvent | Interrupt


@dataclass(frozen=True)
class EventTimings:
    """Where the gateway's share of a token's time is observed, in seconds (``perf_counter``):
    ``observe_hop`` gets the time from the worker's sink call to the event loop running it,
    ``observe_chunk`` the time from then until the event's SSE chunk was handed to the
    connection (:meth:`EventChannel.chunk_sent`)."""

    observe_hop: Callable[[float], None]
    observe_chunk: Callable[[float], None]


class EventChannel:
    """An asyncio queue filled from any thread through :meth:`sink`, or from the loop through
    :meth:`interrupt`.

    Create it on the event loop; pass :meth:`sink` to the core's request. With ``timings``, each
    event's hop to the loop is observed, and a streaming response calls :meth:`chunk_sent`
    once the chunk of the event it last took is written.
    """

    def __init__(self, timings: EventTimings | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[ChannelItem, float]] = asyncio.Queue()
        self._timings = timings
        self._taken_arrival_s = 0.0  # when the item next() returned last reached the loop
        self.has_events = False  # an event of the core has reached the loop (the request started producing)

    def sink(self, event: RequestEvent) -> None:
        """Called by the worker thread: hand the event to the loop (never blocks)."""
        self._loop.call_soon_threadsafe(self._put, event, time.perf_counter())

    def _put(self, event: RequestEvent, sent_s: float) -> None:
        arrival_s = time.perf_counter()
        if self._timings is not None:
            self._timings.observe_hop(arrival_s - sent_s)
        self.has_events = True
        self._queue.put_nowait((event, arrival_s))

    def interrupt(self, reason: InterruptReason) -> None:
        """Called on the loop: queue an :class:`Interrupt` after what is queued."""
        self._queue.put_nowait((Interrupt(reason), time.perf_counter()))

    async def next(self) -> ChannelItem:
        """The next event or interrupt."""
        item, self._taken_arrival_s = await self._queue.get()
        return item

    def chunk_sent(self) -> None:
        """Observe the time from the last item's arrival on the loop until now, when its chunk
        has been handed to the connection (nothing without ``timings``)."""
        if self._timings is not None:
            self._timings.observe_chunk(time.perf_counter() - self._taken_arrival_s)


class RequestWatch:
    """Ends the wait on ``channels`` when ``deadline_s`` passes or the HTTP client disconnects.

    On a hang-up, every core request in ``requests`` is cancelled (the batcher drops it and frees
    its blocks at its next step) and each channel gets an :class:`Interrupt`. At the deadline, a
    request whose channel has had no event yet (still queued, or in its first prefill) is
    cancelled and interrupted at once, so its 504 comes on time however long the model's current
    step takes; one that has produced events is left to the core, which ends it at its next step
    with its last tokens and ``finish_reason: "timeout"``, and is cancelled and interrupted only
    if that has not happened ``backstop_s`` later. The timers run on the event loop.

    The disconnect watch reads the ASGI ``receive`` channel (the body has been read by then, so
    the next message is ``http.disconnect``). Stop it with :meth:`stop_disconnect_watch` before
    handing the connection to a streaming response, which listens for the disconnect itself.

    Args:
        requests: the core requests to cancel.
        channels: their event channels, in the same order.
        deadline_s: ``time.monotonic()`` seconds; ``None``: no deadline.
        receive: the ASGI receive callable; ``None``: no disconnect watch.
        backstop_s: seconds past the deadline the edge ends a generating request itself.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        channels: Sequence[EventChannel],
        deadline_s: float | None,
        receive: Callable[[], Any] | None,
        backstop_s: float = DEADLINE_BACKSTOP_S,
    ):
        self._requests = requests
        self._channels = channels
        self._backstop_s = backstop_s
        self.reason: InterruptReason | None = None
        self._loop = asyncio.get_running_loop()
        self._timers: list[asyncio.TimerHandle] = []
        if deadline_s is not None:
            self._timers.append(self._loop.call_later(max(0.0, deadline_s - time.monotonic()), self._deadline_passed))
        self._watcher = asyncio.ensure_future(self._watch(receive)) if receive is not None else None

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self._fire(InterruptReason.DISCONNECTED)
                return

    def _deadline_passed(self) -> None:
        """Interrupt the waits with no event yet; give the generating ones ``backstop_s`` more."""
        if self.reason is not None:
            return
        self.reason = InterruptReason.TIMEOUT
        generating = [(r, c) for r, c in zip(self._requests, self._channels) if c.has_events]
        self._interrupt([(r, c) for r, c in zip(self._requests, self._channels) if not c.has_events], self.reason)
        if generating:
            self._timers.append(self._loop.call_later(self._backstop_s, self._interrupt, generating, self.reason))

    def _fire(self, reason: InterruptReason) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        self._interrupt(list(zip(self._requests, self._channels)), reason)

    @staticmethod
    def _interrupt(waits: list[tuple[Request, EventChannel]], reason: InterruptReason) -> None:
        for request, channel in waits:
            request.cancel("timeout" if reason is InterruptReason.TIMEOUT else "cancelled")
            channel.interrupt(reason)

    def stop_disconnect_watch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        """Stop both watches (the request has finished or been answered)."""
        self.stop_disconnect_watch()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
