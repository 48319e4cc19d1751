"""Fair share and the starvation floor in the continuous scheduler, the dynamic batcher and
admission (fake requests, a fake clock, no model)."""

from __future__ import annotations

import dataclasses

import pytest

from buckets.admission import AdmissionControl
from buckets.dynamic import DynamicBatcher
from buckets.errors import QueueFullError
from buckets.scheduler import Scheduler, StepPlan
from buckets.sequence import Sequence
from buckets.settings import DynamicBatcherSettings
from models.step_io import ForwardOutput
from tests.factories import FakeClock, make_request, make_requests, make_scheduler, make_sequence
from tests.unit.test_dynamic_batcher import FakeRunner
from tests.unit.test_scheduler_stall_free import stall_free_scheduler, step as stall_free_step


def add(scheduler: Scheduler, tenant: str, num: int, max_tokens: int = 100, priority: int = 0, prompt_len: int = 4) -> list[Sequence]:
    """``num`` sequences of ``tenant`` that generate ``max_tokens`` tokens each (EOS ignored)."""
    seqs = []
    for i in range(num):
        request = make_request(prompt_len, max_tokens, ignore_eos=True, name=f"{tenant}{i}", priority=priority)
        request.tenant = tenant
        seq = make_sequence(request)
        scheduler.add(seq)
        seqs.append(seq)
    return seqs


def step(scheduler: Scheduler) -> StepPlan:
    """Plan a step and postprocess it with token 7 for every sequence that samples."""
    plan = scheduler.schedule()
    scheduler.postprocess(plan, ForwardOutput({s.seq_id: 7 for s in plan.forward.sequences if s.do_sample}))
    return plan


def seats(scheduler: Scheduler) -> dict[str, int]:
    by_tenant: dict[str, int] = {}
    for seq in scheduler.running:
        by_tenant[seq.request.tenant] = by_tenant.get(seq.request.tenant, 0) + 1
    return by_tenant


def test_a_tenant_arriving_at_a_full_bucket_joins_in_the_next_step() -> None:
    scheduler = make_scheduler(max_num_seqs=8, num_blocks=512)
    add(scheduler, "a", 8)
    step(scheduler)
    step(scheduler)
    assert seats(scheduler) == {"a": 8}
    (b,) = add(scheduler, "b", 1)
    plan = step(scheduler)
    assert b in plan.scheduled and plan.num_preempted == 0  # the running phase preempted nothing
    assert seats(scheduler) == {"a": 7, "b": 1}
    assert scheduler.counters.num_preemptions == 1
    assert scheduler.counters.tokens_served_by_tenant["b"] == 4


def test_with_fair_share_off_the_newcomer_waits_for_a_seat() -> None:
    scheduler = make_scheduler(max_num_seqs=8, num_blocks=512, fair_share=False)
    add(scheduler, "a", 8)
    step(scheduler)
    (b,) = add(scheduler, "b", 1)
    for _ in range(5):
        assert b not in step(scheduler).scheduled
    assert scheduler.counters.num_preemptions == 0


@pytest.mark.parametrize("fair_share", [True, False])
def test_an_urgent_request_at_a_full_bucket_preempts_a_less_urgent_one_in_the_next_step(fair_share: bool) -> None:
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=512, fair_share=fair_share)
    low = add(scheduler, "a", 4, priority=5)
    step(scheduler)
    (urgent,) = add(scheduler, "a", 1, priority=0)
    plan = step(scheduler)
    assert urgent in plan.scheduled
    preempted = [s for s in low if s not in scheduler.running]
    assert preempted == [low[-1]]  # the least urgent, latest arrival
    (second,) = add(scheduler, "a", 1, priority=0)
    step(scheduler)
    assert second in scheduler.running and sum(s in scheduler.running for s in low) == 2


def test_turning_fair_share_off_live_makes_the_queue_one_group() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a0, a1 = add(scheduler, "a", 2)
    (b0,) = add(scheduler, "b", 1)
    scheduler.fair.charge("a", 100, 1.0)
    assert scheduler.waiting.peek() is b0
    scheduler.update_settings(dataclasses.replace(scheduler.settings, fair_share=False))
    assert scheduler.waiting.peek() is a0 and list(scheduler.waiting) == [a0, a1, b0]


def test_three_tenants_with_fractional_shares_settle_without_thrashing() -> None:
    scheduler = make_scheduler(max_num_seqs=8, num_blocks=1024)
    add(scheduler, "a", 10)
    step(scheduler)
    assert seats(scheduler) == {"a": 8}
    add(scheduler, "b", 10)
    add(scheduler, "c", 10)
    preemptions_after_step = []
    for _ in range(40):
        step(scheduler)
        preemptions_after_step.append(scheduler.counters.num_preemptions)
    assert preemptions_after_step[-1] == preemptions_after_step[4] > 0  # none after the first few steps
    assert sorted(seats(scheduler).values()) == [2, 2, 4]  # shares of 8/3: a seat of slack each side


def test_tenants_arriving_together_fill_the_seats_by_share_without_preempting() -> None:
    scheduler = make_scheduler(max_num_seqs=8, num_blocks=1024)
    for tenant in "abc":
        add(scheduler, tenant, 10)
    for _ in range(10):
        step(scheduler)
    assert scheduler.counters.num_preemptions == 0
    assert min(seats(scheduler).values()) >= 2  # each at least its whole seats of 8/3


def run_with_urgent_stream(max_starvation_s: float, num_steps: int = 300) -> tuple[float, int]:
    """A low-priority sequence under urgent ones that keep two waiting at every step (0.1 s each),
    two seats and a small KV pool: the longest gap between its tokens, and its preemptions."""
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=24, clock=clock, max_starvation_s=max_starvation_s)
    add(scheduler, "u", 2, max_tokens=8, prompt_len=8)
    (low,) = add(scheduler, "low", 1, max_tokens=80, priority=10)
    last_progress_s, longest_gap_s, num_added = 0.0, 0.0, 2
    for _ in range(num_steps):
        waiting_urgent = sum(1 for s in scheduler.waiting if s.request.priority == 0)
        for _ in range(2 - waiting_urgent):
            request = make_request(8, 8, ignore_eos=True, name=f"u{num_added}")
            request.timeline["enqueued"] = clock()
            scheduler.add(make_sequence(request))
            num_added += 1
        if low in step(scheduler).scheduled:
            longest_gap_s, last_progress_s = max(longest_gap_s, clock() - last_progress_s), clock()
        clock.advance(0.1)
    return max(longest_gap_s, clock() - last_progress_s if low.finish_reason is None else 0.0), low.num_preemptions


def test_a_low_priority_sequence_progresses_every_max_starvation_s_under_urgent_ones() -> None:
    longest_gap_s, num_preemptions = run_with_urgent_stream(max_starvation_s=4.0)
    assert longest_gap_s <= 4.0
    assert num_preemptions >= 1  # the bound held across a preemption
    starved_gap_s, _ = run_with_urgent_stream(max_starvation_s=1000.0, num_steps=100)
    assert starved_gap_s > 4.0  # without the floor it waits out the urgent stream


def test_admission_refuses_the_tenant_over_its_share_and_admits_the_quiet_one() -> None:
    admission = AdmissionControl(max_queue_len=4, fair_share=True)
    tickets = [admission.admit(10, tenant="a") for _ in range(4)]
    with pytest.raises(QueueFullError, match="weighted share"):
        admission.admit(10, tenant="a")
    tickets += [admission.admit(10, tenant="b"), admission.admit(10, tenant="b")]  # up to its share, 4 / 2
    assert admission.num_queued == 6  # over the limit by b's share
    assert admission.refusal(10, tenant="b") is not None
    for ticket in tickets:
        ticket.release()
    assert admission.num_queued == 0 and admission.admit(10, tenant="a") is not None


def test_without_fair_share_admission_refuses_every_tenant_at_the_limit() -> None:
    admission = AdmissionControl(max_queue_len=4)
    for _ in range(4):
        admission.admit(10, tenant="a")
    for tenant in "ab":
        with pytest.raises(QueueFullError):
            admission.admit(10, tenant=tenant)


def batches_of(fair_share: bool) -> list[list[str]]:
    runner = FakeRunner()
    settings = DynamicBatcherSettings(max_batch_size=2, max_queue_delay_ms=0.0, fair_share=fair_share)
    batcher = DynamicBatcher(runner, settings, clock=FakeClock())
    requests = make_requests(6, length=3)
    for index, request in enumerate(requests):
        request.prompt_token_ids = [index + 1] * 3  # equal lengths: equal charges
        request.tenant = "a" if index < 4 else "b"
        batcher.submit(request)
    while batcher.seconds_until_ready(0.0) is not None:
        batcher.step()
    return [["ab"[call_ids[0] > 4] for call_ids in call] for call in runner.calls]


def test_the_dynamic_batcher_forms_batches_fairly_between_tenants() -> None:
    assert batches_of(fair_share=True) == [["a", "b"], ["a", "b"], ["a", "a"]]
    assert batches_of(fair_share=False) == [["a", "a"], ["a", "a"], ["b", "b"]]


def test_within_one_priority_an_overloaded_queue_waits_its_turn_without_preemptions() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=512, clock=clock, max_starvation_s=1.0)
    add(scheduler, "a", 6, max_tokens=40)
    for _ in range(100):  # 10 s: the queued ones wait far past max_starvation_s behind older ones
        step(scheduler)
        clock.advance(0.1)
    assert scheduler.counters.num_preemptions == 0


def test_a_starved_sequence_that_finds_no_room_lets_an_urgent_head_in() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=512, clock=clock, max_starvation_s=1.0)
    add(scheduler, "a", 3, max_tokens=100, priority=10)
    for _ in range(20):  # 2 s: the third low one is starved; nothing running is more urgent than it
        step(scheduler)
        clock.advance(0.1)
    (urgent,) = add(scheduler, "a", 1, priority=0)
    step(scheduler)
    assert urgent in scheduler.running


def test_an_urgent_request_short_of_step_budget_preempts_only_a_prefill_chunk() -> None:
    scheduler = stall_free_scheduler(target_step_s=0.050)
    for i in range(4):
        scheduler.add(make_sequence(make_request(8, max_tokens=1000, name=f"d{i}", first_token=100 * i + 1, priority=5)))
    stall_free_step(scheduler)
    long = make_sequence(make_request(600, max_tokens=4, name="long", first_token=1000, priority=5))
    scheduler.add(long)
    stall_free_step(scheduler)
    stall_free_step(scheduler)
    urgent = make_sequence(make_request(8, max_tokens=4, name="u", first_token=5000, priority=0))
    scheduler.add(urgent)
    plan = stall_free_step(scheduler)  # the long prompt's chunk had taken the prefill room: it gives it back
    assert urgent in plan.scheduled and scheduler.counters.num_preemptions == 1  # not a decode: they hold no prefill room
    assert sum(s.request.priority == 5 and s is not long for s in plan.scheduled) == 4  # every decode still ran
