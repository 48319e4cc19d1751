"""Scheduler and ContinuousBatcher with fake requests, a fake tokenizer and a fake runner (no model)."""

from __future__ import annotations

from buckets.continuous import ContinuousBatcher
from buckets.errors import BatchFailedError, ShuttingDownError
from buckets.request import ErrorEvent, GenerationRequest, RequestEvent, TokenEvent
from buckets.scheduler import Scheduler, StepPlan
from buckets.sequence import Sequence, SequenceStatus
from buckets.settings import ContinuousBatcherSettings
from models.detokenizer import IncrementalDetokenizer
from models.step_io import ForwardInput, ForwardOutput

EOS = 0


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTokenizer:
    """Token ``i`` decodes to ``pieces[i]`` if given, else to the letter ``chr(ord('a') + i % 26)``.

    ``EOS`` is special and dropped with ``skip_special_tokens``.
    """

    def __init__(self, pieces: dict[int, str] | None = None) -> None:
        self.pieces = pieces or {}

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        out = []
        for i in ids:
            if i == EOS:
                if not skip_special_tokens:
                    out.append("</s>")
                continue
            out.append(self.pieces.get(i, chr(ord("a") + i % 26)))
        return "".join(out)


class Recorder:
    def __init__(self) -> None:
        self.events: list[RequestEvent] = []

    def __call__(self, event: RequestEvent) -> None:
        self.events.append(event)


def make_request(
    prompt_len: int = 4, max_tokens: int = 4, stop: tuple[str, ...] = (), ignore_eos: bool = False, name: str = "r"
) -> GenerationRequest:
    return GenerationRequest(
        request_id=name,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sink=Recorder(),
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
    )


def make_sequence(request: GenerationRequest, tokenizer: FakeTokenizer | None = None) -> Sequence:
    detokenizer = IncrementalDetokenizer(tokenizer or FakeTokenizer(), request.stop)
    return Sequence(request, detokenizer, frozenset({EOS}))


def make_scheduler(max_num_seqs: int = 4, max_num_batched_tokens: int = 64) -> Scheduler:
    settings = ContinuousBatcherSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(settings, FakeClock())


def add_sequences(scheduler: Scheduler, *prompt_lens: int, max_tokens: int = 4) -> list[Sequence]:
    seqs = [make_sequence(make_request(n, max_tokens, name=f"r{i}")) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def events_of(request: GenerationRequest) -> list[RequestEvent]:
    assert isinstance(request.sink, Recorder)
    return request.sink.events


def sample_all(plan: StepPlan, token_id: int = 7) -> ForwardOutput:
    """A runner's output: ``token_id`` for every sequence that samples."""
    return ForwardOutput({s.seq_id: token_id for s in plan.forward.sequences if s.do_sample})


def run_step(scheduler: Scheduler, token_id: int = 7) -> tuple[StepPlan, list[Sequence]]:
    scheduler.drop_cancelled()
    plan = scheduler.schedule()
    return plan, scheduler.postprocess(plan, sample_all(plan, token_id))


# --- scheduling -----------------------------------------------------------------------------


def test_first_step_prefills_the_whole_prompt() -> None:
    scheduler = make_scheduler()
    (seq,) = add_sequences(scheduler, 5)
    plan = scheduler.schedule()
    (inp,) = plan.forward.sequences
    assert plan.scheduled == [seq]
    assert inp.seq_id == seq.seq_id
    assert inp.token_ids == [1, 2, 3, 4, 5]
    assert inp.position == 0
    assert inp.do_sample
    assert inp.capacity_tokens == 5 + 4
    assert seq.status is SequenceStatus.RUNNING


def test_running_decodes_are_scheduled_before_new_prompts() -> None:
    scheduler = make_scheduler()
    (first,) = add_sequences(scheduler, 3)
    run_step(scheduler, token_id=9)
    (second,) = add_sequences(scheduler, 2)
    plan = scheduler.schedule()
    assert plan.scheduled == [first, second]
    decode, prefill = plan.forward.sequences
    assert decode.token_ids == [9] and decode.position == 3
    assert prefill.token_ids == [1, 2] and prefill.position == 0


def test_prompts_are_admitted_while_the_token_budget_allows() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b, c = add_sequences(scheduler, 4, 4, 4)
    plan, _ = run_step(scheduler)
    assert plan.scheduled == [a, b]  # 8 tokens; a third prompt of 4 would make 12
    assert plan.forward.num_tokens == 8
    assert list(scheduler.waiting) == [c]
    plan, _ = run_step(scheduler)
    assert plan.scheduled == [a, b, c]  # 2 decode tokens + 4 prompt tokens
    assert plan.forward.num_tokens == 6


def test_a_prompt_exactly_filling_the_budget_is_admitted() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b = add_sequences(scheduler, 5, 3)
    plan = scheduler.schedule()
    assert plan.scheduled == [a, b]


def test_head_of_line_prompt_blocks_later_ones_fcfs() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b, c = add_sequences(scheduler, 6, 6, 1)
    plan = scheduler.schedule()
    # c would fit in the 4 tokens left, but b is first in line and does not.
    assert plan.scheduled == [a]
    assert list(scheduler.waiting) == [b, c]


def test_max_num_seqs_bounds_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    a, b, c = add_sequences(scheduler, 1, 1, 1, max_tokens=2)
    plan, _ = run_step(scheduler)
    assert plan.scheduled == [a, b]
    plan, finished = run_step(scheduler)
    assert plan.scheduled == [a, b]
    assert finished == [a, b]
    plan, _ = run_step(scheduler)
    assert plan.scheduled == [c]


def test_step_ids_increase_and_are_recorded_on_requests() -> None:
    scheduler = make_scheduler()
    a, b = add_sequences(scheduler, 2, 2)
    first, _ = run_step(scheduler)
    second, _ = run_step(scheduler)
    assert second.step_id == first.step_id + 1
    assert a.request.batches == [(first.step_id, 0), (second.step_id, 0)]
    assert b.request.batches == [(first.step_id, 1), (second.step_id, 1)]


def test_empty_scheduler_plans_an_empty_step() -> None:
    scheduler = make_scheduler()
    assert not scheduler.has_work
    assert scheduler.schedule().is_empty


# --- postprocess ----------------------------------------------------------------------------


def test_generation_ends_at_max_tokens_with_length() -> None:
    scheduler = make_scheduler()
    (seq,) = add_sequences(scheduler, 3, max_tokens=3)
    finished: list[Sequence] = []
    for _ in range(3):
        _, finished = run_step(scheduler, token_id=2)  # 'c'
    assert finished == [seq]
    assert seq.output_token_ids == [2, 2, 2]
    events = events_of(seq.request)
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.finish_reason for e in events] == [None, None, "length"]  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == "ccc"  # type: ignore[union-attr]
    assert events[-1].num_completion_tokens == 3  # type: ignore[union-attr]
    assert events[-1].num_prompt_tokens == 3  # type: ignore[union-attr]
    assert seq.status is SequenceStatus.FINISHED
    assert seq.request.info["outcome"] == "length"
    assert not scheduler.running and not scheduler.waiting


def test_eos_ends_generation_with_stop() -> None:
    scheduler = make_scheduler()
    (seq,) = add_sequences(scheduler, 2, max_tokens=10)
    run_step(scheduler, token_id=3)
    _, finished = run_step(scheduler, token_id=EOS)
    assert finished == [seq]
    last = events_of(seq.request)[-1]
    assert isinstance(last, TokenEvent)
    assert last.finish_reason == "stop"
    assert last.token_ids == [EOS]
    assert "".join(e.text for e in events_of(seq.request)) == "d"  # type: ignore[union-attr]


def test_ignore_eos_generates_through_eos_until_length() -> None:
    scheduler = make_scheduler()
    seq = make_sequence(make_request(2, max_tokens=3, ignore_eos=True))
    scheduler.add(seq)
    finished: list[Sequence] = []
    for _ in range(3):
        _, finished = run_step(scheduler, token_id=EOS)
    assert finished == [seq]
    assert seq.output_token_ids == [EOS, EOS, EOS]
    assert [e.finish_reason for e in events_of(seq.request)] == [None, None, "length"]  # type: ignore[union-attr]


def test_stop_string_ends_generation_and_is_not_returned() -> None:
    scheduler = make_scheduler()
    tokenizer = FakeTokenizer({10: "Hi", 11: " ST", 12: "OP", 13: "!"})
    seq = make_sequence(make_request(2, max_tokens=10, stop=("STOP",)), tokenizer)
    scheduler.add(seq)
    finished: list[Sequence] = []
    for token in (10, 11, 12):
        _, finished = run_step(scheduler, token_id=token)
    assert finished == [seq]
    events = events_of(seq.request)
    assert events[-1].finish_reason == "stop"  # type: ignore[union-attr]
    assert "".join(e.text for e in events) == "Hi "  # type: ignore[union-attr]


def test_first_token_time_is_stamped_once() -> None:
    scheduler = make_scheduler()
    (seq,) = add_sequences(scheduler, 2)
    clock = scheduler.clock
    assert isinstance(clock, FakeClock)
    clock.now = 1.0
    run_step(scheduler)
    clock.now = 2.0
    run_step(scheduler)
    assert seq.request.timeline["first_token"] == 1.0


# --- releasing KV ---------------------------------------------------------------------------


def test_finished_sequence_is_released_exactly_once() -> None:
    scheduler = make_scheduler()
    (seq,) = add_sequences(scheduler, 2, max_tokens=1)
    _, finished = run_step(scheduler)
    assert finished == [seq]
    assert scheduler.has_work  # the release still has to reach the runner
    releases = [scheduler.schedule().forward.released_seq_ids for _ in range(3)]
    assert releases == [[seq.seq_id], [], []]
    assert not scheduler.has_work


def test_cancelled_running_sequence_is_dropped_and_released_once() -> None:
    scheduler = make_scheduler()
    a, b = add_sequences(scheduler, 2, 2, max_tokens=10)
    run_step(scheduler)
    a.request.cancel()
    dropped = scheduler.drop_cancelled()
    assert dropped == [a]
    assert a.request.info["outcome"] == "cancelled"
    plan = scheduler.schedule()
    assert plan.scheduled == [b]
    assert plan.forward.released_seq_ids == [a.seq_id]
    scheduler.postprocess(plan, sample_all(plan))
    assert scheduler.drop_cancelled() == []  # not dropped twice
    later = [scheduler.schedule().forward.released_seq_ids for _ in range(2)]
    assert later == [[], []]


def test_cancelled_waiting_sequence_is_dropped_and_never_scheduled() -> None:
    scheduler = make_scheduler()
    a, b = add_sequences(scheduler, 2, 2)
    b.request.cancel()
    assert scheduler.drop_cancelled() == [b]
    plan = scheduler.schedule()
    assert plan.scheduled == [a]
    # b never ran, so it holds no KV and the runner never hears of it.
    assert b.seq_id not in plan.forward.released_seq_ids
    assert b.status is SequenceStatus.FINISHED


def test_fail_takes_sequences_out_and_releases_running_ones() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = add_sequences(scheduler, 2, 2)
    run_step(scheduler)
    scheduler.fail([a, b])
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.schedule().forward.released_seq_ids == [a.seq_id]
    assert a.request.info["outcome"] == b.request.info["outcome"] == "error"


# --- the continuous batcher -----------------------------------------------------------------


class FakeRunner:
    """Tracks live sequences like the real runner's KV storage; samples ``token_id``.

    Raises ``RuntimeError`` on the calls whose index is in ``fail_calls`` (after releasing and
    admitting, as the real runner would). Double releases or unknown releases fail the test.
    """

    def __init__(self, token_id: int = 7, fail_calls: frozenset[int] = frozenset()) -> None:
        self.token_id = token_id
        self.fail_calls = fail_calls
        self.live: set[int] = set()
        self.released: list[int] = []
        self.calls: list[ForwardInput] = []

    def run(self, batch: ForwardInput) -> ForwardOutput:
        self.calls.append(batch)
        for seq_id in batch.released_seq_ids:
            assert seq_id in self.live, f"release of unknown or already released sequence {seq_id}"
            self.live.remove(seq_id)
            self.released.append(seq_id)
        for seq in batch.sequences:
            if seq.position == 0:
                assert seq.seq_id not in self.live
                self.live.add(seq.seq_id)
            else:
                assert seq.seq_id in self.live, f"decode of a sequence with no KV: {seq.seq_id}"
        if len(self.calls) - 1 in self.fail_calls:
            raise RuntimeError("CUDA error: out of luck")
        return ForwardOutput({s.seq_id: self.token_id for s in batch.sequences if s.do_sample})


def make_batcher(
    runner: FakeRunner, max_num_seqs: int = 4, max_num_batched_tokens: int = 64
) -> ContinuousBatcher:
    settings = ContinuousBatcherSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
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
        assert request.info["outcome"] == "error"
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
