"""Logprobs without a model: the batched computation, the scheduler's prompt-logprob inputs
(chunks, the prefix cache skipped, ``max_tokens`` 0), the output stage's events, the process
pipe, and OpenAI's two formats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from buckets.continuous import ContinuousBatcher
from buckets.output import OutputProcessor
from buckets.request import GenerationRequest, TokenEvent
from buckets.scheduler import StepResult
from buckets.settings import ContinuousBatcherSettings
from buckets.slices.messages import decode_event, decode_request, encode_event, encode_request
from gateway.logprobs_format import LogprobsFormatter, choice_logprobs
from models.logprobs import token_logprobs
from models.step_io import ForwardInput, ForwardOutput, TokenLogprobs
from tests.factories import EOS, FakeClock, FakeTokenizer, Recorder, make_scheduler, make_sequence

SAMPLED = 7
BLOCK_SIZE = 4


def fake_logprobs(position: int, token_id: int) -> TokenLogprobs:
    """What the fake runner reports for ``token_id`` at ``position``: unique per pair."""
    return TokenLogprobs(token_id, -position - token_id / 1000, ((token_id, -position - token_id / 1000), (99, -50.0)))


class LogprobsRunner:
    """Samples ``SAMPLED`` (a sequence's ``k``-th fork: ``SAMPLED + 1 + k``) and reports
    :func:`fake_logprobs` for what each sequence asked (a fork asks as its parent does)."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.kv_cache = SimpleNamespace(num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.calls: list[ForwardInput] = []

    def run(self, batch: ForwardInput) -> ForwardOutput:
        self.calls.append(batch)
        sampling = [
            (seq_id, s.position + len(s.token_ids), SAMPLED + k, s.num_top_logprobs)
            for s in batch.sequences
            if s.do_sample
            for k, seq_id in enumerate((s.seq_id, *(f for f, _ in s.forks)))
        ]
        return ForwardOutput(
            sampled_token_ids={seq_id: token_id for seq_id, _, token_id, _ in sampling},
            logprobs={seq_id: fake_logprobs(p, token_id) for seq_id, p, token_id, top in sampling if top is not None},
            prompt_logprobs={
                s.seq_id: [fake_logprobs(s.position + 1 + i, t) for i, t in enumerate(s.prompt_logprob_token_ids)]
                for s in batch.sequences
                if s.prompt_logprob_token_ids
            },
        )


def make_batcher(runner: LogprobsRunner, max_num_batched_tokens: int = 64) -> ContinuousBatcher:
    settings = ContinuousBatcherSettings(4, max_num_batched_tokens, BLOCK_SIZE)
    return ContinuousBatcher(runner, settings, FakeTokenizer(), frozenset({EOS}), clock=FakeClock())


def request(
    prompt: list[int], max_tokens: int = 3, num_top: int | None = 2, echo: bool = False, name: str = "r", n: int = 1
) -> GenerationRequest:
    return GenerationRequest(
        request_id=name, prompt_token_ids=prompt, sink=Recorder(), max_tokens=max_tokens, ignore_eos=True,
        num_top_logprobs=num_top, needs_prompt_logprobs=echo, n=n,
    )


def token_events(req: GenerationRequest) -> list[TokenEvent]:
    assert isinstance(req.sink, Recorder)
    events = req.sink.events
    assert all(isinstance(e, TokenEvent) for e in events), events
    return events  # type: ignore[return-value]


def drain(batcher: ContinuousBatcher) -> None:
    for _ in range(100):
        if batcher.seconds_until_ready(0.0) is None:
            return
        batcher.step()
    pytest.fail("the batcher did not finish")


# --- the computation --------------------------------------------------------------------------


def test_token_logprobs_are_log_softmax_of_the_rows_with_their_top_tokens() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    got = token_logprobs(logits, [4, 10, 49], [0, 2, 5])
    want = torch.log_softmax(logits, dim=-1)
    for row, (entry, token_id, k) in enumerate(zip(got, [4, 10, 49], [0, 2, 5])):
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(float(want[row, token_id]), abs=1e-6)
        top = torch.topk(want[row], k) if k else None
        assert [t for t, _ in entry.top] == ([] if top is None else top.indices.tolist())
        assert [v for _, v in entry.top] == pytest.approx([] if top is None else top.values.tolist(), abs=1e-6)


def test_token_logprobs_refuses_rows_and_ids_that_disagree() -> None:
    with pytest.raises(ValueError, match="must agree"):
        token_logprobs(torch.zeros(2, 5), [1], [0])


# --- scheduler and output stage ---------------------------------------------------------------


def test_generated_tokens_carry_their_logprobs_and_others_pay_nothing() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner)
    asking, plain = request([1, 2, 3], name="a"), request([4, 5, 6], num_top=None, name="p")
    batcher.submit(asking)
    batcher.submit(plain)
    drain(batcher)
    events = token_events(asking)
    assert [lp for e in events for lp in e.logprobs] == [fake_logprobs(p, SAMPLED) for p in (3, 4, 5)]
    assert all(e.prompt_logprobs is None for e in events)
    assert all(not e.logprobs for e in token_events(plain))
    plain_id = next(s.seq_id for s in runner.calls[0].sequences if s.token_ids == [4, 5, 6])
    plain_inputs = [s for c in runner.calls for s in c.sequences if s.seq_id == plain_id]
    assert plain_inputs and all(s.num_top_logprobs is None and not s.prompt_logprob_token_ids for s in plain_inputs)


def test_chunked_prompt_logprobs_cover_each_prompt_position_once_on_the_first_event() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner, max_num_batched_tokens=4)
    prompt = list(range(10, 21))  # 11 tokens: chunks of 4, 4, 3
    req = request(prompt, echo=True)
    batcher.submit(req)
    drain(batcher)
    first, *rest = token_events(req)
    assert first.prompt_logprobs == (None, *(fake_logprobs(p, prompt[p]) for p in range(1, len(prompt))))
    assert all(e.prompt_logprobs is None for e in rest)
    targets = [t for c in runner.calls for s in c.sequences for t in s.prompt_logprob_token_ids]
    assert targets == prompt[1:]


def test_prompt_logprobs_skip_a_cached_prefix_that_others_reuse() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner)
    prompt = list(range(30, 43))  # three full blocks and one token
    for name in ("warm", "echo", "plain"):
        before = len(runner.calls)
        req = request(prompt, num_top=2, echo=name == "echo", name=name)
        batcher.submit(req)
        drain(batcher)
        first_input = runner.calls[before].sequences[0]
        if name == "echo":
            assert first_input.position == 0 and len(first_input.token_ids) == len(prompt)
            assert token_events(req)[0].prompt_logprobs == (None, *(fake_logprobs(p, prompt[p]) for p in range(1, len(prompt))))
        if name == "plain":
            assert first_input.position == 3 * BLOCK_SIZE  # the cache was there to hit


def test_max_tokens_zero_computes_the_prompt_and_ends_with_one_event_of_prompt_logprobs() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner, max_num_batched_tokens=4)
    prompt = [3, 4, 5, 6, 8, 9]
    req = request(prompt, max_tokens=0, echo=True)
    batcher.submit(req)
    drain(batcher)
    (event,) = token_events(req)
    assert (event.token_ids, event.text, event.finish_reason, event.num_completion_tokens) == ([], "", "length", 0)
    assert event.prompt_logprobs == (None, *(fake_logprobs(p, prompt[p]) for p in range(1, len(prompt))))
    assert not any(s.do_sample for c in runner.calls for s in c.sequences)
    assert batcher.block_manager.num_used_blocks == 0


def test_each_of_n_choices_gets_its_own_tokens_logprobs_and_the_prompts_on_its_first_event() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner, max_num_batched_tokens=4)  # the prompt runs in two chunks
    prompt = [3, 4, 5, 6, 8, 9]
    req = request(prompt, max_tokens=3, echo=True, n=3)
    batcher.submit(req)
    drain(batcher)
    events = token_events(req)
    want_prompt = (None, *(fake_logprobs(p, prompt[p]) for p in range(1, len(prompt))))
    for index in range(3):
        mine = [e for e in events if e.index == index]
        tokens = [t for e in mine for t in e.token_ids]
        assert [lp.token_id for e in mine for lp in e.logprobs] == tokens
        assert tokens[0] == SAMPLED + index  # its first token, sampled from the shared prompt's row
        assert mine[0].logprobs == (fake_logprobs(len(prompt), SAMPLED + index),)
        assert mine[0].prompt_logprobs == want_prompt and all(e.prompt_logprobs is None for e in mine[1:])
    assert sum(len(s.prompt_logprob_token_ids) for c in runner.calls for s in c.sequences) == len(prompt) - 1
    assert batcher.block_manager.num_used_blocks == 0


def test_max_tokens_zero_with_n_choices_ends_every_choice_with_the_prompt_logprobs() -> None:
    runner = LogprobsRunner()
    batcher = make_batcher(runner)
    prompt = [3, 4, 5, 6, 8]
    req = request(prompt, max_tokens=0, echo=True, n=2)
    batcher.submit(req)
    drain(batcher)
    events = token_events(req)
    assert sorted(e.index for e in events) == [0, 1] and events[-1].ends_request
    want_prompt = (None, *(fake_logprobs(p, prompt[p]) for p in range(1, len(prompt))))
    for event in events:
        assert (event.token_ids, event.finish_reason, event.prompt_logprobs) == ([], "length", want_prompt)
    assert not any(s.do_sample for c in runner.calls for s in c.sequences)
    assert batcher.block_manager.num_used_blocks == 0


def test_recomputed_prompt_positions_keep_their_first_report() -> None:
    scheduler = make_scheduler(block_size=BLOCK_SIZE)
    output = OutputProcessor(scheduler, FakeTokenizer(), scheduler.clock)
    seq = make_sequence(request([1, 2, 3, 4], echo=True))
    scheduler.add(seq)
    output.add(seq)
    a, b, c = (fake_logprobs(p, 0) for p in (1, 2, 3))
    output.process(StepResult(prompt_logprobs={seq.seq_id: (1, [a, b])}))
    output.process(StepResult(prompt_logprobs={seq.seq_id: (1, [fake_logprobs(1, 5), fake_logprobs(2, 5), c])}))
    output.process(StepResult(new_token_ids={seq.seq_id: [SAMPLED]}))
    assert token_events(seq.request)[0].prompt_logprobs == (None, a, b, c)


def test_logprobs_cross_the_process_pipe_unchanged() -> None:
    req = request([1, 2], echo=True)
    wire = encode_request(5, req)
    back = decode_request(wire, Recorder())
    assert isinstance(back, GenerationRequest)
    assert (back.num_top_logprobs, back.needs_prompt_logprobs) == (2, True)
    event = TokenEvent("a", [7], None, 2, 1, logprobs=(fake_logprobs(2, 7),), prompt_logprobs=(None, fake_logprobs(1, 2)))
    assert decode_event(encode_event(event)) == event


# --- OpenAI's formats -------------------------------------------------------------------------


def test_completion_form_with_echo_has_a_null_first_entry_offsets_and_the_chosen_token() -> None:
    tokenizer = FakeTokenizer({1: "He", 2: "llo", 3: " wor", 4: "ld"})
    req = request([1, 2], echo=True, num_top=1)
    view = choice_logprobs(req, tokenizer, is_chat=False)
    assert view is not None
    chosen = TokenLogprobs(3, -0.5, ((4, -0.25),))
    view.add(TokenEvent(" wor", [3], "length", 2, 1, logprobs=(chosen,), prompt_logprobs=(None, TokenLogprobs(2, -1.0, ((2, -1.0),)))))
    assert view.whole() == {
        "tokens": ["He", "llo", " wor"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"llo": -1.0}, {"ld": -0.25, " wor": -0.5}],
        "text_offset": [0, 2, 5],
    }


def test_streamed_completion_offsets_go_on_from_chunk_to_chunk() -> None:
    view = choice_logprobs(request([1]), FakeTokenizer({1: "ab", 2: "cde"}), is_chat=False)
    assert view is not None
    first = view.chunk(TokenEvent("ab", [1], None, 1, 1, logprobs=(TokenLogprobs(1, -1.0),)))
    second = view.chunk(TokenEvent("cde", [2], "length", 1, 2, logprobs=(TokenLogprobs(2, -2.0),)))
    assert (first["text_offset"], second["text_offset"]) == ([0], [2])
    assert second["top_logprobs"] == [{"cde": -2.0}]  # logprobs 0: the chosen token alone


def test_chat_form_has_token_logprob_bytes_and_exactly_top_logprobs_alternatives() -> None:
    formatter = LogprobsFormatter(FakeTokenizer({1: "é", 2: "x", 3: "y"}), num_top=1)
    content = formatter.chat([TokenLogprobs(1, -0.1, ((1, -0.1), (2, -3.0))), TokenLogprobs(3, -2.0, ((2, -1.0), (3, -2.0)))])
    assert content == {"content": [
        {"token": "é", "logprob": -0.1, "bytes": [195, 169], "top_logprobs": [{"token": "é", "logprob": -0.1, "bytes": [195, 169]}]},
        {"token": "y", "logprob": -2.0, "bytes": [121], "top_logprobs": [{"token": "x", "logprob": -1.0, "bytes": [120]}]},
    ]}


def test_chat_content_has_no_entry_for_the_end_of_turn_token_its_text_leaves_out() -> None:
    formatter = LogprobsFormatter(FakeTokenizer({1: "Hi", 2: "!"}), num_top=0)
    content = formatter.chat([TokenLogprobs(1, -0.5), TokenLogprobs(2, -0.2), TokenLogprobs(EOS, -0.1)])["content"]
    assert [item["token"] for item in content] == ["Hi", "!"]
    completion = formatter.completion([1, EOS], [TokenLogprobs(1, -0.5), TokenLogprobs(EOS, -0.1)])
    assert completion["tokens"] == ["Hi", "</s>"]  # completions keep it, as OpenAI's legacy answers did


def test_a_request_without_logprobs_has_no_view() -> None:
    assert choice_logprobs(request([1], num_top=None), FakeTokenizer(), is_chat=True) is None
