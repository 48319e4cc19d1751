"""The load benchmark's arithmetic on plain values: percentiles, TPOT, goodput, knee detection,
per-bucket attribution, baseline comparison; and its workload and arrival draws."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics

import httpx
import pytest

from bench import load, load_client
from bench.load_report import (
    RequestResult,
    bucket_knees,
    compare_with_baseline,
    find_knee,
    format_table,
    goodput_per_s,
    percentile,
    step_knee,
    step_stats,
    summarize,
)


def make_result(ttft_s: float = 0.1, e2e_s: float = 1.0, num_output_tokens: int = 10, **kwargs: object) -> RequestResult:
    return RequestResult(ok=True, status=200, ttft_s=ttft_s, e2e_s=e2e_s, num_output_tokens=num_output_tokens, **kwargs)  # type: ignore[arg-type]


def make_step(load_value: float, qps: float, p95_ttft_ms: float, p95_tpot_ms: float = 10.0) -> dict:
    return {
        "load": load_value,
        "requests_per_s": qps,
        "ttft_ms": {"mean": p95_ttft_ms, "p50": p95_ttft_ms, "p95": p95_ttft_ms, "p99": p95_ttft_ms},
        "tpot_ms": {"mean": p95_tpot_ms, "p50": p95_tpot_ms, "p95": p95_tpot_ms, "p99": p95_tpot_ms},
        "buckets": {},
    }


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_gives_mean_and_percentiles() -> None:
    assert summarize([]) is None
    stats = summarize([1.0, 2.0, 3.0, 4.0])
    assert stats == {"mean": 2.5, "p50": 2.5, "p95": pytest.approx(3.85), "p99": pytest.approx(3.97)}


def test_tpot_excludes_the_first_token() -> None:
    assert make_result(ttft_s=0.2, e2e_s=1.1, num_output_tokens=10).tpot_s == pytest.approx(0.1)
    assert make_result(num_output_tokens=1).tpot_s is None
    assert RequestResult(ok=False, e2e_s=1.0, num_output_tokens=5).tpot_s is None


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = [
        make_result(ttft_s=0.1, e2e_s=1.0, num_output_tokens=10),  # TTFT 100 ms, TPOT 100 ms
        make_result(ttft_s=0.3, e2e_s=1.2, num_output_tokens=10),  # TTFT over
        make_result(ttft_s=0.1, e2e_s=2.0, num_output_tokens=10),  # TPOT ~211 ms: over
        RequestResult(ok=False, status=429),
    ]
    assert goodput_per_s(results, 2.0, None, None) is None
    assert goodput_per_s(results, 2.0, 200, None) == pytest.approx(1.0)
    assert goodput_per_s(results, 2.0, 200, 150) == pytest.approx(0.5)
    assert goodput_per_s(results, 2.0, None, 150) == pytest.approx(1.0)


def test_step_stats_counts_errors_429s_and_throughput() -> None:
    results = [
        make_result(ttft_s=0.1, e2e_s=1.0, num_output_tokens=10, itl_s=[0.1, 0.1]),
        make_result(ttft_s=0.3, e2e_s=1.2, num_output_tokens=10, itl_s=[0.3]),
        RequestResult(ok=False, status=429),
        RequestResult(ok=False, status=500),
        RequestResult(ok=False, status=None, error="ConnectError"),
    ]
    step = step_stats(4, results, 2.0, slo_ttft_ms=200)
    assert (step["num_requests"], step["num_completed"], step["num_errors"], step["num_429"]) == (5, 2, 2, 1)
    assert step["requests_per_s"] == 1.0
    assert step["output_tokens_per_s"] == 10.0
    assert step["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert step["itl_ms"]["p50"] == pytest.approx(100.0)
    assert step["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert step["goodput_per_s"] == 0.5
    assert step["buckets"] == {}
    assert "<- knee" in format_table([step], "concurrency", 0)


def test_itl_p50_and_p99_are_in_the_step_and_the_table() -> None:
    gaps = [0.02] * 98 + [1.0, 2.0]  # a stream that stalled twice
    step = step_stats(4, [make_result(ttft_s=0.1, e2e_s=5.0, num_output_tokens=101, itl_s=gaps)], 5.0)
    assert step["itl_ms"]["p50"] == pytest.approx(20.0)
    assert step["itl_ms"]["p99"] == pytest.approx(1000 + 0.01 * 1000, rel=0.02)
    header, _, row = format_table([step], "concurrency", None).splitlines()
    assert "ITL p50" in header and header.split().count("p99") == 2  # TTFT's and ITL's
    cells = row.split()
    assert f"{step['itl_ms']['p50']:.1f}" in cells and f"{step['itl_ms']['p99']:.1f}" in cells


def test_buckets_attribute_queue_prefill_and_decode() -> None:
    results = [
        make_result(ttft_s=0.1, e2e_s=0.5, bucket="short", queue_ms=10.0, prefill_ms=50.0),
        make_result(ttft_s=0.3, e2e_s=0.9, bucket="short", queue_ms=30.0, prefill_ms=70.0),
        make_result(ttft_s=0.2, e2e_s=1.2, bucket="long", queue_ms=None, prefill_ms=150.0),
        make_result(),  # another server's response: no bucket header
    ]
    buckets = step_stats(1, results, 1.0)["buckets"]
    assert set(buckets) == {"short", "long"}
    short = buckets["short"]
    assert short["count"] == 2 and short["requests_per_s"] == 2.0
    assert short["queue_ms"] == {"mean": 20.0, "p95": pytest.approx(29.0)}
    assert short["prefill_ms"]["mean"] == 60.0
    assert short["decode_ms"]["mean"] == pytest.approx(500.0)
    assert buckets["long"]["queue_ms"] is None
    assert buckets["long"]["decode_ms"]["mean"] == pytest.approx(1000.0)


def test_knee_is_first_step_where_qps_stalls_and_latency_jumps() -> None:
    qps = [10.0, 19.0, 30.0, 31.0, 31.5]
    ttft = [100.0, 110.0, 130.0, 300.0, 900.0]
    assert find_knee(qps, ttft) == 3
    # QPS still growing 10% or more: no knee even though latency jumps.
    assert find_knee([10.0, 11.0], [100.0, 500.0]) is None
    # Latency growing 50% or less: no knee even though QPS is flat.
    assert find_knee([10.0, 10.0], [100.0, 150.0]) is None
    assert find_knee([10.0, 10.0], [100.0, 151.0]) == 1
    # Thresholds are options; missing data is skipped.
    assert find_knee([10.0, 11.0], [100.0, 500.0], knee_gain=0.2) == 1
    assert find_knee([10.0, 10.0], [100.0, 140.0], knee_latency=0.3) == 1
    assert find_knee([10.0, 10.0, 10.0], [None, 100.0, 400.0]) == 2
    assert find_knee([], []) is None and find_knee([5.0], [1.0]) is None


def test_step_and_bucket_knees() -> None:
    steps = [make_step(1, 10, 100), make_step(2, 19, 120), make_step(4, 19.5, 400)]
    assert step_knee(steps, 0.10, 0.50) == 2
    for step, (a, b) in zip(steps, [(5, 5), (10, 9), (10.2, 9.3)]):
        step["buckets"] = {
            "a": {"requests_per_s": a, "ttft_ms": {"mean": 1.0, "p95": 100.0 * step["load"]}},
            "b": {"requests_per_s": b, "ttft_ms": {"mean": 1.0, "p95": 100.0}},
        }
    assert bucket_knees(steps, 0.10, 0.50) == {"a": 4, "b": None}
    assert bucket_knees([make_step(1, 1, 1)], 0.10, 0.50) == {}


def test_baseline_comparison_flags_regressions_beyond_tolerance() -> None:
    base = [make_step(1, 10.0, 100.0, 20.0), make_step(2, 20.0, 120.0, 22.0)]
    assert compare_with_baseline(base, base, 0.10) == ([], 2)
    within = [make_step(1, 9.5, 109.0, 21.9), make_step(2, 18.1, 130.0, 24.0)]
    assert compare_with_baseline(within, base, 0.10) == ([], 2)
    worse = [make_step(1, 8.0, 100.0, 20.0), make_step(2, 20.0, 200.0, 30.0), make_step(8, 1.0, 9e9)]
    regressions, matched = compare_with_baseline(worse, base, 0.10)
    assert matched == 2
    assert len(regressions) == 3
    assert regressions[0].startswith("load 1: requests_per_s 10 -> 8")
    assert any("p95 ttft_ms" in r for r in regressions) and any("p95 tpot_ms" in r for r in regressions)
    # Better is never a regression.
    better = [make_step(1, 30.0, 10.0, 2.0)]
    assert compare_with_baseline(better, base, 0.10) == ([], 1)
    assert compare_with_baseline(base, [make_step(64, 1, 1)], 0.10) == ([], 0)


def test_workload_is_seeded_and_within_length_range() -> None:
    args = argparse.Namespace(prompts_file=None, input_len=100, input_len_range=0.5, output_len=64, output_len_range=0.0)
    draw = load.make_prompts(args, random.Random(3))
    pairs = [next(draw) for _ in range(200)]
    again = load.make_prompts(args, random.Random(3))
    assert pairs == [next(again) for _ in range(200)]
    lengths = [len(prompt.split()) for prompt, _ in pairs]
    assert 50 <= min(lengths) < 60 and 140 < max(lengths) <= 150
    assert {max_tokens for _, max_tokens in pairs} == {64}


def test_arrival_gaps_have_the_rate_and_burstiness() -> None:
    for burstiness in (1.0, 0.25, 4.0):
        gaps = load._arrival_gaps(10.0, burstiness, random.Random(0))
        sample = [next(gaps) for _ in range(20000)]
        assert statistics.mean(sample) == pytest.approx(0.1, rel=0.05)
        # A gamma's coefficient of variation is 1 / sqrt(shape): 1 for Poisson arrivals.
        cv = statistics.pstdev(sample) / statistics.mean(sample)
        assert cv == pytest.approx(burstiness**-0.5, rel=0.08)
    assert next(load._arrival_gaps(float("inf"), 1.0, random.Random(0))) == 0.0


def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    in_flight, peak = [0], [0]

    class FakeSender:
        async def send(self, prompt: str, max_tokens: int) -> RequestResult:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            await asyncio.sleep(0.001)
            in_flight[0] -= 1
            return make_result()

    prompts = iter(lambda: ("x", 1), None)
    results = asyncio.run(load._closed_loop(FakeSender(), 3, prompts, 10, None))  # type: ignore[arg-type]
    assert len(results) == 10 and peak[0] == 3


def test_cli_rejects_a_missing_model_and_unbounded_inf_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert load.main(["--concurrency", "1"]) == 2
    assert load.main(["--model", "m", "--rate", "inf"]) == 2
    assert "--num-requests" in capsys.readouterr().err


def sse(*chunks: str) -> bytes:
    return "".join(f"data: {c}\n\n" for c in (*chunks, "[DONE]")).encode()


def fake_server(statuses: list[int]) -> httpx.MockTransport:
    """Answers each request with the next of ``statuses``: 200 streams two content chunks and
    a usage chunk with Sluice's headers; anything else is an error body."""
    calls = iter(statuses)

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        assert request.url.path == "/v1/completions" and body["max_tokens"] == 3
        status = next(calls)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue full"}}, headers={"retry-after": "0"})
        content = sse(
            '{"choices":[{"index":0,"text":""}]}',
            '{"choices":[{"index":0,"text":"a"}]}',
            '{"choices":[{"index":0,"text":"b"}]}',
            '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}',
        )
        headers = {"x-sluice-bucket": "le48", "x-sluice-queue-ms": "1.5", "x-sluice-prefill-ms": "20"}
        return httpx.Response(200, content=content, headers=headers)

    return httpx.MockTransport(handle)


def send_one(statuses: list[int], retry: bool) -> RequestResult:
    args = argparse.Namespace(model="m", endpoint="completions", retry=retry)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url="http://test", transport=fake_server(statuses)) as client:
            return await load_client.Sender(client, args, random.Random(0)).send("hello", 3)

    return asyncio.run(go())


def test_sender_times_a_stream_and_reads_usage_and_bucket_headers() -> None:
    result = send_one([200], retry=False)
    assert result.ok and result.status == 200 and result.error is None
    assert result.ttft_s is not None and 0 < result.ttft_s <= result.e2e_s
    assert len(result.itl_s) == 1  # two content chunks; the empty one does not count
    assert (result.num_output_tokens, result.num_prompt_tokens) == (3, 5)
    assert (result.bucket, result.queue_ms, result.prefill_ms) == ("le48", 1.5, 20.0)


@pytest.mark.parametrize(("last_chunk", "whole"), [
    ('{"choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"completion_tokens":2}}', True),
    ('{"choices":[{"index":0,"text":"b"}]}', False),
])
def test_a_stream_without_done_is_whole_only_after_a_finish_reason(last_chunk: str, whole: bool) -> None:
    """transformers serve ends its completion streams after the finish chunk, without [DONE]."""
    content = "".join(f"data: {c}\n\n" for c in ('{"choices":[{"index":0,"text":"a"}]}', last_chunk)).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
    args = argparse.Namespace(model="m", endpoint="completions", retry=False)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as client:
            return await load_client.Sender(client, args, random.Random(0)).send("hello", 2)

    result = asyncio.run(go())
    assert result.ok is whole and result.ttft_s is not None
    assert (result.error is None) is whole, result.error


def test_429_is_counted_not_retried_unless_asked() -> None:
    refused = send_one([429, 200], retry=False)
    assert not refused.ok and refused.status == 429 and "queue full" in (refused.error or "")
    assert step_stats(1, [refused], 1.0)["num_429"] == 1
    assert send_one([429, 200], retry=True).ok


def test_embeddings_are_timed_whole_with_ttft_equal_to_e2e_and_no_tpot() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/v1/embeddings" and body == {"model": "m", "input": "hello"}
        usage = {"prompt_tokens": 3, "total_tokens": 3}
        return httpx.Response(200, json={"data": [], "usage": usage}, headers={"x-sluice-bucket": "le64"})

    args = argparse.Namespace(model="m", endpoint="embeddings", retry=False)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handle)) as client:
            return await load_client.Sender(client, args, random.Random(0)).send("hello", 3)

    result = asyncio.run(go())
    assert result.ok and result.num_prompt_tokens == 3 and result.bucket == "le64"
    assert result.ttft_s is not None and result.ttft_s <= result.e2e_s and result.e2e_s - result.ttft_s < 0.05
    assert result.num_output_tokens == 0 and result.tpot_s is None
    stats = step_stats(1, [result], 1.0, slo_ttft_ms=1000.0, slo_tpot_ms=1.0)
    assert stats["tpot_ms"] is None and stats["goodput_per_s"] == 1.0
