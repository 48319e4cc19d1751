"""Scheduler and ContinuousBatcher with fake requests, a fake tokenizer and a fake runner (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from buckets.continuous import ContinuousBatcher
from buckets.errors import BatchFailedError, KVCapacityError, ShuttingDownError
from buckets.request import ErrorEvent, TokenEvent
from buckets.output import OutputProcessor
from buckets.scheduler import Scheduler, StepPlan
from buckets.sequence import FinishReason, Sequence, SequenceStatus
from buckets.settings import ContinuousBatcherSettings
from models.step_io import ForwardInput, ForwardOutput
from tests.factories import EOS, FakeClock, FakeTokenizer, events_of, make_request, make_scheduler, make_sequence

class Core:
    """A scheduler and its output stage, wired as the continuous batcher wires them (no model)."""

    def __init__(self, scheduler: Scheduler, tokenizer: FakeTokenizer) -> None:
        self.scheduler = scheduler
        self.output = OutputProcessor(scheduler, tokenizer, scheduler.clock)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.output.add(seq)

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.output.record_plan(plan)
        return plan

    def postprocess(self, plan: StepPlan, output: ForwardOutput) -> list[Sequence]:
        """Postprocess and output; the sequences that ended."""
        return self.output.process(self.scheduler.postprocess(plan, output))

    def drop_ended(self, now: float | None = None) -> list[Sequence]:
        """Drop cancelled and expired sequences (at ``now``, default the clock) and tell their clients."""
        return self.output.process(self.scheduler.drop_ended(self.scheduler.clock() if now is None else now))


def make_core(tokenizer: FakeTokenizer | None = None, **scheduler_args: int | bool) -> Core:
    return Core(make_scheduler(**scheduler_args), tokenizer or FakeTokenizer())  # type: ignore[arg-type]


def add_sequences(core: Core, *prompt_lens: int, max_tokens: int = 4) -> list[Sequence]:
    seqs = [make_sequence(make_request(n, max_tokens, name=f"r{i}")) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        core.add(seq)
    return seqs


def sample_all(plan: StepPlan, token_id: int = 7) -> ForwardOutput:
    """A runner's output: ``token_id`` for every sequence that samples."""
    return ForwardOutput({s.seq_id: token_id for s in plan.forward.sequences if s.do_sample})


def run_step(core: Core, token_id: int = 7) -> tuple[StepPlan, list[Sequence]]:
    """One step as the batcher runs it: drop ended, schedule, postprocess, output."""
    core.drop_ended()
    plan = core.schedule()
    return plan, core.postprocess(plan, sample_all(plan, token_id))


# --- scheduling -----------------------------------------------------------------------------


def test_first_step_prefills_the_whole_prompt() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 5)
    plan = core.schedule()
    (inp,) = plan.forward.sequences
    assert plan.scheduled == [seq]
    assert inp.seq_id == seq.seq_id
    assert inp.token_ids == [1, 2, 3, 4, 5]
    assert inp.position == 0
    assert inp.do_sample
    assert len(inp.block_table) == 2  # 5 tokens in blocks of 4
    assert seq.status is SequenceStatus.RUNNING


def test_running_decodes_are_scheduled_before_new_prompts() -> None:
    core = make_core()
    (first,) = add_sequences(core, 3)
    run_step(core, token_id=9)
    (second,) = add_sequences(core, 2)
    plan = core.schedule()
    assert plan.scheduled == [first, second]
    decode, prefill = plan.forward.sequences
    assert decode.token_ids == [9] and decode.position == 3
    assert prefill.token_ids == [1, 2] and prefill.position == 0


def test_prompts_are_admitted_while_the_token_budget_allows() -> None:
    core = make_core(max_num_batched_tokens=10)
    a, b, c = add_sequences(core, 4, 4, 4)
    plan, _ = run_step(core)
    # 4 + 4 tokens, then c's first chunk takes the 2 left.
    assert plan.scheduled == [a, b, c]
    assert [len(s.token_ids) for s in plan.forward.sequences] == [4, 4, 2]
    assert [s.do_sample for s in plan.forward.sequences] == [True, True, False]
    plan, _ = run_step(core)
    assert plan.scheduled == [a, b, c]  # 2 decode tokens + c's last 2 prompt tokens
    assert plan.forward.sequences[2].token_ids == [3, 4] and plan.forward.sequences[2].position == 2
    assert plan.forward.num_tokens == 4


def test_a_prompt_exactly_filling_the_budget_is_admitted() -> None:
    core = make_core(max_num_batched_tokens=8)
    a, b = add_sequences(core, 5, 3)
    plan = core.schedule()
    assert plan.scheduled == [a, b]
    assert core.scheduler.counters.num_chunked_prefills == 0


def test_no_budget_left_keeps_later_prompts_waiting_fcfs() -> None:
    core = make_core(max_num_batched_tokens=10)
    a, b, c = add_sequences(core, 6, 6, 1)
    plan = core.schedule()
    # b's first chunk takes the 4 tokens left; c, behind it, waits.
    assert plan.scheduled == [a, b]
    assert list(core.scheduler.waiting) == [c]


def test_max_num_seqs_bounds_the_running_set() -> None:
    core = make_core(max_num_seqs=2)
    a, b, c = add_sequences(core, 1, 1, 1, max_tokens=2)
    plan, _ = run_step(core)
    assert plan.scheduled == [a, b]
    plan, finished = run_step(core)
    assert plan.scheduled == [a, b]
    assert finished == [a, b]
    plan, _ = run_step(core)
    assert plan.scheduled == [c]


def test_step_ids_increase_and_are_recorded_on_requests() -> None:
    core = make_core()
    a, b = add_sequences(core, 2, 2)
    first, _ = run_step(core)
    second, _ = run_step(core)
    assert second.step_id == first.step_id + 1
    assert a.request.batches == [(first.step_id, 0), (second.step_id, 0)]
    assert b.request.batches == [(first.step_id, 1), (second.step_id, 1)]


def test_empty_scheduler_plans_an_empty_step() -> None:
    core = make_core()
    assert not core.scheduler.has_work
    assert core.schedule().is_empty


# --- postprocess ----------------------------------------------------------------------------


def test_generation_ends_at_max_tokens_with_length() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 3, max_tokens=3)
    finished: list[Sequence] = []
    for _ in range(3):
        _, finished = run_step(core, token_id=2)  # 'c'
    assert finished == [seq]
    assert seq.output_token_ids == [2, 2, 2]
    events = events_of(seq.request)
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.finish_reason for e in events] == [None, None, "length"]  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == "ccc"  # type: ignore[union-attr]
    assert events[-1].num_completion_tokens == 3  # type: ignore[union-attr]
    assert events[-1].num_prompt_tokens == 3  # type: ignore[union-attr]
    assert seq.status is SequenceStatus.FINISHED
    assert seq.finish_reason is FinishReason.LENGTH
    assert not core.scheduler.running and not core.scheduler.waiting


def test_eos_ends_generation_with_stop() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 2, max_tokens=10)
    run_step(core, token_id=3)
    _, finished = run_step(core, token_id=EOS)
    assert finished == [seq]
    last = events_of(seq.request)[-1]
    assert isinstance(last, TokenEvent)
    assert last.finish_reason == "stop"
    assert last.token_ids == [EOS]
    assert "".join(e.text for e in events_of(seq.request)) == "d"  # type: ignore[union-attr]


def test_ignore_eos_generates_through_eos_until_length() -> None:
    core = make_core()
    seq = make_sequence(make_request(2, max_tokens=3, ignore_eos=True))
    core.add(seq)
    finished: list[Sequence] = []
    for _ in range(3):
        _, finished = run_step(core, token_id=EOS)
    assert finished == [seq]
    assert seq.output_token_ids == [EOS, EOS, EOS]
    assert [e.finish_reason for e in events_of(seq.request)] == [None, None, "length"]  # type: ignore[union-attr]


def test_stop_string_ends_generation_and_is_not_returned() -> None:
    core = make_core(FakeTokenizer({10: "Hi", 11: " ST", 12: "OP", 13: "!"}))
    seq = make_sequence(make_request(2, max_tokens=10, stop=("STOP",)))
    core.add(seq)
    finished: list[Sequence] = []
    for token in (10, 11, 12):
        _, finished = run_step(core, token_id=token)
    assert finished == [seq]
    events = events_of(seq.request)
    assert events[-1].finish_reason == "stop"  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == "Hi "  # type: ignore[union-attr]
    # The stop string finished it through the scheduler: out of the running set, blocks freed.
    assert seq.finish_reason is FinishReason.STOP and seq.status is SequenceStatus.FINISHED
    assert not core.scheduler.running and core.scheduler.block_manager.num_used_blocks == 0
    assert core.schedule().forward.released_seq_ids == [seq.seq_id]


def test_a_stop_string_in_the_last_allowed_token_still_reports_stop() -> None:
    core = make_core(FakeTokenizer({10: "Hi", 11: " STOP"}))
    seq = make_sequence(make_request(2, max_tokens=2, stop=("STOP",)))
    core.add(seq)
    run_step(core, token_id=10)
    _, finished = run_step(core, token_id=11)
    assert finished == [seq]
    events = events_of(seq.request)
    assert [e.finish_reason for e in events] == [None, "stop"]  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == "Hi "  # type: ignore[union-attr]


def test_the_output_stage_stamps_the_timeline_and_postprocess_emits_nothing() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 2, max_tokens=1)
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    clock.now = 1.0
    plan = core.scheduler.schedule()
    assert seq.request.timeline == {} and seq.request.batches == []
    core.output.record_plan(plan)
    assert seq.request.timeline == {"started": 1.0} and seq.request.batches == [(plan.step_id, 0)]
    clock.now = 2.0
    result = core.scheduler.postprocess(plan, sample_all(plan))
    assert result.new_token_ids == {seq.seq_id: [7]}
    assert result.finished == {seq.seq_id: FinishReason.LENGTH}
    assert events_of(seq.request) == [] and "finished" not in seq.request.timeline
    assert core.output.process(result) == [seq]
    assert seq.request.timeline == {"started": 1.0, "first_token": 2.0, "finished": 2.0}
    (event,) = events_of(seq.request)
    assert isinstance(event, TokenEvent) and event.finish_reason == "length" and event.text == "h"


def test_first_token_time_is_stamped_once() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 2)
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    clock.now = 1.0
    run_step(core)
    clock.now = 2.0
    run_step(core)
    assert seq.request.timeline["first_token"] == 1.0


# --- releasing KV ---------------------------------------------------------------------------


def test_finished_sequence_is_released_exactly_once() -> None:
    core = make_core()
    (seq,) = add_sequences(core, 2, max_tokens=1)
    _, finished = run_step(core)
    assert finished == [seq]
    assert core.scheduler.has_work  # the release still has to reach the runner
    releases = [core.schedule().forward.released_seq_ids for _ in range(3)]
    assert releases == [[seq.seq_id], [], []]
    assert not core.scheduler.has_work


def test_cancelled_running_sequence_is_dropped_and_released_once() -> None:
    core = make_core()
    a, b = add_sequences(core, 2, 2, max_tokens=10)
    run_step(core)
    a.request.cancel()
    num_events = len(events_of(a.request))
    result = core.scheduler.drop_ended(core.scheduler.clock())
    assert result.finished == {a.seq_id: FinishReason.CANCELLED} and not result.new_token_ids
    assert core.output.process(result) == [a]
    assert len(events_of(a.request)) == num_events  # nothing emitted: the canceller answers
    assert a.finish_reason is FinishReason.CANCELLED
    plan = core.schedule()
    assert plan.scheduled == [b]
    assert plan.forward.released_seq_ids == [a.seq_id]
    core.postprocess(plan, sample_all(plan))
    assert core.drop_ended() == []  # not dropped twice
    later = [core.schedule().forward.released_seq_ids for _ in range(2)]
    assert later == [[], []]


def test_cancelled_waiting_sequence_is_dropped_and_never_scheduled() -> None:
    core = make_core()
    a, b = add_sequences(core, 2, 2)
    b.request.cancel()
    assert core.drop_ended() == [b]
    plan = core.schedule()
    assert plan.scheduled == [a]
    # b never ran, so it holds no KV and the runner never hears of it.
    assert b.seq_id not in plan.forward.released_seq_ids
    assert b.status is SequenceStatus.FINISHED


def test_fail_takes_sequences_out_and_releases_running_ones() -> None:
    core = make_core(max_num_seqs=1)
    a, b = add_sequences(core, 2, 2)
    run_step(core)
    core.scheduler.fail([a, b])
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.schedule().forward.released_seq_ids == [a.seq_id]
    assert a.finish_reason is b.finish_reason is FinishReason.ERROR


# --- the continuous batcher -----------------------------------------------------------------


class FakeRunner:
    """Checks what a real runner relies on; samples ``token_id``.

    Every scheduled sequence's block table must hold its positions, and no block may be
    written by two sequences in one step. Sampler state is created on a sequence's first
    sample and dropped on release; a double or unknown release fails the test. Raises
    ``RuntimeError`` on the calls whose index is in ``fail_calls``.
    """

    def __init__(self, token_id: int = 7, fail_calls: frozenset[int] = frozenset(), num_blocks: int = 64, block_size: int = 4) -> None:
        self.token_id = token_id
        self.fail_calls = fail_calls
        self.kv_cache = SimpleNamespace(num_blocks=num_blocks, block_size=block_size)
        self.live: set[int] = set()
        self.released: list[int] = []
        self.calls: list[ForwardInput] = []

    def run(self, batch: ForwardInput) -> ForwardOutput:
        self.calls.append(batch)
        for seq_id in batch.released_seq_ids:
            assert seq_id in self.live, f"release of unknown or already released sequence {seq_id}"
            self.live.remove(seq_id)
            self.released.append(seq_id)
        written: dict[int, int] = {}
        block_size = self.kv_cache.block_size
        for seq in batch.sequences:
            end = seq.position + len(seq.token_ids)
            assert len(seq.block_table) * block_size >= end, "block table too short"
            for p in range(seq.position, end):
                block = seq.block_table[p // block_size]
                assert written.setdefault(block, seq.seq_id) == seq.seq_id, f"block {block} written twice"
            if seq.do_sample:
                self.live.add(seq.seq_id)
        if len(self.calls) - 1 in self.fail_calls:
            raise RuntimeError("CUDA error: out of luck")
        return ForwardOutput({s.seq_id: self.token_id for s in batch.sequences if s.do_sample})


def make_batcher(
    runner: FakeRunner, max_num_seqs: int = 4, max_num_batched_tokens: int = 64
) -> ContinuousBatcher:
    settings = ContinuousBatcherSettings(max_num_seqs, max_num_batched_tokens, runner.kv_cache.block_size)
    return ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=FakeClock())


def drain(batcher: ContinuousBatcher, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if batcher.seconds_until_ready(0.0) is None:
            return
        batcher.step()
    raise AssertionError("the batcher did not run out of work")


def test_batcher_runs_requests_to_the_end_and_frees_all_kv() -> None:
    runner = FakeRunner()
    batcher = make_batcher(runner)
    requests = [make_request(3, max_tokens=2, name="a"), make_request(5, max_tokens=3, name="b")]
    for request in requests:
        batcher.submit(request)
    assert batcher.seconds_until_ready(0.0) == 0.0
    drain(batcher)
    for request in requests:
        events = events_of(request)
        assert len(events) == request.max_tokens
        assert events[-1].finish_reason == "length"  # type: ignore[union-attr]
    assert runner.live == set()
    stats = batcher.stats()
    assert stats.kind == "continuous"
    assert stats.num_finished == 2
    assert stats.num_steps == 3
    assert stats.max_batch_seqs == 2
    assert stats.num_batched_tokens == (3 + 5) + 2 + 1


def test_batcher_step_failure_fails_that_steps_requests_and_keeps_going() -> None:
    runner = FakeRunner(fail_calls=frozenset({1}))
    batcher = make_batcher(runner)
    a = make_request(2, max_tokens=5, name="a")
    batcher.submit(a)
    batcher.step()  # a prefills
    b = make_request(3, max_tokens=5, name="b")
    batcher.submit(b)
    batcher.step()  # a decodes, b prefills: the forward raises
    for request in (a, b):
        last = events_of(request)[-1]
        assert isinstance(last, ErrorEvent)
        assert isinstance(last.error, BatchFailedError)
        assert "out of luck" in str(last.error)
        assert sum(isinstance(e, ErrorEvent) for e in events_of(request)) == 1
    assert batcher.stats().num_failed == 2
    c = make_request(2, max_tokens=2, name="c")
    batcher.submit(c)
    drain(batcher)
    assert [e.finish_reason for e in events_of(c)] == [None, "length"]  # type: ignore[union-attr]
    assert runner.live == set()  # the failed sequences' KV was released too
    assert sorted(runner.released) == sorted(set(runner.released))


def test_batcher_cancellation_releases_kv_on_the_next_step() -> None:
    runner = FakeRunner()
    batcher = make_batcher(runner)
    a, b = make_request(2, max_tokens=10, name="a"), make_request(2, max_tokens=10, name="b")
    batcher.submit(a)
    batcher.submit(b)
    batcher.step()
    a_seq_id = runner.calls[0].sequences[0].seq_id
    a.cancel()
    batcher.step()
    assert runner.calls[-1].released_seq_ids == [a_seq_id]
    assert [s.seq_id for s in runner.calls[-1].sequences] == [runner.calls[0].sequences[1].seq_id]
    b.cancel()
    drain(batcher)
    assert runner.live == set()
    assert batcher.stats().num_cancelled == 2
    assert len(events_of(a)) == 1  # nothing after the cancel


def test_batcher_shutdown_fails_pending_requests_and_frees_kv() -> None:
    runner = FakeRunner()
    batcher = make_batcher(runner, max_num_seqs=1)
    running, queued = make_request(2, max_tokens=10, name="a"), make_request(2, max_tokens=10, name="b")
    batcher.submit(running)
    batcher.submit(queued)
    batcher.step()
    inbox = make_request(2, name="c")
    batcher.submit(inbox)
    batcher.shutdown()
    for request in (running, queued, inbox):
        last = events_of(request)[-1]
        assert isinstance(last, ErrorEvent) and isinstance(last.error, ShuttingDownError)
    assert runner.live == set()


def test_batcher_refuses_a_request_larger_than_the_whole_pool() -> None:
    runner = FakeRunner(num_blocks=4, block_size=4)
    batcher = make_batcher(runner)
    too_big = make_request(10, max_tokens=7, name="big")  # 17 tokens > 16
    batcher.submit(too_big)
    batcher.step()
    (event,) = events_of(too_big)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, KVCapacityError)
    assert batcher.stats().num_failed == 1


# --- chunked prefill, preemption, prefix caching ----------------------------------------------


def run_until_done(core: Scheduler, max_steps: int = 200) -> list[StepPlan]:
    plans = []
    for _ in range(max_steps):
        if not core.scheduler.has_work:
            return plans
        plan, _ = run_step(core)
        plans.append(plan)
        core.scheduler.block_manager.check_invariants()
    raise AssertionError("the scheduler did not run out of work")


def test_a_long_prompt_is_chunked_while_running_sequences_decode_every_step() -> None:
    core = make_core(max_num_batched_tokens=8)
    (short,) = add_sequences(core, 2, max_tokens=8)
    run_step(core)
    (long,) = add_sequences(core, 20, max_tokens=2)
    chunks = []
    for _ in range(3):
        plan, _ = run_step(core)
        assert plan.scheduled[0] is short and len(plan.forward.sequences[0].token_ids) == 1
        chunks.append((plan.forward.sequences[1].position, len(plan.forward.sequences[1].token_ids)))
    assert chunks == [(0, 7), (7, 7), (14, 6)]  # 20 prompt tokens beside one decode per step
    assert long.output_token_ids == [7]  # sampled only after the last chunk
    assert core.scheduler.counters.num_chunked_prefills == 2


def test_out_of_blocks_preempts_the_lowest_priority_latest_arrival() -> None:
    # 6 blocks of 2 tokens; three prompts of 3 tokens take 2 blocks each; the first decode
    # that needs a third block has to take one from someone.
    core = make_core(num_blocks=6, block_size=2)
    urgent = make_sequence(make_request(3, max_tokens=4, name="urgent", priority=-1))
    early = make_sequence(make_request(3, max_tokens=4, name="early"))
    late = make_sequence(make_request(3, max_tokens=4, name="late"))
    for seq in (early, urgent, late):
        core.add(seq)
    run_step(core)  # all prefill: 6 blocks used
    assert core.scheduler.block_manager.num_free_blocks == 0
    plan, _ = run_step(core)  # decodes at position 3: 4 tokens fit in 2 blocks
    plan = core.schedule()  # position 4 needs a third block each
    assert plan.num_preempted >= 1
    assert late.status is SequenceStatus.PREEMPTED  # priority 0 like early, but arrived later
    assert urgent.status is SequenceStatus.RUNNING
    assert core.scheduler.waiting.peek() is late and late.num_computed_tokens == 0
    core.postprocess(plan, sample_all(plan))
    run_until_done(core)
    for seq in (urgent, early, late):
        assert seq.output_token_ids == [7, 7, 7, 7]
        assert [e.finish_reason for e in events_of(seq.request)][-1] == "length"  # type: ignore[union-attr]
    assert core.scheduler.counters.num_preemptions >= 1
    assert core.scheduler.block_manager.num_used_blocks == 0


def test_a_preempted_sequence_recomputes_its_prompt_and_outputs() -> None:
    core = make_core(num_blocks=3, block_size=2, enable_prefix_caching=False)
    a, b = add_sequences(core, 2, 2, max_tokens=3)
    run_step(core)  # both prefill: 2 blocks
    run_step(core)  # a's decode needs block 3, b's decode then needs a 4th: b is preempted
    assert b.status is SequenceStatus.PREEMPTED
    plans = run_until_done(core)
    resumed = next(p for p in plans if b in p.scheduled)
    seq_input = resumed.forward.sequences[resumed.scheduled.index(b)]
    assert seq_input.position == 0
    assert seq_input.token_ids == [1, 2, 7]  # prompt + the token it had already generated
    assert b.output_token_ids == [7, 7, 7]
    assert core.scheduler.block_manager.num_used_blocks == 0


def test_shared_prefix_hits_the_prefix_cache() -> None:
    core = make_core(block_size=4)
    first = make_sequence(make_request(10, max_tokens=2, name="first"))
    core.add(first)
    run_until_done(core)
    second = make_sequence(make_request(10, max_tokens=2, name="second"))
    core.add(second)
    plan, _ = run_step(core)
    (seq_input,) = plan.forward.sequences
    assert seq_input.position == 8  # two full blocks of the same 10-token prompt reused
    assert seq_input.token_ids == [9, 10]
    stats = core.scheduler.block_manager.stats()
    assert stats.prefix_cache_hits == 2
    run_until_done(core)
    assert second.output_token_ids == first.output_token_ids


def test_prefix_caching_off_recomputes_everything() -> None:
    core = make_core(block_size=4, enable_prefix_caching=False)
    for name in ("first", "second"):
        core.add(make_sequence(make_request(10, max_tokens=1, name=name)))
        plan, _ = run_step(core)
        assert plan.forward.sequences[0].position == 0
        run_until_done(core)
    assert core.scheduler.block_manager.stats().prefix_cache_hits == 0


def test_every_block_is_free_or_evictable_after_all_end_cancelled_included() -> None:
    core = make_core(num_blocks=12, block_size=2, max_num_batched_tokens=6)
    seqs = add_sequences(core, 5, 3, 7, 1, 4, max_tokens=5)
    run_step(core)
    seqs[1].request.cancel()
    run_step(core)
    seqs[4].request.cancel()  # maybe still waiting
    run_until_done(core)
    manager = core.scheduler.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks


def test_add_refuses_a_sequence_that_can_never_fit() -> None:
    core = make_core(num_blocks=2, block_size=4)
    with pytest.raises(KVCapacityError, match="exceeds the KV pool's 8 tokens"):
        core.add(make_sequence(make_request(5, max_tokens=4)))


def test_waiting_sequences_join_by_effective_priority_with_aging() -> None:
    core = make_core(max_num_seqs=1)
    clock = core.scheduler.clock
    assert isinstance(clock, FakeClock)
    background = make_sequence(make_request(2, max_tokens=1, name="background", priority=2))
    core.add(background)  # arrives at t=0
    clock.now = 5.0
    urgent = make_sequence(make_request(2, max_tokens=1, name="urgent", priority=0))
    core.add(urgent)  # 2 levels more urgent, 5 s later: aging (10 s a level) leaves it ahead
    plan, _ = run_step(core)
    assert plan.scheduled == [urgent]
    clock.now = 30.0
    late_urgent = make_sequence(make_request(2, max_tokens=1, name="late", priority=0))
    core.add(late_urgent)  # 30 s after background: background has aged past it
    run_until_done(core)
    assert background.request.batches[0][0] < late_urgent.request.batches[0][0]


def test_a_blocked_waiting_sequence_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import buckets.sequence

    hashed: list[tuple[int, ...]] = []
    real_hash = buckets.sequence.hash_block_tokens

    def counting_hash(parent_hash: int | None, token_ids: list[int]) -> int:
        hashed.append(tuple(token_ids))
        return real_hash(parent_hash, token_ids)

    monkeypatch.setattr(buckets.sequence, "hash_block_tokens", counting_hash)
    core = make_core(num_blocks=4, block_size=4)
    running = make_sequence(make_request(12, max_tokens=4, name="running"))
    core.add(running)
    run_step(core)  # 12 prompt tokens in 3 blocks; its decodes take the 4th
    blocked = make_sequence(make_request(12, max_tokens=2, name="blocked", first_token=100))
    core.add(blocked)
    num_blocked_steps = 0
    while blocked not in run_step(core)[0].scheduled:
        assert list(core.scheduler.waiting) == [blocked]
        num_blocked_steps += 1
    assert num_blocked_steps >= 2
    blocked_blocks = [tuple(range(100 + i, 104 + i)) for i in (0, 4, 8)]
    assert [h for h in hashed if h in blocked_blocks] == blocked_blocks  # each of its 3 blocks once
