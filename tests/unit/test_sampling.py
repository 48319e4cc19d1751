"""models.sampling.sample: greedy rows, seeded reproducibility per row, top-k, top-p, temperature."""

from __future__ import annotations

import pytest
import torch

from models.sampling import make_generator, sample
from models.step_io import SamplingParams

VOCAB = 32


def make_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    """Distinct random logits (no ties), ``[num_rows, VOCAB]`` float32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 3


def draw(logits: torch.Tensor, params: list[SamplingParams], num_draws: int) -> list[list[int]]:
    """``num_draws`` calls of :func:`sample`, each row keeping its own generator across calls."""
    generators = [make_generator(p) for p in params]
    return [sample(logits, params, generators) for _ in range(num_draws)]


def test_greedy_rows_are_argmax() -> None:
    logits = make_logits(5)
    params = [SamplingParams(temperature=0.0)] * 5
    generators = [make_generator(p) for p in params]
    assert sample(logits, params, generators) == torch.argmax(logits, dim=-1).tolist()


def test_greedy_rows_stay_argmax_next_to_sampled_rows() -> None:
    logits = make_logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(temperature=0.0), SamplingParams(seed=2)]
    argmax = torch.argmax(logits, dim=-1).tolist()
    for tokens in draw(logits, params, 20):
        assert tokens[0] == argmax[0] and tokens[2] == argmax[2]


def test_seeded_sampling_is_reproducible() -> None:
    logits = make_logits(2)
    params = [SamplingParams(temperature=1.0, seed=123), SamplingParams(temperature=0.7, top_p=0.9, seed=9)]
    assert draw(logits, params, 50) == draw(logits, params, 50)


def test_seeded_row_is_independent_of_its_batch_companions() -> None:
    mine = make_logits(1, seed=42)[0]
    p = SamplingParams(temperature=1.0, top_k=10, seed=7)
    alone = [t[0] for t in draw(mine.unsqueeze(0), [p], 100)]
    companions = make_logits(3, seed=5)
    batch = torch.stack([companions[0], mine, companions[1], companions[2]])
    params = [SamplingParams(seed=1), p, SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)]
    together = [t[1] for t in draw(batch, params, 100)]
    assert together == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_draws() -> None:
    logits = make_logits(1)
    a = [t[0] for t in draw(logits, [SamplingParams(seed=1)], 50)]
    b = [t[0] for t in draw(logits, [SamplingParams(seed=2)], 50)]
    assert a != b


def test_top_k_one_is_argmax() -> None:
    logits = make_logits(3)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(3)]
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert all(tokens == argmax for tokens in draw(logits, params, 30))


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = make_logits(1)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    tokens = {t[0] for t in draw(logits, [SamplingParams(temperature=2.0, top_k=3, seed=0)], 200)}
    assert tokens <= top3
    assert len(tokens) > 1


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = make_logits(2)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=s) for s in range(2)]
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert all(tokens == argmax for tokens in draw(logits, params, 30))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.75 needs the first two tokens (0.5 < 0.75 <= 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    tokens = {t[0] for t in draw(logits, [SamplingParams(top_p=0.75, seed=3)], 300)}
    assert tokens == {0, 1}


@pytest.mark.parametrize("temperature", [1e-3, 1e-6])
def test_very_low_temperature_is_argmax(temperature: float) -> None:
    logits = make_logits(4)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert all(tokens == argmax for tokens in draw(logits, params, 20))


def test_high_temperature_spreads_the_draws() -> None:
    logits = make_logits(1)
    cold = {t[0] for t in draw(logits, [SamplingParams(temperature=0.05, seed=0)], 200)}
    hot = {t[0] for t in draw(logits, [SamplingParams(temperature=2.0, seed=0)], 200)}
    assert len(hot) > len(cold)


def test_empirical_frequencies_follow_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    counts = torch.zeros(3)
    for tokens in draw(logits, [SamplingParams(seed=11)], 3000):
        counts[tokens[0]] += 1
    expected = torch.softmax(logits[0], dim=-1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_denormal_temperature_is_argmax_and_does_not_raise() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    params = [SamplingParams(temperature=1e-40, seed=1), SamplingParams(temperature=0.0)]
    assert sample(logits, params, [make_generator(p) for p in params]) == [1, 0]


def test_unseeded_generators_draw_fresh_entropy() -> None:
    a = make_generator(SamplingParams()).initial_seed()
    b = make_generator(SamplingParams()).initial_seed()
    assert a != b


@pytest.mark.parametrize("temperature", [1e-129, 5e-324, 9.9e-6])
def test_temperatures_below_float32_range_are_argmax(temperature: float) -> None:
    """Found by the API fuzz: 1e-129 rounds to 0 in float32, and (logits - max) / 0 is NaN."""
    logits = make_logits(2)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(2)]
    assert sample(logits, params, [make_generator(p) for p in params]) == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("top_p", [5e-324, 1e-300])
def test_a_top_p_below_float32_range_keeps_the_top_token(top_p: float) -> None:
    """Found by the API fuzz: such a top_p is 0 against float32 sums, so ``0 >= 0`` dropped every token."""
    logits = make_logits(2)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(2)]
    assert sample(logits, params, [make_generator(p) for p in params]) == torch.argmax(logits, dim=-1).tolist()
