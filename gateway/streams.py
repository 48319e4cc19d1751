"""Carrying a request's events from a worker thread to the event loop, and interrupting the wait
when the request's deadline passes or its client hangs up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from buckets.request import Request, RequestEvent


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


class EventChannel:
    """An asyncio queue filled from any thread through :meth:`sink`, or from the loop through
    :meth:`interrupt`.

    Create it on the event loop; pass :meth:`sink` to the core's request.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[ChannelItem] = asyncio.Queue()

    def sink(self, event: RequestEvent) -> None:
        """Called by the worker thread: hand the event to the loop (never blocks)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def interrupt(self, reason: InterruptReason) -> None:
        """Called on the loop: queue an :class:`Interrupt` after what is queued."""
        self._queue.put_nowait(Interrupt(reason))

    async def next(self) -> ChannelItem:
        """The next event or interrupt."""
        return await self._queue.get()


class RequestWatch:
    """Ends the wait on ``channels`` when ``deadline_s`` passes or the HTTP client disconnects.

    On either, every core request in ``requests`` is cancelled (the batcher drops it and frees its
    blocks at its next step) and each channel gets an :class:`Interrupt`. The deadline is a timer
    on the event loop, so it fires on time however long the model's current step takes.

    The disconnect watch reads the ASGI ``receive`` channel (the body has been read by then, so
    the next message is ``http.disconnect``). Stop it with :meth:`stop_disconnect_watch` before
    handing the connection to a streaming response, which listens for the disconnect itself.

    Args:
        requests: the core requests to cancel.
        channels: their event channels.
        deadline_s: ``time.monotonic()`` seconds; ``None``: no deadline.
        receive: the ASGI receive callable; ``None``: no disconnect watch.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        channels: Sequence[EventChannel],
        deadline_s: float | None,
        receive: Callable[[], Any] | None,
    ):
        self._requests = requests
        self._channels = channels
        self.reason: InterruptReason | None = None
        loop = asyncio.get_running_loop()
        self._timer = None
        if deadline_s is not None:
            self._timer = loop.call_later(max(0.0, deadline_s - time.monotonic()), self._fire, InterruptReason.TIMEOUT)
        self._watcher = asyncio.ensure_future(self._watch(receive)) if receive is not None else None

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self._fire(InterruptReason.DISCONNECTED)
                return

    def _fire(self, reason: InterruptReason) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        for request in self._requests:
            request.cancel("timeout" if reason is InterruptReason.TIMEOUT else "cancelled")
        for channel in self._channels:
            channel.interrupt(reason)

    def stop_disconnect_watch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        """Stop both watches (the request has finished or been answered)."""
        self.stop_disconnect_watch()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
