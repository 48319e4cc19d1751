"""The quantized kinds' row crossover (models.backends.row_crossover), on a clock the products
advance themselves: each fake product costs a fixed number of seconds per call at each row count."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.backends.row_crossover import (
    SwitchedLinear,
    measure_max_quantized_rows,
    measure_min_prefill_rows,
    set_max_quantized_rows,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class CostedLinear:
    """A product ``[M, K] -> [M, N]`` whose call advances ``clock`` by ``cost_s(M)``."""

    def __init__(self, clock: FakeClock, cost_s: Callable[[int], float], in_features: int = 8, out_features: int = 4):
        self.clock, self.cost_s = clock, cost_s
        self.in_features, self.out_features = in_features, out_features
        self.calls: list[int] = []

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] == self.in_features
        self.calls.append(x.shape[0])
        self.clock.now_s += self.cost_s(x.shape[0])
        return torch.zeros(x.shape[0], self.out_features)


def switched(clock: FakeClock, quantized_cost: Callable[[int], float], dense_cost: Callable[[int], float]) -> SwitchedLinear:
    return SwitchedLinear(CostedLinear(clock, quantized_cost), CostedLinear(clock, dense_cost), max_rows=0)


def test_the_answer_is_the_last_row_count_before_the_quantized_products_lose() -> None:
    clock = FakeClock()
    # Quantized costs grow 1.0 per row, float32 0.25 per row from 3.0: equal at 4 rows (a tie loses).
    products = [switched(clock, lambda r: 1.0 * r, lambda r: 3.0 + 0.25 * r) for _ in range(3)]
    assert measure_max_quantized_rows(products, rows=(1, 2, 4, 8), repeats=2, clock=clock) == 2


def test_zero_when_even_the_first_row_count_does_not_pay() -> None:
    clock = FakeClock()
    products = [switched(clock, lambda r: 2.0, lambda r: 1.0)]
    assert measure_max_quantized_rows(products, rows=(1, 2, 4), repeats=1, clock=clock) == 0


def test_the_largest_row_count_when_every_one_pays() -> None:
    clock = FakeClock()
    products = [switched(clock, lambda r: 0.5 * r, lambda r: 1.0 * r)]
    assert measure_max_quantized_rows(products, rows=(1, 2, 4, 16), repeats=1, clock=clock) == 16


def test_the_measurement_stops_at_the_first_loss_and_never_tries_larger_rows() -> None:
    clock = FakeClock()
    # Loses at 2 rows, would win again at 8: the crossover is where it first stops paying.
    quantized_cost = {1: 1.0, 2: 5.0, 4: 1.0, 8: 1.0}
    products = [switched(clock, quantized_cost.__getitem__, lambda r: 2.0)]
    assert measure_max_quantized_rows(products, rows=(1, 2, 4, 8), repeats=1, clock=clock) == 1
    assert products[0].quantized.calls == [1, 2]  # type: ignore[attr-defined]


def test_the_best_of_the_repeats_counts_for_each_kind() -> None:
    clock = FakeClock()
    # The quantized product's first pass at each row count is slow (a burst of other load): the
    # best of three passes wins against float32's steady 2.0 s.
    passes: dict[int, int] = {}

    def bursty(r: int) -> float:
        passes[r] = passes.get(r, 0) + 1
        return 10.0 if passes[r] == 1 else 1.0

    products = [switched(clock, bursty, lambda r: 2.0)]
    assert measure_max_quantized_rows(products, rows=(1, 2), repeats=3, clock=clock) == 2
    passes.clear()
    assert measure_max_quantized_rows([switched(clock, bursty, lambda r: 2.0)], rows=(1, 2), repeats=1, clock=clock) == 0


def test_every_product_runs_once_per_pass_on_its_own_input_width() -> None:
    clock = FakeClock()
    wide = SwitchedLinear(CostedLinear(clock, lambda r: 1.0, in_features=16), CostedLinear(clock, lambda r: 2.0, in_features=16), 0)
    narrow = switched(clock, lambda r: 1.0, lambda r: 2.0)
    measure_max_quantized_rows([wide, narrow], rows=(1, 4), repeats=2, clock=clock)
    for product in (wide, narrow):
        assert product.quantized.calls == [1, 1, 4, 4]  # type: ignore[attr-defined]
        assert product.dense.calls == [1, 1, 4, 4]  # type: ignore[attr-defined]


def test_a_product_that_does_not_say_its_width_is_refused() -> None:
    class Opaque:
        def mm(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match="in_features"):
        measure_max_quantized_rows([SwitchedLinear(Opaque(), Opaque(), 0)], rows=(1,), repeats=1)


def test_set_max_quantized_rows_sets_every_product_and_the_switch_follows_it() -> None:
    clock = FakeClock()
    products = [switched(clock, lambda r: 1.0 * r, lambda r: 6.5) for _ in range(2)]
    assert set_max_quantized_rows(products, "lean-test", clock=clock) == 6
    assert [p.max_rows for p in products] == [6, 6]
    products[0].mm(torch.zeros(6, 8))
    products[0].mm(torch.zeros(7, 8))
    assert products[0].quantized.calls[-1] == 6  # type: ignore[attr-defined]
    assert products[0].dense.calls[-1] == 7  # type: ignore[attr-defined]


def with_prefill(clock: FakeClock, prefill_cost: Callable[[int], float], dense_cost: Callable[[int], float]) -> SwitchedLinear:
    return SwitchedLinear(CostedLinear(clock, lambda r: 0.0), CostedLinear(clock, dense_cost), 0, CostedLinear(clock, prefill_cost))


def test_the_prefill_threshold_is_the_smallest_row_count_from_which_int8_activations_always_pay() -> None:
    clock = FakeClock()
    # The int8-activation GEMM costs 2.0 + 0.5 per row, float32 1.0 per row: it pays above 4 rows.
    products = [with_prefill(clock, lambda r: 2.0 + 0.5 * r, lambda r: 1.0 * r) for _ in range(2)]
    assert measure_min_prefill_rows(products, rows=(2, 8, 32), repeats=1, clock=clock) == 8
    assert products[0].prefill.calls == [32, 8, 2]  # type: ignore[union-attr]


def test_no_prefill_threshold_when_the_largest_row_count_does_not_pay_or_nothing_has_one() -> None:
    clock = FakeClock()
    assert measure_min_prefill_rows([with_prefill(clock, lambda r: 2.0 * r, lambda r: 1.0 * r)], rows=(2, 8), clock=clock) is None
    assert measure_min_prefill_rows([switched(clock, lambda r: 1.0, lambda r: 1.0)], rows=(2, 8), clock=clock) is None


def test_rows_go_to_the_gemv_the_float32_product_or_int8_activations_by_count() -> None:
    clock = FakeClock()
    product = with_prefill(clock, lambda r: 0.0, lambda r: 0.0)
    product.max_rows = 2
    for rows in (1, 2, 3, 16):
        product.mm(torch.zeros(rows, 8))
    assert product.dense.calls == [3, 16]  # type: ignore[attr-defined]
    product.min_prefill_rows = 8
    for rows in (2, 3, 8, 16):
        product.mm(torch.zeros(rows, 8))
    assert product.quantized.calls == [1, 2, 2]  # type: ignore[attr-defined]
    assert product.dense.calls == [3, 16, 3] and product.prefill.calls == [8, 16]  # type: ignore[attr-defined, union-attr]
