"""The LoRA slot policy with plain numbers: which slot an adapter takes, when it waits, what is reloaded."""

from __future__ import annotations

import pytest

from policies.lora_slots import LoraSlots


def test_an_adapter_takes_the_lowest_empty_slot_and_loads_once() -> None:
    slots = LoraSlots(3)
    assert slots.take(10) == (0, True)
    assert slots.take(11) == (1, True)
    assert slots.take(10) == (0, False)  # already there: no copy
    assert slots.num_active == 2 and slots.num_loads == 2
    slots.check_invariants()


def test_an_idle_adapter_keeps_its_slot_until_another_needs_it() -> None:
    slots = LoraSlots(2)
    slots.take(10)
    slots.release(10)
    assert slots.num_active == 0
    assert slots.take(10) == (0, False)  # came back: its weights are still in the slot
    slots.check_invariants()


def test_a_full_table_reloads_the_longest_idle_slot() -> None:
    slots = LoraSlots(2)
    slots.take(10)
    slots.take(11)
    slots.release(11)  # idle first
    slots.release(10)
    assert slots.take(12) == (1, True)  # 11's slot: idle longest
    assert slots.slot_of(11) is None and slots.slot_of(10) == 0
    assert slots.take(13) == (0, True)
    slots.check_invariants()


def test_no_slot_while_every_adapter_runs() -> None:
    slots = LoraSlots(2)
    slots.take(10)
    slots.take(11)
    assert not slots.can_take(12)
    assert slots.can_take(10)  # its own slot
    with pytest.raises(RuntimeError, match="all 2 LoRA slots"):
        slots.take(12)
    slots.release(10)
    assert slots.can_take(12)


def test_a_slot_stays_busy_until_its_last_sequence_stops() -> None:
    slots = LoraSlots(1)
    slots.take(10)
    slots.take(10)
    slots.release(10)
    assert not slots.can_take(11)
    slots.release(10)
    assert slots.can_take(11)
    with pytest.raises(KeyError):
        slots.release(10)


def test_max_loras_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        LoraSlots(0)
