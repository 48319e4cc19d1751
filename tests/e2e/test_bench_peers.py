"""``sluice bench peers``'s harness against Sluice alone, as the benchmark runs it: the test
config's server started by the harness in its own process group, the gate-aware ready wait, a
two-step concurrency sweep of the workload's prompts, the record, and the stop."""

from __future__ import annotations

import argparse
from pathlib import Path

import psutil
import yaml

from bench import peers
from bench.peers_systems import PeerKind
from tests.e2e.conftest import CONFIG, GENERATE_MODEL

OUTPUT_TOKENS = 8
CONCURRENCIES = [1, 2]


def test_the_harness_measures_sluice_and_stops_it(tmp_path: Path) -> None:
    args = argparse.Namespace(
        cache_dir=tmp_path / "cache", startup_timeout=120.0, output_tokens=OUTPUT_TOKENS, duration=2.0,
        min_prompt_tokens=16, max_prompt_tokens=40, seed=0,
    )
    sluice = peers.sluice_setup(CONFIG)
    num_threads = yaml.safe_load(CONFIG.read_text())["slices"][0]["num_threads"]
    assert sluice["model"] == GENERATE_MODEL and sluice["max_num_seqs"] == 16 and sluice["num_threads"] == num_threads
    texts, summary = peers.workload_texts(sluice["folder"], args)
    assert len(texts) == peers.NUM_PROMPTS and summary
    record = peers.measure_system(PeerKind.SLUICE, sluice, texts, CONCURRENCIES, args, tmp_path / "logs")
    assert record["status"] == "ok", record["error"]
    assert record["version"]["config"] == str(CONFIG) and record["startup_s"] > 0
    assert [step["concurrency"] for step in record["steps"]] == CONCURRENCIES
    for step in record["steps"]:
        assert step["num_completed"] > 0 and step["num_errors"] == 0, step["error_samples"]
        assert step["output_tokens_per_s"] > 0 and step["tpot_ms_p50"] > 0 and step["ttft_ms_p50"] > 0
    log = (tmp_path / "logs" / "sluice.log").read_text()
    assert "Traceback" not in log, log[-2000:]
    servers = [p for p in psutil.Process().children(recursive=True) if str(CONFIG) in " ".join(p.cmdline())]
    assert not servers, f"the harness left its server running: {servers}"
