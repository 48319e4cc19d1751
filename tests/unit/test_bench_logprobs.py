"""bench.logprobs_cost: the table and the isolated computation row (no model)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.logprobs_cost import CostRow, computation_cost, format_table


def test_computation_row_times_both_variants_and_the_table_shows_the_ratio() -> None:
    loaded = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=64)))
    row = computation_cost(loaded, num_rows=4, repeats=3, num_top=5)
    assert row.without_ms >= 0 and row.with_ms > 0
    table = format_table([CostRow("decode", 10.0, 12.5), row])
    assert "decode" in table and "1.250" in table and row.step in table
