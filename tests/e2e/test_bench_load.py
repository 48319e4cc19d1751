"""``sluice bench load`` and ``sluice bench tune`` against a real server: a short concurrency
sweep writes results.json with every step's statistics and the plots, attributes time per bucket
when the server sends the ``x-sluice-*`` headers, and ``--baseline`` passes against itself and
fails against a baseline with doubled throughput. ``bench tune`` sweeps one bucket with its
batch cap opened, proposes knobs, puts the old ones back, or sets the proposal with ``--apply``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.cli import main as sluice
from tests.e2e.conftest import ADMIN_TOKEN, EMBED_MODEL, GENERATE_MODEL, Server

CONCURRENCY = [1, 2, 4]
NUM_REQUESTS = 6
OUTPUT_LEN = 8
STEP_FIELDS = {
    "load", "num_requests", "num_completed", "num_errors", "num_429", "duration_s", "requests_per_s",
    "output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput_per_s", "mean_queue_depth", "buckets",
}


@pytest.fixture(scope="module")
def server(admin_server: Server) -> str:
    """The shared admin server (``bench tune`` changes knobs through the admin API)."""
    return admin_server.url


def sweep_args(url: str, output: Path) -> list[str]:
    return [
        "bench", "load", "--base-url", url, "--model", GENERATE_MODEL, "--no-progress",
        "--concurrency", ",".join(map(str, CONCURRENCY)), "--num-requests", str(NUM_REQUESTS),
        "--input-len", "32", "--output-len", str(OUTPUT_LEN), "--slo-ttft-ms", "60000", "--output", str(output),
    ]


@pytest.fixture(scope="module")
def sweep(server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("bench_load")
    assert sluice(sweep_args(server, output)) == 0
    return output


def has_bucket_headers(url: str) -> bool:
    body = {"model": GENERATE_MODEL, "prompt": "Hello", "max_tokens": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    return "x-sluice-bucket" in response.headers


def test_sweep_writes_every_step_and_the_plots(sweep: Path) -> None:
    report = json.loads((sweep / "results.json").read_text())
    assert report["mode"] == "concurrency"
    assert [s["load"] for s in report["steps"]] == CONCURRENCY
    for step in report["steps"]:
        assert STEP_FIELDS <= set(step)
        assert step["num_requests"] == step["num_completed"] == NUM_REQUESTS
        assert step["num_errors"] == step["num_429"] == 0
        assert step["requests_per_s"] > 0 and step["output_tokens_per_s"] > 0
        assert step["output_tokens_per_s"] == pytest.approx(step["requests_per_s"] * OUTPUT_LEN)
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = step[name]
            assert 0 < stats["p50"] <= stats["p95"] <= stats["p99"]
        assert step["ttft_ms"]["p99"] <= step["e2e_ms"]["p99"]
        assert step["goodput_per_s"] == pytest.approx(step["requests_per_s"])
    assert report["knee"] is None or 0 < report["knee"] < len(CONCURRENCY)
    assert report["plots"][:3] == ["qps.png", "ttft.png", "tpot.png"]
    for name in report["plots"]:
        assert (sweep / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_attributes_time_per_bucket(server: str, sweep: Path) -> None:
    if not has_bucket_headers(server):
        pytest.skip("the server sends no x-sluice-bucket header")
    report = json.loads((sweep / "results.json").read_text())
    assert "buckets.png" in report["plots"] and (sweep / "buckets.png").exists()
    for step in report["steps"]:
        assert sum(b["count"] for b in step["buckets"].values()) == NUM_REQUESTS
        for bucket in step["buckets"].values():
            for name in ("queue_ms", "prefill_ms", "decode_ms"):
                assert bucket[name] is not None and 0 <= bucket[name]["mean"] <= bucket[name]["p95"]


def test_baseline_against_itself_passes(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = sweep / "results.json"
    assert sluice(["bench", "load", "--from-results", str(results), "--baseline", str(results)]) == 0
    assert "no regression" in capsys.readouterr().out


def test_baseline_with_doubled_throughput_fails(server: str, sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads((sweep / "results.json").read_text())
    for step in report["steps"]:
        step["requests_per_s"] *= 2
    doctored = tmp_path / "doctored.json"
    doctored.write_text(json.dumps(report))
    capsys.readouterr()
    assert sluice([*sweep_args(server, tmp_path / "again"), "--baseline", str(doctored)]) == 1
    out = capsys.readouterr().out
    assert "regressions against" in out and "requests_per_s" in out


def bucket_config(url: str, model: str, bucket: str) -> dict[str, object]:
    response = httpx.get(f"{url}/admin/models/{model}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert response.status_code == 200
    names = [b["name"] for b in response.json()["buckets"]]
    return response.json()["config"]["buckets"][names.index(bucket)]  # type: ignore[no-any-return]


def tune_args(url: str, model: str, bucket: str, *extra: str) -> list[str]:
    return [
        "bench", "tune", "--base-url", url, "--model", model, "--bucket", bucket, "--admin-token", ADMIN_TOKEN,
        "--concurrency", ",".join(map(str, CONCURRENCY)), "--num-requests", "4", "--output-len", "4", "--no-progress", *extra,
    ]


def test_tune_proposes_knobs_from_a_sweep_of_the_bucket_and_puts_the_old_ones_back(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = bucket_config(server, GENERATE_MODEL, "le48")
    assert sluice(tune_args(server, GENERATE_MODEL, "le48", "--slo-ttft-ms", "60000", "--output", str(tmp_path))) == 0
    assert "PATCH body" in capsys.readouterr().out
    proposal = json.loads((tmp_path / "proposal.json").read_text())
    report = json.loads((tmp_path / "results.json").read_text())
    assert [s["load"] for s in report["steps"]] == CONCURRENCY
    for step in report["steps"]:  # every prompt landed in the bucket (1-48 tokens)
        assert step["num_completed"] == 4 and set(step["buckets"]) == {"le48"}
    # a 60 s TTFT SLO keeps every step: the most goodput below any knee is taken
    chosen = report["steps"][proposal["chosen_step"]]
    below_knee = report["steps"][: report["knee"] or len(CONCURRENCY)]
    assert chosen["goodput_per_s"] == max(s["goodput_per_s"] for s in below_knee)
    assert proposal["knobs"]["max_num_seqs"] == chosen["load"]
    assert proposal["knobs"]["max_queued_tokens"] == proposal["knobs"]["max_queue_len"] * 48
    assert bucket_config(server, GENERATE_MODEL, "le48") == before  # no --apply: the sweep's changes undone


def test_tune_apply_sets_the_proposal_through_the_admin_api(server: str, tmp_path: Path) -> None:
    args = tune_args(server, EMBED_MODEL, "le256", "--slo-ttft-ms", "60000", "--apply", "--output", str(tmp_path))
    assert sluice(args) == 0
    knobs = json.loads((tmp_path / "proposal.json").read_text())["knobs"]
    after = bucket_config(server, EMBED_MODEL, "le256")
    assert after["batcher"]["max_batch_size"] == knobs["max_batch_size"]  # type: ignore[index]
    assert after["batcher"]["max_queue_delay_ms"] == knobs["max_queue_delay_ms"]  # type: ignore[index]
    assert (after["max_queue_len"], after["max_queued_tokens"]) == (knobs["max_queue_len"], knobs["max_queued_tokens"])


def test_tune_refuses_a_bad_token_an_unknown_bucket_a_missing_slo_and_a_sweep_that_completed_nothing(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad_token = tune_args(server, GENERATE_MODEL, "le48", "--slo-ttft-ms", "1000")
    bad_token[bad_token.index(ADMIN_TOKEN)] = "wrong"
    assert sluice(bad_token) == 1  # refused
    assert "401" in capsys.readouterr().err
    assert sluice(tune_args(server, GENERATE_MODEL, "nope", "--slo-ttft-ms", "1000")) == 2
    assert "has no bucket 'nope'" in capsys.readouterr().err
    assert sluice(tune_args(server, GENERATE_MODEL, "le48")) == 2
    assert "--slo-ttft-ms" in capsys.readouterr().err
    before = bucket_config(server, GENERATE_MODEL, "le48")
    too_long = tune_args(server, GENERATE_MODEL, "le48", "--slo-ttft-ms", "1000")
    too_long[too_long.index("--output-len") + 1] = "400"  # beyond max_model_len: every request is a 400
    assert sluice(too_long) == 1
    assert "no step of the sweep completed a request" in capsys.readouterr().err
    assert bucket_config(server, GENERATE_MODEL, "le48") == before
