"""stop_token_ids and min_tokens through the scheduler and the output stage (no model), and the
prompt the scheduler sends the runner for repetition_penalty."""

from __future__ import annotations

import dataclasses

from buckets.sequence import FinishReason, Sequence
from models.detokenizer import IncrementalDetokenizer
from models.step_io import SamplingParams
from tests.factories import EOS, FakeTokenizer, events_of, make_request, make_sequence
from tests.unit.test_scheduler import make_core, run_step


def controlled_sequence(params: SamplingParams, max_tokens: int = 10, stop: tuple[str, ...] = ()) -> Sequence:
    request = dataclasses.replace(make_request(2, max_tokens=max_tokens, stop=stop), params=params)
    return make_sequence(request)


def run_tokens(tokens: list[int], params: SamplingParams, tokenizer: FakeTokenizer, stop: tuple[str, ...] = ()) -> Sequence:
    """Feed ``tokens`` as the sampled tokens until the sequence ends (or they run out)."""
    core = make_core(tokenizer)
    seq = controlled_sequence(params, stop=stop)
    core.add(seq)
    for token in tokens:
        _, finished = run_step(core, token_id=token)
        if finished:
            break
    return seq


def text_of(seq: Sequence) -> str:
    return "".join(e.text for e in events_of(seq.request))  # type: ignore[union-attr]


def test_a_stop_token_id_ends_with_stop_and_stays_out_of_the_text() -> None:
    seq = run_tokens([10, 11, 12, 13], SamplingParams(stop_token_ids=(12,)), FakeTokenizer({10: "a", 11: "b", 12: ".", 13: "c"}))
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [10, 11, 12]  # counted as a completion token, as vLLM does
    assert text_of(seq) == "ab"
    assert events_of(seq.request)[-1].finish_reason == "stop"  # type: ignore[union-attr]
    assert events_of(seq.request)[-1].token_ids == [12]  # type: ignore[union-attr]


def test_stop_token_ids_and_eos_wait_for_min_tokens() -> None:
    tokenizer = FakeTokenizer({10: "a", 12: "."})
    seq = run_tokens([12, EOS, 10, 12], SamplingParams(stop_token_ids=(12,), min_tokens=3), tokenizer)
    assert seq.output_token_ids == [12, EOS, 10, 12]
    assert seq.finish_reason is FinishReason.STOP
    assert text_of(seq) == ".a"


def test_eos_at_min_tokens_ends_the_sequence() -> None:
    seq = run_tokens([10, 10, EOS, 10], SamplingParams(min_tokens=2), FakeTokenizer())
    assert seq.output_token_ids == [10, 10, EOS] and seq.finish_reason is FinishReason.STOP


def test_stop_strings_in_the_first_min_tokens_are_ignored() -> None:
    tokenizer = FakeTokenizer({10: "x", 11: "e", 12: "y"})
    seq = run_tokens([11, 10, 12, 11, 10], SamplingParams(min_tokens=3), tokenizer, stop=("e",))
    assert seq.output_token_ids == [11, 10, 12, 11]
    assert text_of(seq) == "exy" and seq.finish_reason is FinishReason.STOP


def test_detokenizer_matches_vllms_min_tokens_rule() -> None:
    """vLLM's tests/detokenizer/test_min_tokens.py: a stop string must end in the text of a
    token after the first ``min_tokens``; one that starts before may still match."""
    tokenizer = FakeTokenizer({1: "ab", 2: "cd", 3: "ef"})
    ids = [1, 2, 3]
    for min_tokens, want in [(0, "a"), (1, "a"), (2, "abc")]:
        stop = ("bc",) if min_tokens < 2 else ("bc", "de")
        detokenizer = IncrementalDetokenizer(tokenizer, stop, min_tokens)
        text = "".join(detokenizer.update(ids[: i + 1], is_last=i == len(ids) - 1) for i in range(len(ids)))
        assert detokenizer.stopped and text == want, (min_tokens, text)


def test_repetition_penalty_sends_the_whole_prompt_with_each_prefill_chunk_only() -> None:
    core = make_core(max_num_batched_tokens=4)
    plain = make_sequence(make_request(2, max_tokens=4, name="plain"))
    penalised = dataclasses.replace(make_request(6, max_tokens=4, name="rep"), params=SamplingParams(repetition_penalty=1.2))
    seq = make_sequence(penalised)
    core.add(plain)
    core.add(seq)
    sent: list[tuple[int, list[int] | None]] = []
    for _ in range(5):
        plan, _ = run_step(core)
        sent.extend((s.position, s.prompt_token_ids) for s in plan.forward.sequences if s.seq_id == seq.seq_id)
        assert all(s.prompt_token_ids is None for s in plan.forward.sequences if s.seq_id == plain.seq_id)
    prompt = seq.prompt_token_ids
    assert [p for p, _ in sent if p < len(prompt)] == [0, 2, 5]  # three prefill chunks, then decodes
    assert all(ids == (prompt if position < len(prompt) else None) for position, ids in sent)
    assert len(sent) > 3


def test_sampling_controls_cross_to_a_process_slice_unchanged() -> None:
    import pickle

    from buckets.request import GenerationRequest
    from buckets.slices.messages import decode_request, encode_request

    params = SamplingParams(
        frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2, min_p=0.1,
        logit_bias=((3, 10.0), (7, -100.0)), stop_token_ids=(5, 9), min_tokens=2,
    )
    request = dataclasses.replace(make_request(), params=params)
    wire = pickle.loads(pickle.dumps(encode_request(1, request)))
    copy = decode_request(wire, lambda event: None)
    assert isinstance(copy, GenerationRequest) and copy.params == params
