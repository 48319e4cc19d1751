"""The shared factories build what the unit tests expect: a real scheduler over fake requests."""

from __future__ import annotations

from buckets.sequence import SequenceStatus
from tests.factories import EOS, FakeClock, FakeTokenizer, events_of, make_request, make_requests, make_scheduler, make_sequence


def test_the_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(1.5)
    assert clock() == 1.5
    clock.advance(0.25)
    assert clock() == 1.75


def test_make_scheduler_schedules_a_made_sequence_whole() -> None:
    scheduler = make_scheduler(block_size=4)
    seq = make_sequence(make_request(prompt_len=5, name="r0"))
    scheduler.add(seq)
    plan = scheduler.schedule()
    (forward,) = plan.forward.sequences
    assert forward.token_ids == [1, 2, 3, 4, 5] and len(forward.block_table) == 2
    assert seq.status is SequenceStatus.RUNNING
    assert events_of(seq.request) == []


def test_make_requests_and_the_fake_tokenizer() -> None:
    requests = make_requests(3, start_token=7)
    assert [r.request_id for r in requests] == ["e0", "e1", "e2"]
    assert [r.prompt_token_ids for r in requests] == [[7, 7], [8, 8, 8], [9, 9, 9, 9]]
    tokenizer = FakeTokenizer({5: "five"})
    assert tokenizer.decode([0, 1, 5]) == "</s>bfive"
    assert tokenizer.decode([EOS, 1], skip_special_tokens=True) == "b"
