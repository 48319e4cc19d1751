"""Requests with ``n`` choices: one prefill, forks sharing the prompt's KV blocks, exact block
accounting on every path (finish, cancel, timeout, failure, preemption, no block for a fork)."""

from __future__ import annotations

from types import SimpleNamespace

from buckets.admission import AdmissionControl
from buckets.continuous import ContinuousBatcher
from buckets.errors import BatchFailedError, DeadlineExceededError
from buckets.request import ErrorEvent, GenerationRequest, TokenEvent
from buckets.sequence import Sequence, child_seed
from buckets.settings import ContinuousBatcherSettings
from buckets.slices.messages import decode_event, decode_request, encode_event, encode_request, is_final
from models.step_io import ForwardInput, ForwardOutput, SamplingParams
from policies.admission import refusal_reason
from tests.factories import EOS, FakeClock, FakeTokenizer, Recorder, events_of


class KVRunner:
    """A fake runner that keeps the token each KV slot holds, so a sequence reading a slot
    another sequence wrote (a shared block written twice, a fork's copy missing) fails the test.

    Each sequence's known tokens by position are recorded from its inputs (a fork inherits its
    parent's; a sequence first seen past position 0 starts from prefix-cached blocks, taken as
    they are); before a step, every earlier position of every scheduled sequence must hold its
    own token. Samples ``1 + (31 * seq_id + position) % 25`` (never ``EOS``), so choices differ.
    Raises ``RuntimeError`` on the calls whose index is in ``fail_calls``. A broken check is
    kept in ``violations`` too, since the batcher turns a runner's exception into failed requests.
    """

    def __init__(self, num_blocks: int = 64, block_size: int = 4, fail_calls: frozenset[int] = frozenset()) -> None:
        self.kv_cache = SimpleNamespace(num_blocks=num_blocks, block_size=block_size)
        self.fail_calls = fail_calls
        self.slots: dict[tuple[int, int], int] = {}
        self.known: dict[int, dict[int, int]] = {}
        self.live: set[int] = set()
        self.calls: list[ForwardInput] = []
        self.violations: list[str] = []

    def run(self, batch: ForwardInput) -> ForwardOutput:
        self.calls.append(batch)
        try:
            return self._run(batch)
        except AssertionError as exc:
            self.violations.append(str(exc))
            raise

    def _run(self, batch: ForwardInput) -> ForwardOutput:
        for seq_id in batch.released_seq_ids:
            assert seq_id in self.live, f"release of unknown or already released sequence {seq_id}"
            self.live.remove(seq_id)
        size = self.kv_cache.block_size
        for src, dst in batch.block_copies:
            for offset in range(size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        for seq in batch.sequences:
            if seq.seq_id not in self.known:
                self.known[seq.seq_id] = {p: self.slots[(seq.block_table[p // size], p % size)] for p in range(seq.position)}
            known = self.known[seq.seq_id]
            for p in range(seq.position):
                assert self.slots.get((seq.block_table[p // size], p % size)) == known[p], f"seq {seq.seq_id} pos {p}"
        for seq in batch.sequences:  # a failing step may have made sampler state already
            if seq.do_sample:
                self.live.update(seq_id for seq_id, _ in ((seq.seq_id, seq.params), *seq.forks))
        if len(self.calls) - 1 in self.fail_calls:
            raise RuntimeError("CUDA error: out of luck")
        sampled: dict[int, int] = {}
        for seq in batch.sequences:
            for i, token_id in enumerate(seq.token_ids):
                p = seq.position + i
                self.known[seq.seq_id][p] = token_id
                self.slots[(seq.block_table[p // size], p % size)] = token_id
            if not seq.do_sample:
                continue
            last = seq.position + len(seq.token_ids) - 1
            for seq_id, _ in ((seq.seq_id, seq.params), *seq.forks):
                if seq_id != seq.seq_id:
                    self.known[seq_id] = {p: t for p, t in self.known[seq.seq_id].items() if p <= last}
                sampled[seq_id] = 1 + (31 * seq_id + last) % 25
        return ForwardOutput(sampled)

    def num_prompt_tokens_computed(self, prompt_len: int) -> int:
        """Tokens at positions below ``prompt_len`` that all the forwards so far computed."""
        return sum(1 for call in self.calls for s in call.sequences for i in range(len(s.token_ids)) if s.position + i < prompt_len)


def make_batcher(
    runner: KVRunner, max_num_seqs: int = 8, clock: FakeClock | None = None, max_num_batched_tokens: int = 64
) -> ContinuousBatcher:
    settings = ContinuousBatcherSettings(max_num_seqs, max_num_batched_tokens, runner.kv_cache.block_size)
    return ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=clock or FakeClock())


def make_request(prompt_len: int, n: int, max_tokens: int = 5, seed: int | None = None, deadline_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sink=Recorder(),
        max_tokens=max_tokens,
        params=SamplingParams(seed=seed),
        n=n,
        deadline_s=deadline_s,
        ignore_eos=True,
    )


def drain(batcher: ContinuousBatcher, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if batcher.seconds_until_ready(0.0) is None:
            return
        batcher.step()
    raise AssertionError("the batcher did not run out of work")


def assert_all_blocks_back(batcher: ContinuousBatcher, runner: KVRunner) -> None:
    assert runner.violations == []
    manager = batcher.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    assert runner.live == set()
    assert not batcher.scheduler.has_work


def token_events(request: GenerationRequest) -> list[TokenEvent]:
    events = events_of(request)
    assert all(isinstance(e, TokenEvent) for e in events)
    return events  # type: ignore[return-value]


def test_n_choices_prefill_the_prompt_once_and_each_runs_to_its_end() -> None:
    runner = KVRunner()
    batcher = make_batcher(runner)
    request = make_request(prompt_len=6, n=3, max_tokens=5)
    batcher.submit(request)
    drain(batcher)
    assert runner.num_prompt_tokens_computed(6) == 6
    events = token_events(request)
    by_choice = {i: [e for e in events if e.index == i] for i in range(3)}
    for choice_events in by_choice.values():
        assert len(choice_events) == 5
        assert [e.finish_reason for e in choice_events] == [None] * 4 + ["length"]
    assert len({tuple(t for e in evs for t in e.token_ids) for evs in by_choice.values()}) == 3  # own tokens
    finished = [e for e in events if e.finish_reason is not None]
    assert [e.num_open_choices for e in finished] == [2, 1, 0]
    assert [e.ends_request for e in events].count(True) == 1 and events[-1].ends_request
    assert batcher.stats().num_finished == 1  # one request
    assert_all_blocks_back(batcher, runner)


def test_forks_share_full_blocks_and_copy_the_partial_last_block() -> None:
    runner = KVRunner(block_size=4)
    batcher = make_batcher(runner)
    batcher.submit(make_request(prompt_len=6, n=3, max_tokens=5))
    batcher.step()  # the prefill: every choice's first token
    manager = batcher.block_manager
    tables = [manager.block_table(seq.seq_id) for seq in batcher.scheduler.running]
    assert len(tables) == 3
    assert len({t[0] for t in tables}) == 1  # the full block, shared
    assert len({t[1] for t in tables}) == 3  # the partial block: the parent's and two copies
    assert manager.num_used_blocks == 4
    batcher.step()
    copies = runner.calls[1].block_copies
    assert sorted(dst for _, dst in copies) == sorted(t[1] for t in tables[1:])
    assert {src for src, _ in copies} == {tables[0][1]}
    manager.check_invariants()


def test_a_prompt_of_whole_blocks_forks_without_a_copy() -> None:
    runner = KVRunner(block_size=4)
    batcher = make_batcher(runner)
    batcher.submit(make_request(prompt_len=8, n=2, max_tokens=3))
    drain(batcher)
    assert all(not call.block_copies for call in runner.calls)
    assert runner.num_prompt_tokens_computed(8) == 8
    assert_all_blocks_back(batcher, runner)


def test_a_chunked_prompt_forks_after_its_last_chunk_only() -> None:
    runner = KVRunner(block_size=4)
    batcher = make_batcher(runner, max_num_batched_tokens=4)
    request = make_request(prompt_len=10, n=3, max_tokens=3)
    batcher.submit(request)
    drain(batcher)
    forking = [s for call in runner.calls for s in call.sequences if s.forks]
    assert len(forking) == 1 and forking[0].position + len(forking[0].token_ids) == 10
    assert runner.num_prompt_tokens_computed(10) == 10
    assert sorted(e.index for e in token_events(request) if e.finish_reason) == [0, 1, 2]
    assert_all_blocks_back(batcher, runner)


def test_a_second_request_reuses_the_cached_prompt_and_forks_too() -> None:
    runner = KVRunner(block_size=4)
    batcher = make_batcher(runner)
    for _ in range(2):
        batcher.submit(make_request(prompt_len=10, n=2, max_tokens=3))
        drain(batcher)
    assert runner.num_prompt_tokens_computed(10) == 10 + 2  # the second prefills only its partial block
    assert batcher.stats().prefix_cache_hits == 2
    assert_all_blocks_back(batcher, runner)


def test_cancelling_a_request_ends_every_choice_and_frees_every_block() -> None:
    for num_steps in (0, 1, 2):  # queued, just forked, decoding
        runner = KVRunner()
        batcher = make_batcher(runner)
        request = make_request(prompt_len=6, n=4, max_tokens=20)
        batcher.submit(request)
        for _ in range(num_steps):
            batcher.step()
        request.cancel()
        drain(batcher)
        assert len(events_of(request)) == 4 * num_steps and not any(isinstance(e, ErrorEvent) for e in events_of(request))
        assert batcher.stats().num_cancelled == 1
        assert_all_blocks_back(batcher, runner)


def test_a_deadline_before_the_first_token_sends_one_error_for_all_choices() -> None:
    clock = FakeClock()
    runner = KVRunner()
    batcher = make_batcher(runner, max_num_seqs=1, clock=clock)
    batcher.submit(make_request(prompt_len=3, n=1, max_tokens=20))  # holds the only seat
    late = make_request(prompt_len=6, n=3, max_tokens=5, deadline_s=1.0)
    batcher.submit(late)
    batcher.step()
    clock.advance(2.0)
    batcher.step()
    (event,) = events_of(late)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, DeadlineExceededError)
    drain(batcher)
    assert_all_blocks_back(batcher, runner)


def test_a_deadline_mid_generation_ends_each_choice_with_timeout() -> None:
    clock = FakeClock()
    runner = KVRunner()
    batcher = make_batcher(runner, clock=clock)
    request = make_request(prompt_len=6, n=2, max_tokens=20, deadline_s=1.0)
    batcher.submit(request)
    batcher.step()
    batcher.step()
    clock.advance(2.0)
    drain(batcher)
    last = [e for e in token_events(request) if e.finish_reason is not None]
    assert sorted(e.index for e in last) == [0, 1] and {e.finish_reason for e in last} == {"timeout"}
    assert last[-1].ends_request
    assert_all_blocks_back(batcher, runner)


def test_a_failed_forward_fails_the_request_once_and_frees_its_forks() -> None:
    for fail_call in (0, 1):  # the prefill (forks pending), a decode (forks running)
        runner = KVRunner(fail_calls=frozenset({fail_call}))
        batcher = make_batcher(runner)
        request = make_request(prompt_len=6, n=3, max_tokens=5)
        batcher.submit(request)
        drain(batcher)
        errors = [e for e in events_of(request) if isinstance(e, ErrorEvent)]
        assert len(errors) == 1 and isinstance(errors[0].error, BatchFailedError)
        assert_all_blocks_back(batcher, runner)


def test_a_fork_without_a_free_block_recomputes_and_accounting_stays_exact() -> None:
    # 3 blocks of 4: the 6-token prompt takes 2, one fork gets the last, the other must wait.
    runner = KVRunner(num_blocks=3, block_size=4)
    batcher = make_batcher(runner)
    request = make_request(prompt_len=6, n=3, max_tokens=2)
    batcher.submit(request)
    drain(batcher)
    events = token_events(request)
    assert sorted(e.index for e in events if e.finish_reason == "length") == [0, 1, 2]
    assert runner.num_prompt_tokens_computed(6) > 6  # the third choice recomputed its prompt
    assert_all_blocks_back(batcher, runner)


def test_preempting_forks_under_block_pressure_keeps_accounting_exact() -> None:
    runner = KVRunner(num_blocks=8, block_size=4)
    batcher = make_batcher(runner)
    request = make_request(prompt_len=6, n=4, max_tokens=8)
    batcher.submit(request)
    drain(batcher, max_steps=300)
    events = token_events(request)
    for i in range(4):
        assert len([e for e in events if e.index == i]) == 8
    assert batcher.stats().num_preemptions > 0
    assert_all_blocks_back(batcher, runner)


def test_a_request_takes_room_for_all_its_choices_in_max_num_seqs() -> None:
    runner = KVRunner()
    batcher = make_batcher(runner, max_num_seqs=4)
    first = make_request(prompt_len=3, n=2, max_tokens=3)
    second = make_request(prompt_len=3, n=3, max_tokens=3)
    batcher.submit(first)
    batcher.submit(second)
    batcher.step()
    assert len(batcher.scheduler.running) == 2  # 2 + 3 > 4: the second waits
    drain(batcher)
    assert max(len(call.sequences) for call in runner.calls) <= 4
    assert_all_blocks_back(batcher, runner)


def test_child_seeds_follow_vllms_rule_and_choice_zero_keeps_the_seed() -> None:
    assert [child_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert child_seed(None, 2) is None
    assert child_seed(2**64 - 1, 1) == 0  # wraps below 2**64
    parent = Sequence(make_request(prompt_len=3, n=3, seed=5), frozenset({EOS}))
    children = parent.spawn_forks()
    assert [parent.params.seed] + [c.params.seed for c in children] == [5, 6, 7]
    assert [c.index for c in children] == [1, 2]


def test_admission_counts_a_request_as_its_n_sequences() -> None:
    assert refusal_reason(1, 10, 5, max_queue_len=4, max_queued_tokens=None, num_seqs=3) is None
    assert "max_queue_len 4" in (refusal_reason(2, 10, 5, max_queue_len=4, max_queued_tokens=None, num_seqs=3) or "")
    assert refusal_reason(0, 0, 5, max_queue_len=4, max_queued_tokens=None, num_seqs=8) is None  # an empty queue takes it
    admission = AdmissionControl(max_queue_len=8)
    ticket = admission.admit(6, num_seqs=3)
    assert (admission.num_queued, admission.num_queued_tokens) == (3, 6)
    ticket.release()
    ticket.release()
    assert (admission.num_queued, admission.num_queued_tokens) == (0, 0)


def test_choices_cross_a_process_slice_pipe_with_their_index() -> None:
    request = make_request(prompt_len=3, n=4)
    assert decode_request(encode_request(7, request), Recorder()).n == 4  # type: ignore[attr-defined]
    event = TokenEvent("a", [3], "stop", 3, 1, index=2, num_open_choices=1)
    assert decode_event(encode_event(event)) == event
    assert not is_final(event)
    assert is_final(TokenEvent("a", [3], "stop", 3, 1, index=1, num_open_choices=0))


def test_the_kv_pool_copies_whole_blocks_of_every_layer() -> None:
    import torch

    from models.kv_cache import KVShape, PagedKVCache

    cache = PagedKVCache(KVShape(num_layers=2, num_kv_heads=1, head_dim=2), num_blocks=4, block_size=2, dtype=torch.float32, device="cpu")
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    cache.copy_blocks([(1, 3), (1, 0)])
    assert torch.equal(cache.data[:, :, 3], before[:, :, 1]) and torch.equal(cache.data[:, :, 0], before[:, :, 1])
    assert torch.equal(cache.data[:, :, 1:3], before[:, :, 1:3])
