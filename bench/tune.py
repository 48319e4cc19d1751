"""``sluice bench tune``: sweep one bucket of a running Sluice gateway, find its knee, propose
its batch knobs and admission caps, and (``--apply``) set them through the admin API.

Steps:

1. ``GET /admin/models/{model}`` gives the bucket's kind, its prompt range (above the previous
   bucket's ``max_input_tokens``, up to its own) and its knobs.
2. For the sweep the bucket's batch cap (``max_num_seqs`` or ``max_batch_size``) is raised to
   the sweep's largest concurrency, and its queue made room for it, through
   ``PATCH /admin/models/{model}/buckets/{bucket}``; otherwise the sweep would only measure
   the cap already set.
3. A concurrency sweep (:mod:`bench.load`) sends prompts sized into the bucket's range
   (completions for a generation model, embeddings for an embedding model); answers whose
   ``x-sluice-bucket`` names another bucket are left out of the figures.
4. :func:`policies.tuning.propose_knobs` picks the knobs from the steps, the knee and the SLO
   (``--slo-ttft-ms`` / ``--slo-tpot-ms``, else the bucket's own ``slo``).
5. The knobs the sweep changed are put back, or, with ``--apply``, the proposal is sent.

The admin token comes from ``--admin-token`` or ``SLUICE_ADMIN_TOKEN`` (none: the gateway must
allow loopback admin without one). Exit codes: 0 done; 1 the admin API refused (a bad token, a
change) or could not be reached to put knobs back, or no request of the sweep completed; 2 bad
options or an unknown model or bucket; 130 stopped by SIGINT or SIGTERM, knobs put back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from bench import load, load_report
from policies.tuning import SLO, KnobProposal, SweepPoint, propose_knobs

DEFAULT_CONCURRENCY = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
# Prompts are drawn this far either side of the middle of the bucket's range (words, ~ tokens).
INPUT_SPREAD = 0.25


class TuneError(Exception):
    """The gateway's admin API refused or could not answer; the message says what and
    ``exit_code`` is the command's (1: a change was refused, 2: bad input or no such bucket)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``bench tune``'s options to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway root (default http://127.0.0.1:8000)")
    parser.add_argument("--model", required=True, help="a served model")
    parser.add_argument("--bucket", required=True, help="one of its buckets (e.g. le256)")
    parser.add_argument("--slo-ttft-ms", type=load._positive_float, help="p95 TTFT target (default: the bucket's slo)")
    parser.add_argument("--slo-tpot-ms", type=load._positive_float, help="p95 TPOT target (default: the bucket's slo)")
    parser.add_argument("--concurrency", type=load._loads, help="requests in flight per step (default 1,2,4,...,64)")
    parser.add_argument("--duration", type=load._positive_float, default=15.0, help="seconds per step (default 15)")
    parser.add_argument("--num-requests", type=load._positive_int, help="requests per step (instead of --duration)")
    parser.add_argument("--output-len", type=load._positive_int, default=32, help="max_tokens (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--knee-gain", type=load._positive_float, default=0.10, help="knee: QPS gain below (0.10)")
    parser.add_argument("--knee-latency", type=load._positive_float, default=0.50, help="knee: p95 TTFT growth above (0.50)")
    parser.add_argument("--admin-token", default=os.environ.get("SLUICE_ADMIN_TOKEN"), help="default $SLUICE_ADMIN_TOKEN")
    parser.add_argument("--apply", action="store_true", help="send the proposal through the admin API")
    parser.add_argument("--output", type=Path, help="folder for results.json, proposal.json and plots")
    parser.add_argument("--timeout", type=load._positive_float, default=600.0, help="per-request seconds (default 600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and tune; return the exit code."""
    parser = argparse.ArgumentParser(prog="sluice bench tune", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the whole tune (see the module docstring); 0, 1 when the admin API refused or the
    sweep completed nothing, 2 on bad input, 130 when stopped by SIGINT or SIGTERM (after the
    bucket's knobs were put back)."""
    code, _ = run_stoppable(_tune(args), "sluice bench tune")
    return code


def run_stoppable(work: Any, prog: str) -> tuple[int, Any]:
    """Run coroutine ``work`` (see :func:`stoppable`); ``(0, its result)``, or the exit code of
    its :class:`TuneError` or 130 when SIGINT or SIGTERM stopped it (said on stderr), and ``None``."""
    try:
        return 0, asyncio.run(stoppable(work))
    except TuneError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code, None
    except asyncio.CancelledError:
        print(f"{prog}: stopped; the knobs it changed were put back", file=sys.stderr)
        return 130, None


async def stoppable(work: Any) -> Any:
    """Run coroutine ``work`` so that SIGINT and SIGTERM cancel it: its ``finally`` blocks (which
    put changed knobs back) run, then :class:`asyncio.CancelledError` propagates."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _tune(args: argparse.Namespace) -> int:
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as admin:
        bucket = await describe_bucket(admin, args.model, args.bucket)
        slo = _slo(args, bucket["config"])
        concurrency = args.concurrency or DEFAULT_CONCURRENCY
        sweep_knobs = _sweep_knobs(bucket, int(max(concurrency)))
        original = {k: _current(bucket["config"], k) for k in sweep_knobs}
        await patch_bucket(admin, args.model, args.bucket, sweep_knobs)
        applied = False
        try:
            report = await load.run_sweep(_sweep_args(args, bucket, slo, concurrency, base_url))
            try:
                proposal = propose_knobs(
                    _points(report["steps"]), slo, bucket["kind"], report["knee"], bucket["max_input_tokens"]
                )
            except ValueError as exc:
                print(load_report.format_table(report["steps"], "concurrency", report["knee"]))
                errors = [r for s in report["steps"] for r in s.get("error_samples", [])]
                raise TuneError(f"{exc}{'; e.g. ' + errors[0] if errors else ''}", exit_code=1) from None
            _print(report, proposal, bucket)
            if args.apply:
                after = await patch_bucket(admin, args.model, args.bucket, {**original, **proposal.knobs})
                applied = True
                print(f"\napplied: {json.dumps(after['config'])}")
        finally:
            if not applied:
                await patch_bucket(admin, args.model, args.bucket, original)
    if args.output is not None:
        _write(args.output, report, proposal)
    return 0


async def describe_bucket(admin: httpx.AsyncClient, model: str, bucket: str) -> dict[str, Any]:
    """The bucket as the admin API describes it, with ``min_input_tokens`` (its range's low end)
    and ``config`` (its config entry) added.

    Raises:
        TuneError: the admin API is not reachable, refuses the token, or has no such model or bucket.
    """
    try:
        response = await admin.get(f"/admin/models/{model}")
    except httpx.HTTPError as exc:
        raise TuneError(f"cannot reach the admin API: {exc}") from None
    if response.status_code != 200:
        refused = response.status_code in (401, 403)
        raise TuneError(f"GET /admin/models/{model}: HTTP {response.status_code}: {response.text[:300]}", 1 if refused else 2)
    described = response.json()
    configs = described["config"]["buckets"]
    limits = [c["max_input_tokens"] for c in configs]
    for entry, config in zip(described["buckets"], configs):
        if entry["name"] == bucket:
            low = max([x for x in limits if x < entry["max_input_tokens"]], default=0)
            return {**entry, "min_input_tokens": low + 1, "config": config, "task": described["config"]["task"]}
    names = ", ".join(b["name"] for b in described["buckets"])
    raise TuneError(f"model {model!r} has no bucket {bucket!r} (it has {names})")


async def patch_bucket(admin: httpx.AsyncClient, model: str, bucket: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """``PATCH`` ``knobs`` onto the bucket; the response body.

    Raises:
        TuneError: (exit code 1) with the gateway's answer when it is not a 200.
    """
    try:
        response = await admin.patch(f"/admin/models/{model}/buckets/{bucket}", json=knobs)
    except httpx.HTTPError as exc:
        raise TuneError(f"cannot reach the admin API to set {json.dumps(knobs)} on {model}/{bucket}: {exc}", exit_code=1) from None
    if response.status_code != 200:
        message = f"the admin API refused {json.dumps(knobs)}: HTTP {response.status_code}: {response.text[:300]}"
        raise TuneError(message, exit_code=1)
    return response.json()  # type: ignore[no-any-return]


def _slo(args: argparse.Namespace, config: dict[str, Any]) -> SLO:
    configured = config.get("slo") or {}
    slo = SLO(
        ttft_p95_ms=args.slo_ttft_ms if args.slo_ttft_ms is not None else configured.get("ttft_p95_ms"),
        tpot_p95_ms=args.slo_tpot_ms if args.slo_tpot_ms is not None else configured.get("tpot_p95_ms"),
    )
    if slo.ttft_p95_ms is None and slo.tpot_p95_ms is None:
        raise TuneError("give --slo-ttft-ms and/or --slo-tpot-ms (the bucket has no slo)")
    if config["batcher"]["kind"] == "dynamic" and slo.ttft_p95_ms is None:
        raise TuneError("an embedding bucket has no TPOT: give --slo-ttft-ms (its latency target)")
    return slo


def _current(config: dict[str, Any], knob: str) -> Any:
    return config[knob] if knob in ("max_queue_len", "max_queued_tokens") else config["batcher"][knob]


def _sweep_knobs(bucket: dict[str, Any], max_concurrency: int) -> dict[str, Any]:
    """Knobs that let the bucket take the sweep's largest load: batch cap and queue room."""
    config = bucket["config"]
    cap = "max_num_seqs" if bucket["kind"] == "continuous" else "max_batch_size"
    knobs: dict[str, Any] = {cap: max(max_concurrency, config["batcher"][cap])}
    knobs["max_queue_len"] = max(config["max_queue_len"], 2 * max_concurrency)
    if config.get("max_queued_tokens") is not None:
        knobs["max_queued_tokens"] = max(config["max_queued_tokens"], 2 * max_concurrency * bucket["max_input_tokens"])
    return knobs


def _sweep_args(
    args: argparse.Namespace, bucket: dict[str, Any], slo: SLO, concurrency: list[float], base_url: str
) -> argparse.Namespace:
    """The :mod:`bench.load` options for a sweep whose prompts land in the bucket."""
    low, high = bucket["min_input_tokens"], bucket["max_input_tokens"]
    # Words map to about one token; the special tokens the tokenizer adds take a little room.
    middle = max(1, round((low + high) / 2 * 0.9))
    return argparse.Namespace(
        base_url=base_url, model=args.model, endpoint="completions" if bucket["task"] == "generate" else "embeddings",
        concurrency=concurrency, rate=None, burstiness=1.0, duration=args.duration, num_requests=args.num_requests,
        prompts_file=None, input_len=middle, input_len_range=min(INPUT_SPREAD, max(0.0, (high - low) / (high + low))),
        output_len=args.output_len, output_len_range=0.0, seed=args.seed, slo_ttft_ms=slo.ttft_p95_ms,
        slo_tpot_ms=slo.tpot_p95_ms, knee_gain=args.knee_gain, knee_latency=args.knee_latency, retry=False,
        timeout=args.timeout, no_progress=args.no_progress, only_bucket=bucket["name"],
    )


def _points(steps: list[dict[str, Any]]) -> list[SweepPoint]:
    return [
        SweepPoint(
            concurrency=int(s["load"]),
            requests_per_s=s["requests_per_s"],
            ttft_p95_ms=s["ttft_ms"]["p95"] if s["ttft_ms"] else None,
            tpot_p95_ms=s["tpot_ms"]["p95"] if s["tpot_ms"] else None,
            goodput_per_s=s["goodput_per_s"],
        )
        for s in steps
    ]


def _print(report: dict[str, Any], proposal: KnobProposal, bucket: dict[str, Any]) -> None:
    print(load_report.format_table(report["steps"], "concurrency", report["knee"]))
    knee = report["knee"]
    print("\nknee: " + ("none" if knee is None else f"{report['steps'][knee]['load']:g}"))
    print(f"\nproposal for {bucket['name']} ({bucket['kind']}, prompts {bucket['min_input_tokens']}-{bucket['max_input_tokens']} tokens):")
    for note in proposal.notes:
        print(f"  {note}")
    print(f"  PATCH body: {json.dumps(proposal.knobs)}")


def _write(folder: Path, report: dict[str, Any], proposal: KnobProposal) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    plots = load_report.write_plots(report["steps"], "concurrency", report["knee"], folder, {})
    report = {**report, "plots": [p.name for p in plots]}
    (folder / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    chosen = {"knobs": proposal.knobs, "chosen_step": proposal.chosen, "notes": list(proposal.notes)}
    (folder / "proposal.json").write_text(json.dumps(chosen, indent=2) + "\n")
    print(f"wrote {folder / 'results.json'}, {folder / 'proposal.json'} and {', '.join(report['plots'])}")


if __name__ == "__main__":
    sys.exit(main())
