"""Priority with aging, and the slice arbiter that picks which bucket steps next.

Requests carry an integer ``priority``; lower is more urgent (vLLM's convention). A request that
has waited ``w`` seconds has the *effective* priority ``priority - w / aging_s``, so every
``aging_s`` seconds of waiting is worth one priority level and nothing starves.

Because every waiting request ages at the same rate, the order by effective priority never
changes while requests wait: ``priority - (now - arrival_s) / aging_s`` orders like the fixed key
``priority + arrival_s / aging_s``. The queue is therefore a plain heap on that key (ties by
arrival order), with no re-sorting as time passes.

Starvation bound: a request of priority ``p`` that arrived at ``t`` is served before every request
of priority ``q < p`` that arrives after ``t + (p - q) * aging_s``; under a steady stream of
urgent requests it waits at most that long plus the time to drain the urgent requests already
queued at that instant.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


def priority_key(priority: int, arrival_s: float, aging_s: float) -> float:
    """The fixed sort key of a waiting request: ``priority + arrival_s / aging_s`` (lower first).

    Raises:
        ValueError: ``aging_s`` is not positive.
    """
    if aging_s <= 0:
        raise ValueError(f"aging_s must be > 0, got {aging_s}")
    return priority + arrival_s / aging_s


def effective_priority(priority: int, arrival_s: float, now_s: float, aging_s: float) -> float:
    """``priority - waited / aging_s``, the waited seconds being ``now_s - arrival_s`` (lower is more urgent)."""
    return priority_key(priority, arrival_s, aging_s) - now_s / aging_s


@dataclass(order=True)
class _Entry(Generic[T]):
    key: float
    order: int
    item: T = field(compare=False)


class AgingPriorityQueue(Generic[T]):
    """Waiting requests ordered by effective priority with aging, then arrival order.

    Args:
        aging_s: seconds of waiting worth one priority level.

    ``push`` takes the item's ``priority`` and ``arrival_s`` (seconds on the caller's clock); an
    item pushed back after preemption keeps its original arrival, so it returns near the front.
    Removing an arbitrary item (a cancelled request) is O(n).
    """

    def __init__(self, aging_s: float):
        priority_key(0, 0.0, aging_s)  # validates aging_s
        self.aging_s = aging_s
        self._heap: list[_Entry[T]] = []
        self._orders = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[T]:
        """Items in the order they would be popped."""
        return (entry.item for entry in sorted(self._heap))

    def push(self, item: T, priority: int, arrival_s: float) -> None:
        heapq.heappush(self._heap, _Entry(priority_key(priority, arrival_s, self.aging_s), next(self._orders), item))

    def peek(self) -> T:
        """The most urgent item. Raises IndexError when empty."""
        return self._heap[0].item

    def peek_key(self) -> float | None:
        """The most urgent item's fixed key, or ``None`` when empty."""
        return self._heap[0].key if self._heap else None

    def pop(self) -> T:
        """Remove and return the most urgent item. Raises IndexError when empty."""
        return heapq.heappop(self._heap).item

    def remove(self, item: T) -> None:
        """Remove ``item`` (compared by identity). Raises ValueError if it is not queued."""
        for index, entry in enumerate(self._heap):
            if entry.item is item:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("item is not in the queue")


class SliceArbiter:
    """Picks which of a slice's buckets steps next.

    The bucket whose most urgent request has the best (lowest) effective priority goes next, ties
    to the lower index; but no bucket runs more than ``max_consecutive_steps`` steps in a row
    while another bucket has work, so a short-prompt bucket is never stuck behind a long prefill.

    Raises:
        ValueError: ``max_consecutive_steps`` below 1.
    """

    def __init__(self, max_consecutive_steps: int):
        if max_consecutive_steps < 1:
            raise ValueError(f"max_consecutive_steps must be >= 1, got {max_consecutive_steps}")
        self.max_consecutive_steps = max_consecutive_steps
        self._last: int | None = None
        self._streak = 0

    def pick(self, head_priorities: list[float | None]) -> int | None:
        """Index of the bucket to step, from each bucket's best effective priority now
        (``None``: no work); ``None`` when no bucket has work."""
        ready = [i for i, p in enumerate(head_priorities) if p is not None]
        if not ready:
            return None
        if self._last in ready and self._streak >= self.max_consecutive_steps and len(ready) > 1:
            ready.remove(self._last)
        chosen = min(ready, key=lambda i: (head_priorities[i], i))
        self._streak = self._streak + 1 if chosen == self._last else 1
        self._last = chosen
        return chosen
