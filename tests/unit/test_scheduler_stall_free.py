"""Stall-free chunked prefill: the scheduler's prefill budget from a step-time model fed plain
step times (no model, no sleeping), and the continuous batcher feeding it from a fake clock."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from buckets.continuous import ContinuousBatcher
from buckets.scheduler import Scheduler, StepPlan
from buckets.settings import ContinuousBatcherSettings
from models.step_io import ForwardInput, ForwardOutput
from policies.step_time import StallFreeBudget, StepTimeFit, StepTimeModel, attended_pairs
from tests.factories import EOS, FakeClock, FakeTokenizer, events_of, make_request, make_scheduler, make_sequence

BASE_S, DECODE_S, PREFILL_S, PAIR_S = 0.010, 0.002, 0.001, 1e-6  # the fake backend's step time
BLOCK_SIZE = 16


def step_time_s(num_decode_tokens: int, num_prefill_tokens: int) -> float:
    return BASE_S + DECODE_S * num_decode_tokens + PREFILL_S * num_prefill_tokens


class FixedFit(StepTimeModel):
    """A step-time model that always answers ``fit`` (a stand-in for a fed one, exact)."""

    def __init__(self, fit: StepTimeFit) -> None:
        super().__init__()
        self._fixed = fit

    @property
    def fit(self) -> StepTimeFit:
        return self._fixed


def fixed_budget(target_step_s: float | None, pair_s: float = 0.0) -> StallFreeBudget:
    """A budget over the fake backend's exact step-time model."""
    fit = StepTimeFit(BASE_S, DECODE_S, PREFILL_S, pair_s, num_samples=10, num_outliers=0, has_prefill=True)
    return StallFreeBudget(target_step_s, BLOCK_SIZE, FixedFit(fit))


def stall_free_scheduler(
    target_step_s: float | None, max_num_batched_tokens: int = 1024, budget: StallFreeBudget | None = None
) -> Scheduler:
    return make_scheduler(
        max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, num_blocks=256, block_size=BLOCK_SIZE,
        prefill_budget=budget or fixed_budget(target_step_s),
    )


def step(scheduler: Scheduler) -> StepPlan:
    plan = scheduler.schedule()
    sampled = {s.seq_id: 7 for s in plan.forward.sequences if s.do_sample}
    scheduler.postprocess(plan, ForwardOutput(sampled))
    return plan


def start_decodes(scheduler: Scheduler, num: int) -> list[int]:
    """``num`` short requests prefilled together (nothing decodes yet), decoding from then on."""
    seqs = [make_sequence(make_request(8, max_tokens=1000, name=f"d{i}", first_token=100 * i + 1)) for i in range(num)]
    for seq in seqs:
        scheduler.add(seq)
    plan = step(scheduler)
    assert plan.num_decode_tokens == 0 and plan.num_prefill_tokens == 8 * num
    return [seq.seq_id for seq in seqs]


def test_a_long_prompt_beside_decodes_runs_in_bounded_chunks() -> None:
    scheduler = stall_free_scheduler(target_step_s=0.050)
    decode_ids = start_decodes(scheduler, 4)
    prompt = make_sequence(make_request(600, max_tokens=4, name="long", first_token=1000))
    scheduler.add(prompt)
    # 4 decodes: 18 ms predicted; the 50 ms target leaves 32 ms for 32 prefill tokens a step.
    chunk = 32
    num_steps = math.ceil(600 / chunk)
    for i in range(num_steps):
        plan = step(scheduler)
        tokens = {s.seq_id: len(s.token_ids) for s in plan.forward.sequences}
        assert all(tokens[seq_id] == 1 for seq_id in decode_ids), f"step {i}: a decode waited"
        assert tokens[prompt.seq_id] == min(chunk, 600 - i * chunk)
        assert plan.max_prefill_tokens == chunk
        assert step_time_s(plan.num_decode_tokens, plan.num_prefill_tokens) <= 0.050 + 1e-9
        assert (prompt.num_computed_tokens == 600) == (i == num_steps - 1)
    assert prompt.output_token_ids == [7]  # the last chunk sampled its first token
    assert scheduler.counters.num_chunked_prefills == num_steps - 1


def test_chunks_shrink_as_the_prompt_goes_deeper_when_attention_costs() -> None:
    budget = fixed_budget(0.050, pair_s=1e-6)
    fit = budget.model.fit
    assert fit is not None
    scheduler = stall_free_scheduler(None, budget=budget)
    start_decodes(scheduler, 4)
    prompt = make_sequence(make_request(1200, max_tokens=4, name="long", first_token=1000))
    scheduler.add(prompt)
    chunks = []
    while prompt.num_computed_tokens < 1200:
        position = prompt.num_computed_tokens
        plan = step(scheduler)
        assert plan.num_decode_tokens == 4
        chunks.append(plan.num_prefill_tokens)
        predicted = fit.predict_s(4, plan.num_prefill_tokens, plan.num_attended_pairs)
        assert predicted <= 0.050 + 1e-9 or plan.num_prefill_tokens <= BLOCK_SIZE  # the floor
        assert plan.num_attended_pairs == attended_pairs(position, plan.num_prefill_tokens) + sum(
            s.position + 1 for s in plan.forward.sequences if s.seq_id != prompt.seq_id
        )
    assert chunks[0] > chunks[len(chunks) // 2] > chunks[-2] >= BLOCK_SIZE  # deeper chunks attend more


def test_with_nothing_decoding_a_prompt_takes_the_whole_step() -> None:
    scheduler = stall_free_scheduler(target_step_s=0.050)
    prompt = make_sequence(make_request(600, max_tokens=4, name="long"))
    scheduler.add(prompt)
    plan = step(scheduler)
    assert plan.num_prefill_tokens == 600 and plan.max_prefill_tokens == 1024
    assert scheduler.counters.num_chunked_prefills == 0


def test_the_step_cap_still_bounds_the_prefill() -> None:
    scheduler = stall_free_scheduler(target_step_s=10.0, max_num_batched_tokens=256)
    decode_ids = start_decodes(scheduler, 4)
    scheduler.add(make_sequence(make_request(600, max_tokens=4, name="long", first_token=1000)))
    plan = step(scheduler)
    assert plan.num_decode_tokens == len(decode_ids)
    assert plan.forward.num_tokens == 256


def test_decodes_over_the_target_still_leave_the_floor_for_prefill() -> None:
    scheduler = stall_free_scheduler(target_step_s=0.012)  # 4 decodes alone take 18 ms
    start_decodes(scheduler, 4)
    prompt = make_sequence(make_request(40, max_tokens=4, name="p", first_token=1000))
    scheduler.add(prompt)
    chunks = [step(scheduler).num_prefill_tokens for _ in range(3)]
    assert chunks == [BLOCK_SIZE, BLOCK_SIZE, 40 - 2 * BLOCK_SIZE]
    assert prompt.num_computed_tokens == 40


def test_default_target_is_twice_the_decode_only_step() -> None:
    scheduler = stall_free_scheduler(target_step_s=None)
    start_decodes(scheduler, 4)
    scheduler.add(make_sequence(make_request(600, max_tokens=4, name="long", first_token=1000)))
    plan = step(scheduler)
    # 4 decodes: 18 ms decode-only, a 36 ms target, 18 ms of prefill.
    assert plan.num_prefill_tokens == 18


def test_new_prompts_share_one_prefill_budget() -> None:
    scheduler = stall_free_scheduler(target_step_s=0.050)
    start_decodes(scheduler, 4)
    for i in range(3):
        scheduler.add(make_sequence(make_request(20, max_tokens=4, name=f"p{i}", first_token=1000 + 50 * i)))
    plan = step(scheduler)
    assert plan.num_prefill_tokens == 32  # 20 + the first 12 of the second; the third waits
    assert len(plan.forward.sequences) == 4 + 2


# --- the batcher feeds the model from its clock ---------------------------------------------


class TimedRunner:
    """A fake runner whose forward takes :func:`step_time_s` plus ``PAIR_S`` per attended pair on
    the fake ``clock``."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.kv_cache = SimpleNamespace(num_blocks=256, block_size=BLOCK_SIZE)
        self.plans: list[tuple[int, int]] = []  # (decode tokens, prefill tokens) per forward
        self.seconds: list[float] = []  # the time each forward took

    def run(self, batch: ForwardInput) -> ForwardOutput:
        num_decode = sum(1 for s in batch.sequences if len(s.token_ids) == 1)
        num_prefill = batch.num_tokens - num_decode
        self.plans.append((num_decode, num_prefill))
        num_pairs = sum(attended_pairs(s.position, len(s.token_ids)) for s in batch.sequences)
        self.seconds.append(step_time_s(num_decode, num_prefill) + PAIR_S * num_pairs)
        self.clock.advance(self.seconds[-1])
        return ForwardOutput({s.seq_id: 7 for s in batch.sequences if s.do_sample})


def timed_batcher(**settings: object) -> tuple[ContinuousBatcher, TimedRunner]:
    clock = FakeClock()
    runner = TimedRunner(clock)
    config = ContinuousBatcherSettings(8, 1024, BLOCK_SIZE, **settings)  # type: ignore[arg-type]
    return ContinuousBatcher(runner, config, FakeTokenizer(), frozenset({EOS}), clock=clock), runner


def run_until(batcher: ContinuousBatcher, done: object, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():  # type: ignore[operator]
            return
        batcher.step()
    raise AssertionError("the condition did not hold in time")


def start_streams(batcher: ContinuousBatcher, runner: TimedRunner) -> list[object]:
    """Four streams, started one after another so the model sees several shapes."""
    streams = []
    for i in range(4):
        request = make_request(24 + 8 * i, max_tokens=500, name=f"s{i}", first_token=100 * i + 1, ignore_eos=True)
        batcher.submit(request)
        streams.append(request)
        run_until(batcher, lambda: len(runner.plans) >= 3 * (i + 1))
    return streams


def test_batcher_fits_its_steps_and_chunks_a_long_prompt_within_the_target() -> None:
    batcher, runner = timed_batcher(tpot_target_ms=50.0)
    streams = start_streams(batcher, runner)
    long = make_request(600, max_tokens=2, name="long", first_token=1000, ignore_eos=True)
    batcher.submit(long)
    before = len(runner.plans)
    tokens_before = [len(events_of(s)) for s in streams]
    run_until(batcher, lambda: events_of(long))
    steps = runner.plans[before:]  # (the runner counts a last chunk of one token as a decode)
    assert sum(decode + prefill for decode, prefill in steps) == 600 + 4 * len(steps)  # 4 decodes and a chunk each
    assert math.ceil(600 / 32) < len(steps) <= math.ceil(600 / BLOCK_SIZE)  # deeper chunks are smaller
    assert max(runner.seconds[before:]) <= 0.050 * 1.01  # within the target, give or take the fit
    assert [len(events_of(s)) - n for s, n in zip(streams, tokens_before)] == [len(steps)] * 4  # a token every step
    stats = batcher.stats()
    assert stats.step_time_base_ms == pytest.approx(10.0, rel=0.01)
    assert stats.step_time_decode_token_ms == pytest.approx(2.0, rel=0.01)
    assert stats.step_time_prefill_token_ms == pytest.approx(1.0, rel=0.01)
    assert stats.step_time_attended_pair_ns == pytest.approx(1000.0, rel=0.01)
    assert stats.step_target_ms == 50.0 and 16 < stats.max_prefill_tokens < 32
    assert stats.step_time_samples > 0


def test_fixed_chunking_keeps_the_old_behaviour() -> None:
    batcher, runner = timed_batcher(chunked_prefill="fixed", tpot_target_ms=50.0)
    start_streams(batcher, runner)
    long = make_request(600, max_tokens=2, name="long", first_token=1000, ignore_eos=True)
    batcher.submit(long)
    before = len(runner.plans)
    run_until(batcher, lambda: events_of(long))
    assert runner.plans[before] == (4, 600)  # one whole prefill, which the decodes waited out
    assert batcher.stats().step_target_ms == 0.0
    assert batcher.stats().max_prefill_tokens == 1024


def test_switching_the_mode_at_run_time_keeps_the_fitted_model() -> None:
    batcher, runner = timed_batcher(chunked_prefill="fixed", tpot_target_ms=50.0)
    start_streams(batcher, runner)
    batcher.update_settings(ContinuousBatcherSettings(8, 1024, BLOCK_SIZE, tpot_target_ms=50.0))
    long = make_request(600, max_tokens=2, name="long", first_token=1000, ignore_eos=True)
    batcher.submit(long)
    before = len(runner.plans)
    batcher.step()
    assert runner.plans[before] == (4, 31)  # 32 ms of room: 31 tokens with their attention


def test_the_default_target_gets_a_floor_of_four_blocks_and_a_set_one_of_one() -> None:
    from buckets.continuous import STALL_FREE_DECODE_FACTOR, STALL_FREE_MIN_PREFILL_BLOCKS

    batcher, _ = timed_batcher()
    assert batcher.step_budget.min_prefill_tokens == STALL_FREE_MIN_PREFILL_BLOCKS * BLOCK_SIZE
    assert batcher.step_budget.decode_only_factor == STALL_FREE_DECODE_FACTOR
    batcher.update_settings(ContinuousBatcherSettings(8, 1024, BLOCK_SIZE, tpot_target_ms=50.0))
    batcher.step()  # settings apply at the next step
    assert batcher.step_budget.min_prefill_tokens == BLOCK_SIZE
    batcher.update_settings(ContinuousBatcherSettings(8, 1024, BLOCK_SIZE))
    batcher.step()
    assert batcher.step_budget.min_prefill_tokens == STALL_FREE_MIN_PREFILL_BLOCKS * BLOCK_SIZE


def test_a_thread_slice_shows_each_continuous_batcher_its_neighbours_running_sequences() -> None:
    from buckets.slices.thread import ThreadSlice

    device_slice = ThreadSlice("s", "cpu", num_threads=1)  # never started: the test steps the batchers
    (first, _), (second, _) = timed_batcher(), timed_batcher()
    for name, batcher in (("a", first), ("b", second)):
        device_slice.attach(("m", name, 0), SimpleNamespace(make_batcher=lambda b=batcher: b, backend_info={}))
    assert first.step_budget.neighbour_decodes is not None and second.step_budget.neighbour_decodes is not None
    for i in range(3):
        second.submit(make_request(8, max_tokens=50, name=f"r{i}", first_token=10 * i + 1, ignore_eos=True))
    second.step()
    assert second.num_running == 3
    assert first.step_budget.neighbour_decodes() == 3  # the other bucket's sequences wait out first's steps
    assert second.step_budget.neighbour_decodes() == 0


def test_a_detached_batcher_is_freed_without_the_cycle_collector() -> None:
    """The gateway freezes its heap (gc.freeze) after start, so a bucket whose batcher sat in a
    reference cycle would never give its weights and KV pool back when unloaded."""
    import gc
    import weakref

    from buckets.slices.thread import ThreadSlice

    device_slice = ThreadSlice("s", "cpu", num_threads=1)
    batcher, _ = timed_batcher()
    device_slice.attach(("m", "a", 0), SimpleNamespace(make_batcher=lambda: batcher, backend_info={}))
    other, _ = timed_batcher()
    device_slice.attach(("m", "b", 0), SimpleNamespace(make_batcher=lambda: other, backend_info={}))
    gone = weakref.ref(batcher)
    gc.disable()
    try:
        device_slice.detach(("m", "a", 0))
        del batcher
        assert gone() is None, "the detached batcher is still referenced (a cycle through the slice?)"
    finally:
        gc.enable()
