"""models.logits_processors and their place in models.sampling.sample: each processor against a
reference written as plain loops over a small vocabulary, and batches of mixed settings."""

from __future__ import annotations

import math

import pytest
import torch

from models.logits_processors import (
    SequenceHistory, apply_logit_bias, apply_logits_processors, apply_min_p, apply_min_tokens, apply_penalties, token_coordinates,
)
from models.sampling import make_generator, sample
from models.step_io import SamplingParams

VOCAB = 12
EOS = 11


def make_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    """Random ``[num_rows, VOCAB]`` float32 logits of both signs."""
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float) -> list[float]:
    """CTRL's repetition penalty over prompt and output as vLLM applies it, then OpenAI's
    frequency and presence penalties over the output, token by token."""
    out = list(logits)
    for j in range(len(out)):
        if j in prompt or j in output:
            out[j] = out[j] / rep if out[j] > 0 else out[j] * rep
        count = output.count(j)
        out[j] -= count * freq + (1.0 if count > 0 else 0.0) * pres
    return out


def test_token_coordinates_count_each_row_and_ignore_padding() -> None:
    rows, ids, counts = token_coordinates([[1, 1, 3], [], [0]], 4, "cpu")
    assert list(zip(rows.tolist(), ids.tolist(), counts.tolist())) == [(0, 1, 2.0), (0, 3, 1.0), (2, 0, 1.0)]


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -1.5), (0.6, -0.4, 1.1)])
def test_penalties_follow_their_formulas(rep: float, freq: float, pres: float) -> None:
    logits = make_logits(3)
    raw = logits.clone()
    prompt, output = [[1, 2, 2, 5], [7]], [[2, 3, 3, 3], []]
    got = apply_penalties(
        logits, torch.tensor([2, 0]), prompt, output, torch.tensor([rep, rep]), torch.tensor([freq, freq]), torch.tensor([pres, pres]),
    )
    for at, row in enumerate([2, 0]):
        want = reference_penalties(raw[row].tolist(), prompt[at], output[at], rep, freq, pres)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(got[1], raw[1])  # a row not named is not touched


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = make_logits(2)
    got = apply_logit_bias(logits.clone(), torch.tensor([0, 0, 1]), torch.tensor([3, 5, 3]), torch.tensor([100.0, -2.5, -100.0]))
    want = logits.clone()
    for row, token, bias in [(0, 3, 100.0), (0, 5, -2.5), (1, 3, -100.0)]:
        want[row, token] += bias
    assert torch.equal(got, want)


def test_min_tokens_masks_the_named_tokens() -> None:
    logits = make_logits(2)
    got = apply_min_tokens(logits.clone(), torch.tensor([1, 1]), torch.tensor([EOS, 4]))
    assert torch.equal(got[0], logits[0])
    assert got[1, EOS] == -math.inf and got[1, 4] == -math.inf
    assert torch.equal(got[1, :4], logits[1, :4])


@pytest.mark.parametrize(("min_p", "temperature"), [(0.1, 1.0), (0.3, 0.5), (0.05, 1.7), (1.0, 1.0)])
def test_min_p_drops_tokens_below_its_share_of_the_top_probability(min_p: float, temperature: float) -> None:
    logits = make_logits(1, seed=3)
    got = apply_min_p(logits.clone(), torch.tensor([min_p]), torch.tensor([temperature]))[0]
    probs = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    top = max(probs)
    for j, p in enumerate(probs):
        if p < min_p * top:
            assert got[j] == -math.inf, j
        else:
            assert got[j] == logits[0, j], j


def test_min_p_zero_keeps_every_token() -> None:
    logits = make_logits(3)
    assert torch.equal(apply_min_p(logits.clone(), torch.zeros(3), torch.ones(3)), logits)


def test_mixed_batch_leaves_rows_without_controls_untouched() -> None:
    logits = make_logits(4)
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2),
        SamplingParams(logit_bias=((2, 5.0),)),
        SamplingParams(min_tokens=3, stop_token_ids=(4,)),
    ]
    histories = [None, SequenceHistory([1, 2], [2, 2]), None, SequenceHistory([], [6])]
    raw = logits.clone()
    got = apply_logits_processors(logits, params, histories, frozenset({EOS}))
    assert torch.equal(logits, raw)  # the input keeps the raw logits
    assert torch.equal(got[0], logits[0])
    assert got[1].tolist() == pytest.approx(reference_penalties(logits[1].tolist(), [1, 2], [2, 2], 1.2, 1.0, 0.0), abs=1e-5)
    want_bias = logits[2].clone()
    want_bias[2] += 5.0
    assert torch.equal(got[2], want_bias)
    assert got[3, EOS] == -math.inf and got[3, 4] == -math.inf
    assert torch.equal(got[3, :4], logits[3, :4])


def test_min_tokens_mask_lifts_once_enough_tokens_are_out() -> None:
    logits = make_logits(1)
    params = [SamplingParams(min_tokens=2)]
    assert apply_logits_processors(logits, params, [SequenceHistory([], [5])], frozenset({EOS}))[0, EOS] == -math.inf
    assert torch.equal(apply_logits_processors(logits, params, [SequenceHistory([], [5, 6])], frozenset({EOS})), logits)


def test_greedy_pick_follows_logit_bias_and_keeps_the_raw_logits() -> None:
    logits = make_logits(2)
    raw = logits.clone()
    target = int(torch.argmin(logits[0]))
    params = [SamplingParams(temperature=0.0, logit_bias=((target, 100.0),)), SamplingParams(temperature=0.0)]
    chosen = sample(logits, params, [make_generator(p) for p in params], [None, None])
    assert chosen == [target, int(torch.argmax(logits[1]))]
    assert torch.equal(logits, raw)


def test_greedy_pick_follows_the_presence_penalty() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)]
    assert sample(logits, params, [make_generator(params[0])], [SequenceHistory([], [3])]) == [4]


def test_min_p_one_samples_only_the_top_token() -> None:
    logits = make_logits(1, seed=5)
    params = [SamplingParams(temperature=1.5, min_p=1.0, seed=1)]
    generator = make_generator(params[0])
    draws = {sample(logits, params, [generator])[0] for _ in range(50)}
    assert draws == {int(torch.argmax(logits[0]))}


def test_sampled_rows_never_draw_below_min_p() -> None:
    logits = make_logits(2, seed=7)
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=3), SamplingParams(temperature=1.0, seed=4)]
    generators = [make_generator(p) for p in params]
    probs = torch.softmax(logits[0], dim=-1)
    for _ in range(200):
        token = sample(logits, params, generators)[0]
        assert probs[token] >= 0.2 * probs.max()


def test_a_row_without_controls_draws_as_without_them_beside_rows_with_them() -> None:
    logits = make_logits(3, seed=9)
    plain = SamplingParams(temperature=1.0, seed=11)
    alone = make_generator(plain)
    want = [sample(logits[:1], [plain], [alone])[0] for _ in range(20)]
    params = [plain, SamplingParams(temperature=1.0, min_p=0.3, seed=2), SamplingParams(frequency_penalty=2.0, seed=5)]
    generators = [make_generator(p) for p in params]
    histories: list[SequenceHistory | None] = [None, None, SequenceHistory([], [1, 1])]
    got = [sample(logits, params, generators, histories)[0] for _ in range(20)]
    assert got == want


def test_controls_defaults_are_off() -> None:
    params = SamplingParams()
    assert not params.uses_logits_processors and not params.needs_history and params.min_p == 0.0
    assert SamplingParams(repetition_penalty=1.1).uses_prompt_tokens
    assert not SamplingParams(frequency_penalty=0.5).uses_prompt_tokens
    assert SamplingParams(min_tokens=1).needs_history


@pytest.mark.parametrize("rep", [1e-300, 1e-40, 1e300])
def test_extreme_repetition_penalties_keep_the_logits_finite_and_drawable(rep: float) -> None:
    logits = make_logits(1)
    logits[0, 4] = 0.0
    params = [SamplingParams(temperature=1.0, repetition_penalty=rep, seed=1)]
    histories: list[SequenceHistory | None] = [SequenceHistory([1, 2, 3, 4], [5])]
    penalised = apply_logits_processors(logits, params, histories)
    assert not torch.isnan(penalised).any() and not torch.isinf(penalised[0, [1, 2, 3, 4, 5]]).any()
    assert 0 <= sample(logits, params, [make_generator(params[0])], histories)[0] < VOCAB
