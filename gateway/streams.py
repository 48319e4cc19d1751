"""Carrying a request's events from a worker thread to the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from buckets.request import EmbeddingEvent, ErrorEvent, RequestEvent, TokenEvent


class EventChannel:
    """An asyncio queue filled from any thread through :meth:`sink`.

    Create it on the event loop; pass :meth:`sink` to the core's request.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()

    def sink(self, event: RequestEvent) -> None:
        """Called by the worker thread: hand the event to the loop (never blocks)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[RequestEvent]:
        """Yield events until the final one (finished token event, embedding, or error)."""
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, (EmbeddingEvent, ErrorEvent)):
                return
            if isinstance(event, TokenEvent) and event.finish_reason is not None:
                return
