"""Which LoRA adapter each of a runner's ``max_loras`` slots holds, and which slot a new one takes.

A bucket's runner keeps its adapters' weights in ``max_loras`` slots (stacked, so one step's
rows of different adapters run in one batched product: Punica's SGMV, S-LoRA). The scheduler
asks this policy before a sequence with an adapter starts running:

- the adapter already sits in a slot: the sequence uses it (no copy);
- else it takes an empty slot, the lowest first (the runner's products span the slots up to the
  highest one in use, so low slots keep them short);
- else the slot whose adapter has been idle longest (no running sequence; LRU, as S-LoRA's and
  vLLM's adapter caches), which the runner reloads before the step's forward;
- else (every slot's adapter has running sequences) it waits: a step never holds more than
  ``max_loras`` distinct adapters.

Integer bookkeeping only: adapters are named by their ``adapter_id``
(:class:`models.step_io.LoraRequest`), weights never pass through here.
"""

from __future__ import annotations

import itertools


class LoraSlots:
    """The slots of one runner: ``slot -> adapter_id``, and the running sequences using each.

    Args:
        max_loras: slots in the runner (>= 1): the most distinct adapters among running sequences.

    Raises:
        ValueError: ``max_loras`` below 1.
    """

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._adapter_in: list[int | None] = [None] * max_loras  # slot -> adapter_id
        self._slot_of: dict[int, int] = {}  # adapter_id -> slot
        self._users: dict[int, int] = {}  # adapter_id -> running sequences (absent: none)
        self._idle_since: dict[int, int] = {}  # slot of an idle adapter -> tick it became idle
        self._ticks = itertools.count()
        self.num_loads = 0  # adapters copied into a slot since construction

    @property
    def num_active(self) -> int:
        """Distinct adapters with running sequences (at most ``max_loras``)."""
        return len(self._users)

    def slot_of(self, adapter_id: int) -> int | None:
        """The slot holding ``adapter_id``, or ``None``."""
        return self._slot_of.get(adapter_id)

    def can_take(self, adapter_id: int) -> bool:
        """Whether a sequence of ``adapter_id`` could start running now: its adapter is in a
        slot, or a slot is empty or holds an idle adapter."""
        return adapter_id in self._slot_of or len(self._users) < self.max_loras

    def take(self, adapter_id: int) -> tuple[int, bool]:
        """Count one more running sequence of ``adapter_id``; returns ``(slot, needs_load)``:
        ``needs_load`` when the adapter was not in a slot and the runner must copy it into
        ``slot`` before the sequence's first forward (the slot's former adapter was idle).

        Raises:
            RuntimeError: no slot is free (check :meth:`can_take` first).
        """
        slot = self._slot_of.get(adapter_id)
        needs_load = slot is None
        if slot is None:
            slot = self._free_slot()
            former = self._adapter_in[slot]
            if former is not None:
                del self._slot_of[former]
            self._adapter_in[slot] = adapter_id
            self._slot_of[adapter_id] = slot
            self.num_loads += 1
        self._idle_since.pop(slot, None)
        self._users[adapter_id] = self._users.get(adapter_id, 0) + 1
        return slot, needs_load

    def release(self, adapter_id: int) -> None:
        """One running sequence of ``adapter_id`` stopped (finished, failed or preempted); its
        slot becomes idle (reusable, its weights kept for a return) with the last one.

        Raises:
            KeyError: ``adapter_id`` has no running sequence.
        """
        left = self._users[adapter_id] - 1
        if left:
            self._users[adapter_id] = left
            return
        del self._users[adapter_id]
        self._idle_since[self._slot_of[adapter_id]] = next(self._ticks)

    def _free_slot(self) -> int:
        """The lowest empty slot, else the longest-idle one."""
        for slot, adapter_id in enumerate(self._adapter_in):
            if adapter_id is None:
                return slot
        if not self._idle_since:
            raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters with running sequences")
        return min(self._idle_since, key=self._idle_since.__getitem__)

    def check_invariants(self) -> None:
        """Assert the books agree (tests call it after every step)."""
        assert len(self._users) <= self.max_loras, "more active adapters than slots"
        for adapter_id, slot in self._slot_of.items():
            assert self._adapter_in[slot] == adapter_id, "slot map and slot contents disagree"
        assert sum(a is not None for a in self._adapter_in) == len(self._slot_of), "an adapter in two slots"
        for adapter_id in self._users:
            assert adapter_id in self._slot_of, "a running adapter without a slot"
            assert self._slot_of[adapter_id] not in self._idle_since, "a running adapter's slot marked idle"
        for slot in self._idle_since:
            assert self._adapter_in[slot] not in self._users, "an idle slot with running sequences"
