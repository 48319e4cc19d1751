"""bench.token_path's pure parts: reading the metrics, the shares per step and per event, the
config it serves, the table."""

from __future__ import annotations

import pytest

from bench.token_path import KINDS, STEP_PHASES, format_table, gateway_config, parse_metrics, shares
from buckets.stats import STEP_PHASES as BUCKET_STEP_PHASES
from gateway.config import GatewayConfig

EXPOSITION = """# HELP sluice_steps_total Forwards run.
# TYPE sluice_steps_total counter
sluice_steps_total{model="smollm2",bucket="le256"} 10.0
sluice_steps_total{model="smollm2",bucket="le2048"} 10.0
# TYPE sluice_step_phase_seconds_total counter
sluice_step_phase_seconds_total{model="smollm2",bucket="le256",phase="forward"} 0.2
sluice_step_phase_seconds_total{model="smollm2",bucket="le2048",phase="forward"} 0.1
sluice_step_phase_seconds_total{model="smollm2",bucket="le256",phase="output"} 0.004
sluice_step_phase_seconds_total{model="smollm2",bucket="le256",phase="detokenize"} 0.002
# TYPE sluice_event_hop_seconds histogram
sluice_event_hop_seconds_bucket{le="0.001"} 30.0
sluice_event_hop_seconds_bucket{le="+Inf"} 40.0
sluice_event_hop_seconds_count 40.0
sluice_event_hop_seconds_sum 0.02
# TYPE sluice_stream_chunk_seconds histogram
sluice_stream_chunk_seconds_count 40.0
sluice_stream_chunk_seconds_sum 0.008
"""


def test_the_phases_are_the_buckets() -> None:
    assert STEP_PHASES == BUCKET_STEP_PHASES


def test_parse_sums_over_buckets() -> None:
    totals = parse_metrics(EXPOSITION)
    assert totals["steps"] == 20
    assert totals["phase:forward"] == pytest.approx(0.3)
    assert totals["hop_count"] == 40 and totals["hop_sum"] == pytest.approx(0.02)
    assert totals["chunk_sum"] == pytest.approx(0.008)


def test_shares_per_step_and_per_event() -> None:
    before = {"steps": 5.0, "phase:forward": 0.05, "hop_count": 10.0, "hop_sum": 0.005}
    figures = shares(before, parse_metrics(EXPOSITION))
    assert figures["num_steps"] == 15 and figures["num_events"] == 30
    assert figures["forward_ms"] == pytest.approx(1000 * 0.25 / 15)
    assert figures["detokenize_ms"] == pytest.approx(1000 * 0.002 / 15)
    assert figures["hop_ms"] == pytest.approx(1000 * 0.015 / 30)
    assert figures["chunk_ms"] == pytest.approx(1000 * 0.008 / 40)
    # The total leaves detokenize out: the output phase includes it.
    assert figures["step_ms"] == pytest.approx(figures["forward_ms"] + figures["output_ms"] + figures["schedule_ms"]
                                               + figures["sampling_ms"] + figures["postprocess_ms"])


def test_no_steps_gives_no_figures() -> None:
    figures = shares({}, {})
    assert figures["num_steps"] == 0 and figures["step_ms"] is None and figures["hop_ms"] is None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_served_config_is_valid(kind: str) -> None:
    config = GatewayConfig.model_validate(gateway_config(kind, 2, 32))
    bucket = config.models[0].buckets[0]
    assert (bucket.backend, bucket.quantization) == KINDS[kind]
    assert bucket.batcher.max_num_seqs == 32


def test_the_table_names_the_headline() -> None:
    figures = shares({}, parse_metrics(EXPOSITION))
    results = {
        "kind": "lean-int4", "threads": 2, "bare_step_ms": 10.0, "target_ratio": 1.15,
        "served": {"1": {**figures, "tpot_p50_ms": 11.0}, "32": {**figures, "tpot_p50_ms": None}},
        "c1_served_tpot_over_bare_step": 1.1,
    }
    table = format_table(results)
    assert "c1" in table and "c32" in table
    assert "served TPOT p50 / bare step at c1: 1.100" in table
    assert "events per step" in table
