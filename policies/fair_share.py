"""Fair share of a bucket between tenants by tokens served, and a floor against starvation.

Order of a bucket's waiting queue (:class:`FairQueue`): priority first, then fair share within a
priority, then aging. Requests are grouped into *bands* by their integer ``priority``; the band
that goes next is the one whose oldest waiting item has the smallest aged key ``priority +
arrival_s / aging_s`` (:func:`policies.priority.priority_key`: with one tenant the order is
exactly :class:`policies.priority.AgingPriorityQueue`'s); within the band the tenant with the
smallest :class:`VirtualTokenCounter` goes (ties: the older head), and within a tenant the oldest
arrival (a preempted sequence keeps its original arrival, so it returns near the front).

The counter is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI '24, Algorithm 2): each tenant's tokens served divided by its weight; a tenant
that becomes active is lifted to the smallest counter of the other active tenants, so idle time
earns no credit. VTC alone only orders admission: :func:`fair_share_victim` also lets a tenant
under its share of ``max_num_seqs`` take a seat from one over its share.

Starvation floor (``max_starvation_s``): priority must not starve a request. While a more
urgent sequence heads the queue, a waiting sequence whose last progress (its arrival, then every
token it sampled: a chunk that recomputes a preempted sequence's KV is no progress to its client,
so one preempted again mid-recompute stays first in line, and one recomputing is never the
floor's victim) is more than ``max_starvation_s / 2`` old joins first (:meth:`FairQueue.starved`
with ``less_urgent_than`` the head's priority), preempting a running sequence that is not itself
starved when seats or blocks lack (one of its own priority too: with more low-priority streams
than seats, they take turns). Half, because the other half covers the step in progress when the
threshold passes and the step that admits it (each starved sequence is admitted in the first
step that plans after it crosses the threshold): so every admitted sequence samples a token at
least every ``max_starvation_s`` whatever more urgent requests arrive after it, as long as one
step takes under ``max_starvation_s / 4``, at most ``max_num_seqs`` sequences starve at once,
and a recomputing sequence's context fits one step's prefill budget (else add the steps its
recompute takes; swap preemption resumes without recomputing).

With no more urgent request waiting the floor stands aside: within one priority FIFO and the fair
share decide, and a request waits only behind its own tenant's earlier requests and the other
tenants' shares (VTC bounds each backlogged tenant's service). A floor there would turn an
overloaded queue into preemptions: once the queue's wait passed ``max_starvation_s / 2``, every
admission would preempt a running sequence (measured on a bucket of 8 sequences under 68
closed-loop clients of one priority: 30 % fewer tokens served). Overload is for admission limits,
quotas and deadlines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from policies.priority import priority_key

T = TypeVar("T")

# The tenant every request counts as when fair share is off: one group, today's order.
ONE_GROUP = ""


class VirtualTokenCounter:
    """Weighted tokens served per tenant of one bucket, and which tenants are active there.

    A tenant is active while it has a waiting or running sequence in the bucket
    (:meth:`activate` / :meth:`deactivate`, counted per sequence). :meth:`charge` adds
    ``num_tokens / weight``. On becoming active a tenant's counter is lifted to
    ``max(own, min counter of the other active tenants)`` (Sheng et al., OSDI '24, Algorithm 2).

    Memory stays bounded by the tenants active or still ahead of the active ones: an inactive
    tenant whose counter is at most the smallest active counter is forgotten (on its return it
    would be lifted to at least that value, which only grows while some tenant is active), and
    when no tenant is active at all every counter is dropped (nobody waits for anybody).
    """

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._num_live: dict[str, int] = {}  # active tenants: their waiting or running sequences
        self._weights: dict[str, float] = {}  # active tenants' weights (their latest sequence's)

    def counter(self, tenant: str) -> float:
        """``tenant``'s weighted tokens served (0.0 for one never served or forgotten)."""
        return self._counters.get(tenant, 0.0)

    @property
    def weights(self) -> Mapping[str, float]:
        """The active tenants and their weights."""
        return self._weights

    def activate(self, tenant: str, weight: float) -> None:
        """One more waiting or running sequence of ``tenant`` (``weight`` > 0).

        Raises:
            ValueError: ``weight`` is not positive.
        """
        if weight <= 0:
            raise ValueError(f"tenant_weight must be > 0, got {weight} for tenant {tenant!r}")
        num_live = self._num_live.get(tenant, 0)
        if num_live == 0 and self._num_live:
            floor = min(self.counter(other) for other in self._num_live)
            self._counters[tenant] = max(self.counter(tenant), floor)
        self._num_live[tenant] = num_live + 1
        self._weights[tenant] = weight

    def deactivate(self, tenant: str) -> None:
        """One sequence of ``tenant`` left the bucket (finished, failed or cancelled)."""
        num_live = self._num_live[tenant] - 1
        if num_live > 0:
            self._num_live[tenant] = num_live
            return
        del self._num_live[tenant], self._weights[tenant]
        if not self._num_live:
            self._counters.clear()
            return
        floor = min(self.counter(other) for other in self._num_live)
        for name in [n for n, c in self._counters.items() if n not in self._num_live and c <= floor]:
            del self._counters[name]

    def charge(self, tenant: str, num_tokens: int, weight: float) -> None:
        """``tenant`` was served ``num_tokens`` tokens: its counter grows by ``num_tokens / weight``."""
        self._counters[tenant] = self.counter(tenant) + num_tokens / weight

    @property
    def num_remembered(self) -> int:
        """Tenants with a counter kept (active or ahead of every active one)."""
        return len(self._counters)


def fair_share_victim(
    tenant: str, seats: list[tuple[str, int]], weights: Mapping[str, float], max_num_seqs: int, candidates: list[str]
) -> str | None:
    """The tenant that gives up one running sequence so that ``tenant``'s waiting one can join.

    Reason: VTC alone only orders admission; a tenant arriving while long requests of another
    hold every seat would wait for one of them to end, so its TTFT would grow with the other's
    backlog. ``share_t = max_num_seqs * w_t / sum(w of the active tenants)``; tenant ``T``
    (``tenant``) may take a seat from ``U`` when ``r_T + 1 <= share_T`` and ``r_U - 1 >=
    share_U`` (``r``: seats held, ``num_seats``): the slack of one seat each side stops two
    tenants with fractional shares from trading a seat back and forth every step. The scheduler
    asks again after each preemption, so ``T`` takes seats while the conditions hold.

    Args:
        tenant: the tenant of the waiting sequence that finds no seat or no blocks.
        seats: ``(tenant, seats held)`` of each running sequence (1 plus its pending forks).
        weights: the active tenants' weights (``tenant`` among them).
        max_num_seqs: the bucket's seats.
        candidates: tenants whose running sequences may be preempted (same or less urgent priority).
    Returns:
        The candidate furthest over its share that satisfies both conditions, or ``None``.
    """
    num_seats: dict[str, int] = {}
    for name, num in seats:
        num_seats[name] = num_seats.get(name, 0) + num
    total_weight = sum(weights.values())
    if tenant not in weights or total_weight <= 0:
        return None

    def share(name: str) -> float:
        return max_num_seqs * weights.get(name, 0.0) / total_weight

    if num_seats.get(tenant, 0) + 1 > share(tenant):
        return None
    over = [(num_seats.get(u, 0) - share(u), u) for u in candidates if u != tenant and num_seats.get(u, 0) - 1 >= share(u)]
    return max(over)[1] if over else None


class _Prioritised(Protocol):
    @property
    def request(self) -> Any: ...


S = TypeVar("S", bound=_Prioritised)


def priority_victims(priority: int, running: list[S]) -> list[S]:
    """The running sequences a waiting one of ``priority`` may preempt when it finds no seat or
    blocks: those of a less urgent (higher) priority. Priority comes first (vLLM's ``priority``
    scheduling policy preempts the same way); the starvation floor bounds what the preempted
    ones lose, and the scheduler never offers a starved sequence here."""
    return [s for s in running if s.request.priority > priority]


def under_share_tenants(seats: list[tuple[str, int]], weights: Mapping[str, float], max_num_seqs: int) -> frozenset[str]:
    """The active tenants that may take one more seat within their share,
    ``r_t + 1 <= max_num_seqs * w_t / sum(w)`` (as :func:`fair_share_victim` counts): within a
    priority they go before the others, whatever the counters say. VTC's order alone makes a
    tenant whose counter is ahead wait, with a seat of its share free, until the others' counters
    pass it (a few steps for a closed-loop client's every request, which its TTFT pays); the
    counters still order the tenants on each side and charge every token.

    Args:
        seats: ``(tenant, seats held)`` of each running sequence (1 plus its pending forks).
        weights: the active tenants' weights.
        max_num_seqs: the bucket's seats.
    """
    total_weight = sum(weights.values())
    if total_weight <= 0 or len(weights) < 2:
        return frozenset()
    held: dict[str, int] = {}
    for name, num in seats:
        held[name] = held.get(name, 0) + num
    return frozenset(t for t, w in weights.items() if held.get(t, 0) + 1 <= max_num_seqs * w / total_weight)


@dataclass(order=True)
class _Entry(Generic[T]):
    key: float  # priority_key(priority, arrival_s, aging_s)
    order: int  # push order: ties
    item: T = field(compare=False)
    priority: int = field(compare=False)
    group: str = field(compare=False)
    progress_s: float = field(compare=False)


class FairQueue(Generic[T]):
    """Waiting items ordered by priority band, then fair share, then aging (see the module).

    Args:
        aging_s: seconds of waiting worth one priority level.
        counters: the bucket's tenant counters; ``None``: fair share off, every tenant one group
            (then the order is exactly :class:`policies.priority.AgingPriorityQueue`'s).

    Items are compared by identity. A pick costs O(bands x tenants); push O(log n); removing the
    head of a tenant O(log n), another item O(n of its tenant).

    Raises:
        ValueError: ``aging_s`` is not positive.
    """

    def __init__(self, aging_s: float, counters: VirtualTokenCounter | None = None):
        priority_key(0, 0.0, aging_s)  # validates aging_s
        self.aging_s = aging_s
        self.counters = counters
        self._bands: dict[int, dict[str, list[_Entry[T]]]] = {}  # priority -> group -> heap
        self._entries: dict[int, _Entry[T]] = {}  # id(item) -> its entry
        self._by_progress: list[tuple[float, int, int]] = []  # (progress_s, order, id(item)), lazily pruned
        self._orders = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[T]:
        """Items by aged key (arrival order within a priority); the pop order also depends on
        the counters, which change as tokens are served."""
        return (entry.item for entry in sorted(self._entries.values()))

    def push(self, item: T, priority: int, arrival_s: float, tenant: str = ONE_GROUP, progress_s: float | None = None) -> None:
        """Queue ``item`` of ``tenant`` (``priority``, lower more urgent; ``arrival_s`` on the
        caller's clock, kept across preemption), last computed a token at ``progress_s``
        (``None``: at ``arrival_s``)."""
        group = tenant if self.counters is not None else ONE_GROUP
        progress = arrival_s if progress_s is None else progress_s
        entry = _Entry(priority_key(priority, arrival_s, self.aging_s), next(self._orders), item, priority, group, progress)
        heapq.heappush(self._bands.setdefault(priority, {}).setdefault(group, []), entry)
        self._entries[id(item)] = entry
        heapq.heappush(self._by_progress, (progress, entry.order, id(item)))
        if len(self._by_progress) > 2 * len(self._entries) + 64:  # drop the removed items' stale marks
            self._by_progress = [(e.progress_s, e.order, key) for key, e in self._entries.items()]
            heapq.heapify(self._by_progress)

    def _head(self, first: frozenset[str] = frozenset()) -> _Entry[T]:
        """The entry :meth:`peek` returns. Raises IndexError when empty."""
        if not self._entries:
            raise IndexError("peek from an empty FairQueue")
        band = min(self._bands.values(), key=lambda groups: min(heap[0] for heap in groups.values()))
        counters = self.counters
        if counters is None or len(band) == 1:
            return min(heap[0] for heap in band.values())
        return min(
            (heap[0] for heap in band.values()),
            key=lambda e: (e.group not in first, counters.counter(e.group), e.key, e.order),
        )

    def peek(self, first: frozenset[str] = frozenset()) -> T:
        """The item that goes next; within its priority band the tenants of ``first`` (those under
        their share of seats, :func:`under_share_tenants`) before the others. Raises IndexError
        when empty."""
        return self._head(first).item

    def peek_key(self) -> float | None:
        """The smallest aged key waiting (the most urgent effective priority plus ``now / aging_s``),
        or ``None`` when empty."""
        if not self._entries:
            return None
        return min(heap[0].key for groups in self._bands.values() for heap in groups.values())

    def pop(self) -> T:
        """Remove and return the item that goes next. Raises IndexError when empty."""
        item = self._head().item
        self.remove(item)
        return item

    def remove(self, item: T) -> None:
        """Remove ``item`` (by identity). Raises ValueError if it is not queued."""
        entry = self._entries.pop(id(item), None)
        if entry is None:
            raise ValueError("item is not in the queue")
        groups = self._bands[entry.priority]
        heap = groups[entry.group]
        if heap[0] is entry:
            heapq.heappop(heap)
        else:
            heap.remove(entry)
            heapq.heapify(heap)
        if not heap:
            del groups[entry.group]
            if not groups:
                del self._bands[entry.priority]

    def starved(self, before_s: float, less_urgent_than: int | None = None) -> T | None:
        """The item without progress for longest among those whose last progress is before
        ``before_s`` (and, given ``less_urgent_than``, whose priority is above it: less urgent);
        ``None`` when there is none. O(1) while nothing is that old; else O(n)."""
        heap = self._by_progress
        while heap:
            progress_s, order, key = heap[0]
            entry = self._entries.get(key)
            if entry is None or entry.order != order:  # removed (or removed and pushed again)
                heapq.heappop(heap)
                continue
            if progress_s >= before_s:
                return None
            if less_urgent_than is None or entry.priority > less_urgent_than:
                return entry.item
            break
        eligible = [
            e for e in self._entries.values()
            if e.progress_s < before_s and (less_urgent_than is None or e.priority > less_urgent_than)
        ]
        return min(eligible, key=lambda e: (e.progress_s, e.order)).item if eligible else None
