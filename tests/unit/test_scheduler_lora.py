"""The scheduler with LoRA slots (fake runner, no model): at most ``max_loras`` adapters per step,
loads before first use, passed-over sequences keep their place, prefix-cache keys by adapter."""

from __future__ import annotations

import pytest

from buckets.errors import LoraSlotsError
from buckets.scheduler import Scheduler, StepPlan
from buckets.sequence import Sequence
from models.step_io import ForwardOutput, LoraRequest
from tests.factories import make_request, make_scheduler, make_sequence


def adapter(adapter_id: int) -> LoraRequest:
    return LoraRequest(name=f"a{adapter_id}", adapter_id=adapter_id, weights=None)


def add(scheduler: Scheduler, lora: LoraRequest | None, prompt_len: int = 4, max_tokens: int = 3, first_token: int = 1) -> Sequence:
    seq = make_sequence(make_request(prompt_len, max_tokens, first_token=first_token, lora=lora))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, loaded: dict[int, int]) -> StepPlan:
    """Plan, check the plan against the runner's slots (``loaded``: slot -> adapter id, updated
    by the plan's loads), then sample token 7 for every sampling sequence."""
    plan = scheduler.schedule()
    for slot, lora in plan.forward.lora_loads:
        loaded[slot] = lora.adapter_id
    for seq, seq_input in zip(plan.scheduled, plan.forward.sequences):
        if seq.lora is None:
            assert seq_input.lora_slot is None
        else:
            assert seq_input.lora_slot is not None and loaded[seq_input.lora_slot] == seq.lora.adapter_id
    assert plan.num_loras <= scheduler.settings.max_loras
    scheduler.postprocess(plan, ForwardOutput({s.seq_id: 7 for s in plan.forward.sequences if s.do_sample}))
    scheduler.block_manager.check_invariants()
    assert scheduler.lora_slots is not None
    scheduler.lora_slots.check_invariants()
    return plan


def run_all(scheduler: Scheduler, loaded: dict[int, int], max_steps: int = 200) -> list[StepPlan]:
    plans = []
    while scheduler.has_work:
        plans.append(step(scheduler, loaded))
        assert len(plans) < max_steps, "the scheduler did not run out of work"
    return plans


def test_more_adapters_than_slots_all_finish_with_at_most_max_loras_per_step() -> None:
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, max_loras=2)
    seqs = [add(scheduler, adapter(i % 5), first_token=10 * i + 1) for i in range(10)]
    seqs += [add(scheduler, None, first_token=200 + i) for i in range(2)]
    loaded: dict[int, int] = {}
    plans = run_all(scheduler, loaded)
    assert all(s.output_token_ids == [7, 7, 7] for s in seqs)
    assert max(p.num_loras for p in plans) == 2
    assert scheduler.counters.max_step_loras == 2
    assert scheduler.counters.num_lora_loads >= 5  # five adapters through two slots
    assert scheduler.lora_slots is not None and scheduler.lora_slots.num_active == 0


def test_an_adapter_in_a_slot_is_loaded_once_for_all_its_sequences() -> None:
    scheduler = make_scheduler(max_loras=2)
    lora = adapter(1)
    add(scheduler, lora, first_token=1)
    add(scheduler, lora, first_token=50)
    loaded: dict[int, int] = {}
    plan = step(scheduler, loaded)
    assert [slot for slot, _ in plan.forward.lora_loads] == [0]
    run_all(scheduler, loaded)
    assert scheduler.counters.num_lora_loads == 1


def test_a_passed_over_sequence_keeps_its_place_and_only_base_sequences_pass_it() -> None:
    scheduler = make_scheduler(max_num_seqs=8, max_loras=1)
    first = add(scheduler, adapter(1), max_tokens=4, first_token=1)
    waiting = add(scheduler, adapter(2), first_token=20)  # no slot while adapter 1 runs
    same_as_running = add(scheduler, adapter(1), first_token=40)  # would pin adapter 1's slot longer
    base = add(scheduler, None, first_token=60)
    loaded: dict[int, int] = {}
    plan = step(scheduler, loaded)
    assert {s.seq_id for s in plan.scheduled} == {first.seq_id, base.seq_id}
    while first.finish_reason is None:
        step(scheduler, loaded)
    plan = step(scheduler, loaded)  # the slot is free: the passed-over head goes first
    assert waiting in plan.scheduled and same_as_running not in plan.scheduled
    run_all(scheduler, loaded)
    assert same_as_running.output_token_ids == [7, 7, 7]


def test_a_preempted_sequence_gives_its_slot_back_and_reloads_when_it_resumes() -> None:
    # Two blocks of 4 tokens: the two sequences cannot both grow, so one is preempted.
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=3, block_size=4, max_loras=2)
    seqs = [add(scheduler, adapter(1), prompt_len=3, max_tokens=5, first_token=1),
            add(scheduler, adapter(2), prompt_len=3, max_tokens=5, first_token=30)]
    loaded: dict[int, int] = {}
    run_all(scheduler, loaded)
    assert scheduler.counters.num_preemptions >= 1
    assert all(len(s.output_token_ids) == 5 for s in seqs)


def test_the_same_prompt_under_two_adapters_shares_no_blocks() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_loras=2)
    loaded: dict[int, int] = {}
    a = add(scheduler, adapter(1), prompt_len=9)
    run_all(scheduler, loaded)
    b = add(scheduler, adapter(2), prompt_len=9)
    base = add(scheduler, None, prompt_len=9)
    again = add(scheduler, adapter(1), prompt_len=9)
    plan = step(scheduler, loaded)
    positions = {s.seq_id: inp.position for s, inp in zip(plan.scheduled, plan.forward.sequences)}
    assert positions[b.seq_id] == 0 and positions[base.seq_id] == 0  # no hit from adapter 1's blocks
    assert positions[again.seq_id] == 8  # two full blocks cached under adapter 1
    assert a.block_hashes[:2] != b.block_hashes[:2] != base.block_hashes[:2]


def test_a_bucket_without_slots_refuses_an_adapter() -> None:
    scheduler = make_scheduler()
    with pytest.raises(LoraSlotsError, match="max_loras 0"):
        add(scheduler, adapter(1))


def test_max_loras_cannot_change_live() -> None:
    scheduler = make_scheduler(max_loras=2)
    from dataclasses import replace

    with pytest.raises(ValueError, match="max_loras is fixed"):
        scheduler.update_settings(replace(scheduler.settings, max_loras=4))
