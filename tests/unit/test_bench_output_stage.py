"""The output-stage benchmark at tiny sizes: every length runs to the end and the table adds up (no timing assertion)."""

from __future__ import annotations

import pytest

from bench import output_stage


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return output_stage.load_tokenizer()


def test_plain_token_ids_leave_out_special_tokens(tokenizer: object) -> None:
    ids = output_stage.plain_token_ids(tokenizer, 500, seed=1)
    assert len(ids) == 500
    assert not set(ids) & set(tokenizer.all_special_ids)  # type: ignore[attr-defined]


def test_measure_gives_one_row_per_length_relative_to_the_first(tokenizer: object) -> None:
    rows = output_stage.measure(tokenizer, lengths=(4, 8), num_seqs=2, repeats=1)
    assert [r.output_tokens for r in rows] == [4, 8]
    assert all(r.us_per_token > 0 for r in rows)
    assert rows[0].ratio == 1.0
    assert rows[1].ratio == pytest.approx(rows[1].us_per_token / rows[0].us_per_token)
    table = output_stage.format_table(rows)
    assert len(table.splitlines()) == 3


@pytest.mark.parametrize(("last_ratio", "status"), [(1.2, 0), (output_stage.MAX_RATIO + 0.1, 1)])
def test_the_cli_exits_non_zero_when_the_last_length_misses_the_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], last_ratio: float, status: int
) -> None:
    rows = [output_stage.OutputStageRow(64, 10.0, 1.0), output_stage.OutputStageRow(2048, 10.0 * last_ratio, last_ratio)]
    monkeypatch.setattr(output_stage, "load_tokenizer", lambda: None)
    monkeypatch.setattr(output_stage, "measure", lambda *args: rows)
    assert output_stage.main([]) == status
    assert "2048" in capsys.readouterr().out
