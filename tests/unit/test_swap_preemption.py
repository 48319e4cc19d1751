"""Swap preemption without a model: the per-victim policy with plain numbers, the scheduler's
books of both pools (a real scheduler, fake requests), and a batcher over a fake runner that
checks every KV slot a sequence reads was written by it, across swaps out and back in."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from buckets.continuous import ContinuousBatcher
from buckets.request import GenerationRequest
from buckets.scheduler import Scheduler, StepPlan
from buckets.sequence import FinishReason, Sequence, SequenceStatus
from buckets.settings import ContinuousBatcherSettings
from gateway.config import parse_config
from gateway.errors import ConfigError
from models.step_io import ForwardInput, ForwardOutput, LoraRequest
from policies.preemption import SwapCostModel, fit_swap_costs, should_swap
from policies.step_time import StepTimeFit
from tests.factories import EOS, FakeClock, FakeTokenizer, Recorder, make_request, make_scheduler, make_sequence
from tests.unit.test_config import make_config_data
from tests.unit.test_forks import KVRunner, drain

# --- the policy, plain numbers ---------------------------------------------------------------

# Recompute: 1 ms + 0.1 ms a token + 1 us a (query, key) pair; a block copy 0.5 ms each way.
COSTS = SwapCostModel(0.0005, 0.0005, StepTimeFit(0.001, 0.0, 0.0001, 1e-6, 3, 0, True))


def test_recompute_never_swaps_and_swap_swaps_whenever_the_host_pool_has_room() -> None:
    assert not should_swap("recompute", 1000, 10, 100, COSTS)
    assert should_swap("swap", 4, 1, 100, None)
    assert not should_swap("swap", 1000, 10, 9, COSTS)  # no room: recompute
    assert not should_swap("swap", 0, 0, 100, COSTS)  # nothing computed, nothing to save


def test_auto_swaps_when_recompute_costs_more_than_the_copy_both_ways() -> None:
    # 16 tokens in 1 block: recompute 1 + 1.6 + 0.136 ms = 2.7 ms > 1 ms of copies.
    assert COSTS.recompute_s(16) == pytest.approx(0.001 + 0.0016 + 136e-6)
    assert should_swap("auto", 16, 1, 100, COSTS)
    # 16 tokens spread over 4 blocks (2.7 ms) against 4 ms of copies: recompute.
    assert not should_swap("auto", 16, 4, 100, COSTS)
    assert not should_swap("auto", 16, 1, 100, None)  # nothing measured: never


def test_the_fit_recovers_a_quadratic_prefill_time() -> None:
    def prefill_s(n: int) -> float:
        return 0.002 + 0.0003 * n + 2e-6 * n * (n + 1) / 2

    costs = fit_swap_costs(0.001, 0.002, [(n, prefill_s(n)) for n in (64, 256, 1024)])
    assert costs.swap_s(3) == pytest.approx(0.009)
    for n in (100, 512, 2048):
        assert costs.recompute_s(n) == pytest.approx(prefill_s(n), rel=1e-3)
    with pytest.raises(ValueError, match="two prefill timings"):
        fit_swap_costs(0.001, 0.002, [(64, 0.01)])


# --- the scheduler's books ------------------------------------------------------------------


def step(scheduler: Scheduler, token_id: int = 7) -> StepPlan:
    """Schedule and postprocess one step, every sampling sequence getting ``token_id``."""
    plan = scheduler.schedule()
    scheduler.postprocess(plan, ForwardOutput({s.seq_id: token_id for s in plan.forward.sequences if s.do_sample}))
    return plan


def two_decoding(scheduler: Scheduler, max_tokens: int = 4) -> tuple[Sequence, Sequence]:
    """Two 3-token prompts (no prefix in common) prefilled into 4 blocks of 2, decoded once; the
    next decodes need a third block each."""
    early, late = (make_sequence(make_request(3, max_tokens, name=name, first_token=first)) for name, first in (("early", 1), ("late", 11)))
    scheduler.add(early)
    scheduler.add(late)
    step(scheduler)
    step(scheduler)
    return early, late


def assert_pools_full(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0
    assert scheduler.swapper is not None
    scheduler.swapper.space.check_invariants()
    assert scheduler.swapper.space.num_free_blocks == scheduler.swapper.space.num_blocks


def test_a_swapped_victim_keeps_its_kv_on_the_host_and_resumes_without_recompute() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=False, preemption="swap", num_host_blocks=4)
    early, late = two_decoding(scheduler)
    device_table = scheduler.block_manager.block_table(late.seq_id)
    plan = scheduler.schedule()  # early's decode at position 4 needs a third block: late goes
    assert late.status is SequenceStatus.SWAPPED and late.num_computed_tokens == 4
    assert plan.forward.swap_out == [(device_table[0], 0), (device_table[1], 1)] and plan.swapped_out == [late]
    assert scheduler.counters.num_swap_outs == scheduler.counters.num_preemptions == 1
    scheduler.postprocess(plan, ForwardOutput({early.seq_id: 7}))
    while early.status is not SequenceStatus.FINISHED:
        plan = step(scheduler)
    resumed = step(scheduler)
    (seq_input,) = resumed.forward.sequences
    assert seq_input.position == 4 and seq_input.token_ids == [7]  # a decode: nothing recomputed
    assert [host for host, _ in resumed.forward.swap_in] == [0, 1]
    assert [device for _, device in resumed.forward.swap_in] == seq_input.block_table[:2]
    assert scheduler.counters.num_swap_ins == 1
    while late.status is not SequenceStatus.FINISHED:
        step(scheduler)
    assert late.output_token_ids == early.output_token_ids == [7] * 4
    assert_pools_full(scheduler)


def test_recompute_mode_or_a_full_host_pool_preempts_by_recompute() -> None:
    for scheduler in (
        make_scheduler(num_blocks=4, block_size=2),
        make_scheduler(num_blocks=4, block_size=2, preemption="swap", num_host_blocks=1),
    ):
        _, late = two_decoding(scheduler)
        plan = scheduler.schedule()
        assert late.status is SequenceStatus.PREEMPTED and late.num_computed_tokens == 0
        assert plan.forward.swap_out == [] and scheduler.counters.num_swap_outs == 0


def test_a_swapped_sequence_that_ends_while_swapped_frees_its_host_blocks() -> None:
    for reason in (FinishReason.CANCELLED, FinishReason.STOP):
        scheduler = make_scheduler(num_blocks=4, block_size=2, preemption="swap", num_host_blocks=4)
        early, late = two_decoding(scheduler, max_tokens=5)
        step(scheduler)
        assert late.status is SequenceStatus.SWAPPED
        assert scheduler.swapper is not None and scheduler.swapper.space.num_used_blocks == 2
        scheduler.finish(late.seq_id, reason)
        scheduler.finish(early.seq_id, reason)
        assert_pools_full(scheduler)
        assert not scheduler.has_work or scheduler.schedule().forward.sequences == []


def test_a_swapped_sequence_resumes_before_a_later_request_of_the_same_priority() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=4, block_size=2, preemption="swap", num_host_blocks=4, clock=clock)
    early, late = two_decoding(scheduler, max_tokens=3)
    step(scheduler)
    assert late.status is SequenceStatus.SWAPPED
    clock.advance(1.0)
    newcomer = make_sequence(make_request(3, 2, name="new", first_token=21))
    newcomer.request.timeline["enqueued"] = clock()
    scheduler.add(newcomer)
    while early.status is not SequenceStatus.FINISHED:
        step(scheduler)
    plan = step(scheduler)
    assert plan.scheduled[0] is late  # its place by age: ahead of the newcomer


def test_a_failed_step_has_its_swapped_victims_recompute() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, preemption="swap", num_host_blocks=4)
    _, late = two_decoding(scheduler)
    plan = scheduler.schedule()
    assert scheduler.swapper is not None
    scheduler.swapper.unswap(plan.swapped_out)  # as the batcher does when the runner raised
    assert late.status is SequenceStatus.PREEMPTED and late.num_computed_tokens == 0
    assert scheduler.swapper.space.num_used_blocks == 0


def test_a_victim_sharing_prefix_cached_blocks_takes_them_back_uncopied() -> None:
    # Both prompts share their first block (tokens 1, 2); it stays on the device for the other.
    scheduler = make_scheduler(num_blocks=5, block_size=2, preemption="swap", num_host_blocks=4)
    early, late = (make_sequence(make_request(3, 6, name=name)) for name in ("early", "late"))
    scheduler.add(early)
    step(scheduler)
    scheduler.add(late)
    step(scheduler)  # late reuses early's cached first block
    shared = scheduler.block_manager.block_table(early.seq_id)[0]
    assert scheduler.block_manager.block_table(late.seq_id)[0] == shared
    while late.status is not SequenceStatus.SWAPPED:
        step(scheduler)
    assert scheduler.block_manager.block_table(early.seq_id)[0] == shared
    while late.status is not SequenceStatus.RUNNING:
        plan = step(scheduler)
    assert plan.forward.sequences[plan.scheduled.index(late)].block_table[0] == shared
    assert shared not in [device for _, device in plan.forward.swap_in]  # a prefix hit: no copy
    while scheduler.has_work:
        step(scheduler)
    assert late.output_token_ids == [7] * 6
    assert_pools_full(scheduler)


def test_a_swapped_lora_sequence_gives_its_slot_back_and_takes_one_when_it_resumes() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_loras=2, preemption="swap", num_host_blocks=4)
    early, late = (
        make_sequence(make_request(3, 4, name=f"a{i}", first_token=1 + 10 * i, lora=LoraRequest(f"a{i}", i, None)))
        for i in (1, 2)
    )
    scheduler.add(early)
    scheduler.add(late)
    while late.status is not SequenceStatus.SWAPPED:
        step(scheduler)
    assert scheduler.lora_slots is not None and scheduler.lora_slots.num_active == 1
    while late.status is not SequenceStatus.RUNNING:
        plan = step(scheduler)
    assert scheduler.lora_slots.num_active == 1 and plan.forward.sequences[plan.scheduled.index(late)].lora_slot is not None
    while scheduler.has_work:
        step(scheduler)
    assert late.output_token_ids == [7] * 4
    assert_pools_full(scheduler)


# --- a batcher over a fake runner that checks the KV each sequence reads ---------------------


class SwapKVRunner(KVRunner):
    """:class:`KVRunner` with a host pool, in the real runner's order: the fork block copies,
    then ``swap_out`` copies slots to the host, then ``swap_in`` copies them back, so a block
    reused too early or a copy missed fails the slot checks."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        super().__init__(num_blocks, block_size)
        self.kv_cache = SimpleNamespace(num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks)
        self.host_slots: dict[tuple[int, int], int] = {}

    def _run(self, batch: ForwardInput) -> ForwardOutput:
        size = self.kv_cache.block_size
        for src, dst in batch.block_copies:
            for offset in range(size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        for device, host in batch.swap_out:
            for offset in range(size):
                self.host_slots.pop((host, offset), None)
                if (device, offset) in self.slots:
                    self.host_slots[(host, offset)] = self.slots[(device, offset)]
        for host, device in batch.swap_in:
            for offset in range(size):
                if (host, offset) in self.host_slots:
                    self.slots[(device, offset)] = self.host_slots[(host, offset)]
        return super()._run(dataclasses.replace(batch, block_copies=[]))


def test_a_fork_swapped_out_in_the_step_after_its_fork_takes_its_copied_block_along() -> None:
    # 5 blocks of 2. Step 1 prefills "a" (4 tokens, 2 blocks) and "b" (3 tokens, 2 blocks) and
    # forks b's second choice (b's first block shared, a copy of its partial second block: the 5th).
    # Step 2: a's decode needs a 3rd block; the victim is the fork (lowest priority, latest), whose
    # copied block must reach the host pool with its parent's KV, not as it was before the copy.
    runner = SwapKVRunner(num_blocks=5, block_size=2, num_host_blocks=8)
    settings = ContinuousBatcherSettings(8, 64, 2, preemption="swap", swap_space_bytes=1)
    batcher = ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=FakeClock())
    batcher.submit(make_request(4, 6, name="a", first_token=11, ignore_eos=True))
    batcher.submit(GenerationRequest(request_id="b", priority=1, prompt_token_ids=[1, 2, 3], sink=Recorder(), max_tokens=6, n=2, ignore_eos=True))
    batcher.step()
    batcher.step()
    assert runner.calls[-1].block_copies and runner.calls[-1].swap_out  # the fork's copy and its swap, one step
    drain(batcher)
    stats = batcher.stats()
    assert runner.violations == [] and stats.num_finished == 2 and stats.num_swap_ins == stats.num_swap_outs > 0


def test_a_batcher_swapping_under_pressure_reads_only_its_own_kv_and_gives_every_block_back() -> None:
    runner = SwapKVRunner(num_blocks=10, block_size=2, num_host_blocks=12)
    settings = ContinuousBatcherSettings(4, 64, 2, preemption="swap", swap_space_bytes=1)
    batcher = ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=FakeClock())
    requests = [make_request(3 + i, 8, name=f"r{i}", first_token=10 * i + 1, ignore_eos=True) for i in range(4)]
    for request in requests:
        batcher.submit(request)
    drain(batcher, max_steps=200)
    stats = batcher.stats()
    assert runner.violations == []
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert stats.num_finished == 4
    assert stats.kv_blocks_used == 0 and (stats.swap_blocks_used, stats.swap_blocks_total) == (0, 12)
    with pytest.raises(ValueError, match="preemption and swap_space_bytes are fixed"):
        batcher.update_settings(ContinuousBatcherSettings(4, 64, 2, preemption="auto", swap_space_bytes=1))


class FailingSwapRunner(SwapKVRunner):
    """Raises on the first step that swaps a victim out, before copying anything."""

    failed = False

    def _run(self, batch: ForwardInput) -> ForwardOutput:
        if batch.swap_out and not self.failed:
            self.failed = True
            raise RuntimeError("CUDA error: out of luck")
        return super()._run(batch)


def test_the_victims_of_a_failed_swapping_step_recompute_instead_of_reading_a_missing_copy() -> None:
    runner = FailingSwapRunner(num_blocks=10, block_size=2, num_host_blocks=12)
    settings = ContinuousBatcherSettings(4, 64, 2, preemption="swap", swap_space_bytes=1)
    batcher = ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=FakeClock())
    for i in range(4):
        batcher.submit(make_request(3 + i, 8, name=f"r{i}", first_token=10 * i + 1, ignore_eos=True))
    drain(batcher, max_steps=200)
    stats = batcher.stats()
    assert runner.failed and runner.violations == []
    assert stats.num_failed > 0 and stats.num_finished > 0 and stats.num_finished + stats.num_failed == 4
    assert batcher.block_manager.num_used_blocks == 0
    assert batcher.swapper is not None and batcher.swapper.space.num_free_blocks == 12


# --- config -----------------------------------------------------------------------------------


def test_swap_or_auto_without_swap_space_is_a_config_error_naming_the_field() -> None:
    data = make_config_data()
    batcher = data["models"][0]["buckets"][0]["batcher"]
    batcher["preemption"] = "auto"
    with pytest.raises(ConfigError, match=r"models\.0\.buckets\.0\.batcher\.swap_space_bytes: preemption auto needs host memory"):
        parse_config(data)
    batcher["swap_space_bytes"] = "64MiB"
    knobs = parse_config(data).models[0].buckets[0].batcher
    assert knobs.preemption == "auto" and knobs.swap_space_bytes == 64 * 1024 * 1024  # type: ignore[union-attr]



def test_only_a_swapping_bucket_holds_a_host_pool_which_the_memory_budget_counts() -> None:
    from gateway.memory import GATEWAY_SCOPE, model_bytes_by_scope

    data = make_config_data()
    batcher = data["models"][0]["buckets"][0]["batcher"]
    batcher["swap_space_bytes"] = "1GiB"  # left over under recompute: no 1 GiB (pinned on CUDA) for nothing
    config = parse_config(data)
    name = config.models[0].name
    assert config.models[0].buckets[0].batcher.host_swap_bytes == 0  # type: ignore[union-attr]
    recompute_bytes = model_bytes_by_scope(config, name, {}, 100)[GATEWAY_SCOPE]
    batcher["preemption"] = "swap"
    config = parse_config(data)
    assert config.models[0].buckets[0].batcher.host_swap_bytes == 1024**3  # type: ignore[union-attr]
    assert model_bytes_by_scope(config, name, {}, 100)[GATEWAY_SCOPE] == recompute_bytes + 1024**3
